//! The decode-time C API (docs/decode.md): the state update and the fused decode step, states in
//! place.

use super::{args_ref, call, dtype_of, some, XlaSsmDtype, XlaSsmStatus};
use crate::error::Result;
use crate::ops::{Platform, Tensor};
use crate::DType;
use std::ffi::c_void;

/// Arguments of `selective_state_update`: one token, `state` updated in place. Dense row-major
/// arrays; optional pointers may be NULL.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct XlaSsmStateUpdateArgs {
    pub batch: i64,
    pub dim: i64,
    /// 0..=256.
    pub dstate: i64,
    /// Groups of B and C (must divide dim).
    pub groups: i64,
    /// Rows of `state` when `state_batch_indices` is given (a pool of states); ignored otherwise
    /// (the state then has `batch` rows).
    pub n_slots: i64,
    /// dtype of x, dt, z and out.
    pub dtype: XlaSsmDtype,
    /// dtype of B and C: XLA_SSM_F32 or `dtype`.
    pub bc_dtype: XlaSsmDtype,
    /// dtype of the state: XLA_SSM_F32 or `dtype`.
    pub state_dtype: XlaSsmDtype,
    pub dt_softplus: bool,
    /// (n_slots or batch, dim, dstate), read and written.
    pub state: *mut c_void,
    /// (batch, dim).
    pub x: *const c_void,
    /// (batch, dim).
    pub dt: *const c_void,
    /// (dim, dstate) f32.
    pub a: *const f32,
    /// (batch, groups, dstate).
    pub b: *const c_void,
    pub c: *const c_void,
    /// (dim) f32, optional.
    pub d: *const f32,
    /// (batch, dim), optional.
    pub z: *const c_void,
    /// (dim) f32, optional.
    pub dt_bias: *const f32,
    /// (batch) int32, optional: row i updates state row state_batch_indices[i]; a negative entry is a
    /// padding row (output 0, no state touched). On the host an entry >= n_slots is an error; on the
    /// GPU such a row is skipped like padding.
    pub state_batch_indices: *const i32,
    /// (batch, dim), like x.
    pub out: *mut c_void,
}

/// Arguments of the fused decode step: `XlaSsmStateUpdateArgs` (whose `x` is the conv's input) plus
/// the conv: `conv_state` (n_slots or batch, dim, width - 1), dtype of x, updated in place;
/// `conv_weight` (dim, width) and optional `conv_bias` (dim), both of `conv_dtype` (XLA_SSM_F32 or
/// the dtype of x). width is 2..=4.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct XlaSsmDecodeStepArgs {
    pub ssm: XlaSsmStateUpdateArgs,
    pub width: i64,
    pub conv_dtype: XlaSsmDtype,
    pub conv_state: *mut c_void,
    pub conv_weight: *const c_void,
    pub conv_bias: *const c_void,
}

/// Tensors of a state update described by the C struct: (state, x, dt, A, B, C, D, z, dt_bias, indices, out).
fn update_tensors(a: &XlaSsmStateUpdateArgs) -> Result<[Tensor; 11]> {
    let dtype = dtype_of("selective_state_update", a.dtype, "dtype")?;
    let bc_dtype = dtype_of("selective_state_update", a.bc_dtype, "bc_dtype")?;
    let state_dtype = dtype_of("selective_state_update", a.state_dtype, "state_dtype")?;
    let slots = if a.state_batch_indices.is_null() { a.batch } else { a.n_slots };
    let t = |dtype, dims: &[i64], p: *const c_void| Tensor { dtype, dims: dims.to_vec(), data: p as *mut c_void };
    let rows = [a.batch, a.dim];
    let bc = [a.batch, a.groups, a.dstate];
    Ok([
        t(state_dtype, &[slots, a.dim, a.dstate], a.state),
        t(dtype, &rows, a.x),
        t(dtype, &rows, a.dt),
        t(DType::F32, &[a.dim, a.dstate], a.a as *const c_void),
        t(bc_dtype, &bc, a.b),
        t(bc_dtype, &bc, a.c),
        t(DType::F32, &[a.dim], a.d as *const c_void),
        t(dtype, &rows, a.z),
        t(DType::F32, &[a.dim], a.dt_bias as *const c_void),
        t(DType::S32, &[a.batch], a.state_batch_indices as *const c_void),
        t(dtype, &rows, a.out),
    ])
}

