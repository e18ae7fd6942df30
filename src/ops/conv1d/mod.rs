//! `causal_conv1d_fwd`, `causal_conv1d_bwd`, `causal_conv1d_update`: the depthwise causal convolution
//! in front of Mamba's scan (docs/decode.md has the ABI). Per channel d, with W = width:
//!
//! ```text
//! pre[t] = bias[d] + sum_k weight[d, k] * xpad[t - (W - 1) + k]     (xpad[t] = x[t], t >= 0;
//! out[t] = silu(pre[t]) if silu else pre[t]                         initial_states[W - 1 + t], t < 0, or 0)
//! ```
//! The update op runs the same recurrence token by token from `conv_state` (the last W - 1 inputs,
//! oldest first) and leaves the newest W - 1 inputs there, in place.
//!
//! Packed sequences (fwd, bwd): with `cu_seqlens` (num_seqs + 1 boundaries along seqlen of a batch-1
//! x), the window restarts at each sequence's start: xpad above is per sequence, its steps before 0
//! from `initial_states[s]` (num_seqs, dim, W - 1) or 0.

use super::alias::{self, Alias, StateCopy};
use super::buffers::check_buffers;
use super::selective_scan::check_cu_seqlens_values;
use super::selective_scan::Layout;
use super::state_update::{check_indices_host, opt_ptr, slots};
use super::{check_elements, expect, expect_dtype, expect_nonnull, fmt_dims, Platform, Tensor};
use crate::error::{Error, Result};
use crate::DType;
use std::ffi::c_void;

pub const MIN_WIDTH: i64 = 2;
pub const MAX_WIDTH: i64 = 4;

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// Which of the three operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Fwd,
    Bwd,
    Update,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Fwd => "causal_conv1d_fwd",
            Kind::Bwd => "causal_conv1d_bwd",
            Kind::Update => "causal_conv1d_update",
        }
    }
}

/// Kernel parameters of all three; generated into kernels/params.h. Unused and absent operands are
/// null; strides (elements) address x, out, dout and dx alike.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ConvParams {
    pub x: *const c_void,
    pub weight: *const c_void,
    pub bias: *const c_void,
    /// fwd / bwd: (batch, dim, width - 1), like x's dtype.
    pub initial_states: *const c_void,
    /// update: (n_slots, dim, width - 1), like x's dtype, updated in place.
    pub conv_state: *mut c_void,
    pub state_batch_indices: *const i32,
    /// fwd / update: out; bwd: dx.
    pub out: *mut c_void,
    pub dout: *const c_void,
    pub dweight: *mut c_void,
    pub dbias: *mut c_void,
    pub dinitial_states: *mut c_void,
    pub batch: i64,
    pub dim: i64,
    pub seqlen: i64,
    pub width: i64,
    pub n_slots: i64,
    pub x_stride_batch: i64,
    pub x_stride_dim: i64,
    pub x_stride_seq: i64,
    pub silu: i32,
    pub _reserved: i32,
    /// fwd / bwd: (num_seqs + 1) boundaries of packed sequences along seqlen (batch 1), or null.
    /// initial_states and dinitial_states then have num_seqs rows.
    pub cu_seqlens: *const i32,
    pub num_seqs: i64,
}

impl ConvParams {
    /// The packed sequences' boundaries, when there are some.
    ///
    /// # Safety
    /// The parameters are validated and `cu_seqlens` is host memory (the CPU platform).
    pub unsafe fn host_cu_seqlens(&self) -> Option<&[i32]> {
        // SAFETY: per the contract, num_seqs + 1 readable i32s.
        (!self.cu_seqlens.is_null())
            .then(|| unsafe { std::slice::from_raw_parts(self.cu_seqlens, self.num_seqs as usize + 1) })
    }
}

validated! {
    /// A validated call of one of the three.
    #[derive(Debug, Clone, Copy)]
    pub struct Conv {
        kind: Kind,
        params: ConvParams,
        /// dtype of x, out, dout, dx and the states.
        dtype: DType,
        /// dtype of weight and bias (and their gradients).
        weight_dtype: DType,
        /// update: how conv_state reaches its result.
        alias: Alias,
        state_in: *const c_void,
    }
}

