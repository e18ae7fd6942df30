//! Mamba-2's chunked SSD scan, C API (docs/ssd.md).

use super::{args_ref, call, dtype_of, guard, size, some, tensor, workspace, XlaSsmDtype, XlaSsmStatus, XLA_SSM_F32};
use crate::error::{Error, Result};
use crate::ops::{Platform, Tensor};
use crate::DType;
use std::ffi::c_void;

/// Arguments of the SSD forward (docs/ssd.md). Dense row-major arrays; optional pointers may be NULL.
#[repr(C)]
pub struct XlaSsmSsdFwdArgs {
    pub batch: i64,
    pub seqlen: i64,
    pub heads: i64,
    pub headdim: i64,
    /// 1..=256.
    pub dstate: i64,
    /// Groups of B and C (must divide heads; head h reads group h / (heads / groups)).
    pub groups: i64,
    /// 32, 64, 128 or 256: the spacing of `chunk_states`.
    pub chunk_size: i64,
    /// dtype of x, dt, B, C, z and y.
    pub dtype: XlaSsmDtype,
    /// D is (heads, headdim) rather than (heads).
    pub d_per_channel: bool,
    pub dt_softplus: bool,
    /// dt (after bias and softplus) is clamped to [dt_min, dt_max]; -INFINITY / INFINITY: no clamp.
    pub dt_min: f32,
    pub dt_max: f32,
    /// (batch, seqlen, heads, headdim).
    pub x: *const c_void,
    /// (batch, seqlen, heads).
    pub dt: *const c_void,
    /// (heads) f32.
    pub a: *const f32,
    /// (batch, seqlen, groups, dstate).
    pub b: *const c_void,
    pub c: *const c_void,
    /// (heads) or (heads, headdim) f32, optional.
    pub d: *const f32,
    /// like x, optional.
    pub z: *const c_void,
    /// (heads) f32, optional.
    pub dt_bias: *const f32,
    /// (batch, heads, headdim, dstate) f32, optional; (num_seqs, heads, headdim, dstate) with
    /// `cu_seqlens`, as are final_states (and the backward's dfinal_states, dinitial_states).
    pub initial_states: *const f32,
    /// like x.
    pub y: *mut c_void,
    /// (batch, heads, headdim, dstate) f32.
    pub final_states: *mut f32,
    /// (batch, heads, headdim, ceil(seqlen / chunk_size), dstate), optional: the state entering
    /// each chunk, which the backward needs.
    pub chunk_states: *mut c_void,
    /// dtype of `chunk_states`, ignored where it is NULL. Must be the one
    /// [`xla_ssm_ssd_chunk_states_dtype`] names (`dtype` where the tensor-core kernels run, else
    /// f32): any other is refused, so a buffer sized for another dtype is never written past.
    pub chunk_states_dtype: XlaSsmDtype,
    /// Device scratch of at least [`xla_ssm_ssd_fwd_workspace_bytes`] bytes
    /// ([`xla_ssm_ssd_packed_fwd_workspace_bytes`] with `cu_seqlens`): required by the CUDA
    /// forward, unused on the host.
    pub workspace: *mut c_void,
    pub workspace_bytes: i64,
    /// Packed sequences (docs/ssd.md): NULL, or int32 (num_seqs + 1) boundaries along seqlen of a
    /// batch-1 input; the states are then (num_seqs, heads, headdim, dstate).
    pub cu_seqlens: *const i32,
    pub num_seqs: i64,
}