fn update_args(t: &[Tensor; 11], softplus: bool) -> crate::ops::state_update::UpdateArgs<'_> {
    crate::ops::state_update::UpdateArgs {
        state: &t[0],
        x: &t[1],
        dt: &t[2],
        a: &t[3],
        b: &t[4],
        c: &t[5],
        d: some(&t[6]),
        z: some(&t[7]),
        dt_bias: some(&t[8]),
        state_batch_indices: some(&t[9]),
        out: &t[10],
        state_out: &t[0],
        dt_softplus: softplus,
    }
}

fn state_update(args: *const XlaSsmStateUpdateArgs, platform: Platform) -> Result<()> {
    use crate::ops::state_update::{run, validate};
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args_ref("selective_state_update", args) }?;
    let t = update_tensors(a)?;
    run(&validate(&update_args(&t, a.dt_softplus))?, platform)
}

fn decode_step(args: *const XlaSsmDecodeStepArgs, platform: Platform) -> Result<()> {
    use crate::ops::mamba_decode::{run, validate, DecodeArgs};
    // SAFETY: as in `state_update`.
    let a = unsafe { args_ref("mamba_decode_step", args) }?;
    let t = update_tensors(&a.ssm)?;
    let u = update_args(&t, a.ssm.dt_softplus);
    let conv_dtype = dtype_of("mamba_decode_step", a.conv_dtype, "conv_dtype")?;
    let dtype = t[1].dtype;
    let slots = t[0].dims[0];
    let conv_state = Tensor { dtype, dims: vec![slots, a.ssm.dim, a.width - 1], data: a.conv_state };
    let weight = Tensor { dtype: conv_dtype, dims: vec![a.ssm.dim, a.width], data: a.conv_weight as *mut c_void };
    let bias = Tensor { dtype: conv_dtype, dims: vec![a.ssm.dim], data: a.conv_bias as *mut c_void };
    let step = validate(&DecodeArgs {
        x: u.x,
        conv_state: &conv_state,
        conv_weight: &weight,
        conv_bias: some(&bias),
        ssm_state: u.state,
        dt: u.dt,
        a: u.a,
        b: u.b,
        c: u.c,
        d: u.d,
        z: u.z,
        dt_bias: u.dt_bias,
        state_batch_indices: u.state_batch_indices,
        out: u.out,
        conv_state_out: &conv_state,
        ssm_state_out: u.state,
        dt_softplus: a.ssm.dt_softplus,
    })?;
    run(&step, platform)
}

/// One decode token of the selective scan on host memory; `state` is updated in place.
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_state_update_host(args: *const XlaSsmStateUpdateArgs) -> XlaSsmStatus {
    call(|| state_update(args, Platform::Cpu))
}

/// One decode token of the selective scan on device memory, enqueued on `stream` (NULL: the legacy
/// default stream); `state` is updated in place. One kernel, no synchronization: capturable in CUDA
/// graphs. Out-of-range `state_batch_indices` are skipped, not checked (that would need a sync).
///
/// # Safety
/// As [`xla_ssm_selective_state_update_host`], with device pointers of the stream's context.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_state_update_cuda_launch(
    args: *const XlaSsmStateUpdateArgs,
    stream: *mut c_void,
) -> XlaSsmStatus {
    call(|| state_update(args, Platform::Cuda { stream }))
}

/// The fused decode step (conv update + SiLU + state update + gate) on host memory; `conv_state` and
/// the ssm state are updated in place.
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_mamba_decode_step_host(args: *const XlaSsmDecodeStepArgs) -> XlaSsmStatus {
    call(|| decode_step(args, Platform::Cpu))
}

/// The fused decode step on device memory, one kernel enqueued on `stream`; capturable in CUDA graphs.
///
/// # Safety
/// As [`xla_ssm_mamba_decode_step_host`], with device pointers of the stream's context.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_mamba_decode_step_cuda_launch(
    args: *const XlaSsmDecodeStepArgs,
    stream: *mut c_void,
) -> XlaSsmStatus {
    call(|| decode_step(args, Platform::Cuda { stream }))
}
