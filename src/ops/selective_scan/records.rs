//! `selective_scan_chunk_records`: what each chunk of the CUDA forward's sequence split hands on
//! from a zero state (docs/selective_scan_fwd.md, "Chunk records"; docs/sharding.md has where it is
//! used).
//!
//! ```text
//! n_chunks = split_plan(batch, dim, seqlen).1;   chunk_len = ceil(seqlen / n_chunks) rounded up to 32
//! R = split_record_floats(dstate) = 8 * max(2, next_power_of_two(ceil(dstate / 8))) + 1
//! records[k, b, d, n]     = the state of channel d after chunk k's steps, scanned from zero (n < dstate)
//! records[k, b, d, n]     = 0                                              (dstate <= n < R - 1)
//! records[k, b, d, R - 1] = the sum of dt over chunk k (dt after delta_bias and softplus)
//! ```
//! They are the forward's first pass, for every chunk (the forward itself records all but the
//! last). A forward given them (its `chunk_records` operand) on the same inputs skips that pass, so
//! a caller can fold them into the sequence's end state from zero, exchange it, and then run the
//! forward from the true incoming state at no more than the forward's cost.

use super::{split_plan, split_record_floats, validate_inputs, Fwd, FwdParams, Inputs, Layout, SCAN_NAMES};
use crate::error::{Error, Result};
use crate::ops::buffers::{check_buffers, Named};
use crate::ops::{expect, expect_nonnull, Records, Tensor};
use crate::DType;

const OP: &str = "selective_scan_chunk_records";

impl Fwd {
    /// The name of the call, for messages: a forward or a records call.
    pub fn op(&self) -> &'static str {
        match self.records {
            Records::Only(_) => OP,
            Records::Made | Records::Given(_) => "selective_scan_fwd",
        }
    }
}

const RECORDS_MEANING: &str = "[n_chunks, batch, dim, record_floats]";

/// Chunks of the records of a shape: the CUDA forward's split (1 where it never splits).
pub fn chunk_records_count(batch: i64, dim: i64, seqlen: i64) -> i64 {
    split_plan(batch, dim, seqlen).1
}

fn records_dims(p: &FwdParams) -> [i64; 4] {
    [chunk_records_count(p.batch, p.dim, p.seqlen), p.batch, p.dim, split_record_floats(p.dstate)]
}

/// The forward's `chunk_records` operand: the records of its inputs' shape, and not packed.
pub(super) fn check_records_operand(op: &str, t: &Tensor, p: &FwdParams, results: &[Named]) -> Result<*const f32> {
    let what = format!("{op}: operand `chunk_records`");
    if !p.cu_seqlens.is_null() {
        return Err(Error::invalid(format!("{what}: not taken with packed sequences (`cu_seqlens`)")));
    }
    expect(t, &what, &records_dims(p), RECORDS_MEANING, &[DType::F32])?;
    expect_nonnull(t, &format!("{op}: `chunk_records`"))?;
    check_buffers(op, &[("chunk_records", Some(t))], results)?;
    Ok(t.data as *const f32)
}

/// The operands of one records call, as the host describes them: the forward's that its first
/// pass reads.
pub struct ChunkRecordsArgs<'a> {
    pub u: &'a Tensor,
    pub delta: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub delta_bias: Option<&'a Tensor>,
    pub delta_softplus: bool,
    pub layout: Layout,
    /// (n_chunks, batch, dim, record_floats) f32.
    pub records: &'a Tensor,
}

/// Checks every operand; the message names the operand, what was expected and what came.
pub fn validate_chunk_records(args: &ChunkRecordsArgs) -> Result<Fwd> {
    let op = OP;
    let inputs = Inputs {
        u: args.u,
        delta: args.delta,
        a: args.a,
        b: args.b,
        c: args.b,
        d: None,
        z: None,
        delta_bias: args.delta_bias,
        initial_state: None,
        cu_seqlens: None,
        delta_softplus: args.delta_softplus,
        layout: args.layout,
    };
    let k = validate_inputs(op, SCAN_NAMES, &inputs)?;
    let what = format!("{op}: result `chunk_records`");
    expect(args.records, &what, &records_dims(&k.params), RECORDS_MEANING, &[DType::F32])?;
    expect_nonnull(args.records, &format!("{op}: `chunk_records`"))?;
    let mut operands = inputs.named();
    operands[4] = ("C", None); // B's tensor stands in for it
    check_buffers(op, &operands, &[("chunk_records", Some(args.records))])?;
    let (chunk_len, n_chunks) = split_plan(k.params.batch, k.params.dim, k.params.seqlen);
    // Validation fills C's pointer with B's: the tiled first pass stages C's tiles with B's (and
    // never uses them), so it must be readable.
    let params = FwdParams { chunk_len, n_chunks, ..k.params };
    Ok(Fwd {
        params,
        dtype: k.dtype,
        bc_dtype: k.bc_dtype,
        bc_time_varying: k.time_varying,
        workspace_bytes: 0,
        records: Records::Only(args.records.data as *mut f32),
    })
}
