//! Call frames of `xla_ssm_selective_scan_fwd` / `_bwd` (docs/selective_scan_fwd.md,
//! docs/selective_scan_bwd.md): operands and results per the attributes, then the op's validation.

use super::frame::Frame;
use super::operands::{find, frame_operands, frame_results, prefixed};
use crate::error::Result;
use crate::ops::selective_scan::*;
use crate::ops::{Platform, Tensor};

/// The optional inputs, in operand order, with their `has_*` attributes.
const OPTIONAL_INPUTS: [(&str, &str); 4] =
    [("D", "has_d"), ("z", "has_z"), ("delta_bias", "has_delta_bias"), ("initial_state", "has_initial_state")];

/// The attributes both calls share: layout, delta_softplus, and which optional inputs are present.
fn frame_flags(frame: &Frame, op: &'static str) -> Result<(Layout, bool, [bool; 4])> {
    let prefix = prefixed(op);
    let layout = Layout::parse(&frame.attr_str("layout").map_err(&prefix)?).map_err(&prefix)?;
    let delta_softplus = frame.attr_bool("delta_softplus").map_err(&prefix)?;
    let mut present = [false; 4];
    for (flag, (_, attr)) in present.iter_mut().zip(OPTIONAL_INPUTS) {
        *flag = frame.attr_bool(attr).map_err(&prefix)?;
    }
    Ok((layout, delta_softplus, present))
}

/// Operand names of a call: the five inputs, the present optional ones, then `extra` (each with
/// its presence).
fn operand_names(present: [bool; 4], extra: &[(&'static str, bool)]) -> Vec<&'static str> {
    let mut names = vec!["u", "delta", "A", "B", "C"];
    names.extend(OPTIONAL_INPUTS.iter().zip(present).filter(|(_, p)| *p).map(|((n, _), _)| *n));
    names.extend(extra.iter().filter(|(_, p)| *p).map(|(n, _)| *n));
    names
}

/// The inputs of a call from its decoded operands.
fn frame_inputs<'t>(names: &[&str], operands: &'t [Tensor], layout: Layout, delta_softplus: bool) -> Inputs<'t> {
    Inputs {
        u: &operands[0],
        delta: &operands[1],
        a: &operands[2],
        b: &operands[3],
        c: &operands[4],
        d: find(names, operands, "D"),
        z: find(names, operands, "z"),
        delta_bias: find(names, operands, "delta_bias"),
        initial_state: find(names, operands, "initial_state"),
        delta_softplus,
        layout,
    }
}

/// The XLA handler's body of the forward: decode operands per the attributes, validate, run.
pub fn fwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let op = "selective_scan_fwd";
    let (layout, delta_softplus, present) = frame_flags(frame, op)?;
    let checkpoint_len = frame.attr_opt("checkpoint_len", Frame::attr_i64).map_err(prefixed(op))?.unwrap_or(0);
    // Before counting results, which depend on it.
    validate_checkpoint_len(op, checkpoint_len, true)?;
    let names = operand_names(present, &[]);
    let operands = frame_operands(frame, op, &names)?;
    let mut ret_names = vec!["out", "final_state"];
    if checkpoint_len != 0 {
        ret_names.push("checkpoints");
    }
    let (rets, workspace) = frame_results(frame, op, &ret_names)?;
    let fwd = validate_fwd(&FwdArgs {
        inputs: frame_inputs(&names, &operands, layout, delta_softplus),
        out: &rets[0],
        final_state: &rets[1],
        checkpoints: rets.get(2),
        checkpoint_len,
        workspace: workspace.as_ref(),
    })?;
    run_fwd(&fwd, platform)
}

/// The XLA handler's body of the backward: decode operands and results per the attributes,
/// validate, run.
pub fn bwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let op = "selective_scan_bwd";
    let (layout, delta_softplus, present) = frame_flags(frame, op)?;
    let prefix = prefixed(op);
    let has_dfinal_state = frame.attr_bool("has_dfinal_state").map_err(&prefix)?;
    let checkpoint_len = frame.attr_i64("checkpoint_len").map_err(&prefix)?;
    validate_checkpoint_len(op, checkpoint_len, false)?;
    let names = operand_names(present, &[("checkpoints", true), ("dout", true), ("dfinal_state", has_dfinal_state)]);
    let operands = frame_operands(frame, op, &names)?;
    let mut ret_names = vec!["du", "ddelta", "dA", "dB", "dC"];
    let grads = ["dD", "dz", "ddelta_bias", "dinitial_state"];
    ret_names.extend(grads.iter().zip(present).filter(|(_, p)| *p).map(|(n, _)| *n));
    let (rets, workspace) = frame_results(frame, op, &ret_names)?;
    let ret = |name: &str| find(&ret_names, &rets, name);
    let bwd = validate_bwd(&BwdArgs {
        inputs: frame_inputs(&names, &operands, layout, delta_softplus),
        checkpoints: find(&names, &operands, "checkpoints").expect("named above"),
        checkpoint_len,
        dout: find(&names, &operands, "dout").expect("named above"),
        dfinal_state: find(&names, &operands, "dfinal_state"),
        du: &rets[0],
        ddelta: &rets[1],
        da: &rets[2],
        db: &rets[3],
        dc: &rets[4],
        dd: ret("dD"),
        dz: ret("dz"),
        ddelta_bias: ret("ddelta_bias"),
        dinitial_state: ret("dinitial_state"),
        workspace: workspace.as_ref(),
    })?;
    run_bwd(&bwd, platform)
}
