//! `selective_state_update`: one decode step of Mamba-1's selective scan (docs/decode.md has the ABI).
//!
//! ```text
//! dt = dt + dt_bias;  if dt_softplus: dt = softplus(dt)
//! state = exp(dt * A) * state + dt * B * x          (state row: state_batch_indices[b], or b)
//! y = <C, state> + D * x;  out = y * silu(z)  if z is given
//! ```
//! The state is updated in place: the host aliases the `state` operand to the `state` result; when it
//! does not, the operand is copied into the result first (a full copy: costs what the kernel costs).

use super::alias::{self, Alias, StateCopy};
use super::buffers::{check_buffers, Named};
use super::{expect, expect_dtype, expect_nonnull, fmt_dims, Platform, Tensor};
use crate::error::{Error, Result};
use crate::DType;
use std::ffi::c_void;

/// Largest supported dstate (as the scan).
pub const MAX_DSTATE: i64 = 256;

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
const S32: DType = DType::S32;

/// The operands of one state update, as the host describes them.
pub struct UpdateArgs<'a> {
    /// (n_slots, dim, dstate) f32 or the dtype of x; n_slots == batch without indices.
    pub state: &'a Tensor,
    pub x: &'a Tensor,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub dt_bias: Option<&'a Tensor>,
    pub state_batch_indices: Option<&'a Tensor>,
    pub out: &'a Tensor,
    /// The result the updated state goes to (the `state` operand's buffer when aliased).
    pub state_out: &'a Tensor,
    pub dt_softplus: bool,
}

impl<'a> UpdateArgs<'a> {
    /// The operands by name, for the checks every call's buffers get.
    fn operands(&self) -> [Named<'a>; 10] {
        [
            ("state", Some(self.state)),
            ("x", Some(self.x)),
            ("dt", Some(self.dt)),
            ("A", Some(self.a)),
            ("B", Some(self.b)),
            ("C", Some(self.c)),
            ("D", self.d),
            ("z", self.z),
            ("dt_bias", self.dt_bias),
            ("state_batch_indices", self.state_batch_indices),
        ]
    }
}

/// Kernel parameters; generated into kernels/params.h as `StateUpdateParams`. Absent optional operands
/// are null.
/// cbindgen:field-names=[state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, out, batch, dim, dstate, groups, dim_per_group, n_slots, dt_softplus, vectorized, lanes, _reserved]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct UpdateParams {
    /// (n_slots, dim, dstate), updated in place (after the copy when not aliased).
    pub state: *mut c_void,
    pub x: *const c_void,
    pub dt: *const c_void,
    pub a: *const f32,
    pub b: *const c_void,
    pub c: *const c_void,
    pub d: *const f32,
    pub z: *const c_void,
    pub dt_bias: *const f32,
    pub state_batch_indices: *const i32,
    pub out: *mut c_void,
    pub batch: i64,
    pub dim: i64,
    pub dstate: i64,
    pub groups: i64,
    pub dim_per_group: i64,
    pub n_slots: i64,
    pub dt_softplus: i32,
    /// Set by the CUDA launch: 16-byte vector access to state, A, B, C is safe.
    pub vectorized: i32,
    /// Set by the CUDA launch: threads per channel (a power of two up to 32).
    pub lanes: i32,
    pub _reserved: i32,
}

validated! {
    /// A validated state update.
    #[derive(Debug, Clone, Copy)]
    pub struct Update {
        params: UpdateParams,
        /// dtype of x, dt, z and out.
        dtype: DType,
        /// dtype of B and C.
        bc_dtype: DType,
        /// dtype of the state.
        state_dtype: DType,
        /// Where the state comes from: the result itself, or the operand (copied over first).
        alias: Alias,
        state_in: *const c_void,
    }
}

