//! The fused decode step on CUDA: conv update, SiLU, state update and gate in one kernel of
//! kernels/selective_state_update.cu.

use super::kernels;
use super::state_update::geometry;
use super::{copy_async, launch};
use crate::error::Result;
use crate::ops::conv1d::Conv;
use crate::ops::mamba_decode::DecodeParams;
use crate::ops::state_update::Update;
use std::ffi::c_void;

/// Enqueues the step on `stream` (after copying non-aliased states into their results).
pub fn step(c: &Conv, u: &Update, stream: *mut c_void) -> Result<()> {
    for copy in [c.state_copy(), u.state_copy()].into_iter().flatten() {
        // SAFETY: validated, distinct device buffers of that size.
        unsafe { copy_async(stream, copy.to, copy.from, copy.bytes) }?;
    }
    let mut ssm = u.params();
    if ssm.batch * ssm.dim == 0 {
        return Ok(());
    }
    let (config, fast) = geometry(&mut ssm, u.state_dtype(), Some(c.params().width));
    let params = DecodeParams {
        ssm,
        conv_state: c.params().conv_state,
        conv_weight: c.params().weight,
        conv_bias: c.params().bias,
        width: c.params().width,
    };
    let kernel = kernels::decode_step([u.dtype(), u.bc_dtype(), u.state_dtype(), c.weight_dtype()], fast);
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, kernels::STATE_UPDATE, &kernel, config, &params) }
}
