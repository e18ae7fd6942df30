//! `selective_scan_fwd` / `selective_scan_bwd`: Mamba-1's selective scan and its backward pass
//! (docs/selective_scan_fwd.md and docs/selective_scan_bwd.md have the ABIs).
//!
//! [`validate_fwd`] turns operand descriptions into [`FwdParams`] (pointers, sizes and element
//! strides: the one struct that the CPU loop and the CUDA kernel both read, so that both layouts and
//! both forms of B/C are a matter of strides), and [`run_fwd`] runs it on a platform.
//! [`validate_bwd`] shares its checks of the inputs and adds those of the checkpoints, cotangents and
//! gradients ([`BwdParams`] embeds the forward's parameters); [`run_bwd`] runs it.

use super::buffers::{check_buffers, Named};
use super::{check_elements, expect, expect_dtype, expect_nonnull, Platform, Records, Tensor};
use crate::error::{Error, Result};
use crate::DType;
use std::ffi::c_void;

pub mod carry;
pub mod records;

pub use records::{chunk_records_count, validate_chunk_records, ChunkRecordsArgs};

/// Largest supported state size (the CUDA kernel spreads it over at most 32 lanes of 8 states).
pub const MAX_DSTATE: i64 = 256;

/// The layout of u, delta, z and out (and of time-varying B and C).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// (batch, dim, seqlen); B, C: (batch, groups, dstate, seqlen).
    ChannelFirst,
    /// (batch, seqlen, dim); B, C: (batch, seqlen, groups, dstate).
    ChannelLast,
}

impl Layout {
    pub fn parse(s: &str) -> Result<Layout> {
        match s {
            "bdl" => Ok(Layout::ChannelFirst),
            "bld" => Ok(Layout::ChannelLast),
            other => Err(Error::invalid(format!("attribute `layout`: expected \"bdl\" or \"bld\", got {other:?}"))),
        }
    }
}

/// The forward's inputs: operands of both the forward and the backward call.
pub struct Inputs<'a> {
    pub u: &'a Tensor,
    pub delta: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub delta_bias: Option<&'a Tensor>,
    pub initial_state: Option<&'a Tensor>,
    /// Packed sequences: int32 (num_seqs + 1) boundaries along seqlen of a batch-1 input.
    pub cu_seqlens: Option<&'a Tensor>,
    pub delta_softplus: bool,
    pub layout: Layout,
}

impl<'a> Inputs<'a> {
    /// The operands by name, for the checks every call's buffers get.
    fn named(&self) -> Vec<Named<'a>> {
        vec![
            ("u", Some(self.u)),
            ("delta", Some(self.delta)),
            ("A", Some(self.a)),
            ("B", Some(self.b)),
            ("C", Some(self.c)),
            ("D", self.d),
            ("z", self.z),
            ("delta_bias", self.delta_bias),
            ("initial_state", self.initial_state),
            ("cu_seqlens", self.cu_seqlens),
        ]
    }
}

/// The operands of one forward call, as the host describes them.
pub struct FwdArgs<'a> {
    pub inputs: Inputs<'a>,
    pub out: &'a Tensor,
    pub final_state: &'a Tensor,
    /// States entering every `checkpoint_len`-th step, for the backward pass (docs/selective_scan_bwd.md);
    /// present exactly when `checkpoint_len` > 0.
    pub checkpoints: Option<&'a Tensor>,
    pub checkpoint_len: i64,
    /// Scratch for the CUDA kernel's sequence split (see [`workspace_bytes`]); any dtype, contents
    /// undefined afterwards. Without it (or when it is too small) the scan runs unsplit.
    pub workspace: Option<&'a Tensor>,
    /// The split's first pass, made beforehand by `selective_scan_chunk_records` on the same inputs
    /// ([`records`]): the CUDA split reads them instead of making them.
    pub chunk_records: Option<&'a Tensor>,
}

/// Kernel parameters, passed by value to the CUDA kernel; generated into kernels/params.h as
/// `SelectiveScanFwdParams`. Absent optional operands are null. Strides are in elements. Channel `d`
/// reads B/C at
/// `b * bc_stride_batch + (d / dim_per_group) * bc_stride_group + n * bc_stride_state + l * bc_stride_seq`.
/// cbindgen:field-names=[u, delta, A, B, C, D, z, delta_bias, initial_state, out, final_state, batch, dim, seqlen, dstate, dim_per_group, x_stride_batch, x_stride_dim, x_stride_seq, bc_stride_batch, bc_stride_group, bc_stride_state, bc_stride_seq, delta_softplus, _reserved, workspace, chunk_len, n_chunks, checkpoints, checkpoint_len, cu_seqlens, num_seqs]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FwdParams {
    pub u: *const c_void,
    pub delta: *const c_void,
    pub a: *const f32,
    pub b: *const c_void,
    pub c: *const c_void,
    pub d: *const f32,
    pub z: *const c_void,
    pub delta_bias: *const f32,
    pub initial_state: *const f32,
    pub out: *mut c_void,
    pub final_state: *mut f32,
    pub batch: i64,
    pub dim: i64,
    pub seqlen: i64,
    pub dstate: i64,
    pub dim_per_group: i64,
    pub x_stride_batch: i64,
    pub x_stride_dim: i64,
    pub x_stride_seq: i64,
    pub bc_stride_batch: i64,
    pub bc_stride_group: i64,
    pub bc_stride_state: i64,
    pub bc_stride_seq: i64,
    pub delta_softplus: i32,
    pub _reserved: i32,
    /// Sequence split (CUDA tiled kernel): chunks of `chunk_len` steps, per-chunk records (state, sum
    /// of dt), `[n_chunks - 1][batch][dim][dstate + 1]` f32. `n_chunks` == 1: no split.
    pub workspace: *mut f32,
    pub chunk_len: i64,
    pub n_chunks: i64,
    /// f32 (batch, dim, n_checkpoints, dstate): the state entering every `checkpoint_len`-th step, a
    /// multiple of [`CHECKPOINT_MULTIPLE`] (null and 0: none). Residuals for the backward pass.
    pub checkpoints: *mut f32,
    pub checkpoint_len: i64,
    /// Packed sequences (docs/selective_scan_fwd.md, "Packed sequences"): int32 (num_seqs + 1)
    /// boundaries along seqlen of a batch-1 input, or null. With them initial_state and
    /// final_state are (num_seqs, dim, dstate), and the state resets at every boundary.
    pub cu_seqlens: *const i32,
    pub num_seqs: i64,
}

