//! Call frames of `xla_ssm_causal_conv1d_fwd` / `_bwd` / `_update` (docs/decode.md).

use super::frame::Frame;
use super::operands;
use crate::error::Result;
use crate::ops::conv1d::*;
use crate::ops::Platform;

/// The XLA handlers' body, for each of the three.
pub fn from_frame(frame: &Frame, platform: Platform, kind: Kind) -> Result<()> {
    let op = kind.name();
    let pre = operands::prefixed(op);
    let silu = frame.attr_bool("silu").map_err(&pre)?;
    let layout = parse_layout(op, &frame.attr_str("layout").map_err(&pre)?)?;
    let conv = match kind {
        Kind::Fwd => {
            let (req, opt) = operands::operands(frame, op, &["x", "weight"], &["bias", "initial_states"])?;
            let rets = operands::results(frame, op, &["out"])?;
            validate(&ConvArgs {
                kind,
                x: &req[0],
                weight: &req[1],
                bias: opt[0].as_ref(),
                initial_states: opt[1].as_ref(),
                dout: None,
                conv_state: None,
                state_batch_indices: None,
                out: &rets[0],
                dweight: None,
                dbias: None,
                dinitial_states: None,
                silu,
                layout,
            })?
        }
        Kind::Bwd => {
            let (req, opt) = operands::operands(frame, op, &["x", "weight", "dout"], &["bias", "initial_states"])?;
            let mut names = vec!["dx", "dweight"];
            if opt[0].is_some() {
                names.push("dbias");
            }
            if opt[1].is_some() {
                names.push("dinitial_states");
            }
            let rets = operands::results(frame, op, &names)?;
            let find = |n: &str| names.iter().position(|m| *m == n).map(|i| &rets[i]);
            validate(&ConvArgs {
                kind,
                x: &req[0],
                weight: &req[1],
                bias: opt[0].as_ref(),
                initial_states: opt[1].as_ref(),
                dout: Some(&req[2]),
                conv_state: None,
                state_batch_indices: None,
                out: &rets[0],
                dweight: Some(&rets[1]),
                dbias: find("dbias"),
                dinitial_states: find("dinitial_states"),
                silu,
                layout,
            })?
        }
        Kind::Update => {
            let (req, opt) =
                operands::operands(frame, op, &["x", "conv_state", "weight"], &["bias", "state_batch_indices"])?;
            let rets = operands::results(frame, op, &["out", "conv_state"])?;
            validate(&ConvArgs {
                kind,
                x: &req[0],
                weight: &req[2],
                bias: opt[0].as_ref(),
                initial_states: None,
                dout: None,
                conv_state: Some((&req[1], &rets[1])),
                state_batch_indices: opt[1].as_ref(),
                out: &rets[0],
                dweight: None,
                dbias: None,
                dinitial_states: None,
                silu,
                layout,
            })?
        }
    };
    run(&conv, platform)
}
