//! The CUDA launch of the forward scan (kernels/selective_scan_fwd.cu).

use super::Fwd;
use crate::error::Result;
use std::ffi::c_void;

const STATES_PER_LANE: i64 = 8;
const BLOCK_THREADS: u32 = 128;

/// Lanes per channel: enough lanes of 8 states to cover dstate, a power of two up to 32.
fn lanes_per_channel(dstate: i64) -> i64 {
    let lanes = (dstate + STATES_PER_LANE - 1) / STATES_PER_LANE;
    (lanes.max(1) as u64).next_power_of_two() as i64
}

pub(super) fn fwd(fwd: &Fwd, stream: *mut c_void) -> Result<()> {
    let p = &fwd.params;
    let ns = lanes_per_channel(p.dstate);
    let kernel = format!("selective_scan_fwd_{}_{}_ns{ns}", fwd.dtype.name(), fwd.bc_dtype.name());
    let threads = p.batch * p.dim * ns;
    let grid = (threads as u64).div_ceil(BLOCK_THREADS as u64);
    crate::cuda::launch(stream, "selective_scan_fwd", &kernel, grid, BLOCK_THREADS, p)
}