impl FwdParams {
    /// The packed sequences' boundaries (num_seqs + 1), when there are some.
    ///
    /// # Safety
    /// The parameters are validated and `cu_seqlens` is host memory (the CPU platform).
    pub unsafe fn host_cu_seqlens(&self) -> Option<&[i32]> {
        // SAFETY: per the contract, num_seqs + 1 readable i32s.
        (!self.cu_seqlens.is_null())
            .then(|| unsafe { std::slice::from_raw_parts(self.cu_seqlens, self.num_seqs as usize + 1) })
    }
}

validated! {
    /// A validated forward call.
    #[derive(Debug, Clone, Copy)]
    pub struct Fwd {
        params: FwdParams,
        /// dtype of u, delta, z and out.
        dtype: DType,
        /// dtype of B and C.
        bc_dtype: DType,
        /// B and C are (batch, groups, dstate, seqlen)-like rather than (dim, dstate).
        bc_time_varying: bool,
        /// Size of the workspace the host passed (0: none).
        workspace_bytes: i64,
        /// Where the sequence split's chunk records come from, or that they are all the call makes.
        records: Records,
    }
}

/// Channels per block of the CUDA `tiled` kernel up to dstate 64 (`kTileChannels`); the split plans
/// its chunks in tiles of this many channels at every dstate.
pub const TILE_CHANNELS: i64 = 64;
/// Threads of the largest `tiled` block (`kTiledMaxThreads`).
const TILED_MAX_THREADS: i64 = 512;
/// Largest dstate of the CUDA `tiled` kernel (`Tiled<32>::kStates`), the only one that splits.
pub const TILED_MAX_DSTATE: i64 = 256;

/// Threads per channel of the CUDA `tiled` kernel for this dstate (`TPC`: 8 states each, 2 at least;
/// cuda.rs takes one thread of 16 states instead at dstate <= 16 where the grid is large).
pub fn tiled_threads_per_channel(dstate: i64) -> i64 {
    let threads = (dstate.max(1) + 7) / 8;
    (threads.max(2) as u64).next_power_of_two() as i64
}

/// States a thread of the `tiled` kernel holds at `tpc` threads per channel
/// (`Tiled<TPC>::kThreadStates`).
pub fn tiled_thread_states(tpc: i64) -> i64 {
    if tpc == 1 {
        16
    } else {
        8
    }
}

/// Channels per block of the CUDA `tiled` kernel at `tpc` threads per channel
/// (`Tiled<TPC>::kChannels`): 64, fewer where that would take more than 512 threads.
pub fn tiled_channels(tpc: i64) -> i64 {
    TILE_CHANNELS.min(TILED_MAX_THREADS / tpc)
}

/// f32s per (chunk, batch, channel) record of the split: end state (the kernel's states for this
/// dstate), then sum of dt (`Tiled<TPC>::kChunkRecord`).
pub fn split_record_floats(dstate: i64) -> i64 {
    let tpc = tiled_threads_per_channel(dstate);
    tiled_thread_states(tpc) * tpc + 1
}
/// Multiprocessors the splits aim to fill (an H100's).
const SPLIT_SMS: i64 = 132;
/// Blocks the forward's split aims for: four per multiprocessor.
pub const FWD_SPLIT_TARGET_BLOCKS: i64 = 4 * SPLIT_SMS;
/// Shortest chunk worth a block of its own.
pub const SPLIT_MIN_CHUNK: i64 = 64;

/// Chunks of the CUDA kernel's sequence split: (chunk_len, n_chunks). A small batch x dim leaves the
/// GPU idle, so the sequence is cut into chunks scanned in parallel: a first pass records each
/// chunk's end state from zero, a second carries the true states in and writes the output. Only
/// when there are fewer than [`FWD_SPLIT_TARGET_BLOCKS`] / 2 tiles of channels; depends on the shape
/// alone, so that a host can size the workspace before it knows the device. As many chunks as fit
/// the target in one wave: one more (a second wave of a few blocks) cost 8% at 1 x 4096 x 16384
/// (H100: 9 chunks 1027 us against 8 chunks 949).
pub fn split_plan(batch: i64, dim: i64, seqlen: i64) -> (i64, i64) {
    let tiles = batch * ((dim + TILE_CHANNELS - 1) / TILE_CHANNELS);
    if tiles == 0 || 2 * tiles >= FWD_SPLIT_TARGET_BLOCKS || seqlen < 2 * SPLIT_MIN_CHUNK {
        return (seqlen, 1);
    }
    let chunks = (FWD_SPLIT_TARGET_BLOCKS / tiles).min(seqlen / SPLIT_MIN_CHUNK);
    let chunk_len = chunk_len_of(seqlen, chunks);
    let n_chunks = (seqlen + chunk_len - 1) / chunk_len;
    // The same count, balanced: chunk_len is then a function of (seqlen, n_chunks) alone, which
    // the chunk records' definition states.
    (chunk_len_of(seqlen, n_chunks), n_chunks)
}

