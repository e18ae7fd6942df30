//! The CUDA launch of the forward scan (kernels/selective_scan_fwd.cuh), which picks one of two kernels:
//! - `tiled`: 2 to 32 threads per channel (dstate <= 16, 32, 64, 128, 256), 8 states each in
//!   registers (or one thread of 16 states at dstate <= 16 on large grids), tiles of 64 channels (32
//!   and 16 past dstate 64) through shared memory. One B/C group per tile, 16-byte aligned rows
//!   (seqlen, or dim when channel-last, a multiple of 8 / 4 elements for 2- / 4-byte types); B/C
//!   staged as 16-byte vectors where they allow it (`tiled_bc_form`).
//! - `lanes`: 1..32 lanes per channel with 8 states each; any dstate up to 256, any groups, any
//!   alignment.
//!
//! The tiled kernel is taken wherever it applies; `XLA_SSM_FWD_KERNEL=lanes` forces the other. When
//! the host passes a workspace and batch x dim is small, the tiled kernel splits the sequence
//! ([`split_plan`]): two launches, a chunk-local pass and the final one. A records call
//! (`selective_scan_chunk_records`) runs the first alone, over every chunk; a forward given its
//! records runs the second alone.
//!
//! Packed sequences (`cu_seqlens`) run kernels of their own (`_packed`), so that the others stay as
//! they were; the plan (kernel, threads per channel, split) is the same as unpacked, from the shapes
//! alone (the boundaries are on the device), except that one thread a channel is never taken.

use crate::error::Result;
use crate::ops::selective_scan::{
    split_plan, split_record_floats, tiled_channels, tiled_thread_states, tiled_threads_per_channel, workspace_bytes,
    Fwd, FwdParams, FWD_SPLIT_TARGET_BLOCKS, TILED_MAX_DSTATE,
};
use crate::ops::Records;
use once_cell::sync::Lazy;
use std::ffi::c_void;

use super::kernels;
use super::{launch, LaunchConfig};

const LANE_STATES: i64 = 8;
const LANES_BLOCK: u32 = 128;
/// Threads of a block of the records' fallback kernel (`kRecordsThreads`).
const RECORDS_BLOCK: u32 = 128;

/// `Tile<T, TPC>::kSharedBytes`: u, delta, z tiles of 64-byte rows padded by a word, f32 dt and gate
/// rows padded by one, f32 B and C of `Tiled<TPC>::kStates`.
fn tiled_shared_bytes(elem_bytes: i64, tpc: i64) -> u32 {
    let (steps, channels) = (64 / elem_bytes, tiled_channels(tpc));
    let pitch = steps + 4 / elem_bytes;
    let states = tiled_thread_states(tpc) * tpc;
    (3 * channels * pitch * elem_bytes + 2 * channels * (steps + 1) * 4 + 2 * steps * states * 4) as u32
}

/// `XLA_SSM_FWD_KERNEL=lanes` forces the lanes kernel, `tiled1` the tiled one at one thread a channel
/// (in the pass that writes the outputs) wherever dstate <= 16 (tests use them to cover every kernel).
static FORCED_KERNEL: Lazy<Option<String>> = Lazy::new(|| std::env::var("XLA_SSM_FWD_KERNEL").ok());

fn forced(kernel: &str) -> bool {
    FORCED_KERNEL.as_deref() == Some(kernel)
}

/// Blocks from which the tiled kernel takes one thread of 16 states a channel at dstate <= 16: about
/// four 64-thread blocks an SM of an H100, the two warps a scheduler its step loop needs. On an H100
/// it ran 7% faster than two threads a channel at 8 x 4096 x 2048 (512 blocks: 3.9 an SM), 2-3% at
/// 64 x 2048 x 512 and 16 x 5120 x 2048 ("bdl"), but 13% slower at 16 x 1536 x 2048 (384 blocks).
const ONE_THREAD_MIN_BLOCKS: i64 = 7 * FWD_SPLIT_TARGET_BLOCKS / 8;
/// Steps a chunk of a sequence split from which its second pass takes one thread a channel: 2-6%
/// faster from 384 steps on (1 x 4096 x 16384 in chunks of 2048: 456 against 486 us), 7% slower at
/// 96 (1 x 1536 x 2048; H100).
const ONE_THREAD_MIN_CHUNK: i64 = 384;