impl Conv {
    /// update: the copy of a conv_state XLA did not alias into its result.
    pub fn state_copy(&self) -> Option<StateCopy> {
        let p = &self.params;
        let bytes = (p.n_slots * p.dim * (p.width - 1) * self.dtype.size_bytes()) as usize;
        StateCopy::of(self.alias, self.state_in, p.conv_state, bytes)
    }
}

/// The operands of any of the three; those an op does not take are `None`.
pub struct ConvArgs<'a> {
    pub kind: Kind,
    pub x: &'a Tensor,
    pub weight: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    pub initial_states: Option<&'a Tensor>,
    /// fwd / bwd: packed sequences, int32 (num_seqs + 1).
    pub cu_seqlens: Option<&'a Tensor>,
    /// bwd.
    pub dout: Option<&'a Tensor>,
    /// update: the operand and the (aliased) result.
    pub conv_state: Option<(&'a Tensor, &'a Tensor)>,
    pub state_batch_indices: Option<&'a Tensor>,
    /// fwd / update: out; bwd: dx.
    pub out: &'a Tensor,
    /// bwd.
    pub dweight: Option<&'a Tensor>,
    pub dbias: Option<&'a Tensor>,
    pub dinitial_states: Option<&'a Tensor>,
    pub silu: bool,
    pub layout: Layout,
}

pub fn parse_layout(op: &str, s: &str) -> Result<Layout> {
    match s {
        "bdl" => Ok(Layout::ChannelFirst),
        "bld" => Ok(Layout::ChannelLast),
        other => Err(Error::invalid(format!("{op}: attribute `layout`: expected \"bdl\" or \"bld\", got {other:?}"))),
    }
}

/// `cu_seqlens` of a packed call: int32 (num_seqs + 1,), x's batch 1, and no steps without a
/// sequence. Returns num_seqs. The values are checked where the host can read them.
fn check_cu_seqlens(op: &str, cu: &Tensor, x: &Tensor, batch: i64, seqlen: i64) -> Result<i64> {
    let what = format!("{op}: operand `cu_seqlens`");
    check_elements(&what, &cu.dims)?;
    expect_dtype(cu, &what, &[DType::S32])?;
    if cu.dims.len() != 1 || cu.dims[0] < 1 {
        return Err(Error::invalid(format!(
            "{what}: expected shape (num_seqs + 1,) [boundaries], got {}",
            fmt_dims(&cu.dims)
        )));
    }
    if batch != 1 {
        return Err(Error::invalid(format!(
            "{what}: packed sequences lie along seqlen of one batch row: x must have batch 1, got shape {}",
            fmt_dims(&x.dims)
        )));
    }
    let num_seqs = cu.dims[0] - 1;
    if num_seqs == 0 && seqlen != 0 {
        return Err(Error::invalid(format!(
            "{what}: shape (1,) holds no sequence, so x's seqlen must be 0, got {seqlen}"
        )));
    }
    Ok(num_seqs)
}

/// Checks `weight` (dim, width) and `bias` (dim); returns width.
pub(crate) fn check_weight(op: &str, dim: i64, dtype: DType, weight: &Tensor, bias: Option<&Tensor>) -> Result<i64> {
    if weight.dims.len() != 2 || weight.dims[0] != dim || !(MIN_WIDTH..=MAX_WIDTH).contains(&weight.dims[1]) {
        return Err(Error::invalid(format!(
            "{op}: operand `weight`: expected shape ({dim}, width) [dim, width] with width in {MIN_WIDTH}..={MAX_WIDTH}, got {}",
            fmt_dims(&weight.dims)
        )));
    }
    let allowed: Vec<DType> = if dtype == DType::F32 { vec![DType::F32] } else { vec![DType::F32, dtype] };
    expect_dtype(weight, &format!("{op}: operand `weight`"), &allowed)?;
    if let Some(bias) = bias {
        expect(bias, &format!("{op}: operand `bias` (dtype of weight)"), &[dim], "[dim]", &[weight.dtype])?;
    }
    Ok(weight.dims[1])
}

