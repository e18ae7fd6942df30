//! `selective_scan_carry_fwd` / `_bwd`: the state carried into a seqlen shard
//! (docs/selective_scan_carry.md; docs/sharding.md has where it is used).
//!
//! ```text
//! dt = delta + delta_bias;  if delta_softplus: dt = softplus(dt)
//! cs[l] = dt[0] + ... + dt[l];   w[l, n] = exp(A[:, n] * cs[l])      (per batch row and channel)
//! fwd:  out[l] += gate[l] * sum_n C[l, n] * w[l, n] * state[n]        (gate = silu(z), or 1)
//! bwd:  dstate_parts[s, n] = sum over segment s of dout[l] * gate[l] * C[l, n] * w[l, n]
//! ```
//! The forward adds what a state entering the shard contributes to the outputs its scan made from
//! a zero state; the backward is its transpose, per segment (the caller sums the parts).
//!
//! The steps are cut into segments of the attribute `segment_len` steps (n_segments =
//! ceil(seqlen / segment_len)), each run on its own (a warp on CUDA), from the cumulative dt before
//! it: the sum of the operand `dt_sums` (batch, dim, n_segments) f32, the sum of dt over each
//! segment, over the segments before it. The caller computes them (it needs their total for the
//! shard's decay anyway). With `delta_softplus` (dt >= 0, so w only shrinks
//! where A < 0) a segment stops at the first step from which every remaining term is below f32's
//! smallest normal: each `w * |state|` (fwd) or each `w` (bwd) has fallen under it; one that starts
//! there does nothing. So a channel costs what its decay needs, and a slow one's steps run in
//! parallel.

use super::{validate_inputs, FwdParams, Inputs, Layout, Names};
use crate::error::{Error, Result};
use crate::ops::alias::{alias, Alias, StateCopy};
use crate::ops::buffers::check_buffers;
use crate::ops::{expect, expect_nonnull, Platform, Tensor};
use crate::DType;
use std::ffi::c_void;

const CARRY_NAMES: Names = Names { u: "out", b: "C" };
const CARRY_BWD_NAMES: Names = Names { u: "dout", b: "C" };

/// The operands of one carry call, as the host describes them.
pub struct CarryArgs<'a> {
    /// fwd: the shard's outputs from a zero state (`out` operand); bwd: their gradient (`dout`).
    pub x: &'a Tensor,
    pub delta: &'a Tensor,
    pub a: &'a Tensor,
    pub c: &'a Tensor,
    pub z: Option<&'a Tensor>,
    pub delta_bias: Option<&'a Tensor>,
    /// fwd only: (batch, dim, dstate) f32, the state entering the shard.
    pub state: Option<&'a Tensor>,
    /// (batch, dim, n_segments) f32: the sum of dt over each segment.
    pub dt_sums: &'a Tensor,
    /// Steps per segment (the last may have fewer), at least 1.
    pub segment_len: i64,
    /// fwd: the corrected outputs (the `out` operand's buffer when aliased); bwd: `dstate_parts`
    /// (batch, dim, n_segments, dstate) f32.
    pub result: &'a Tensor,
    pub delta_softplus: bool,
    pub layout: Layout,
}

/// Which of the two calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Fwd,
    Bwd,
}

impl Direction {
    pub fn op(self) -> &'static str {
        match self {
            Direction::Fwd => "selective_scan_carry_fwd",
            Direction::Bwd => "selective_scan_carry_bwd",
        }
    }
}

/// Kernel parameters; generated into kernels/params.h as `SelectiveScanCarryParams`. The scan's
/// parameters hold the operands: `u` is the outputs (fwd, = `out`) or their gradient (bwd), `C`
/// is C (`B` null), `initial_state` the state (fwd).
/// cbindgen:field-names=[scan, dt_sums, dstate_parts, segment_len, n_segments]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CarryParams {
    pub scan: FwdParams,
    /// (batch, dim, n_segments) f32.
    pub dt_sums: *const f32,
    /// bwd: (batch, dim, n_segments, dstate) f32; fwd: null.
    pub dstate_parts: *mut f32,
    /// Steps per segment (the last may have fewer), at least 1.
    pub segment_len: i64,
    /// ceil(seqlen / segment_len).
    pub n_segments: i64,
}

validated! {
    /// A validated carry call.
    #[derive(Debug, Clone, Copy)]
    pub struct Carry {
        params: CarryParams,
        direction: Direction,
        /// dtype of out / dout, delta and z.
        dtype: DType,
        /// dtype of C.
        bc_dtype: DType,
        /// fwd: whether XLA aliased `out` to its operand.
        alias: Alias,
        /// fwd: the `out` operand.
        out_in: *const c_void,
    }
}

