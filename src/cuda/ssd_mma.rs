//! The tensor-core kernels (kernels/ssd_fwd.cu, kernels/ssd_bwd.cu), for the calls
//! [`plan::mma_applies`] admits: a block of 4 warps per (batch,
//! head) and part of the sequence, the state (forward) or its gradient (backward) in mma
//! accumulators. With several parts, a first launch records what each part passes on (forward: its
//! end state and decay; backward: the gradient entering it), and the second starts every part from the
//! records of the parts before (after) it. The backward's main kernel has no gate: with z, the forward
//! kernel first recomputes y before the gate and a small kernel turns dy into its gradient (and dz).

use super::kernels::{self, SSD_BWD as BWD_MODULE, SSD_FWD as FWD_MODULE};
use super::{compute_capability, copy_async, launch, launch_ex, LaunchConfig, Start};
use crate::error::Result;
use crate::ops::ssd::plan::{self, Shape, MMA_TILE};
use crate::ops::ssd::{BwdMmaParams, FwdMmaParams, Ssd, SsdBwd, SsdBwdParams, SsdParams};
use crate::DType;
use std::ffi::c_void;

/// `ssd_mma::kThreads`.
const THREADS: u32 = 128;
/// Threads of the reduce kernels' blocks, and the most blocks of the grid-stride one.
const REDUCE_THREADS: u32 = 256;
const REDUCE_MAX_BLOCKS: u64 = 4096;

/// `sizeof(SyncSmem<T, N>)` (static_assert in kernels/ssd_fwd_sync.cuh): double-buffered x (64 x 72),
/// B and C (64 x (N + 8)) tiles of 2-byte elements, the state tile, and two tiles' scalars. The wgmma
/// kernel (sm_90a) needs less and gets the same (a static_assert there checks it fits).
fn fwd_shared_bytes(dstate: i64) -> u32 {
    (20480 + 640 * (dstate + 8)) as u32
}

/// `sizeof(BwdSmem<T, N>)` (static_assert there): x and dy (64 x 72), B, C, S and dS (64 x (N + 8))
/// tiles, per-step scalars and partial sums, and a kept 64 x N state in T.
fn bwd_shared_bytes(dstate: i64) -> u32 {
    (21264 + 512 * (dstate + 8) + 128 * dstate) as u32
}

/// head_msum's threads, and its shared memory (`msum_shared_bytes`, kernels/ssd_bwd_sums.cuh): two stages,
/// each of a head's dy and x over the chunk (rows of 64 2-byte elements) and the chunk's {cum, dt}, in
/// whole KiB; then a scaled copy of x's rows but the last tile's; plus a KiB to align them.
const MSUM_THREADS: u32 = 256;
fn msum_shared_bytes(chunk: i64) -> u32 {
    let stage = whole_kib(2 * chunk * 64 * 2 + chunk * 8);
    (2 * stage + (chunk - MMA_TILE) * 64 * 2 + 1024) as u32
}

/// bc_sums' shared memory (`bc_shared_bytes`, kernels/ssd_bwd_sums.cuh): two stages, each of a head's
/// dy or x over the chunk (rows of 72 2-byte elements), a 64 x dstate state tile, the chunk's {cum, dt}
/// and its last two steps', in whole KiB; plus a KiB to align them.
fn bc_shared_bytes(chunk: i64, dstate: i64) -> u32 {
    let stage = whole_kib(chunk * 72 * 2 + 64 * dstate * 2 + chunk * 8 + 16);
    (2 * stage + 1024) as u32
}

/// Bytes rounded up to whole KiB (the kernels' pipeline stages keep their 128-byte-swizzled tiles
/// 1024-byte aligned).
fn whole_kib(bytes: i64) -> i64 {
    (bytes.max(0) as u64).div_ceil(1024) as i64 * 1024
}

/// Whether the pointers suit the kernels: x, B, C (and dy) as 16-byte vectors (cp.async), y (and dx)
/// too (their tiles leave in 16-byte stores, and y holds the parked tile scalars), states as float2,
/// the rest as element pairs.
pub(super) fn aligned(p: &SsdParams) -> bool {
    let at = |ptr: *const c_void, bytes: usize| (ptr as usize).is_multiple_of(bytes);
    at(p.x, 16)
        && at(p.b, 16)
        && at(p.c, 16)
        && at(p.z, 4)
        && at(p.y, 16)
        && at(p.initial_states as *const c_void, 8)
        && at(p.final_states as *const c_void, 8)
        && at(p.chunk_states as *const c_void, 8)
}