impl Update {
    /// The copy of a state XLA did not alias into its result.
    pub fn state_copy(&self) -> Option<StateCopy> {
        let p = &self.params;
        let bytes = (p.n_slots * p.dim * p.dstate * self.state_dtype.size_bytes()) as usize;
        StateCopy::of(self.alias, self.state_in, p.state, bytes)
    }
}

pub(crate) fn opt_ptr(t: Option<&Tensor>) -> *const c_void {
    t.map_or(std::ptr::null(), |t| t.data as *const c_void)
}

/// The (batch, dim) layout of x, shared with the fused decode step: returns (batch, dim).
pub(crate) fn expect_rows(op: &str, x: &Tensor) -> Result<(i64, i64)> {
    if x.dims.len() != 2 || x.dims.iter().any(|&v| v < 0) {
        return Err(Error::invalid(format!(
            "{op}: operand `x`: expected rank 2 [batch, dim], got shape {}",
            fmt_dims(&x.dims)
        )));
    }
    expect_dtype(x, &format!("{op}: operand `x`"), &FLOATS)?;
    Ok((x.dims[0], x.dims[1]))
}

/// Checks `state_batch_indices` (batch,) s32 and returns the number of state slots (rows of a
/// pooled state, given by `pool`'s leading dimension) or `batch` without indices.
pub(crate) fn slots(op: &str, batch: i64, indices: Option<&Tensor>, pool: &Tensor, pool_name: &str) -> Result<i64> {
    match indices {
        None => Ok(batch),
        Some(ix) => {
            expect(ix, &format!("{op}: operand `state_batch_indices`"), &[batch], "[batch]", &[S32])?;
            if pool.dims.is_empty() || pool.dims[0] < 0 {
                return Err(Error::invalid(format!(
                    "{op}: operand `{pool_name}`: expected rank >= 1, got shape {}",
                    fmt_dims(&pool.dims)
                )));
            }
            Ok(pool.dims[0])
        }
    }
}

/// On the host: every index must be a slot or negative (a padding row, skipped).
pub(crate) fn check_indices_host(op: &str, indices: *const i32, batch: i64, n_slots: i64) -> Result<()> {
    if indices.is_null() || batch == 0 {
        return Ok(());
    }
    // SAFETY: validated as a (batch,) s32 host array.
    let ix = unsafe { std::slice::from_raw_parts(indices, batch as usize) };
    if let Some((i, &v)) = ix.iter().enumerate().find(|(_, &v)| v as i64 >= n_slots) {
        return Err(Error::invalid(format!(
            "{op}: operand `state_batch_indices`: expected values < {n_slots} (the state's slots) or negative \
             (padding), got {v} at index {i}"
        )));
    }
    Ok(())
}