/// Arguments of the SSD backward (docs/ssd.md): the forward's inputs and chunk_states, the
/// cotangents and the gradients. Each gradient has its primal's shape (dx, ddt, dB, dC, dz of
/// `dtype`; dA, dD, ddt_bias, dinitial_states f32), and an optional one is given exactly when its
/// primal is.
#[repr(C)]
pub struct XlaSsmSsdBwdArgs {
    pub batch: i64,
    pub seqlen: i64,
    pub heads: i64,
    pub headdim: i64,
    pub dstate: i64,
    pub groups: i64,
    pub chunk_size: i64,
    pub dtype: XlaSsmDtype,
    pub d_per_channel: bool,
    pub dt_softplus: bool,
    pub dt_min: f32,
    pub dt_max: f32,
    pub x: *const c_void,
    pub dt: *const c_void,
    pub a: *const f32,
    pub b: *const c_void,
    pub c: *const c_void,
    pub d: *const f32,
    pub z: *const c_void,
    pub dt_bias: *const f32,
    pub initial_states: *const f32,
    /// The forward's chunk_states, made with the same chunk_size.
    pub chunk_states: *const c_void,
    /// dtype of `chunk_states`: as in the forward ([`xla_ssm_ssd_chunk_states_dtype`]).
    pub chunk_states_dtype: XlaSsmDtype,
    /// Cotangent of y (like x).
    pub dy: *const c_void,
    /// Cotangent of final_states, optional.
    pub dfinal_states: *const f32,
    pub dx: *mut c_void,
    pub ddt: *mut c_void,
    pub da: *mut f32,
    pub db: *mut c_void,
    pub dc: *mut c_void,
    pub dd: *mut f32,
    pub dz: *mut c_void,
    pub ddt_bias: *mut f32,
    pub dinitial_states: *mut f32,
    /// Device scratch of at least [`xla_ssm_ssd_bwd_workspace_bytes`] bytes
    /// ([`xla_ssm_ssd_packed_bwd_workspace_bytes`] with `cu_seqlens`): required by the CUDA
    /// backward, unused on the host.
    pub workspace: *mut c_void,
    pub workspace_bytes: i64,
    /// As in [`XlaSsmSsdFwdArgs`].
    pub cu_seqlens: *const i32,
    pub num_seqs: i64,
}

/// Tensor descriptions of the fields both SSD argument structs share.
struct SsdDescribed {
    dtype: DType,
    x_dims: Vec<i64>,
    dt_dims: Vec<i64>,
    bc_dims: Vec<i64>,
    d_dims: Vec<i64>,
    state_dims: Vec<i64>,
    chunk_dims: Vec<i64>,
    x: Tensor,
    dt: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    d: Tensor,
    z: Tensor,
    dt_bias: Tensor,
    initial_states: Tensor,
    cu_seqlens: Tensor,
    chunk_size: i64,
    dt_softplus: bool,
    dt_min: f32,
    dt_max: f32,
}

/// An [`SsdDescribed`] of `$args` (either SSD argument struct: they share these field names).
macro_rules! describe_ssd {
    ($op:expr, $args:expr) => {{
        let a = $args;
        let dtype = dtype_of($op, a.dtype, "dtype")?;
        let [batch, seqlen, heads, headdim, dstate, groups] =
            [a.batch, a.seqlen, a.heads, a.headdim, a.dstate, a.groups];
        let x_dims = vec![batch, seqlen, heads, headdim];
        let dt_dims = vec![batch, seqlen, heads];
        let bc_dims = vec![batch, seqlen, groups, dstate];
        let d_dims = if a.d_per_channel { vec![heads, headdim] } else { vec![heads] };
        // Packed: a state row per sequence (num_seqs checked like a size before it is used).
        let packed = !a.cu_seqlens.is_null();
        if packed {
            crate::ops::check_sizes($op, &[("states", &[a.num_seqs, heads, headdim, dstate])])?;
        }
        let state_dims = vec![if packed { a.num_seqs } else { batch }, heads, headdim, dstate];
        let chunks = crate::ops::ssd::n_chunks(seqlen, a.chunk_size);
        let chunk_dims = vec![batch, heads, headdim, chunks, dstate];
        let t = tensor;
        let f32_at = |dims: &[i64], p: *const f32| t(DType::F32, dims, p as *const c_void);
        SsdDescribed {
            x: t(dtype, &x_dims, a.x),
            dt: t(dtype, &dt_dims, a.dt),
            a: f32_at(&[heads], a.a),
            b: t(dtype, &bc_dims, a.b),
            c: t(dtype, &bc_dims, a.c),
            d: f32_at(&d_dims, a.d),
            z: t(dtype, &x_dims, a.z),
            dt_bias: f32_at(&[heads], a.dt_bias),
            initial_states: f32_at(&state_dims, a.initial_states),
            cu_seqlens: t(DType::S32, &[a.num_seqs.saturating_add(1)], a.cu_seqlens as *const c_void),
            chunk_size: a.chunk_size,
            dt_softplus: a.dt_softplus,
            dt_min: a.dt_min,
            dt_max: a.dt_max,
            dtype,
            x_dims,
            dt_dims,
            bc_dims,
            d_dims,
            state_dims,
            chunk_dims,
        }
    }};
}

