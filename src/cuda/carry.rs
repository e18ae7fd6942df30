//! The CUDA launch of the carried state of a seqlen shard (kernels/selective_scan_carry.cu): one
//! warp per segment of a (batch, channel) row, four a block, each with its row's A (and state) in
//! shared memory. The fwd updates the outputs in place, after a copy when XLA did not alias them.

use super::kernels;
use super::{copy_async, launch, LaunchConfig};
use crate::error::Result;
use crate::ops::selective_scan::carry::{Carry, Direction};
use std::ffi::c_void;

/// Segments (warps) per block: `kCarryWarps`.
const WARPS_PER_BLOCK: u64 = 4;
/// The kernels' group of states (`kCarryStates`).
const CARRY_STATES: i64 = 16;

pub fn run(carry: &Carry, stream: *mut c_void) -> Result<()> {
    if let Some(copy) = carry.out_copy() {
        // SAFETY: validated, distinct device buffers of that size.
        unsafe { copy_async(stream, copy.to, copy.from, copy.bytes) }?;
    }
    let q = carry.params();
    let p = q.scan;
    let segments = (p.batch * p.dim * q.n_segments) as u64;
    if segments == 0 {
        return Ok(());
    }
    let config = LaunchConfig {
        grid: (segments.div_ceil(WARPS_PER_BLOCK), 1, 1),
        block: 32 * WARPS_PER_BLOCK as u32,
        // Each row's A and state, padded to whole groups of CARRY_STATES.
        shared_bytes: (WARPS_PER_BLOCK as i64 * 2 * ((p.dstate + CARRY_STATES - 1) / CARRY_STATES * CARRY_STATES) * 4)
            as u32,
    };
    let kernel = kernels::scan_carry(carry.direction() == Direction::Fwd, (carry.dtype(), carry.bc_dtype()));
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, kernels::SCAN_CARRY, &kernel, config, &q) }
}