pub(super) fn bwd_aligned(q: &SsdBwdParams) -> bool {
    let at = |ptr: *const c_void, bytes: usize| (ptr as usize).is_multiple_of(bytes);
    aligned(&q.fwd)
        && at(q.dy, 16)
        && at(q.dx, 16)
        && at(q.dz, 4)
        && at(q.dfinal_states as *const c_void, 8)
        && at(q.dinitial_states as *const c_void, 8)
}

/// REDUCE_THREADS-thread blocks for `items` threads, at most `max_blocks` (the kernel then strides).
fn flat(items: i64, max_blocks: u64) -> LaunchConfig {
    let blocks = (items.max(0) as u64).div_ceil(REDUCE_THREADS as u64).min(max_blocks);
    LaunchConfig { grid: (blocks, 1, 1), block: REDUCE_THREADS, shared_bytes: 0 }
}

fn blocks(p: &SsdParams, parts: i64, shared_bytes: u32) -> LaunchConfig {
    LaunchConfig { grid: ((p.batch * p.heads) as u64, parts as u64, 1), block: THREADS, shared_bytes }
}

/// The forward; `workspace` is the workspace's aligned start, `workspace_bytes` long: the split takes
/// as many records as fit there (none when null).
pub(super) fn fwd(
    ssd: &Ssd,
    shape: &Shape,
    workspace: *mut u8,
    workspace_bytes: i64,
    stream: *mut c_void,
) -> Result<()> {
    let p = &ssd.params();
    if p.batch * p.heads == 0 {
        return Ok(());
    }
    let max_records = if workspace.is_null() { 0 } else { workspace_bytes / plan::mma_fwd_record_bytes(shape) };
    let cc = compute_capability(stream)?;
    let split = plan::mma_fwd_split(shape, max_records, plan::Pieces::forward(shape, cc));
    let mut args = FwdMmaParams { p: SsdParams { workspace: workspace as *mut c_void, ..*p }, split, scalars_in_y: 0 };
    let (dtype, dstate, packed) = (ssd.dtype(), p.dstate, p.packed());
    let smem = fwd_shared_bytes(p.dstate);
    if split.n_parts > 1 {
        // SAFETY: the parameters of a validated call (see `launch`).
        unsafe {
            let kernel = kernels::ssd_fwd_mma(true, false, packed, dtype, dstate);
            launch(stream, FWD_MODULE, &kernel, blocks(p, split.records(), smem), &args)
        }?;
    }
    args.scalars_in_y = park_tile_scalars(&args, dtype, cc, stream)?;
    // With z, a kernel of its own (kernels/ssd_fwd.cu: the gate's code slowed the ungated one).
    let main = kernels::ssd_fwd_mma(false, !p.z.is_null(), packed, dtype, dstate);
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, FWD_MODULE, &main, blocks(p, split.n_parts, smem), &args) }
}

/// Where the main kernel is the wgmma one (an sm_90 GPU, dstate 128, unpacked: kernels/ssd_fwd.cu),
/// forms its tile scalars ahead of it into y's rows (`ssd_fwd_tile_scalars`: a warp per (batch,
/// head, full 64-step tile), a block per 4 heads) and returns 1 for `scalars_in_y`; else 0, and the
/// kernel forms them itself. (Where the library was built without sm_90a code, the mma.sync kernel
/// runs instead and overwrites the rows unread.)
fn park_tile_scalars(args: &FwdMmaParams, dtype: DType, cc: (i32, i32), stream: *mut c_void) -> Result<i32> {
    let p = &args.p;
    let units = p.batch * (p.seqlen / MMA_TILE) * ((p.heads + 3) / 4);
    if cc != (9, 0) || p.dstate != 128 || p.packed() || units == 0 {
        return Ok(0);
    }
    let config = LaunchConfig { grid: ((units as u64).min(REDUCE_MAX_BLOCKS), 1, 1), block: THREADS, shared_bytes: 0 };
    // SAFETY: the parameters of a validated call (y 16-byte aligned: `aligned`); the kernel writes
    // the first 8 rows of y's whole tiles, which the main kernel overwrites.
    unsafe { launch(stream, FWD_MODULE, &kernels::ssd_fwd_tile_scalars(dtype), config, args) }?;
    Ok(1)
}

