//! Call frames of `xla_ssm_ssd_fwd` / `_bwd` and `xla_ssm_ssd_part_records` (docs/ssd.md):
//! operands and results by the targets' signatures, then the op's validation.

use super::frame::Frame;
use super::operands::{prefixed, Call};
use crate::error::Result;
use crate::ops::signature::{SSD_BWD, SSD_FWD, SSD_PART_RECORDS};
use crate::ops::ssd::*;
use crate::ops::Platform;

/// The inputs both calls share, with their attributes.
fn inputs<'t>(frame: &Frame, op: &str, call: &'t Call) -> Result<Inputs<'t>> {
    let pre = prefixed(op);
    Ok(Inputs {
        x: call.input("x"),
        dt: call.input("dt"),
        a: call.input("A"),
        b: call.input("B"),
        c: call.input("C"),
        d: call.operand("D"),
        z: call.operand("z"),
        dt_bias: call.operand("dt_bias"),
        initial_states: call.operand("initial_states"),
        cu_seqlens: call.operand("cu_seqlens"),
        chunk_size: frame.attr_i64("chunk_size").map_err(&pre)?,
        dt_softplus: frame.attr_bool("dt_softplus").map_err(&pre)?,
        dt_min: frame.attr_f32("dt_min").map_err(&pre)?,
        dt_max: frame.attr_f32("dt_max").map_err(&pre)?,
    })
}

/// The XLA handler's body of the forward: decode, validate, run.
pub fn fwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let call = Call::decode(frame, &SSD_FWD)?;
    let ssd = validate_fwd(&FwdArgs {
        inputs: inputs(frame, SSD_FWD.op, &call)?,
        y: call.output("y"),
        final_states: call.output("final_states"),
        chunk_states: call.result("chunk_states"),
        workspace: call.workspace.as_ref(),
        part_records: call.operand("part_records"),
    })?;
    run_fwd(&ssd, platform)
}

/// The XLA handler's body of the part-records call: decode, validate, run (as a forward).
pub fn part_records_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let call = Call::decode(frame, &SSD_PART_RECORDS)?;
    let pre = prefixed(SSD_PART_RECORDS.op);
    let ssd = validate_part_records(&PartRecordsArgs {
        x: call.input("x"),
        dt: call.input("dt"),
        a: call.input("A"),
        b: call.input("B"),
        dt_bias: call.operand("dt_bias"),
        chunk_size: frame.attr_i64("chunk_size").map_err(&pre)?,
        dt_softplus: frame.attr_bool("dt_softplus").map_err(&pre)?,
        dt_min: frame.attr_f32("dt_min").map_err(&pre)?,
        dt_max: frame.attr_f32("dt_max").map_err(&pre)?,
        final_states: call.output("final_states"),
        records: call.output("part_records"),
    })?;
    run_fwd(&ssd, platform)
}

/// The XLA handler's body of the backward: decode, validate, run.
pub fn bwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let call = Call::decode(frame, &SSD_BWD)?;
    let bwd = validate_bwd(&BwdArgs {
        inputs: inputs(frame, SSD_BWD.op, &call)?,
        chunk_states: call.input("chunk_states"),
        dy: call.input("dy"),
        dfinal_states: call.operand("dfinal_states"),
        dx: call.output("dx"),
        ddt: call.output("ddt"),
        da: call.output("dA"),
        db: call.output("dB"),
        dc: call.output("dC"),
        dd: call.result("dD"),
        dz: call.result("dz"),
        ddt_bias: call.result("ddt_bias"),
        dinitial_states: call.result("dinitial_states"),
        workspace: call.workspace.as_ref(),
    })?;
    run_bwd(&bwd, platform)
}
