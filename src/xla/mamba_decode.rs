//! Call frames of `xla_ssm_mamba_decode_step` (docs/decode.md).

use super::frame::Frame;
use super::operands;
use crate::error::Result;
use crate::ops::mamba_decode::{run, validate, DecodeArgs, OP};
use crate::ops::Platform;

/// The XLA handler's body.
pub fn from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let dt_softplus = frame.attr_bool("dt_softplus").map_err(operands::prefixed(OP))?;
    let (req, opt) = operands::operands(
        frame,
        OP,
        &["x", "conv_state", "conv_weight", "ssm_state", "dt", "A", "B", "C"],
        &["conv_bias", "D", "z", "dt_bias", "state_batch_indices"],
    )?;
    let rets = operands::results(frame, OP, &["out", "conv_state", "ssm_state"])?;
    let step = validate(&DecodeArgs {
        x: &req[0],
        conv_state: &req[1],
        conv_weight: &req[2],
        conv_bias: opt[0].as_ref(),
        ssm_state: &req[3],
        dt: &req[4],
        a: &req[5],
        b: &req[6],
        c: &req[7],
        d: opt[1].as_ref(),
        z: opt[2].as_ref(),
        dt_bias: opt[3].as_ref(),
        state_batch_indices: opt[4].as_ref(),
        out: &rets[0],
        conv_state_out: &rets[1],
        ssm_state_out: &rets[2],
        dt_softplus,
    })?;
    run(&step, platform)
}