/// Steps a chunk of `chunks`: a whole number of tile steps (32 for 2-byte types, 16 for f32).
fn chunk_len_of(seqlen: i64, chunks: i64) -> i64 {
    ((seqlen + chunks - 1) / chunks + 31) / 32 * 32
}

/// Bytes of workspace that let the CUDA forward scan split the sequence (0: it never splits).
pub fn workspace_bytes(batch: i64, dim: i64, seqlen: i64, dstate: i64) -> i64 {
    let (_, n_chunks) = split_plan(batch, dim, seqlen);
    if n_chunks <= 1 || dstate > TILED_MAX_DSTATE {
        return 0;
    }
    (n_chunks - 1) * batch * dim * split_record_floats(dstate) * 4
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

const STATE_MEANING: &str = "[batch, dim, dstate]";
const PACKED_STATE_MEANING: &str = "[num_seqs, dim, dstate] (packed sequences)";

/// `cu_seqlens` of a packed call: int32 (num_seqs + 1,) with u's batch 1. Returns num_seqs. (Its
/// values are checked where the host can read them: [`check_cu_seqlens_values`].)
fn check_cu_seqlens(op: &str, cu: &Tensor, batch: i64) -> Result<i64> {
    let what = format!("{op}: operand `cu_seqlens`");
    check_elements(&what, &cu.dims)?;
    expect_dtype(cu, &what, &[DType::S32])?;
    if cu.dims.len() != 1 || cu.dims[0] < 1 {
        return Err(Error::invalid(format!(
            "{what}: expected shape (num_seqs + 1,) [boundaries], got {}",
            super::fmt_dims(&cu.dims)
        )));
    }
    if batch != 1 {
        return Err(Error::invalid(format!(
            "{what}: packed sequences lie along seqlen of one batch row: u's batch must be 1, got {batch}"
        )));
    }
    Ok(cu.dims[0] - 1)
}

/// The boundaries themselves: 0 first, non-decreasing, `seqlen` last. For host memory (the CPU
/// target); a CUDA kernel given other values stays inside its buffers, with undefined results.
pub fn check_cu_seqlens_values(op: &str, cu: &[i32], seqlen: i64) -> Result<()> {
    let what = format!("{op}: operand `cu_seqlens`");
    if cu.first() != Some(&0) {
        return Err(Error::invalid(format!("{what}: the first boundary must be 0, got {:?}", cu.first())));
    }
    if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::invalid(format!(
            "{what}: boundaries must not decrease, got {} then {} at index {}",
            cu[i],
            cu[i + 1],
            i + 1
        )));
    }
    let last = *cu.last().expect("one entry at least");
    if i64::from(last) != seqlen {
        return Err(Error::invalid(format!("{what}: the last boundary must be seqlen (= {seqlen}), got {last}")));
    }
    Ok(())
}
const CHECKPOINTS_MEANING: &str = "[batch, dim, n_checkpoints, dstate]";

/// `checkpoint_len` is a multiple of this (a whole number of the CUDA kernels' tiles).
pub const CHECKPOINT_MULTIPLE: i64 = 32;

/// Checkpoints of a sequence: ceil(seqlen / checkpoint_len) (0 without checkpoints).
pub fn n_checkpoints(seqlen: i64, checkpoint_len: i64) -> i64 {
    if checkpoint_len <= 0 {
        0
    } else {
        seqlen / checkpoint_len + i64::from(seqlen % checkpoint_len != 0)
    }
}

/// Longest checkpoint_len the CUDA backward takes (a chunk's tile starts live in shared memory).
pub const BWD_MAX_CHECKPOINT_LEN: i64 = 256;
/// Threads of a CUDA backward block (`kBwdThreads`).
pub const BWD_THREADS: i64 = 128;

/// How the CUDA backward blocks a problem (kernels/selective_scan_bwd.cuh), which sizes its workspace.
#[derive(Debug, Clone, Copy)]
pub struct BwdLayout {
    /// Threads per channel, 8 states each: a power of two from 2 to 32.
    pub threads_per_channel: i64,
    /// Blocks per batch row: each takes up to 128 / threads_per_channel channels of one group.
    pub blocks_per_row: i64,
    pub tiles_per_group: i64,
    /// Parts of the sequence split (1: none), each of `part_len` steps (a whole number of
    /// checkpoint chunks).
    pub n_split: i64,
    pub part_len: i64,
    /// f32s of each of the dB and dC partial sums.
    pub bc_part_floats: i64,
    /// f32s of the whole workspace: dB, dC, dA, dD and ddelta_bias partials, the split's records.
    pub floats: i64,
}

/// Blocks of the CUDA backward per multiprocessor (its launch bounds), which its split aims to fill.
const BWD_BLOCKS_PER_SM: i64 = 2;

