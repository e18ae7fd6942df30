//! Call frames of `xla_ssm_selective_scan_fwd` / `_bwd` (docs/selective_scan_fwd.md,
//! docs/selective_scan_bwd.md): operands and results by the targets' signatures, then the op's
//! validation; of `xla_ssm_selective_scan_chunk_records` (the forward's first pass); and of
//! `xla_ssm_selective_scan_carry_fwd` / `_bwd` (docs/selective_scan_carry.md).

use super::frame::Frame;
use super::operands::{prefixed, Call};
use crate::error::Result;
use crate::ops::selective_scan::carry::{run_carry, validate_carry, CarryArgs, Direction};
use crate::ops::selective_scan::*;
use crate::ops::signature::{
    SELECTIVE_SCAN_BWD, SELECTIVE_SCAN_CARRY_BWD, SELECTIVE_SCAN_CARRY_FWD, SELECTIVE_SCAN_CHUNK_RECORDS,
    SELECTIVE_SCAN_FWD,
};
use crate::ops::Platform;

/// The inputs both calls share, with their attributes.
fn inputs<'t>(frame: &Frame, op: &str, call: &'t Call) -> Result<Inputs<'t>> {
    let pre = prefixed(op);
    Ok(Inputs {
        u: call.input("u"),
        delta: call.input("delta"),
        a: call.input("A"),
        b: call.input("B"),
        c: call.input("C"),
        d: call.operand("D"),
        z: call.operand("z"),
        delta_bias: call.operand("delta_bias"),
        initial_state: call.operand("initial_state"),
        cu_seqlens: call.operand("cu_seqlens"),
        delta_softplus: frame.attr_bool("delta_softplus").map_err(&pre)?,
        layout: Layout::parse(&frame.attr_str("layout").map_err(&pre)?).map_err(&pre)?,
    })
}

/// The XLA handler's body of the forward: decode, validate, run.
pub fn fwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let op = SELECTIVE_SCAN_FWD.op;
    let checkpoint_len = frame.attr_opt("checkpoint_len", Frame::attr_i64).map_err(prefixed(op))?.unwrap_or(0);
    // Before counting results, which depend on it.
    validate_checkpoint_len(op, checkpoint_len, true)?;
    let call = Call::decode(frame, &SELECTIVE_SCAN_FWD)?;
    let fwd = validate_fwd(&FwdArgs {
        inputs: inputs(frame, op, &call)?,
        out: call.output("out"),
        final_state: call.output("final_state"),
        checkpoints: call.result("checkpoints"),
        checkpoint_len,
        workspace: call.workspace.as_ref(),
        chunk_records: call.operand("chunk_records"),
    })?;
    run_fwd(&fwd, platform)
}

/// The XLA handler's body of the chunk records call: decode, validate, run (as a forward).
pub fn chunk_records_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let sig = &SELECTIVE_SCAN_CHUNK_RECORDS;
    let pre = prefixed(sig.op);
    let call = Call::decode(frame, sig)?;
    let records = validate_chunk_records(&ChunkRecordsArgs {
        u: call.input("u"),
        delta: call.input("delta"),
        a: call.input("A"),
        b: call.input("B"),
        delta_bias: call.operand("delta_bias"),
        delta_softplus: frame.attr_bool("delta_softplus").map_err(&pre)?,
        layout: Layout::parse(&frame.attr_str("layout").map_err(&pre)?).map_err(&pre)?,
        records: call.output("chunk_records"),
    })?;
    run_fwd(&records, platform)
}

/// The XLA handler's body of the backward: decode, validate, run.
pub fn bwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let op = SELECTIVE_SCAN_BWD.op;
    let checkpoint_len = frame.attr_i64("checkpoint_len").map_err(prefixed(op))?;
    validate_checkpoint_len(op, checkpoint_len, false)?;
    let call = Call::decode(frame, &SELECTIVE_SCAN_BWD)?;
    let bwd = validate_bwd(&BwdArgs {
        inputs: inputs(frame, op, &call)?,
        checkpoints: call.input("checkpoints"),
        checkpoint_len,
        dout: call.input("dout"),
        dfinal_state: call.operand("dfinal_state"),
        du: call.output("du"),
        ddelta: call.output("ddelta"),
        da: call.output("dA"),
        db: call.output("dB"),
        dc: call.output("dC"),
        dd: call.result("dD"),
        dz: call.result("dz"),
        ddelta_bias: call.result("ddelta_bias"),
        dinitial_state: call.result("dinitial_state"),
        workspace: call.workspace.as_ref(),
    })?;
    run_bwd(&bwd, platform)
}

/// The XLA handler's body of the carry calls: decode, validate, run.
pub fn carry_from_frame(frame: &Frame, direction: Direction, platform: Platform) -> Result<()> {
    let (sig, x, result) = match direction {
        Direction::Fwd => (&SELECTIVE_SCAN_CARRY_FWD, "out", "out"),
        Direction::Bwd => (&SELECTIVE_SCAN_CARRY_BWD, "dout", "dstate_parts"),
    };
    let pre = prefixed(sig.op);
    let call = Call::decode(frame, sig)?;
    let carry = validate_carry(
        direction,
        &CarryArgs {
            x: call.input(x),
            delta: call.input("delta"),
            a: call.input("A"),
            c: call.input("C"),
            z: call.operand("z"),
            delta_bias: call.operand("delta_bias"),
            state: call.operand("state"),
            dt_sums: call.input("dt_sums"),
            segment_len: frame.attr_i64("segment_len").map_err(&pre)?,
            result: call.output(result),
            delta_softplus: frame.attr_bool("delta_softplus").map_err(&pre)?,
            layout: Layout::parse(&frame.attr_str("layout").map_err(&pre)?).map_err(&pre)?,
        },
    )?;
    run_carry(&carry, platform)
}