/// `ssd_part_records` (docs/ssd.md, "Part records"), for a shape the kernels run as it is. Its
/// split's first pass over every part, the last included, with one record a part: states
/// [n_parts][batch * heads][64][N], then decays [n_parts][batch * heads] (what `PartRecords` reads for
/// a split of n_parts + 1 parts); a fold of them into the end states from zero; then the decays
/// moved down over the last part's state, where a forward of n_parts parts reads them.
pub(super) fn part_records(ssd: &Ssd, shape: &Shape, records: *mut f32, stream: *mut c_void) -> Result<()> {
    let p = &ssd.params();
    let bh = p.batch * p.heads;
    if bh == 0 {
        return Ok(());
    }
    let split = plan::part_records_split(shape);
    let all_parts = plan::MmaFwdSplit { n_parts: split.n_parts + 1, ..split };
    let args =
        FwdMmaParams { p: SsdParams { workspace: records as *mut c_void, ..*p }, split: all_parts, scalars_in_y: 0 };
    let local = kernels::ssd_fwd_mma(true, false, false, ssd.dtype(), p.dstate);
    // SAFETY: the parameters of a validated records call, whose result holds n_parts records and
    // decays.
    unsafe { launch(stream, FWD_MODULE, &local, blocks(p, split.n_parts, fwd_shared_bytes(p.dstate)), &args) }?;
    let state_floats = bh * p.headdim * p.dstate;
    let fold = flat(state_floats, REDUCE_MAX_BLOCKS);
    // SAFETY: as above; the fold reads the records and writes the validated final states.
    unsafe { launch(stream, FWD_MODULE, kernels::SSD_FOLD_PART_RECORDS, fold, &args) }?;
    let states = state_floats * split.n_parts;
    // SAFETY: both ranges lie in the records (n_parts states of state_floats, then n_parts * bh
    // decays), and do not overlap (a state is larger than every decay).
    unsafe {
        copy_async(
            stream,
            records.add((states - state_floats) as usize) as *mut c_void,
            records.add(states as usize) as *const c_void,
            (split.n_parts * bh * 4) as usize,
        )
    }
}

/// The forward given the records of a part-records call on the same inputs: its split's second
/// pass alone.
pub(super) fn fwd_given(ssd: &Ssd, shape: &Shape, records: *const f32, stream: *mut c_void) -> Result<()> {
    let p = &ssd.params();
    if p.batch * p.heads == 0 {
        return Ok(());
    }
    let split = plan::part_records_split(shape);
    let mut args = FwdMmaParams { p: SsdParams { workspace: records as *mut c_void, ..*p }, split, scalars_in_y: 0 };
    args.scalars_in_y = park_tile_scalars(&args, ssd.dtype(), compute_capability(stream)?, stream)?;
    let main = kernels::ssd_fwd_mma(false, !p.z.is_null(), false, ssd.dtype(), p.dstate);
    // SAFETY: the parameters of a validated call; the records (validated size) are only read.
    unsafe { launch(stream, FWD_MODULE, &main, blocks(p, split.n_parts, fwd_shared_bytes(p.dstate)), &args) }
}