impl SsdDescribed {
    fn inputs(&self) -> crate::ops::ssd::Inputs<'_> {
        crate::ops::ssd::Inputs {
            x: &self.x,
            dt: &self.dt,
            a: &self.a,
            b: &self.b,
            c: &self.c,
            d: some(&self.d),
            z: some(&self.z),
            dt_bias: some(&self.dt_bias),
            initial_states: some(&self.initial_states),
            cu_seqlens: some(&self.cu_seqlens),
            chunk_size: self.chunk_size,
            dt_softplus: self.dt_softplus,
            dt_min: self.dt_min,
            dt_max: self.dt_max,
        }
    }
}

fn ssd_fwd(args: *const XlaSsmSsdFwdArgs, platform: Platform) -> Result<()> {
    use crate::ops::ssd::{run_fwd, validate_fwd, FwdArgs};
    let op = "ssd_fwd";
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args_ref(op, args) }?;
    let k = describe_ssd!(op, a);
    let t = tensor;
    let y = t(k.dtype, &k.x_dims, a.y);
    let final_states = t(DType::F32, &k.state_dims, a.final_states as *const c_void);
    let rule = crate::ops::ssd::plan::chunk_states_dtype(k.dtype, a.headdim, a.dstate, a.chunk_size);
    let chunk_states =
        t(chunk_states_dtype(op, a.chunk_states_dtype, a.chunk_states, rule)?, &k.chunk_dims, a.chunk_states);
    let workspace = workspace(a.workspace, a.workspace_bytes);
    let ssd = validate_fwd(&FwdArgs {
        inputs: k.inputs(),
        y: &y,
        final_states: &final_states,
        chunk_states: some(&chunk_states),
        workspace: some(&workspace),
        part_records: None,
    })?;
    run_fwd(&ssd, platform)
}

fn ssd_bwd(args: *const XlaSsmSsdBwdArgs, platform: Platform) -> Result<()> {
    use crate::ops::ssd::{run_bwd, validate_bwd, BwdArgs};
    let op = "ssd_bwd";
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args_ref(op, args) }?;
    let k = describe_ssd!(op, a);
    let t = tensor;
    let f32_at = |dims: &[i64], p: *const f32| t(DType::F32, dims, p as *const c_void);
    let rule = crate::ops::ssd::plan::chunk_states_dtype(k.dtype, a.headdim, a.dstate, a.chunk_size);
    let chunk_states =
        t(chunk_states_dtype(op, a.chunk_states_dtype, a.chunk_states, rule)?, &k.chunk_dims, a.chunk_states);
    let dy = t(k.dtype, &k.x_dims, a.dy);
    let dfinal_states = f32_at(&k.state_dims, a.dfinal_states);
    let (dx, ddt) = (t(k.dtype, &k.x_dims, a.dx), t(k.dtype, &k.dt_dims, a.ddt));
    let da = f32_at(&[a.heads], a.da);
    let (db, dc) = (t(k.dtype, &k.bc_dims, a.db), t(k.dtype, &k.bc_dims, a.dc));
    let dd = f32_at(&k.d_dims, a.dd);
    let dz = t(k.dtype, &k.x_dims, a.dz);
    let ddt_bias = f32_at(&[a.heads], a.ddt_bias);
    let dinitial_states = f32_at(&k.state_dims, a.dinitial_states);
    let workspace = workspace(a.workspace, a.workspace_bytes);
    let bwd = validate_bwd(&BwdArgs {
        inputs: k.inputs(),
        chunk_states: &chunk_states,
        dy: &dy,
        dfinal_states: some(&dfinal_states),
        dx: &dx,
        ddt: &ddt,
        da: &da,
        db: &db,
        dc: &dc,
        dd: some(&dd),
        dz: some(&dz),
        ddt_bias: some(&ddt_bias),
        dinitial_states: some(&dinitial_states),
        workspace: some(&workspace),
    })?;
    run_bwd(&bwd, platform)
}

/// The dtype a caller declares for `chunk_states`; validation then holds it to the rule
/// ([`xla_ssm_ssd_chunk_states_dtype`]). Where the pointer is NULL the field is unused (any value):
/// the rule's dtype stands in, so that the backward's validation names the NULL, not a dtype.
fn chunk_states_dtype<P>(op: &str, code: XlaSsmDtype, ptr: *const P, rule: DType) -> Result<DType> {
    if ptr.is_null() {
        return Ok(rule);
    }
    dtype_of(op, code, "chunk_states_dtype")
}