/// The CUDA backward's blocking for a shape (`groups` = 0: time-invariant B/C). Without a
/// `checkpoint_len` (0) the split is sized for the most parts any checkpoint_len could give, which
/// is what the workspace must hold.
pub fn bwd_layout(batch: i64, dim: i64, seqlen: i64, dstate: i64, groups: i64, checkpoint_len: i64) -> BwdLayout {
    let threads_per_channel = (((dstate + 7) / 8).max(2) as u64).next_power_of_two() as i64;
    let channels = BWD_THREADS / threads_per_channel;
    let (n_groups, group_dim) = if groups > 0 { (groups, dim / groups) } else { (1, dim) };
    let tiles_per_group = (group_dim + channels - 1) / channels;
    let blocks = n_groups * tiles_per_group * batch;
    // As the forward: a small batch x dim leaves the GPU idle, so the sequence is cut into parts,
    // as many as fit the target in one wave (one more, a second wave of a few blocks, cost 27-30%).
    let target = BWD_BLOCKS_PER_SM * SPLIT_SMS;
    let chunks = n_checkpoints(seqlen, if checkpoint_len > 0 { checkpoint_len } else { CHECKPOINT_MULTIPLE });
    let (n_split, part_len) = if blocks == 0 || 2 * blocks >= target || chunks < 2 {
        (1, chunks * checkpoint_len.max(CHECKPOINT_MULTIPLE))
    } else {
        let want = (target / blocks).min(chunks);
        let per_part = (chunks + want - 1) / want;
        ((chunks + per_part - 1) / per_part, per_part * checkpoint_len.max(CHECKPOINT_MULTIPLE))
    };
    let rows = batch * dim;
    let bc_part_floats =
        if groups > 0 { batch * groups * tiles_per_group * seqlen * dstate } else { n_split * rows * dstate };
    BwdLayout {
        threads_per_channel,
        blocks_per_row: n_groups * tiles_per_group,
        tiles_per_group,
        n_split,
        part_len,
        bc_part_floats,
        floats: 2 * bc_part_floats + n_split * (rows * dstate + 2 * rows) + (n_split - 1) * rows * (dstate + 1),
    }
}

/// Bytes of workspace the CUDA backward needs (`groups` = 0 for time-invariant B/C): per-block
/// partial sums of dB and dC (per (part, batch, channel) ones when B/C are time-invariant), of dA,
/// and of dD and ddelta_bias, which two small kernels then reduce in a fixed order, and the records
/// of the sequence split. Depends on the shape only.
pub fn bwd_workspace_bytes(batch: i64, dim: i64, seqlen: i64, dstate: i64, groups: i64) -> i64 {
    4 * bwd_layout(batch, dim, seqlen, dstate, groups, 0).floats
}

fn opt_ptr(t: Option<&Tensor>) -> *const c_void {
    t.map_or(std::ptr::null(), |t| t.data as *const c_void)
}

/// What checking the inputs yields: the parameters without results (null pointers) and the shapes
/// the results are checked against.
struct Checked {
    params: FwdParams,
    dtype: DType,
    bc_dtype: DType,
    time_varying: bool,
    /// Groups of time-varying B/C; 0 when they are time-invariant.
    groups: i64,
    x_meaning: &'static str,
    bc_dims: Vec<i64>,
    bc_meaning: &'static str,
    /// Rows of the states: batch, or num_seqs with packed sequences.
    state_rows: i64,
    state_meaning: &'static str,
}

impl Checked {
    fn state_dims(&self) -> [i64; 3] {
        [self.state_rows, self.params.dim, self.params.dstate]
    }

    fn checkpoint_dims(&self, checkpoint_len: i64) -> [i64; 4] {
        let p = &self.params;
        [p.batch, p.dim, n_checkpoints(p.seqlen, checkpoint_len), p.dstate]
    }
}

/// What the checks call the operands in the places of u and B (the carry calls, `carry`, name
/// theirs otherwise).
#[derive(Clone, Copy)]
struct Names {
    u: &'static str,
    b: &'static str,
}

const SCAN_NAMES: Names = Names { u: "u", b: "B" };

