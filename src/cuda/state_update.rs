//! The CUDA launch of the state update (kernels/selective_state_update.cu): `lanes` threads per
//! (batch, channel) row, each holding 16 bytes of the state (4 f32 or 8 half states) per pass, the
//! row's output summed over the lanes by warp shuffles. Where each lane holds exactly one vector of
//! its row and a batch row fills a block, the fast kernel (loads first, a two-dimensional grid, few
//! instructions per row: about the HBM copy rate); otherwise the general kernel. One launch; a copy
//! before it only when XLA did not alias the state.

use super::kernels;
use super::{copy_async, launch, LaunchConfig};
use crate::error::Result;
use crate::ops::state_update::{Update, UpdateParams};
use crate::DType;
use once_cell::sync::Lazy;
use std::ffi::c_void;

/// Threads per block; `XLA_SSM_DECODE_BLOCK` overrides it (64..=1024, for tuning; the fast kernels
/// take at most FAST_BLOCK).
static BLOCK: Lazy<u32> = Lazy::new(|| {
    std::env::var("XLA_SSM_DECODE_BLOCK")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|b: &u32| (64..=1024).contains(b) && b.is_power_of_two())
        .unwrap_or(128)
});

/// Block of the fast kernels (`kFastBlock`, also their launch bound): the fastest on the H100
/// (among 64, 128, 256 and 512 threads).
const FAST_BLOCK: u32 = 128;
/// grid.y (batch rows) is at most this; the fast kernel loops over further rows.
const MAX_GRID_Y: u64 = 65535;

/// Sets `lanes` and `vectorized` and returns the launch shape for `p` and which kernel: the general
/// one (any dstate, several passes per lane, flat rows) or the fast one (true: one 16-byte vector of
/// the state per lane, all loads issued first, a grid of (channel blocks, batch rows)).
/// `conv_width`: the fused step's, whose fast kernel gives each conv tap a lane.
pub(crate) fn geometry(p: &mut UpdateParams, state_dtype: DType, conv_width: Option<i64>) -> (LaunchConfig, bool) {
    let per_lane = 16 / state_dtype.size_bytes();
    let chunks = (p.dstate + per_lane - 1) / per_lane;
    p.lanes = (chunks.max(1) as u64).next_power_of_two().min(32) as i32;
    let lanes = p.lanes as i64;
    let aligned =
        [p.state as *const c_void, p.a as *const c_void, p.b, p.c].iter().all(|&ptr| (ptr as usize).is_multiple_of(16));
    p.vectorized = (aligned && p.dstate % per_lane == 0) as i32;
    let block = (*BLOCK).min(FAST_BLOCK);
    // A block's channels all in one batch row: with fewer, most of every block would idle.
    let fills_block = p.dim * lanes >= block as i64;
    if p.vectorized != 0 && p.dstate == lanes * per_lane && fills_block && conv_width.is_none_or(|w| w <= lanes) {
        let channels_per_block = (block as i64 / lanes) as u64;
        let grid = ((p.dim as u64).div_ceil(channels_per_block), (p.batch as u64).min(MAX_GRID_Y), 1);
        return (LaunchConfig { grid, block, shared_bytes: 0 }, true);
    }
    let rows = (p.batch * p.dim) as u64;
    let rows_per_block = (*BLOCK / p.lanes as u32) as u64;
    (LaunchConfig { grid: (rows.div_ceil(rows_per_block), 1, 1), block: *BLOCK, shared_bytes: 0 }, false)
}

pub fn update(u: &Update, stream: *mut c_void) -> Result<()> {
    if let Some(copy) = u.state_copy() {
        // SAFETY: validated, distinct device buffers of that size.
        unsafe { copy_async(stream, copy.to, copy.from, copy.bytes) }?;
    }
    let mut p = u.params();
    if p.batch * p.dim == 0 {
        return Ok(());
    }
    let (config, fast) = geometry(&mut p, u.state_dtype(), None);
    let kernel = kernels::state_update([u.dtype(), u.bc_dtype(), u.state_dtype()], fast);
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, kernels::STATE_UPDATE, &kernel, config, &p) }
}
