//! Call frames of `xla_ssm_selective_state_update` (docs/decode.md).

use super::frame::Frame;
use super::operands::{prefixed, Call};
use crate::error::Result;
use crate::ops::signature::SELECTIVE_STATE_UPDATE;
use crate::ops::state_update::*;
use crate::ops::Platform;

/// The XLA handler's body.
pub fn from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let call = Call::decode(frame, &SELECTIVE_STATE_UPDATE)?;
    let u = validate(&UpdateArgs {
        state: call.input("state"),
        x: call.input("x"),
        dt: call.input("dt"),
        a: call.input("A"),
        b: call.input("B"),
        c: call.input("C"),
        d: call.operand("D"),
        z: call.operand("z"),
        dt_bias: call.operand("dt_bias"),
        state_batch_indices: call.operand("state_batch_indices"),
        out: call.output("out"),
        state_out: call.output("state"),
        dt_softplus: frame.attr_bool("dt_softplus").map_err(prefixed(SELECTIVE_STATE_UPDATE.op))?,
    })?;
    run(&u, platform)
}
