//! Call frames of `xla_ssm_causal_conv1d_fwd` / `_bwd` / `_update` (docs/decode.md).

use super::frame::Frame;
use super::operands::{prefixed, Call};
use crate::error::Result;
use crate::ops::conv1d::*;
use crate::ops::signature::{CAUSAL_CONV1D_BWD, CAUSAL_CONV1D_FWD, CAUSAL_CONV1D_UPDATE};
use crate::ops::Platform;

/// The XLA handlers' body, for each of the three.
pub fn from_frame(frame: &Frame, platform: Platform, kind: Kind) -> Result<()> {
    let sig = match kind {
        Kind::Fwd => &CAUSAL_CONV1D_FWD,
        Kind::Bwd => &CAUSAL_CONV1D_BWD,
        Kind::Update => &CAUSAL_CONV1D_UPDATE,
    };
    let pre = prefixed(sig.op);
    let call = Call::decode(frame, sig)?;
    let conv_state = match (call.operand("conv_state"), call.result("conv_state")) {
        (Some(input), Some(output)) => Some((input, output)),
        _ => None,
    };
    let conv = validate(&ConvArgs {
        kind,
        x: call.input("x"),
        weight: call.input("weight"),
        bias: call.operand("bias"),
        initial_states: call.operand("initial_states"),
        cu_seqlens: call.operand("cu_seqlens"),
        dout: call.operand("dout"),
        conv_state,
        state_batch_indices: call.operand("state_batch_indices"),
        out: call.result("out").or(call.result("dx")).expect("every conv1d target has `out` or `dx`"),
        dweight: call.result("dweight"),
        dbias: call.result("dbias"),
        dinitial_states: call.result("dinitial_states"),
        silu: frame.attr_bool("silu").map_err(&pre)?,
        layout: parse_layout(sig.op, &frame.attr_str("layout").map_err(&pre)?)?,
    })?;
    run(&conv, platform)
}