/// Lanes per channel: enough lanes of 8 states to cover dstate, a power of two up to 32.
fn lanes_per_channel(dstate: i64) -> i64 {
    let lanes = (dstate + LANE_STATES - 1) / LANE_STATES;
    (lanes.max(1) as u64).next_power_of_two() as i64
}

fn tiled_supported(fwd: &Fwd) -> bool {
    let p = &fwd.params();
    // Tiles move 16-byte vectors along the contiguous axis of u, delta, z and out.
    let vec_elems = 16 / fwd.dtype().size_bytes();
    let contiguous_len = if p.x_stride_seq == 1 { p.seqlen } else { p.dim };
    let aligned = [p.u, p.delta, p.z, p.out as *const c_void].iter().all(|&ptr| (ptr as usize).is_multiple_of(16));
    let vectorizable = aligned && contiguous_len % vec_elems == 0;
    let channels = tiled_channels(tiled_threads_per_channel(p.dstate));
    let one_group_per_tile = !fwd.bc_time_varying() || p.dim_per_group == p.dim || p.dim_per_group % channels == 0;
    vectorizable && p.dstate <= TILED_MAX_DSTATE && one_group_per_tile && p.batch <= u16::MAX as i64
}

/// The tiled kernel's form of B/C (`BcForm`): "varying_vec" stages time-varying B/C as 16-byte
/// vectors along their contiguous axis, which needs them 16-byte aligned and their rows a whole number
/// of vectors; "varying" takes any strides. Rows along time ("bdl") always take vectors where they
/// can (element by element, a warp's shared-memory writes conflict: 593 against 629 us at the main
/// shape, dstate 16). Rows along the states ("bld") take them from dstate 65 on (16 and 32 threads per
/// channel: 4512 against 4738 us at dstate 128, 9847 against 11911 at 256); below, element by
/// element was faster (587 against 597 at 16, 2116 against 2194 at 64; H100).
fn tiled_bc_form(fwd: &Fwd, tpc: i64) -> &'static str {
    let p = &fwd.params();
    if !fwd.bc_time_varying() {
        return "invariant";
    }
    let vec_elems = 16 / fwd.bc_dtype().size_bytes();
    let (row_len, others) = if p.bc_stride_seq == 1 {
        (p.seqlen, [p.bc_stride_state, p.bc_stride_group, p.bc_stride_batch])
    } else if p.bc_stride_state == 1 && tpc >= 16 {
        (p.dstate, [p.bc_stride_seq, p.bc_stride_group, p.bc_stride_batch])
    } else {
        return "varying";
    };
    let aligned = [p.b, p.c].iter().all(|&ptr| (ptr as usize).is_multiple_of(16));
    let whole_vectors = row_len % vec_elems == 0 && others.iter().all(|&x| x % vec_elems == 0);
    if aligned && whole_vectors {
        "varying_vec"
    } else {
        "varying"
    }
}

/// The chunk records where the tiled pass does not apply: a thread per record float.
fn chunk_records_any(fwd: &Fwd, records: *mut f32, stream: *mut c_void) -> Result<()> {
    let p = FwdParams { workspace: records, ..fwd.params() };
    let floats = (p.n_chunks * p.batch * p.dim * split_record_floats(p.dstate)) as u64;
    let config =
        LaunchConfig { grid: (floats.div_ceil(RECORDS_BLOCK as u64), 1, 1), block: RECORDS_BLOCK, shared_bytes: 0 };
    let kernel = kernels::scan_chunk_records((fwd.dtype(), fwd.bc_dtype()));
    // SAFETY: as above.
    unsafe { launch(stream, kernels::SCAN_CARRY, &kernel, config, &p) }
}

