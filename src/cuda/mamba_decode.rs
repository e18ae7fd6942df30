//! The fused decode step on CUDA: conv update, SiLU, state update and gate in one kernel of
//! kernels/selective_state_update.cu.

use super::state_update::{geometry, type_suffix};
use super::{copy_async, launch};
use crate::error::Result;
use crate::ops::alias::Alias;
use crate::ops::conv1d::Conv;
use crate::ops::mamba_decode::DecodeParams;
use crate::ops::state_update::{state_bytes, Update};
use std::ffi::c_void;

/// Enqueues the step on `stream` (after copying non-aliased states into their results).
pub fn step(c: &Conv, u: &Update, stream: *mut c_void) -> Result<()> {
    if c.alias == Alias::Copy {
        let bytes = c.params.n_slots * c.params.dim * (c.params.width - 1) * c.dtype.size_bytes();
        // SAFETY: validated, distinct device buffers of that size.
        unsafe { copy_async(stream, c.params.conv_state, c.state_in, bytes as usize) }?;
    }
    if u.alias == Alias::Copy {
        // SAFETY: validated, distinct device buffers of that size.
        unsafe { copy_async(stream, u.params.state, u.state_in, state_bytes(&u.params, u.state_dtype)) }?;
    }
    let mut ssm = u.params;
    if ssm.batch * ssm.dim == 0 {
        return Ok(());
    }
    let (config, form) = geometry(&mut ssm, u.state_dtype, Some(c.params.width));
    let params = DecodeParams {
        ssm,
        conv_state: c.params.conv_state,
        conv_weight: c.params.weight,
        conv_bias: c.params.bias,
        width: c.params.width,
    };
    let types: [crate::DType; 4] = [u.dtype, u.bc_dtype, u.state_dtype, c.weight_dtype];
    let kernel = format!("mamba_decode_step_{}{form}", type_suffix(&types));
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, "selective_state_update", &kernel, config, &params) }
}
