//! Call frames of `xla_ssm_ssd_fwd` / `_bwd` (docs/ssd.md).

use super::frame::Frame;
use super::operands::{find, frame_operands, frame_results, prefixed};
use crate::error::Result;
use crate::ops::ssd::*;
use crate::ops::{Platform, Tensor};

// ------------------------------------------------------------------------------------ frames

/// The optional inputs, in operand order, with their `has_*` attributes.
const OPTIONAL_INPUTS: [(&str, &str); 4] =
    [("D", "has_d"), ("z", "has_z"), ("dt_bias", "has_dt_bias"), ("initial_states", "has_initial_states")];

/// The attributes both calls share.
struct Flags {
    chunk_size: i64,
    dt_softplus: bool,
    dt_min: f32,
    dt_max: f32,
    present: [bool; 4],
}

fn frame_flags(frame: &Frame, op: &'static str) -> Result<Flags> {
    let pre = prefixed(op);
    let mut present = [false; 4];
    for (flag, (_, attr)) in present.iter_mut().zip(OPTIONAL_INPUTS) {
        *flag = frame.attr_bool(attr).map_err(&pre)?;
    }
    Ok(Flags {
        chunk_size: frame.attr_i64("chunk_size").map_err(&pre)?,
        dt_softplus: frame.attr_bool("dt_softplus").map_err(&pre)?,
        dt_min: frame.attr_f32("dt_min").map_err(&pre)?,
        dt_max: frame.attr_f32("dt_max").map_err(&pre)?,
        present,
    })
}

/// Operand names: the five inputs, the present optional ones, then `extra` (each with its presence).
fn operand_names(present: [bool; 4], extra: &[(&'static str, bool)]) -> Vec<&'static str> {
    let mut names = vec!["x", "dt", "A", "B", "C"];
    names.extend(OPTIONAL_INPUTS.iter().zip(present).filter(|(_, p)| *p).map(|((n, _), _)| *n));
    names.extend(extra.iter().filter(|(_, p)| *p).map(|(n, _)| *n));
    names
}

fn frame_inputs<'t>(names: &[&str], operands: &'t [Tensor], f: &Flags) -> Inputs<'t> {
    Inputs {
        x: &operands[0],
        dt: &operands[1],
        a: &operands[2],
        b: &operands[3],
        c: &operands[4],
        d: find(names, operands, "D"),
        z: find(names, operands, "z"),
        dt_bias: find(names, operands, "dt_bias"),
        initial_states: find(names, operands, "initial_states"),
        chunk_size: f.chunk_size,
        dt_softplus: f.dt_softplus,
        dt_min: f.dt_min,
        dt_max: f.dt_max,
    }
}

/// The XLA handler's body of the forward: decode operands and results per the attributes,
/// validate, run.
pub fn fwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let op = "ssd_fwd";
    let flags = frame_flags(frame, op)?;
    let save = frame.attr_bool("save_chunk_states").map_err(prefixed(op))?;
    let names = operand_names(flags.present, &[]);
    let operands = frame_operands(frame, op, &names)?;
    let mut ret_names = vec!["y", "final_states"];
    if save {
        ret_names.push("chunk_states");
    }
    let (rets, workspace) = frame_results(frame, op, &ret_names)?;
    let ssd = validate_fwd(&FwdArgs {
        inputs: frame_inputs(&names, &operands, &flags),
        y: &rets[0],
        final_states: &rets[1],
        chunk_states: rets.get(2),
        workspace: workspace.as_ref(),
    })?;
    run_fwd(&ssd, platform)
}

/// The XLA handler's body of the backward.
pub fn bwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let op = "ssd_bwd";
    let flags = frame_flags(frame, op)?;
    let has_dfinal = frame.attr_bool("has_dfinal_states").map_err(prefixed(op))?;
    let names = operand_names(flags.present, &[("chunk_states", true), ("dy", true), ("dfinal_states", has_dfinal)]);
    let operands = frame_operands(frame, op, &names)?;
    let mut ret_names = vec!["dx", "ddt", "dA", "dB", "dC"];
    let grads = ["dD", "dz", "ddt_bias", "dinitial_states"];
    ret_names.extend(grads.iter().zip(flags.present).filter(|(_, p)| *p).map(|(n, _)| *n));
    let (rets, workspace) = frame_results(frame, op, &ret_names)?;
    let ret = |name: &str| find(&ret_names, &rets, name);
    let bwd = validate_bwd(&BwdArgs {
        inputs: frame_inputs(&names, &operands, &flags),
        chunk_states: find(&names, &operands, "chunk_states").expect("named above"),
        dy: find(&names, &operands, "dy").expect("named above"),
        dfinal_states: find(&names, &operands, "dfinal_states"),
        dx: &rets[0],
        ddt: &rets[1],
        da: &rets[2],
        db: &rets[3],
        dc: &rets[4],
        dd: ret("dD"),
        dz: ret("dz"),
        ddt_bias: ret("ddt_bias"),
        dinitial_states: ret("dinitial_states"),
        workspace: workspace.as_ref(),
    })?;
    run_bwd(&bwd, platform)
}