/// Checks every input against u's shape and dtype (the checks both passes share); the message names
/// the operand, what was expected and what came.
fn validate_inputs(op: &str, names: Names, args: &Inputs) -> Result<Checked> {
    let x_meaning = match args.layout {
        Layout::ChannelFirst => "[batch, dim, seqlen]",
        Layout::ChannelLast => "[batch, seqlen, dim]",
    };
    let u = args.u;
    check_elements(&format!("{op}: operand `{}`", names.u), &u.dims)?;
    if u.dims.len() != 3 {
        return Err(Error::invalid(format!(
            "{op}: operand `{}`: expected rank 3 {x_meaning}, got shape {}",
            names.u,
            super::fmt_dims(&u.dims)
        )));
    }
    expect_dtype(u, &format!("{op}: operand `{}`", names.u), &FLOATS)?;
    let dtype = u.dtype;
    let (batch, dim, seqlen) = match args.layout {
        Layout::ChannelFirst => (u.dims[0], u.dims[1], u.dims[2]),
        Layout::ChannelLast => (u.dims[0], u.dims[2], u.dims[1]),
    };
    expect(args.delta, &format!("{op}: operand `delta`"), &u.dims, x_meaning, &[dtype])?;
    if let Some(z) = args.z {
        expect(z, &format!("{op}: operand `z`"), &u.dims, x_meaning, &[dtype])?;
    }

    let a = args.a;
    if a.dims.len() != 2 || a.dims[0] != dim || a.dims[1] < 0 {
        return Err(Error::invalid(format!(
            "{op}: operand `A`: expected shape ({dim}, dstate) [dim, dstate], got {}",
            super::fmt_dims(&a.dims)
        )));
    }
    expect_dtype(a, &format!("{op}: operand `A`"), &[DType::F32])?;
    let dstate = a.dims[1];
    if dstate > MAX_DSTATE {
        return Err(Error::invalid(format!("{op}: operand `A`: dstate must be at most {MAX_DSTATE}, got {dstate}")));
    }

    // B and C: time-invariant (dim, dstate) or time-varying with groups.
    let b = args.b;
    let bc_dtypes: Vec<DType> = if dtype == DType::F32 { vec![DType::F32] } else { vec![DType::F32, dtype] };
    let (groups, bc_dims, bc_meaning, time_varying) = match b.dims.len() {
        2 => (0, vec![dim, dstate], "[dim, dstate]", false),
        4 => {
            let g = match args.layout {
                Layout::ChannelFirst => b.dims[1],
                Layout::ChannelLast => b.dims[2],
            };
            if g < 1 || dim % g != 0 {
                return Err(Error::invalid(format!(
                    "{op}: operand `{}`: groups (= {g}) must be at least 1 and divide dim (= {dim})",
                    names.b
                )));
            }
            match args.layout {
                Layout::ChannelFirst => (g, vec![batch, g, dstate, seqlen], "[batch, groups, dstate, seqlen]", true),
                Layout::ChannelLast => (g, vec![batch, seqlen, g, dstate], "[batch, seqlen, groups, dstate]", true),
            }
        }
        _ => {
            return Err(Error::invalid(format!(
                "{op}: operand `{}`: expected rank 4 (time-varying) or rank 2 (dim, dstate), got shape {}",
                names.b,
                super::fmt_dims(&b.dims)
            )))
        }
    };
    expect(b, &format!("{op}: operand `{}`", names.b), &bc_dims, bc_meaning, &bc_dtypes)?;
    expect(args.c, &format!("{op}: operand `C` (must match B)"), &bc_dims, bc_meaning, &[b.dtype])?;

    let per_channel = [dim];
    if let Some(d) = args.d {
        expect(d, &format!("{op}: operand `D`"), &per_channel, "[dim]", &[DType::F32])?;
    }
    if let Some(bias) = args.delta_bias {
        expect(bias, &format!("{op}: operand `delta_bias`"), &per_channel, "[dim]", &[DType::F32])?;
    }
    let (state_rows, state_meaning, num_seqs) = match args.cu_seqlens {
        None => (batch, STATE_MEANING, 0),
        Some(cu) => {
            let num_seqs = check_cu_seqlens(op, cu, batch)?;
            (num_seqs, PACKED_STATE_MEANING, num_seqs)
        }
    };
    if let Some(h0) = args.initial_state {
        let what = format!("{op}: operand `initial_state`");
        expect(h0, &what, &[state_rows, dim, dstate], state_meaning, &[DType::F32])?;
    }
    let named: [(Option<&Tensor>, &str); 9] = [
        (Some(u), names.u),
        (Some(args.delta), "delta"),
        (Some(a), "A"),
        (Some(b), names.b),
        (Some(args.c), "C"),
        (args.d, "D"),
        (args.z, "z"),
        (args.delta_bias, "delta_bias"),
        (args.initial_state, "initial_state"),
    ];
    if let Some(cu) = args.cu_seqlens {
        expect_nonnull(cu, &format!("{op}: `cu_seqlens`"))?;
    }
    for (t, name) in named {
        if let Some(t) = t {
            expect_nonnull(t, &format!("{op}: `{name}`"))?;
        }
    }

    let (x_stride_batch, x_stride_dim, x_stride_seq) = match args.layout {
        Layout::ChannelFirst => (dim * seqlen, seqlen, 1),
        Layout::ChannelLast => (seqlen * dim, 1, dim),
    };
    let (dim_per_group, bc_stride_batch, bc_stride_group, bc_stride_state, bc_stride_seq) = if !time_varying {
        (1, 0, dstate, 1, 0)
    } else {
        match args.layout {
            Layout::ChannelFirst => (dim / groups, groups * dstate * seqlen, dstate * seqlen, seqlen, 1),
            Layout::ChannelLast => (dim / groups, seqlen * groups * dstate, dstate, 1, groups * dstate),
        }
    };
    let params = FwdParams {
        u: u.data,
        delta: args.delta.data,
        a: a.data as *const f32,
        b: b.data,
        c: args.c.data,
        d: opt_ptr(args.d) as *const f32,
        z: opt_ptr(args.z),
        delta_bias: opt_ptr(args.delta_bias) as *const f32,
        initial_state: opt_ptr(args.initial_state) as *const f32,
        out: std::ptr::null_mut(),
        final_state: std::ptr::null_mut(),
        batch,
        dim,
        seqlen,
        dstate,
        dim_per_group,
        x_stride_batch,
        x_stride_dim,
        x_stride_seq,
        bc_stride_batch,
        bc_stride_group,
        bc_stride_state,
        bc_stride_seq,
        delta_softplus: args.delta_softplus as i32,
        _reserved: 0,
        workspace: std::ptr::null_mut(),
        chunk_len: seqlen,
        n_chunks: 1,
        checkpoints: std::ptr::null_mut(),
        checkpoint_len: 0,
        cu_seqlens: args.cu_seqlens.map_or(std::ptr::null(), |t| t.data as *const i32),
        num_seqs,
    };
    Ok(Checked {
        params,
        dtype,
        bc_dtype: b.dtype,
        time_varying,
        groups,
        x_meaning,
        bc_dims,
        bc_meaning,
        state_rows,
        state_meaning,
    })
}

