//! Call frames of `xla_ssm_mamba_decode_step` (docs/decode.md).

use super::frame::Frame;
use super::operands::{prefixed, Call};
use crate::error::Result;
use crate::ops::mamba_decode::{run, validate, DecodeArgs};
use crate::ops::signature::MAMBA_DECODE_STEP;
use crate::ops::Platform;

/// The XLA handler's body.
pub fn from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let call = Call::decode(frame, &MAMBA_DECODE_STEP)?;
    let step = validate(&DecodeArgs {
        x: call.input("x"),
        conv_state: call.input("conv_state"),
        conv_weight: call.input("conv_weight"),
        conv_bias: call.operand("conv_bias"),
        ssm_state: call.input("ssm_state"),
        dt: call.input("dt"),
        a: call.input("A"),
        b: call.input("B"),
        c: call.input("C"),
        d: call.operand("D"),
        z: call.operand("z"),
        dt_bias: call.operand("dt_bias"),
        state_batch_indices: call.operand("state_batch_indices"),
        out: call.output("out"),
        conv_state_out: call.output("conv_state"),
        ssm_state_out: call.output("ssm_state"),
        dt_softplus: frame.attr_bool("dt_softplus").map_err(prefixed(MAMBA_DECODE_STEP.op))?,
    })?;
    run(&step, platform)
}