pub fn fwd(fwd: &Fwd, stream: *mut c_void) -> Result<()> {
    let p = &fwd.params();
    if p.batch * p.dim == 0 {
        return Ok(());
    }
    let types = (fwd.dtype(), fwd.bc_dtype());
    let packed = !p.cu_seqlens.is_null();
    // The tiled kernel is 6-36x faster than the lanes kernel at the benchmark shapes on the H100
    // (`tests/cuda/fwd_check.cu time`), small ones included; lanes covers what tiled does not.
    if tiled_supported(fwd) && !forced("lanes") {
        let (chunk_len, n_chunks) = split_plan(p.batch, p.dim, p.seqlen);
        let needed = workspace_bytes(p.batch, p.dim, p.seqlen, p.dstate);
        // The records are f32: a host's misaligned scratch is not used rather than faulted on.
        let usable = !p.workspace.is_null() && (p.workspace as usize).is_multiple_of(4);
        let given = match fwd.records() {
            Records::Given(records) => Some(records),
            _ => None,
        };
        let split = n_chunks > 1 && (given.is_some() || (needed > 0 && fwd.workspace_bytes() >= needed && usable));
        let tpc = tiled_threads_per_channel(p.dstate);
        // Tiled<1> has as many channels a block as Tiled<2>: the same tiles at either.
        let tiles = (p.dim + tiled_channels(tpc) - 1) / tiled_channels(tpc);
        let chunks = if split { n_chunks } else { 1 };
        // The pass that writes the outputs at one thread a channel (the split's first pass never:
        // it gained only on the longest chunks, and lost on the others).
        let one_thread = p.dstate <= 16
            && (forced("tiled1")
                || (tiles * p.batch * chunks >= ONE_THREAD_MIN_BLOCKS
                    && (!split || chunk_len >= ONE_THREAD_MIN_CHUNK)));
        let launch_pass = |local: bool, pass_tpc: i64, grid_chunks: i64, params: &FwdParams| {
            let kernel = kernels::scan_fwd_tiled(local, packed, types, pass_tpc, tiled_bc_form(fwd, pass_tpc));
            let config = LaunchConfig {
                grid: (tiles as u64, p.batch as u64, grid_chunks as u64),
                block: (tiled_channels(pass_tpc) * pass_tpc) as u32, // Tiled<TPC>::kThreads
                shared_bytes: tiled_shared_bytes(fwd.dtype().size_bytes(), pass_tpc),
            };
            // SAFETY: the parameters of a validated call (see `launch`).
            unsafe { launch(stream, kernels::scan_fwd_module(packed), &kernel, config, params) }
        };
        if let Records::Only(records) = fwd.records() {
            // The first pass alone, over every chunk of the split (the forward's leaves out the
            // last, which nothing after it reads); validation set the records call's split.
            return launch_pass(true, tpc, p.n_chunks, &FwdParams { workspace: records, ..*p });
        }
        let final_tpc = if one_thread { 1 } else { tpc };
        if split {
            if let Some(records) = given {
                // The first pass ran beforehand (`selective_scan_chunk_records`); its records are
                // only read.
                let split = FwdParams { chunk_len, n_chunks, workspace: records as *mut f32, ..*p };
                return launch_pass(false, final_tpc, n_chunks, &split);
            }
            let split = FwdParams { chunk_len, n_chunks, ..*p };
            launch_pass(true, tpc, n_chunks - 1, &split)?;
            return launch_pass(false, final_tpc, n_chunks, &split);
        }
        launch_pass(false, final_tpc, 1, p)
    } else {
        if let Records::Only(records) = fwd.records() {
            return chunk_records_any(fwd, records, stream);
        }
        let ns = lanes_per_channel(p.dstate);
        let kernel = kernels::scan_fwd_lanes(packed, types, ns);
        let blocks = ((p.batch * p.dim * ns) as u64).div_ceil(LANES_BLOCK as u64);
        let config = LaunchConfig { grid: (blocks, 1, 1), block: LANES_BLOCK, shared_bytes: 0 };
        // SAFETY: the parameters of a validated call (see `launch`).
        unsafe { launch(stream, kernels::scan_fwd_module(packed), &kernel, config, p) }
    }
}