/// The workspace-sizing shape, its sizes checked as a call with them would be (before any
/// arithmetic).
fn ssd_shape(
    op: &str,
    [batch, seqlen, heads, headdim, dstate, groups, chunk_size]: [i64; 7],
    dtype: XlaSsmDtype,
) -> Result<crate::ops::ssd::plan::Shape> {
    use crate::ops::ssd::{CHUNK_SIZES, MAX_DSTATE};
    let elem_bytes = dtype_of(op, dtype, "dtype")?.size_bytes();
    crate::ops::check_sizes(
        op,
        &[
            ("x", &[batch, seqlen, heads, headdim]),
            ("B", &[batch, seqlen, groups, dstate]),
            ("states", &[batch, heads, headdim, dstate]),
        ],
    )?;
    if groups < 1 || heads % groups != 0 {
        return Err(Error::invalid(format!(
            "{op}: groups (= {groups}) must be at least 1 and divide heads (= {heads})"
        )));
    }
    if !(1..=MAX_DSTATE).contains(&dstate) {
        return Err(Error::invalid(format!("{op}: dstate must be in [1, {MAX_DSTATE}], got {dstate}")));
    }
    if !CHUNK_SIZES.contains(&chunk_size) {
        return Err(Error::invalid(format!("{op}: chunk_size must be one of {CHUNK_SIZES:?}, got {chunk_size}")));
    }
    Ok(crate::ops::ssd::plan::Shape { batch, seqlen, heads, headdim, dstate, groups, chunk_size, elem_bytes })
}

/// The dtype code of `chunk_states` for an SSD call of element type `dtype` (both targets, forward
/// and backward): `dtype` where the tensor-core kernels run (bf16 or f16, headdim at least 32,
/// dstate 1 to 256, chunk_size 64, 128 or 256), else XLA_SSM_F32; -1 for an unknown dtype code.
/// Depends on these values only (not on batch, seqlen, heads or groups).
#[no_mangle]
pub extern "C" fn xla_ssm_ssd_chunk_states_dtype(
    headdim: i64,
    dstate: i64,
    chunk_size: i64,
    dtype: XlaSsmDtype,
) -> XlaSsmDtype {
    guard(-1, || {
        let Ok(t) = dtype_of("ssd", dtype, "dtype") else { return -1 };
        match crate::ops::ssd::plan::chunk_states_dtype(t, headdim, dstate, chunk_size) {
            DType::F32 => XLA_SSM_F32,
            _ => dtype,
        }
    })
}

/// Bytes of device workspace the CUDA SSD forward needs for this shape and dtype; -1 for a shape or
/// dtype a call would refuse (`xla_ssm_last_error()` says why). Depends on these values only.
#[no_mangle]
pub extern "C" fn xla_ssm_ssd_fwd_workspace_bytes(
    batch: i64,
    seqlen: i64,
    heads: i64,
    headdim: i64,
    dstate: i64,
    groups: i64,
    chunk_size: i64,
    dtype: XlaSsmDtype,
) -> i64 {
    let op = "xla_ssm_ssd_fwd_workspace_bytes";
    size(|| {
        let shape = ssd_shape(op, [batch, seqlen, heads, headdim, dstate, groups, chunk_size], dtype)?;
        Ok(crate::ops::ssd::plan::fwd_workspace_bytes(&shape))
    })
}

/// f32s of the part records `xla_ssm_ssd_part_records` makes for this shape and dtype (its
/// `part_records` result), 0 where the target refuses the shape (docs/ssd.md, "Part records"); -1
/// for a shape or dtype every call would refuse (`xla_ssm_last_error()` says why).
#[no_mangle]
pub extern "C" fn xla_ssm_ssd_part_records_floats(
    batch: i64,
    seqlen: i64,
    heads: i64,
    headdim: i64,
    dstate: i64,
    groups: i64,
    chunk_size: i64,
    dtype: XlaSsmDtype,
) -> i64 {
    let op = "xla_ssm_ssd_part_records_floats";
    size(|| {
        let shape = ssd_shape(op, [batch, seqlen, heads, headdim, dstate, groups, chunk_size], dtype)?;
        Ok(crate::ops::ssd::plan::part_records_floats(&shape))
    })
}