/// `checkpoint_len`: a positive multiple of [`CHECKPOINT_MULTIPLE`], or 0 (none) where `optional`.
pub fn validate_checkpoint_len(op: &str, checkpoint_len: i64, optional: bool) -> Result<()> {
    let valid = (checkpoint_len > 0 || (optional && checkpoint_len == 0)) && checkpoint_len % CHECKPOINT_MULTIPLE == 0;
    if !valid {
        let want = if optional { "0 (no checkpoints) or a positive multiple" } else { "a positive multiple" };
        return Err(Error::invalid(format!(
            "{op}: attribute `checkpoint_len`: expected {want} of {CHECKPOINT_MULTIPLE}, got {checkpoint_len}"
        )));
    }
    Ok(())
}

/// Each named tensor that is present has data (or is empty).
fn expect_nonnull_all(op: &str, named: &[(Option<&Tensor>, &str)]) -> Result<()> {
    for (t, name) in named {
        if let Some(t) = t {
            expect_nonnull(t, &format!("{op}: `{name}`"))?;
        }
    }
    Ok(())
}

/// Checks every operand against u's shape and dtype; the message names the operand, what was
/// expected and what came.
pub fn validate_fwd(args: &FwdArgs) -> Result<Fwd> {
    let op = "selective_scan_fwd";
    let k = validate_inputs(op, SCAN_NAMES, &args.inputs)?;
    let u = args.inputs.u;
    expect(args.out, &format!("{op}: result `out`"), &u.dims, k.x_meaning, &[k.dtype])?;
    expect(args.final_state, &format!("{op}: result `final_state`"), &k.state_dims(), k.state_meaning, &[DType::F32])?;
    validate_checkpoint_len(op, args.checkpoint_len, true)?;
    match (args.checkpoints, args.checkpoint_len) {
        (None, 0) => {}
        (Some(_), 0) => {
            return Err(Error::invalid(format!(
                "{op}: result `checkpoints`: given, but attribute `checkpoint_len` is 0 (no checkpoints)"
            )))
        }
        (None, len) => {
            return Err(Error::invalid(format!(
                "{op}: result `checkpoints`: missing, but attribute `checkpoint_len` is {len}"
            )))
        }
        (Some(t), len) => {
            let what = format!("{op}: result `checkpoints`");
            expect(t, &what, &k.checkpoint_dims(len), CHECKPOINTS_MEANING, &[DType::F32])?;
        }
    }
    expect_nonnull_all(
        op,
        &[(Some(args.out), "out"), (Some(args.final_state), "final_state"), (args.checkpoints, "checkpoints")],
    )?;
    let results = [
        ("out", Some(args.out)),
        ("final_state", Some(args.final_state)),
        ("checkpoints", args.checkpoints),
        ("workspace", args.workspace),
    ];
    check_buffers(op, &args.inputs.named(), &results)?;
    let params = FwdParams {
        out: args.out.data,
        final_state: args.final_state.data as *mut f32,
        checkpoints: opt_ptr(args.checkpoints) as *mut f32,
        checkpoint_len: args.checkpoint_len,
        workspace: args.workspace.map_or(std::ptr::null_mut(), |w| w.data as *mut f32),
        ..k.params
    };
    let workspace_bytes = args.workspace.map_or(0, |w| w.numel() * w.dtype.size_bytes());
    let records = match args.chunk_records {
        None => Records::Made,
        Some(t) => Records::Given(records::check_records_operand(op, t, &params, &results)?),
    };
    Ok(Fwd { params, dtype: k.dtype, bc_dtype: k.bc_dtype, bc_time_varying: k.time_varying, workspace_bytes, records })
}

/// Runs a validated forward call.
pub fn run_fwd(fwd: &Fwd, platform: Platform) -> Result<()> {
    match platform {
        Platform::Cpu => {
            // SAFETY: validated, and on the CPU platform every buffer is host memory.
            if let Some(cu) = unsafe { fwd.params.host_cu_seqlens() } {
                check_cu_seqlens_values("selective_scan_fwd", cu, fwd.params.seqlen)?;
            }
            // Given records are the forward's own first pass: the CPU, which has none, ignores them.
            match fwd.records {
                Records::Only(_) => crate::cpu::records::run(fwd),
                Records::Made | Records::Given(_) => crate::cpu::selective_scan::fwd(fwd),
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => crate::cuda::selective_scan::fwd(fwd, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(no_cuda(fwd.op())),
    }
}

#[cfg(not(feature = "cuda"))]
fn no_cuda(op: &str) -> Error {
    Error::Unimplemented(format!("{op}: this build of xla-ssm has no CUDA support (built without the `cuda` feature)"))
}

// ------------------------------------------------------------------------------------ backward

/// The operands of one backward call (docs/selective_scan_bwd.md), as the host describes them. Each
/// optional gradient is present exactly when its primal is.
pub struct BwdArgs<'a> {
    pub inputs: Inputs<'a>,
    /// The forward's `checkpoints`, made with the same `checkpoint_len`.
    pub checkpoints: &'a Tensor,
    pub checkpoint_len: i64,
    pub dout: &'a Tensor,
    pub dfinal_state: Option<&'a Tensor>,
    pub du: &'a Tensor,
    pub ddelta: &'a Tensor,
    pub da: &'a Tensor,
    pub db: &'a Tensor,
    pub dc: &'a Tensor,
    pub dd: Option<&'a Tensor>,
    pub dz: Option<&'a Tensor>,
    pub ddelta_bias: Option<&'a Tensor>,
    pub dinitial_state: Option<&'a Tensor>,
    /// Scratch of the CUDA backward (see [`bwd_workspace_bytes`]); the CPU ignores it.
    pub workspace: Option<&'a Tensor>,
}

/// Kernel parameters of the backward, passed by value to the CUDA kernel; generated into
/// kernels/params.h as `SelectiveScanBwdParams`. `fwd` holds the inputs as [`validate_fwd`] lays them
/// out, with null `out` and `final_state`, the `checkpoints` operand, the backward's workspace (its
/// partial sums) and one chunk (`chunk_len` = seqlen). Absent optional operands and gradients are null.
/// cbindgen:field-names=[fwd, dout, dfinal_state, du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BwdParams {
    pub fwd: FwdParams,
    pub dout: *const c_void,
    pub dfinal_state: *const f32,
    pub du: *mut c_void,
    pub ddelta: *mut c_void,
    pub da: *mut f32,
    pub db: *mut c_void,
    pub dc: *mut c_void,
    pub dd: *mut f32,
    pub dz: *mut c_void,
    pub ddelta_bias: *mut f32,
    pub dinitial_state: *mut f32,
}

/// Parameters of the backward's reductions, which sum the tiled kernel's partials; generated into
/// kernels/params.h as `SelectiveScanBwdReduceParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BwdReduceParams {
    pub q: BwdParams,
    /// Blocks of the tiled kernel per (batch row, group).
    pub tiles_per_group: i64,
    /// Floats of each of the dB and dC partials.
    pub bc_part: i64,
    /// Groups of time-varying B/C (dim may be 0).
    pub groups: i64,
    pub varying_bc: i32,
    pub _reserved: i32,
}

