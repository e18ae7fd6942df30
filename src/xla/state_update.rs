//! Call frames of `xla_ssm_selective_state_update` (docs/decode.md).

use super::frame::Frame;
use super::operands;
use crate::error::Result;
use crate::ops::state_update::*;
use crate::ops::Platform;

/// The XLA handler's body.
pub fn from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let op = "selective_state_update";
    let dt_softplus = frame.attr_bool("dt_softplus").map_err(operands::prefixed(op))?;
    let (req, opt) = operands::operands(
        frame,
        op,
        &["state", "x", "dt", "A", "B", "C"],
        &["D", "z", "dt_bias", "state_batch_indices"],
    )?;
    let rets = operands::results(frame, op, &["out", "state"])?;
    let u = validate(&UpdateArgs {
        state: &req[0],
        x: &req[1],
        dt: &req[2],
        a: &req[3],
        b: &req[4],
        c: &req[5],
        d: opt[0].as_ref(),
        z: opt[1].as_ref(),
        dt_bias: opt[2].as_ref(),
        state_batch_indices: opt[3].as_ref(),
        out: &rets[0],
        state_out: &rets[1],
        dt_softplus,
    })?;
    run(&u, platform)
}