/// Bytes of device workspace the CUDA SSD backward needs for this shape and dtype; -1 for a shape or
/// dtype a call would refuse (`xla_ssm_last_error()` says why). Depends on these values only.
#[no_mangle]
pub extern "C" fn xla_ssm_ssd_bwd_workspace_bytes(
    batch: i64,
    seqlen: i64,
    heads: i64,
    headdim: i64,
    dstate: i64,
    groups: i64,
    chunk_size: i64,
    dtype: XlaSsmDtype,
) -> i64 {
    let op = "xla_ssm_ssd_bwd_workspace_bytes";
    size(|| {
        let shape = ssd_shape(op, [batch, seqlen, heads, headdim, dstate, groups, chunk_size], dtype)?;
        Ok(crate::ops::ssd::plan::bwd_workspace_bytes(&shape))
    })
}

/// The workspace-sizing shape of a packed call (batch 1), its sizes checked as a call with them
/// would be.
fn packed_shape(
    op: &str,
    [seqlen, num_seqs, heads, headdim, dstate, groups, chunk_size]: [i64; 7],
    dtype: XlaSsmDtype,
) -> Result<crate::ops::ssd::plan::Shape> {
    crate::ops::check_sizes(op, &[("states", &[num_seqs, heads, headdim, dstate])])?;
    ssd_shape(op, [1, seqlen, heads, headdim, dstate, groups, chunk_size], dtype)
}

/// Bytes of device workspace the CUDA SSD forward needs for a packed call (`cu_seqlens` of
/// num_seqs sequences along seqlen, batch 1) of this shape and dtype; -1 for a shape or dtype a
/// call would refuse (`xla_ssm_last_error()` says why). Depends on these values only.
#[no_mangle]
pub extern "C" fn xla_ssm_ssd_packed_fwd_workspace_bytes(
    seqlen: i64,
    num_seqs: i64,
    heads: i64,
    headdim: i64,
    dstate: i64,
    groups: i64,
    chunk_size: i64,
    dtype: XlaSsmDtype,
) -> i64 {
    let op = "xla_ssm_ssd_packed_fwd_workspace_bytes";
    size(|| {
        let shape = packed_shape(op, [seqlen, num_seqs, heads, headdim, dstate, groups, chunk_size], dtype)?;
        Ok(crate::ops::ssd::plan::packed_fwd_workspace_bytes(&shape, num_seqs))
    })
}

/// Bytes of device workspace the CUDA SSD backward needs for a packed call of this shape and dtype
/// (as [`xla_ssm_ssd_packed_fwd_workspace_bytes`]); -1 for a shape or dtype a call would refuse.
#[no_mangle]
pub extern "C" fn xla_ssm_ssd_packed_bwd_workspace_bytes(
    seqlen: i64,
    num_seqs: i64,
    heads: i64,
    headdim: i64,
    dstate: i64,
    groups: i64,
    chunk_size: i64,
    dtype: XlaSsmDtype,
) -> i64 {
    let op = "xla_ssm_ssd_packed_bwd_workspace_bytes";
    size(|| {
        let shape = packed_shape(op, [seqlen, num_seqs, heads, headdim, dstate, groups, chunk_size], dtype)?;
        Ok(crate::ops::ssd::plan::packed_bwd_workspace_bytes(&shape))
    })
}

/// The SSD forward on host memory, on the calling thread (and worker threads it joins).
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_fwd_host(args: *const XlaSsmSsdFwdArgs) -> XlaSsmStatus {
    call(|| ssd_fwd(args, Platform::Cpu))
}

/// The SSD forward on device memory, enqueued on `stream` (a `CUstream`; NULL for the legacy
/// default stream of the current context); needs the workspace. Does not synchronize.
///
/// # Safety
/// As [`xla_ssm_ssd_fwd_host`], with device pointers of the stream's context.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_fwd_cuda_launch(
    args: *const XlaSsmSsdFwdArgs,
    stream: *mut c_void,
) -> XlaSsmStatus {
    call(|| ssd_fwd(args, Platform::Cuda { stream }))
}

/// The SSD backward on host memory, on the calling thread (and worker threads it joins).
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_bwd_host(args: *const XlaSsmSsdBwdArgs) -> XlaSsmStatus {
    call(|| ssd_bwd(args, Platform::Cpu))
}

/// The SSD backward on device memory, enqueued on `stream` (NULL: the legacy default stream); needs
/// the workspace. Does not synchronize.
///
/// # Safety
/// As [`xla_ssm_ssd_bwd_host`], with device pointers of the stream's context.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_bwd_cuda_launch(
    args: *const XlaSsmSsdBwdArgs,
    stream: *mut c_void,
) -> XlaSsmStatus {
    call(|| ssd_bwd(args, Platform::Cuda { stream }))
}
