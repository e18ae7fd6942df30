//! The CUDA launch of the backward scan (kernels/selective_scan_bwd.cuh): the tiled kernel, which
//! leaves per-block partial sums in the workspace, then two reductions that sum them in a fixed
//! order (so the gradients are bitwise deterministic).
//!
//! Packed sequences (`cu_seqlens`) run kernels of their own (`_packed`), so that the others stay as
//! they were; the plan (threads per channel, sequence split, workspace) is the same as unpacked, from
//! the shapes alone (the boundaries are on the device).

use super::kernels::{self, SCAN_BWD};
use super::{launch, sm_shared_memory, LaunchConfig};
use crate::error::{Error, Result};
use crate::ops::selective_scan::{
    bwd_layout, Bwd, BwdParams, BwdReduceParams, FwdParams, BWD_THREADS, CHECKPOINT_MULTIPLE as TILE_STEPS,
};
use std::ffi::c_void;

const THREADS: u32 = BWD_THREADS as u32;
const REDUCE_THREADS: u32 = 256;
/// Grid-stride reductions: enough blocks to fill an H100 a few times over.
const REDUCE_MAX_BLOCKS: i64 = 4096;
/// Blocks of the tiled kernel an SM can hold: its launch bounds' registers allow two.
const MAX_BLOCKS_PER_SM: u32 = 2;
/// The most dynamic shared memory a block may have on any GPU (sm_90's opt-in limit; smaller GPUs
/// refuse less at launch, with the driver's message).
const MAX_SHARED_BYTES: u32 = 227 * 1024;

/// Bytes the packed kernels add after the tile starts: a tile's boundary table, int64 [33] rounded
/// to 16 bytes (mirror of `kBwdSeqTableBytes`).
const SEQ_TABLE_BYTES: u32 = 272;

/// Dynamic shared memory of the tiled kernel: mirror of `BwdShape<TPC>` (the kernel traps when
/// given less than it needs), plus the packed kernels' boundary table.
fn shared_bytes(threads_per_channel: i64, tiles_per_chunk: i64, packed: bool) -> u32 {
    let (states, steps, piece, pitch) = (8, TILE_STEPS, 4, TILE_STEPS + 1);
    let nmax = states * threads_per_channel;
    let channels = THREADS as i64 / threads_per_channel;
    let flush = if nmax <= 32 {
        16
    } else if nmax <= 64 {
        8
    } else {
        4
    };
    let threads = THREADS as i64;
    let floats = 5 * channels * pitch
        + 2 * steps * nmax
        + (steps / piece) * states * threads
        + (threads / 32) * flush * 2 * nmax
        + tiles_per_chunk * states * threads;
    (floats * 4) as u32 + if packed { SEQ_TABLE_BYTES } else { 0 }
}

/// Shared memory for the next tile's inputs as they are in global memory, which the kernel copies in
/// ahead (cp.async) while it computes a tile: mirror of `RawTile` (u, delta, dout, z, then
/// time-varying B and C).
fn raw_tile_bytes(bwd: &Bwd, threads_per_channel: i64) -> u32 {
    let (steps, channels, nmax) = (TILE_STEPS, THREADS as i64 / threads_per_channel, 8 * threads_per_channel);
    let bc = if bwd.bc_time_varying() { 2 * steps * nmax * bwd.bc_dtype().size_bytes() } else { 0 };
    (4 * channels * steps * bwd.dtype().size_bytes() + bc) as u32
}