validated! {
    /// A validated backward call.
    #[derive(Debug, Clone, Copy)]
    pub struct Bwd {
        params: BwdParams,
        /// dtype of u, delta, z, dout and their gradients.
        dtype: DType,
        /// dtype of B, C, dB and dC.
        bc_dtype: DType,
        bc_time_varying: bool,
        /// Groups of time-varying B/C; 0 when they are time-invariant.
        groups: i64,
        /// Size of the workspace the host passed (0: none).
        workspace_bytes: i64,
    }
}

/// Checks the inputs as [`validate_fwd`] does, then the checkpoints, the cotangents and every
/// gradient (shape and dtype of its primal).
pub fn validate_bwd(args: &BwdArgs) -> Result<Bwd> {
    let op = "selective_scan_bwd";
    let k = validate_inputs(op, SCAN_NAMES, &args.inputs)?;
    let i = &args.inputs;
    let (x_dims, state_dims) = (&i.u.dims, k.state_dims());
    validate_checkpoint_len(op, args.checkpoint_len, false)?;
    let checkpoint_dims = k.checkpoint_dims(args.checkpoint_len);
    expect(
        args.checkpoints,
        &format!("{op}: operand `checkpoints`"),
        &checkpoint_dims,
        CHECKPOINTS_MEANING,
        &[DType::F32],
    )?;
    expect(args.dout, &format!("{op}: operand `dout`"), x_dims, k.x_meaning, &[k.dtype])?;
    if let Some(t) = args.dfinal_state {
        expect(t, &format!("{op}: operand `dfinal_state`"), &state_dims, k.state_meaning, &[DType::F32])?;
    }
    expect(args.du, &format!("{op}: result `du`"), x_dims, k.x_meaning, &[k.dtype])?;
    expect(args.ddelta, &format!("{op}: result `ddelta`"), x_dims, k.x_meaning, &[k.dtype])?;
    let (dim, dstate) = (k.params.dim, k.params.dstate);
    expect(args.da, &format!("{op}: result `dA`"), &[dim, dstate], "[dim, dstate]", &[DType::F32])?;
    expect(args.db, &format!("{op}: result `dB`"), &k.bc_dims, k.bc_meaning, &[k.bc_dtype])?;
    expect(args.dc, &format!("{op}: result `dC`"), &k.bc_dims, k.bc_meaning, &[k.bc_dtype])?;
    // (primal, gradient, their names, the gradient's shape, its meaning, dtype)
    type OptionalGrad<'t> = (Option<&'t Tensor>, Option<&'t Tensor>, &'t str, &'t str, &'t [i64], &'t str, DType);
    let optional: [OptionalGrad; 4] = [
        (i.d, args.dd, "D", "dD", &[dim], "[dim]", DType::F32),
        (i.z, args.dz, "z", "dz", x_dims, k.x_meaning, k.dtype),
        (i.delta_bias, args.ddelta_bias, "delta_bias", "ddelta_bias", &[dim], "[dim]", DType::F32),
        (
            i.initial_state,
            args.dinitial_state,
            "initial_state",
            "dinitial_state",
            &state_dims,
            k.state_meaning,
            DType::F32,
        ),
    ];
    for (primal, grad, primal_name, name, dims, meaning, dtype) in optional {
        match (primal, grad) {
            (Some(_), Some(t)) => expect(t, &format!("{op}: result `{name}`"), dims, meaning, &[dtype])?,
            (None, None) => {}
            (Some(_), None) => {
                return Err(Error::invalid(format!(
                    "{op}: result `{name}`: missing, but operand `{primal_name}` is given (its gradient is required)"
                )))
            }
            (None, Some(_)) => {
                return Err(Error::invalid(format!("{op}: result `{name}`: given, but operand `{primal_name}` is not")))
            }
        }
    }
    expect_nonnull_all(
        op,
        &[
            (Some(args.checkpoints), "checkpoints"),
            (Some(args.dout), "dout"),
            (args.dfinal_state, "dfinal_state"),
            (Some(args.du), "du"),
            (Some(args.ddelta), "ddelta"),
            (Some(args.da), "dA"),
            (Some(args.db), "dB"),
            (Some(args.dc), "dC"),
            (args.dd, "dD"),
            (args.dz, "dz"),
            (args.ddelta_bias, "ddelta_bias"),
            (args.dinitial_state, "dinitial_state"),
        ],
    )?;
    let mut operands = i.named();
    operands.extend([
        ("checkpoints", Some(args.checkpoints)),
        ("dout", Some(args.dout)),
        ("dfinal_state", args.dfinal_state),
    ]);
    let results = [
        ("du", Some(args.du)),
        ("ddelta", Some(args.ddelta)),
        ("dA", Some(args.da)),
        ("dB", Some(args.db)),
        ("dC", Some(args.dc)),
        ("dD", args.dd),
        ("dz", args.dz),
        ("ddelta_bias", args.ddelta_bias),
        ("dinitial_state", args.dinitial_state),
        ("workspace", args.workspace),
    ];
    check_buffers(op, &operands, &results)?;
    let mut_ptr = |t: Option<&Tensor>| opt_ptr(t) as *mut c_void;
    let params = BwdParams {
        fwd: FwdParams {
            checkpoints: args.checkpoints.data as *mut f32,
            checkpoint_len: args.checkpoint_len,
            workspace: args.workspace.map_or(std::ptr::null_mut(), |w| w.data as *mut f32),
            ..k.params
        },
        dout: args.dout.data,
        dfinal_state: opt_ptr(args.dfinal_state) as *const f32,
        du: args.du.data,
        ddelta: args.ddelta.data,
        da: args.da.data as *mut f32,
        db: args.db.data,
        dc: args.dc.data,
        dd: mut_ptr(args.dd) as *mut f32,
        dz: mut_ptr(args.dz),
        ddelta_bias: mut_ptr(args.ddelta_bias) as *mut f32,
        dinitial_state: mut_ptr(args.dinitial_state) as *mut f32,
    };
    let workspace_bytes = args.workspace.map_or(0, |w| w.numel() * w.dtype.size_bytes());
    Ok(Bwd {
        params,
        dtype: k.dtype,
        bc_dtype: k.bc_dtype,
        bc_time_varying: k.time_varying,
        groups: k.groups,
        workspace_bytes,
    })
}