pub fn validate(a: &ConvArgs) -> Result<Conv> {
    let op = a.kind.name();
    let x = a.x;
    let rank_ok = match a.kind {
        Kind::Update => x.dims.len() == 2 || x.dims.len() == 3,
        _ => x.dims.len() == 3,
    };
    let x_meaning = match (x.dims.len(), a.layout) {
        (2, _) => "[batch, dim]",
        (_, Layout::ChannelFirst) => "[batch, dim, seqlen]",
        (_, Layout::ChannelLast) => "[batch, seqlen, dim]",
    };
    if !rank_ok || x.dims.iter().any(|&v| v < 0) {
        let want = if a.kind == Kind::Update { "rank 2 [batch, dim] or rank 3" } else { "rank 3" };
        return Err(Error::invalid(format!(
            "{op}: operand `x`: expected {want} ({}), got shape {}",
            if a.layout == Layout::ChannelFirst {
                "layout bdl: [batch, dim, seqlen]"
            } else {
                "layout bld: [batch, seqlen, dim]"
            },
            fmt_dims(&x.dims)
        )));
    }
    expect_dtype(x, &format!("{op}: operand `x`"), &FLOATS)?;
    let dtype = x.dtype;
    let (batch, dim, seqlen) = match (x.dims.len(), a.layout) {
        (2, _) => (x.dims[0], x.dims[1], 1),
        (_, Layout::ChannelFirst) => (x.dims[0], x.dims[1], x.dims[2]),
        (_, Layout::ChannelLast) => (x.dims[0], x.dims[2], x.dims[1]),
    };
    let width = check_weight(op, dim, dtype, a.weight, a.bias)?;
    let (num_seqs, state_rows, state_meaning) = match a.cu_seqlens {
        None => (0, batch, "[batch, dim, width - 1]"),
        Some(_) if a.kind == Kind::Update => {
            return Err(Error::invalid(format!("{op}: operand `cu_seqlens`: only the forward and backward take one")))
        }
        Some(cu) => {
            let n = check_cu_seqlens(op, cu, x, batch, seqlen)?;
            (n, n, "[num_seqs, dim, width - 1] (packed sequences)")
        }
    };
    let state_dims = [state_rows, dim, width - 1];
    if let Some(h0) = a.initial_states {
        expect(h0, &format!("{op}: operand `initial_states`"), &state_dims, state_meaning, &[dtype])?;
    }
    if let Some(dout) = a.dout {
        expect(dout, &format!("{op}: operand `dout`"), &x.dims, x_meaning, &[dtype])?;
    }
    let out_name = if a.kind == Kind::Bwd { "dx" } else { "out" };
    expect(a.out, &format!("{op}: result `{out_name}`"), &x.dims, x_meaning, &[dtype])?;
    if let Some(dw) = a.dweight {
        expect(dw, &format!("{op}: result `dweight`"), &a.weight.dims, "[dim, width]", &[a.weight.dtype])?;
    }
    if let (Some(db), Some(bias)) = (a.dbias, a.bias) {
        expect(db, &format!("{op}: result `dbias`"), &bias.dims, "[dim]", &[bias.dtype])?;
    }
    if let Some(dh0) = a.dinitial_states {
        expect(dh0, &format!("{op}: result `dinitial_states`"), &state_dims, state_meaning, &[dtype])?;
    }
    let (mut n_slots, mut alias, mut state_in, mut conv_state) =
        (0, Alias::InPlace, std::ptr::null(), std::ptr::null_mut());
    if let Some((cs, cs_out)) = a.conv_state {
        n_slots = slots(op, batch, a.state_batch_indices, cs, "conv_state")?;
        let dims = [n_slots, dim, width - 1];
        expect(cs, &format!("{op}: operand `conv_state`"), &dims, "[slots, dim, width - 1]", &[dtype])?;
        expect(
            cs_out,
            &format!("{op}: result `conv_state` (aliases operand `conv_state`)"),
            &dims,
            "[slots, dim, width - 1]",
            &[dtype],
        )?;
        expect_nonnull(cs, &format!("{op}: `conv_state`"))?;
        expect_nonnull(cs_out, &format!("{op}: `conv_state` (result)"))?;
        alias = alias::alias(op, "conv_state", cs, cs_out)?;
        state_in = cs.data as *const c_void;
        conv_state = cs_out.data;
    }
    let named = [
        (Some(x), "x"),
        (Some(a.weight), "weight"),
        (a.bias, "bias"),
        (a.initial_states, "initial_states"),
        (a.cu_seqlens, "cu_seqlens"),
        (a.dout, "dout"),
        (a.state_batch_indices, "state_batch_indices"),
        (Some(a.out), out_name),
        (a.dweight, "dweight"),
        (a.dbias, "dbias"),
        (a.dinitial_states, "dinitial_states"),
    ];
    for (t, name) in named {
        if let Some(t) = t {
            expect_nonnull(t, &format!("{op}: `{name}`"))?;
        }
    }
    let (cs, cs_out) = (a.conv_state.map(|c| c.0), a.conv_state.map(|c| c.1));
    let operands = [
        ("x", Some(x)),
        ("weight", Some(a.weight)),
        ("bias", a.bias),
        ("initial_states", a.initial_states),
        ("cu_seqlens", a.cu_seqlens),
        ("dout", a.dout),
        ("conv_state", cs),
        ("state_batch_indices", a.state_batch_indices),
    ];
    let results = [
        (out_name, Some(a.out)),
        ("conv_state", cs_out),
        ("dweight", a.dweight),
        ("dbias", a.dbias),
        ("dinitial_states", a.dinitial_states),
    ];
    check_buffers(op, &operands, &results)?;
    let (x_stride_batch, x_stride_dim, x_stride_seq) = match a.layout {
        Layout::ChannelFirst => (dim * seqlen, seqlen, 1),
        Layout::ChannelLast => (seqlen * dim, 1, dim),
    };
    let mut_ptr = |t: Option<&Tensor>| t.map_or(std::ptr::null_mut(), |t| t.data);
    let params = ConvParams {
        x: x.data,
        weight: a.weight.data,
        bias: opt_ptr(a.bias),
        initial_states: opt_ptr(a.initial_states),
        conv_state,
        state_batch_indices: opt_ptr(a.state_batch_indices) as *const i32,
        out: a.out.data,
        dout: opt_ptr(a.dout),
        dweight: mut_ptr(a.dweight),
        dbias: mut_ptr(a.dbias),
        dinitial_states: mut_ptr(a.dinitial_states),
        batch,
        dim,
        seqlen,
        width,
        n_slots,
        x_stride_batch,
        x_stride_dim,
        x_stride_seq,
        silu: a.silu as i32,
        _reserved: 0,
        cu_seqlens: opt_ptr(a.cu_seqlens) as *const i32,
        num_seqs,
    };
    Ok(Conv { kind: a.kind, params, dtype, weight_dtype: a.weight.dtype, alias, state_in })
}

pub fn run(conv: &Conv, platform: Platform) -> Result<()> {
    let p = &conv.params;
    match platform {
        Platform::Cpu => {
            if conv.kind == Kind::Update {
                check_indices_host(conv.kind.name(), p.state_batch_indices, p.batch, p.n_slots)?;
                if let Some(copy) = conv.state_copy() {
                    // SAFETY: validated, distinct host buffers of that size.
                    unsafe { copy.on_host() };
                }
            }
            // SAFETY: validated, and on the CPU platform every buffer is host memory.
            if let Some(cu) = unsafe { p.host_cu_seqlens() } {
                check_cu_seqlens_values(conv.kind.name(), cu, p.seqlen)?;
            }
            crate::cpu::conv1d::run(conv);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => crate::cuda::conv1d::run(conv, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(Error::Unimplemented(format!(
            "{}: this build of xla-ssm has no CUDA support (built without the `cuda` feature)",
            conv.kind.name()
        ))),
    }
}