pub fn bwd(bwd: &Bwd, stream: *mut c_void) -> Result<()> {
    let p = &bwd.params().fwd;
    let layout = bwd_layout(p.batch, p.dim, p.seqlen, p.dstate, bwd.groups(), p.checkpoint_len);
    let needed = layout.floats * 4;
    if needed > 0 && (p.workspace.is_null() || bwd.workspace_bytes() < needed) {
        return Err(Error::invalid(format!(
            "selective_scan_bwd: result `workspace`: the CUDA backward needs at least {needed} bytes \
             (xla_ssm_selective_scan_bwd_workspace_bytes), got {}",
            if p.workspace.is_null() { 0 } else { bwd.workspace_bytes() }
        )));
    }
    if !(p.workspace as usize).is_multiple_of(4) {
        return Err(Error::invalid("selective_scan_bwd: result `workspace`: must be 4-byte aligned"));
    }
    let tpc = layout.threads_per_channel;
    let packed = !p.cu_seqlens.is_null();
    // The state entering each tile of a chunk is kept in shared memory.
    let shared = shared_bytes(tpc, p.checkpoint_len / TILE_STEPS, packed);
    if shared > MAX_SHARED_BYTES {
        let per_tile = shared_bytes(tpc, 1, packed) - shared_bytes(tpc, 0, packed);
        let most = (MAX_SHARED_BYTES - shared_bytes(tpc, 0, packed)) / per_tile * TILE_STEPS as u32;
        return Err(Error::invalid(format!(
            "selective_scan_bwd: attribute `checkpoint_len`: the CUDA backward takes at most {most} at dstate {}, \
             got {}",
            p.dstate, p.checkpoint_len
        )));
    }
    // Room for the copy ahead only where it costs no block per SM (the kernel copies ahead when given
    // the room: at dstate 16, bf16 and f16 inputs on an H100, not f32).
    let (sm_shared, reserved) = sm_shared_memory(stream)?;
    let blocks_per_sm = |bytes: u32| (sm_shared / (bytes + reserved)).min(MAX_BLOCKS_PER_SM);
    let with_raw = shared + raw_tile_bytes(bwd, tpc);
    let shared = if with_raw <= MAX_SHARED_BYTES && blocks_per_sm(with_raw) >= blocks_per_sm(shared) {
        with_raw
    } else {
        shared
    };
    // The sequence split rides in the forward's split fields: parts of chunk_len steps.
    let params = BwdParams {
        fwd: FwdParams { chunk_len: layout.part_len, n_chunks: layout.n_split, ..bwd.params().fwd },
        ..bwd.params()
    };
    let tiled_kernel =
        |local: bool| kernels::scan_bwd_tiled(local, packed, (bwd.dtype(), bwd.bc_dtype()), tpc, bwd.bc_time_varying());
    let tiled = |parts: i64| LaunchConfig {
        grid: (layout.blocks_per_row as u64, p.batch as u64, parts as u64),
        block: THREADS,
        shared_bytes: shared,
    };
    if layout.n_split > 1 {
        // SAFETY: the parameters of a validated call (see `launch`).
        unsafe {
            launch(stream, kernels::scan_bwd_module(packed), &tiled_kernel(true), tiled(layout.n_split - 1), &params)
        }?;
    }
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, kernels::scan_bwd_module(packed), &tiled_kernel(false), tiled(layout.n_split), &params) }?;

    let reduce = BwdReduceParams {
        q: params,
        tiles_per_group: layout.tiles_per_group,
        bc_part: layout.bc_part_floats,
        groups: bwd.groups().max(1),
        varying_bc: bwd.bc_time_varying() as i32,
        _reserved: 0,
    };
    let config = |items: i64| LaunchConfig {
        grid: (((items + REDUCE_THREADS as i64 - 1) / REDUCE_THREADS as i64).min(REDUCE_MAX_BLOCKS) as u64, 1, 1),
        block: REDUCE_THREADS,
        shared_bytes: 0,
    };
    let bc = bwd.bc_dtype();
    if bwd.bc_time_varying() {
        let groups = bwd.groups().max(1);
        let items = p.batch * groups * p.seqlen * p.dstate;
        // SAFETY: the parameters of a validated call (see `launch`).
        unsafe { launch(stream, SCAN_BWD, &kernels::scan_bwd_reduce(true, bc), config(items), &reduce) }?;
    }
    let items = p.dim * p.dstate.max(1);
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, SCAN_BWD, &kernels::scan_bwd_reduce(false, bc), config(items), &reduce) }
}