impl Carry {
    /// fwd: the copy of the outputs into the result that XLA did not alias (the kernels update the
    /// result in place, and leave the steps a channel skips as they are).
    pub fn out_copy(&self) -> Option<StateCopy> {
        let p = &self.params.scan;
        let bytes = (p.batch * p.dim * p.seqlen * self.dtype.size_bytes()) as usize;
        StateCopy::of(self.alias, self.out_in, p.out, bytes).filter(|_| self.direction == Direction::Fwd)
    }
}

/// Checks every operand; the message names the operand, what was expected and what came.
pub fn validate_carry(direction: Direction, args: &CarryArgs) -> Result<Carry> {
    let op = direction.op();
    let names = match direction {
        Direction::Fwd => CARRY_NAMES,
        Direction::Bwd => CARRY_BWD_NAMES,
    };
    let inputs = Inputs {
        u: args.x,
        delta: args.delta,
        a: args.a,
        b: args.c,
        c: args.c,
        d: None,
        z: args.z,
        delta_bias: args.delta_bias,
        initial_state: None,
        cu_seqlens: None,
        delta_softplus: args.delta_softplus,
        layout: args.layout,
    };
    let k = validate_inputs(op, names, &inputs)?;
    let mut p = k.params;
    if args.segment_len < 1 {
        return Err(Error::invalid(format!(
            "{op}: attribute `segment_len`: expected at least 1, got {}",
            args.segment_len
        )));
    }
    let n_segments = if p.seqlen == 0 { 0 } else { (p.seqlen - 1) / args.segment_len + 1 };
    let sums = args.dt_sums;
    let sums_dims = [p.batch, p.dim, n_segments];
    let sums_meaning = "[batch, dim, ceil(seqlen / segment_len)]";
    expect(sums, &format!("{op}: operand `dt_sums`"), &sums_dims, sums_meaning, &[DType::F32])?;
    expect_nonnull(sums, &format!("{op}: `dt_sums`"))?;
    let mut named = inputs.named();
    named[0].0 = names.u;
    named[3] = ("C", None);
    named.push(("dt_sums", Some(sums)));
    let mut dstate_parts = std::ptr::null_mut();
    let (alias_kind, out_in) = match direction {
        Direction::Fwd => {
            let Some(state) = args.state else {
                return Err(Error::invalid(format!("{op}: operand `state`: missing")));
            };
            expect(state, &format!("{op}: operand `state`"), &k.state_dims(), k.state_meaning, &[DType::F32])?;
            expect_nonnull(state, &format!("{op}: `state`"))?;
            expect(args.result, &format!("{op}: result `out`"), &args.x.dims, k.x_meaning, &[k.dtype])?;
            expect_nonnull(args.result, &format!("{op}: `out`"))?;
            named.push(("state", Some(state)));
            check_buffers(op, &named, &[("out", Some(args.result))])?;
            let kind = alias(op, "out", args.x, args.result)?;
            // The kernels read and write the result only (after the copy when not aliased).
            p.u = args.result.data;
            p.out = args.result.data;
            p.initial_state = state.data as *const f32;
            (kind, args.x.data as *const c_void)
        }
        Direction::Bwd => {
            let what = format!("{op}: result `dstate_parts`");
            let dims = [p.batch, p.dim, n_segments, p.dstate];
            let meaning = "[batch, dim, ceil(seqlen / segment_len), dstate]";
            expect(args.result, &what, &dims, meaning, &[DType::F32])?;
            expect_nonnull(args.result, &format!("{op}: `dstate_parts`"))?;
            check_buffers(op, &named, &[("dstate_parts", Some(args.result))])?;
            dstate_parts = args.result.data as *mut f32;
            (Alias::InPlace, std::ptr::null()) // nothing to copy
        }
    };
    // Validation fills B's pointer with C's; the kernels read C only.
    p.b = std::ptr::null();
    let segment_len = args.segment_len;
    let params = CarryParams { scan: p, dt_sums: sums.data as *const f32, dstate_parts, segment_len, n_segments };
    Ok(Carry { params, direction, dtype: k.dtype, bc_dtype: k.bc_dtype, alias: alias_kind, out_in })
}

/// Runs a validated carry call.
pub fn run_carry(carry: &Carry, platform: Platform) -> Result<()> {
    match platform {
        Platform::Cpu => {
            crate::cpu::carry::run(carry);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => crate::cuda::carry::run(carry, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(super::no_cuda(carry.direction().op())),
    }
}