/// Runs a validated backward call.
pub fn run_bwd(bwd: &Bwd, platform: Platform) -> Result<()> {
    match platform {
        Platform::Cpu => {
            // SAFETY: validated, and on the CPU platform every buffer is host memory.
            if let Some(cu) = unsafe { bwd.params.fwd.host_cu_seqlens() } {
                check_cu_seqlens_values("selective_scan_bwd", cu, bwd.params.fwd.seqlen)?;
            }
            crate::cpu::selective_scan_bwd::bwd(bwd);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => crate::cuda::selective_scan_bwd::bwd(bwd, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(no_cuda("selective_scan_bwd")),
    }
}

// ------------------------------------------------------------------------------------ frames

#[cfg(test)]
mod tests {
    use super::*;

    /// The splits fill the GPU in one wave: as many parts as fit the target, never one more (a
    /// second wave of a few blocks cost the forward 8% and the backward 27-30%).
    #[test]
    fn splits_fit_one_wave() {
        // (batch, dim, seqlen, forward chunks, backward parts at checkpoint_len 32)
        let cases = [
            (1, 4096, 16384, 8, 4),  // 64 tiles / blocks: 528 / 64 = 8.25, 264 / 64 = 4.1
            (2, 4096, 8192, 4, 2),   // 128: 4.1, 2.06
            (1, 2048, 8192, 16, 8),  // 32: 16.5, 8.25
            (1, 1536, 2048, 22, 11), // 24: 22 and 11 exactly
            (8, 4096, 2048, 1, 1),   // enough blocks: no split
        ];
        for (batch, dim, seqlen, chunks, parts) in cases {
            let (chunk_len, n_chunks) = split_plan(batch, dim, seqlen);
            assert_eq!(n_chunks, chunks, "forward {batch}x{dim}x{seqlen}");
            assert!(chunk_len * n_chunks >= seqlen && chunk_len % 32 == 0);
            let layout = bwd_layout(batch, dim, seqlen, 16, 1, 32);
            assert_eq!(layout.n_split, parts, "backward {batch}x{dim}x{seqlen}");
            assert!(layout.part_len * layout.n_split >= seqlen && layout.part_len % 32 == 0);
        }
        for batch in 1..=4 {
            for dim in [64, 640, 1536, 2048, 4096] {
                let tiles = batch * ((dim + TILE_CHANNELS - 1) / TILE_CHANNELS);
                let (_, n_chunks) = split_plan(batch, dim, 1 << 15);
                assert!(n_chunks == 1 || n_chunks * tiles <= FWD_SPLIT_TARGET_BLOCKS, "{batch}x{dim}");
                let layout = bwd_layout(batch, dim, 1 << 15, 16, 1, 32);
                assert!(
                    layout.n_split == 1 || layout.n_split * tiles <= BWD_BLOCKS_PER_SM * SPLIT_SMS,
                    "{batch}x{dim}"
                );
            }
        }
    }
}