/// Checks every operand; the message names the operand, what was expected and what came.
pub fn validate(args: &UpdateArgs) -> Result<Update> {
    let op = "selective_state_update";
    let (batch, dim) = expect_rows(op, args.x)?;
    let dtype = args.x.dtype;
    let rows = [batch, dim];
    expect(args.dt, &format!("{op}: operand `dt`"), &rows, "[batch, dim]", &[dtype])?;
    if let Some(z) = args.z {
        expect(z, &format!("{op}: operand `z`"), &rows, "[batch, dim]", &[dtype])?;
    }
    let a = args.a;
    if a.dims.len() != 2 || a.dims[0] != dim || a.dims[1] < 0 {
        return Err(Error::invalid(format!(
            "{op}: operand `A`: expected shape ({dim}, dstate) [dim, dstate], got {}",
            fmt_dims(&a.dims)
        )));
    }
    expect_dtype(a, &format!("{op}: operand `A`"), &[DType::F32])?;
    let dstate = a.dims[1];
    if dstate > MAX_DSTATE {
        return Err(Error::invalid(format!("{op}: operand `A`: dstate must be at most {MAX_DSTATE}, got {dstate}")));
    }
    let b = args.b;
    if b.dims.len() != 3 || b.dims[0] != batch || b.dims[2] != dstate {
        return Err(Error::invalid(format!(
            "{op}: operand `B`: expected shape ({batch}, groups, {dstate}) [batch, groups, dstate], got {}",
            fmt_dims(&b.dims)
        )));
    }
    let groups = b.dims[1];
    if groups < 1 || dim % groups != 0 {
        return Err(Error::invalid(format!(
            "{op}: operand `B`: groups (= {groups}) must be at least 1 and divide dim (= {dim})"
        )));
    }
    let pair: Vec<DType> = if dtype == DType::F32 { vec![DType::F32] } else { vec![DType::F32, dtype] };
    expect_dtype(b, &format!("{op}: operand `B`"), &pair)?;
    expect(args.c, &format!("{op}: operand `C` (must match B)"), &b.dims, "[batch, groups, dstate]", &[b.dtype])?;
    for (t, name) in [(args.d, "D"), (args.dt_bias, "dt_bias")] {
        if let Some(t) = t {
            expect(t, &format!("{op}: operand `{name}`"), &[dim], "[dim]", &[DType::F32])?;
        }
    }
    let n_slots = slots(op, batch, args.state_batch_indices, args.state, "state")?;
    let state_dims = [n_slots, dim, dstate];
    expect(args.state, &format!("{op}: operand `state`"), &state_dims, "[slots, dim, dstate]", &pair)?;
    expect(args.out, &format!("{op}: result `out`"), &rows, "[batch, dim]", &[dtype])?;
    expect(
        args.state_out,
        &format!("{op}: result `state` (aliases operand `state`)"),
        &state_dims,
        "[slots, dim, dstate]",
        &[args.state.dtype],
    )?;
    let named = [
        (Some(args.state), "state"),
        (Some(args.x), "x"),
        (Some(args.dt), "dt"),
        (Some(a), "A"),
        (Some(b), "B"),
        (Some(args.c), "C"),
        (args.d, "D"),
        (args.z, "z"),
        (args.dt_bias, "dt_bias"),
        (args.state_batch_indices, "state_batch_indices"),
        (Some(args.out), "out"),
        (Some(args.state_out), "state (result)"),
    ];
    for (t, name) in named {
        if let Some(t) = t {
            expect_nonnull(t, &format!("{op}: `{name}`"))?;
        }
    }
    check_buffers(op, &args.operands(), &[("out", Some(args.out)), ("state", Some(args.state_out))])?;
    let alias = alias::alias(op, "state", args.state, args.state_out)?;
    let params = UpdateParams {
        state: args.state_out.data,
        x: args.x.data,
        dt: args.dt.data,
        a: a.data as *const f32,
        b: b.data,
        c: args.c.data,
        d: opt_ptr(args.d) as *const f32,
        z: opt_ptr(args.z),
        dt_bias: opt_ptr(args.dt_bias) as *const f32,
        state_batch_indices: opt_ptr(args.state_batch_indices) as *const i32,
        out: args.out.data,
        batch,
        dim,
        dstate,
        groups,
        dim_per_group: dim / groups,
        n_slots,
        dt_softplus: args.dt_softplus as i32,
        vectorized: 0,
        lanes: 1,
        _reserved: 0,
    };
    Ok(Update { params, dtype, bc_dtype: b.dtype, state_dtype: args.state.dtype, alias, state_in: args.state.data })
}

/// Runs a validated state update.
pub fn run(u: &Update, platform: Platform) -> Result<()> {
    match platform {
        Platform::Cpu => {
            check_indices_host(
                "selective_state_update",
                u.params.state_batch_indices,
                u.params.batch,
                u.params.n_slots,
            )?;
            if let Some(copy) = u.state_copy() {
                // SAFETY: validated, distinct host buffers of that size.
                unsafe { copy.on_host() };
            }
            crate::cpu::state_update::update(u);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => crate::cuda::state_update::update(u, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(Error::Unimplemented(
            "selective_state_update: this build of xla-ssm has no CUDA support (built without the `cuda` feature)"
                .into(),
        )),
    }
}