/// The backward, its scratch at `workspace` (the aligned start of at least
/// `plan::mma_bwd_layout(shape).bytes`).
pub(super) fn bwd(bwd: &SsdBwd, shape: &Shape, workspace: *mut u8, stream: *mut c_void) -> Result<()> {
    let layout = plan::mma_bwd_layout(shape);
    let at = |offset: i64| workspace.wrapping_add(offset as usize);
    let mut args = BwdMmaParams {
        q: bwd.params(),
        gated: at(layout.gated) as *mut c_void,
        scratch: at(layout.scratch) as *mut c_void,
        da_part: at(layout.da_part) as *mut f32,
        dbias_part: at(layout.dbias_part) as *mut f32,
        dd_part: at(layout.dd_part) as *mut f32,
        records: at(layout.records) as *mut f32,
        chunks_per_part: layout.chunks_per_part,
        n_parts: layout.n_parts,
        records_per_part: layout.records_per_part,
        s_chunk: at(layout.s_chunk) as *mut c_void,
        ds_chunk: at(layout.ds_chunk) as *mut c_void,
        scal: at(layout.scal).cast(),
        msum: at(layout.msum) as *mut f32,
        msum_split: layout.msum_split,
        db_part: at(layout.db_part) as *mut c_void,
        dc_part: at(layout.dc_part) as *mut c_void,
    };
    let q = &bwd.params();
    let p = &q.fwd;
    if bwd.present().z {
        // y before the gate, into `gated`, by the forward kernel, its split's records where the chunk
        // states or the per-head partials go later (split less where they do not fit)...
        let ssd = bwd.ungated_forward(args.gated);
        let (records, records_bytes) = if layout.head_sums {
            (args.s_chunk, 2 * layout.chunk_state_bytes)
        } else {
            (args.db_part, 2 * layout.part_bytes)
        };
        fwd(&ssd, shape, records as *mut u8, records_bytes, stream)?;
        // ...then dz, and the gradient of y before the gate over it, which the ungated kernels take as dy.
        let pairs = p.batch * p.seqlen * p.heads * p.headdim / 2;
        let config = flat(pairs, REDUCE_MAX_BLOCKS);
        // SAFETY: the parameters of a validated call (see `launch`).
        unsafe { launch(stream, BWD_MODULE, &kernels::ssd_bwd_per_type("gate_grad", bwd.dtype()), config, &args) }?;
        args.q = SsdBwdParams { dy: args.gated, fwd: SsdParams { z: std::ptr::null(), ..*p }, ..*q };
    }
    let (dtype, dstate) = (bwd.dtype(), p.dstate);
    let smem = bwd_shared_bytes(p.dstate);
    if layout.n_parts > 1 {
        let config = blocks(p, (layout.n_parts - 1) * layout.records_per_part, smem);
        // SAFETY: the parameters of a validated call (see `launch`).
        unsafe { launch(stream, BWD_MODULE, &kernels::ssd_bwd_mma("mma_local", dtype, dstate), config, &args) }?;
    }
    if !layout.head_sums {
        // dB, dC per head, then summed over each group: a thread per 8 states of (batch, seqlen, group).
        let main = kernels::ssd_bwd_mma("mma_partials", dtype, dstate);
        // SAFETY: the parameters of a validated call (see `launch`).
        unsafe { launch(stream, BWD_MODULE, &main, blocks(p, layout.n_parts, smem), &args) }?;
        let reduce_bc = flat(p.batch * p.seqlen * p.groups * p.dstate / 8, REDUCE_MAX_BLOCKS);
        // SAFETY: the parameters of a validated call (see `launch`).
        unsafe { launch(stream, BWD_MODULE, &kernels::ssd_bwd_per_type("reduce_bc", dtype), reduce_bc, &args) }?;
        return reduce_params(p, &args, stream);
    }
    // dB, dC: each step's {cum, dt} (a warp per (batch, chunk, head)); after the main kernel, M summed
    // over head ranges (a block per (batch, chunk, group) and range); then a block per (batch, chunk,
    // group) for each of dB and dC. The scalars and M read nothing the kernel just ahead of them writes
    // (the forward or the main kernel): they may start as that kernel's last blocks drain (each waits
    // for it before finishing). bc_sums and reduce_params wait before they start, but their launch
    // overlaps the kernel ahead (kernels/ssd_bwd_sums.cuh).
    let n_chunks = (p.seqlen + p.chunk_size - 1) / p.chunk_size;
    let units = (p.batch * n_chunks * p.groups) as u64;
    let scalars = flat(p.batch * p.heads * n_chunks * 32, u64::MAX);
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe {
        launch_ex(
            stream,
            BWD_MODULE,
            &kernels::ssd_bwd_per_type("chunk_scalars", dtype),
            scalars,
            &args,
            Start::Overlapping,
        )
    }?;
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe {
        launch(stream, BWD_MODULE, &kernels::ssd_bwd_mma("mma", dtype, dstate), blocks(p, layout.n_parts, smem), &args)
    }?;
    let msum = LaunchConfig {
        grid: (units * layout.msum_split as u64, 1, 1),
        block: MSUM_THREADS,
        shared_bytes: msum_shared_bytes(p.chunk_size),
    };
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe {
        launch_ex(stream, BWD_MODULE, &kernels::ssd_bwd_per_type("head_msum", dtype), msum, &args, Start::Overlapping)
    }?;
    let bc = LaunchConfig {
        grid: (units, 2, 1),
        block: (2 * p.chunk_size) as u32,
        shared_bytes: bc_shared_bytes(p.chunk_size, p.dstate),
    };
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe {
        launch_ex(stream, BWD_MODULE, &kernels::ssd_bwd_mma("bc_sums", dtype, dstate), bc, &args, Start::Overlapping)
    }?;
    reduce_params(p, &args, stream)
}

/// dA, dD, ddt_bias from their per-(part, batch) partials: a block of headdim threads per head.
fn reduce_params(p: &SsdParams, args: &BwdMmaParams, stream: *mut c_void) -> Result<()> {
    let config = LaunchConfig { grid: (p.heads as u64, 1, 1), block: p.headdim as u32, shared_bytes: 0 };
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch_ex(stream, BWD_MODULE, kernels::SSD_BWD_REDUCE_PARAMS, config, args, Start::Overlapping) }
}
