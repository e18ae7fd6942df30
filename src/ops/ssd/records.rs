//! `ssd_part_records`: the tensor-core forward's first pass alone (docs/ssd.md, "Part records"):
//! what each part of its sequence split hands on from a zero state, and the sequence's end state
//! from zero.
//!
//! The records are opaque f32s ([`plan::part_records_floats`] of them) for a forward given them on
//! the same inputs (its `part_records` operand), which then skips that pass: the two calls together
//! cost one forward, and the forward may start from a state not known when the records were made,
//! which is what a seqlen-sharded SSD needs (docs/sharding.md). Only where the tensor-core kernels
//! run the call as it is (headdim 64, dstate 64 or 128, bf16 / f16, chunks of whole tiles); other
//! shapes are refused.

use super::{plan, validate_inputs, Inputs, Ssd, SsdParams};
use crate::error::{Error, Result};
use crate::ops::buffers::{check_buffers, Named};
use crate::ops::{expect, expect_nonnull, Records, Tensor};
use crate::DType;

const OP: &str = "ssd_part_records";

impl Ssd {
    /// The name of the call, for messages: a forward or a part-records call.
    pub fn op(&self) -> &'static str {
        match self.records {
            Records::Only(_) => OP,
            Records::Made | Records::Given(_) => "ssd_fwd",
        }
    }
}

/// The forward's `part_records` operand: the records of its inputs' shape, and not packed. Where
/// the shape has none (an empty operand), the forward makes its own.
pub(super) fn check_records_operand(
    op: &str,
    t: &Tensor,
    p: &SsdParams,
    dtype: DType,
    results: &[Named],
) -> Result<Records> {
    let what = format!("{op}: operand `part_records`");
    if p.packed() {
        return Err(Error::invalid(format!("{what}: not taken with packed sequences (`cu_seqlens`)")));
    }
    let floats = plan::part_records_floats(&p.shape(dtype));
    expect(t, &what, &[floats], "[xla_ssm_ssd_part_records_floats(...)]", &[DType::F32])?;
    expect_nonnull(t, &format!("{op}: `part_records`"))?;
    check_buffers(op, &[("part_records", Some(t))], results)?;
    Ok(if floats > 0 { Records::Given(t.data as *const f32) } else { Records::Made })
}

/// The operands and results of one part-records call, as the host describes them.
pub struct PartRecordsArgs<'a> {
    pub x: &'a Tensor,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub dt_bias: Option<&'a Tensor>,
    pub chunk_size: i64,
    pub dt_softplus: bool,
    pub dt_min: f32,
    pub dt_max: f32,
    /// (batch, heads, headdim, dstate) f32: the end states from zero.
    pub final_states: &'a Tensor,
    /// ([`plan::part_records_floats`]) f32.
    pub records: &'a Tensor,
}

/// Checks every operand; the message names the operand, what was expected and what came.
pub fn validate_part_records(args: &PartRecordsArgs) -> Result<Ssd> {
    let op = OP;
    let inputs = Inputs {
        x: args.x,
        dt: args.dt,
        a: args.a,
        b: args.b,
        c: args.b,
        d: None,
        z: None,
        dt_bias: args.dt_bias,
        initial_states: None,
        cu_seqlens: None,
        chunk_size: args.chunk_size,
        dt_softplus: args.dt_softplus,
        dt_min: args.dt_min,
        dt_max: args.dt_max,
    };
    let k = validate_inputs(op, &inputs)?;
    let floats = plan::part_records_floats(&k.params.shape(k.dtype));
    if k.params.chunk_size % plan::MMA_TILE != 0 {
        return Err(Error::invalid(format!(
            "{op}: attribute `chunk_size`: the tensor-core kernels take whole 64-step tiles (64, 128 or 256), got {}",
            k.params.chunk_size
        )));
    }
    if floats == 0 {
        return Err(Error::invalid(format!(
            "{op}: only shapes the tensor-core kernels run as they are: x bf16 or f16, headdim 64, dstate 64 \
             or 128, chunk_size 64, 128 or 256 (got x {}, headdim {}, dstate {}, chunk_size {})",
            k.dtype.name(),
            k.params.headdim,
            k.params.dstate,
            k.params.chunk_size
        )));
    }
    let what = format!("{op}: result `final_states`");
    expect(args.final_states, &what, &k.state_dims, k.state_meaning, &[DType::F32])?;
    expect_nonnull(args.final_states, &format!("{op}: `final_states`"))?;
    let what = format!("{op}: result `part_records`");
    expect(args.records, &what, &[floats], "[xla_ssm_ssd_part_records_floats(...)]", &[DType::F32])?;
    expect_nonnull(args.records, &format!("{op}: `part_records`"))?;
    let mut operands = inputs.named();
    operands[4] = ("C", None); // B's tensor stands in for it
    let results = [("final_states", Some(args.final_states)), ("part_records", Some(args.records))];
    check_buffers(op, &operands, &results)?;
    // C is B's pointer: no first pass reads it.
    let params = SsdParams { final_states: args.final_states.data as *mut f32, ..k.params };
    Ok(Ssd {
        params,
        dtype: k.dtype,
        present: k.present,
        save_chunk_states: false,
        records: Records::Only(args.records.data as *mut f32),
    })
}
