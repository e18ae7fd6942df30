//! The plain C API (`include/xla_ssm.h`) for hosts without XLA: the same validation and kernels as
//! the XLA targets, on host pointers (`*_host`) or device pointers and a `CUstream` (`*_cuda_launch`).
//! Every function returns an [`XlaSsmStatus`]; on failure [`xla_ssm_last_error`] tells why.

use crate::error::Error;
use crate::ops::selective_scan::{
    n_checkpoints, run_bwd, run_fwd, validate_bwd, validate_fwd, BwdArgs, FwdArgs, Inputs, Layout,
};
use crate::ops::{Platform, Tensor};
use crate::DType;
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Status codes returned by every function of the C API.
pub type XlaSsmStatus = i32;
pub const XLA_SSM_OK: XlaSsmStatus = 0;
pub const XLA_SSM_INVALID_ARGUMENT: XlaSsmStatus = 1;
pub const XLA_SSM_CUDA_ERROR: XlaSsmStatus = 2;
pub const XLA_SSM_UNIMPLEMENTED: XlaSsmStatus = 3;
pub const XLA_SSM_INTERNAL: XlaSsmStatus = 4;

/// Largest `dstate` the selective scan supports.
pub const XLA_SSM_MAX_DSTATE: i64 = 256;
const _: () = assert!(XLA_SSM_MAX_DSTATE == crate::ops::selective_scan::MAX_DSTATE);

/// Element types.
pub type XlaSsmDtype = i32;
pub const XLA_SSM_F32: XlaSsmDtype = 0;
pub const XLA_SSM_BF16: XlaSsmDtype = 1;
pub const XLA_SSM_F16: XlaSsmDtype = 2;

/// Layouts of u, delta, z, out (and time-varying B, C).
pub type XlaSsmLayout = i32;
/// u: (batch, dim, seqlen); B, C: (batch, groups, dstate, seqlen).
pub const XLA_SSM_LAYOUT_BDL: XlaSsmLayout = 0;
/// u: (batch, seqlen, dim); B, C: (batch, seqlen, groups, dstate).
pub const XLA_SSM_LAYOUT_BLD: XlaSsmLayout = 1;

/// Arguments of the forward selective scan (docs/selective_scan_fwd.md). Dense row-major arrays;
/// optional pointers may be NULL.
#[repr(C)]
pub struct XlaSsmSelectiveScanFwdArgs {
    pub batch: i64,
    pub dim: i64,
    pub seqlen: i64,
    /// 0..=256.
    pub dstate: i64,
    /// Groups of time-varying B/C (must divide dim); 0 means B and C are time-invariant (dim, dstate).
    pub groups: i64,
    /// dtype of u, delta, z and out.
    pub dtype: XlaSsmDtype,
    /// dtype of B and C: XLA_SSM_F32 or `dtype`.
    pub bc_dtype: XlaSsmDtype,
    pub layout: XlaSsmLayout,
    pub delta_softplus: bool,
    pub u: *const c_void,
    pub delta: *const c_void,
    /// (dim, dstate) f32.
    pub a: *const f32,
    pub b: *const c_void,
    pub c: *const c_void,
    /// (dim) f32, optional.
    pub d: *const f32,
    /// like u, optional.
    pub z: *const c_void,
    /// (dim) f32, optional.
    pub delta_bias: *const f32,
    /// (batch, dim, dstate) f32, optional.
    pub initial_state: *const f32,
    /// like u.
    pub out: *mut c_void,
    /// (batch, dim, dstate) f32.
    pub final_state: *mut f32,
    /// Optional device scratch of `workspace_bytes` bytes (see
    /// [`xla_ssm_selective_scan_fwd_workspace_bytes`]): with it the CUDA scan splits long sequences
    /// of a small batch x dim over the whole GPU. NULL / 0: no split. Unused on the host.
    pub workspace: *mut c_void,
    pub workspace_bytes: i64,
    /// Steps between the checkpoints the backward pass needs: 0 (none) or a positive multiple of 32.
    pub checkpoint_len: i64,
    /// (batch, dim, ceil(seqlen / checkpoint_len), dstate) f32, written when checkpoint_len > 0 (NULL
    /// otherwise): checkpoint k is the state entering step k * checkpoint_len.
    pub checkpoints: *mut f32,
}

/// Arguments of the backward selective scan (docs/selective_scan_bwd.md): the forward's inputs, its
/// checkpoints, the cotangents and the gradients. Dense row-major arrays; each gradient has its
/// primal's shape and dtype, and an optional one is given (non-NULL) exactly when its primal is.
#[repr(C)]
pub struct XlaSsmSelectiveScanBwdArgs {
    pub batch: i64,
    pub dim: i64,
    pub seqlen: i64,
    pub dstate: i64,
    /// As in [`XlaSsmSelectiveScanFwdArgs`]: 0 for time-invariant B/C.
    pub groups: i64,
    pub dtype: XlaSsmDtype,
    pub bc_dtype: XlaSsmDtype,
    pub layout: XlaSsmLayout,
    pub delta_softplus: bool,
    pub u: *const c_void,
    pub delta: *const c_void,
    pub a: *const f32,
    pub b: *const c_void,
    pub c: *const c_void,
    pub d: *const f32,
    pub z: *const c_void,
    pub delta_bias: *const f32,
    pub initial_state: *const f32,
    /// The forward's checkpoints and their spacing (a positive multiple of 32).
    pub checkpoint_len: i64,
    pub checkpoints: *const f32,
    /// Cotangent of out (like u).
    pub dout: *const c_void,
    /// Cotangent of final_state, (batch, dim, dstate) f32, optional.
    pub dfinal_state: *const f32,
    pub du: *mut c_void,
    pub ddelta: *mut c_void,
    pub da: *mut f32,
    pub db: *mut c_void,
    pub dc: *mut c_void,
    pub dd: *mut f32,
    pub dz: *mut c_void,
    pub ddelta_bias: *mut f32,
    pub dinitial_state: *mut f32,
    /// Device scratch of at least [`xla_ssm_selective_scan_bwd_workspace_bytes`] bytes: required by
    /// the CUDA backward, unused on the host.
    pub workspace: *mut c_void,
    pub workspace_bytes: i64,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let msg = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

/// The message of the last failed call on this thread ("" if none); valid until the next call.
#[no_mangle]
pub extern "C" fn xla_ssm_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The library version, e.g. "0.1.0".
#[no_mangle]
pub extern "C" fn xla_ssm_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// Number of usable CUDA devices (0 when the driver is missing or the build has no CUDA).
#[no_mangle]
pub extern "C" fn xla_ssm_cuda_device_count() -> i32 {
    #[cfg(feature = "cuda")]
    {
        catch_unwind(crate::cuda::device_count).unwrap_or(0) as i32
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

fn status_of(result: std::thread::Result<crate::error::Result<()>>) -> XlaSsmStatus {
    let err = match result {
        Ok(Ok(())) => {
            set_last_error("");
            return XLA_SSM_OK;
        }
        Ok(Err(e)) => e,
        Err(_) => Error::Internal("xla_ssm panicked (see stderr)".into()),
    };
    set_last_error(err.message());
    match err {
        Error::InvalidArgument(_) => XLA_SSM_INVALID_ARGUMENT,
        Error::Cuda(_) => XLA_SSM_CUDA_ERROR,
        Error::Unimplemented(_) => XLA_SSM_UNIMPLEMENTED,
        Error::Internal(_) => XLA_SSM_INTERNAL,
    }
}

fn dtype_of(op: &str, code: XlaSsmDtype, field: &str) -> crate::error::Result<DType> {
    match code {
        XLA_SSM_F32 => Ok(DType::F32),
        XLA_SSM_BF16 => Ok(DType::BF16),
        XLA_SSM_F16 => Ok(DType::F16),
        other => Err(Error::invalid(format!("{op}: `{field}`: unknown dtype code {other}"))),
    }
}

/// Tensor descriptions of the fields both argument structs share (sizes, dtypes, layout, inputs),
/// and the shapes of u and B: what [`Inputs`] borrows.
struct Described {
    dtype: DType,
    bc_dtype: DType,
    layout: Layout,
    delta_softplus: bool,
    x_dims: Vec<i64>,
    bc_dims: Vec<i64>,
    state_dims: Vec<i64>,
    per_channel: Vec<i64>,
    u: Tensor,
    delta: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    d: Tensor,
    z: Tensor,
    delta_bias: Tensor,
    initial_state: Tensor,
}

/// A [`Described`] of `$args` (either argument struct: they share these field names).
macro_rules! describe {
    ($op:expr, $args:expr) => {{
        let a = $args;
        let ptr = |p: *const c_void| p as *mut c_void;
        describe(
            $op,
            [a.batch, a.dim, a.seqlen, a.dstate, a.groups],
            [a.dtype, a.bc_dtype, a.layout],
            a.delta_softplus,
            [ptr(a.u), ptr(a.delta), ptr(a.a as *const c_void), ptr(a.b), ptr(a.c)],
            [
                ptr(a.d as *const c_void),
                ptr(a.z),
                ptr(a.delta_bias as *const c_void),
                ptr(a.initial_state as *const c_void),
            ],
        )
    }};
}

fn describe(
    op: &str,
    [batch, dim, seqlen, dstate, groups]: [i64; 5],
    [dtype, bc_dtype, layout]: [i32; 3],
    delta_softplus: bool,
    [u, delta, a, b, c]: [*mut c_void; 5],
    [d, z, delta_bias, initial_state]: [*mut c_void; 4],
) -> crate::error::Result<Described> {
    let dtype = dtype_of(op, dtype, "dtype")?;
    let bc_dtype = dtype_of(op, bc_dtype, "bc_dtype")?;
    let layout = match layout {
        XLA_SSM_LAYOUT_BDL => Layout::ChannelFirst,
        XLA_SSM_LAYOUT_BLD => Layout::ChannelLast,
        other => return Err(Error::invalid(format!("{op}: `layout`: unknown layout code {other}"))),
    };
    let x_dims = match layout {
        Layout::ChannelFirst => vec![batch, dim, seqlen],
        Layout::ChannelLast => vec![batch, seqlen, dim],
    };
    let bc_dims = match (groups, layout) {
        (0, _) => vec![dim, dstate],
        (g, Layout::ChannelFirst) => vec![batch, g, dstate, seqlen],
        (g, Layout::ChannelLast) => vec![batch, seqlen, g, dstate],
    };
    let (state_dims, per_channel) = (vec![batch, dim, dstate], vec![dim]);
    let t = |dtype, dims: &Vec<i64>, data| Tensor { dtype, dims: dims.clone(), data };
    Ok(Described {
        u: t(dtype, &x_dims, u),
        delta: t(dtype, &x_dims, delta),
        a: t(DType::F32, &vec![dim, dstate], a),
        b: t(bc_dtype, &bc_dims, b),
        c: t(bc_dtype, &bc_dims, c),
        d: t(DType::F32, &per_channel, d),
        z: t(dtype, &x_dims, z),
        delta_bias: t(DType::F32, &per_channel, delta_bias),
        initial_state: t(DType::F32, &state_dims, initial_state),
        dtype,
        bc_dtype,
        layout,
        delta_softplus,
        x_dims,
        bc_dims,
        state_dims,
        per_channel,
    })
}

/// `t` when its pointer is not NULL (the C API's way of leaving an optional array out).
fn some(t: &Tensor) -> Option<&Tensor> {
    (!t.data.is_null()).then_some(t)
}

impl Described {
    fn inputs(&self) -> Inputs<'_> {
        Inputs {
            u: &self.u,
            delta: &self.delta,
            a: &self.a,
            b: &self.b,
            c: &self.c,
            d: some(&self.d),
            z: some(&self.z),
            delta_bias: some(&self.delta_bias),
            initial_state: some(&self.initial_state),
            delta_softplus: self.delta_softplus,
            layout: self.layout,
        }
    }

    /// A tensor of `dims` and `dtype` at `data`.
    fn tensor(dtype: DType, dims: &[i64], data: *const c_void) -> Tensor {
        Tensor { dtype, dims: dims.to_vec(), data: data as *mut c_void }
    }
}

/// A byte workspace of `bytes` at `data`.
fn workspace(data: *mut c_void, bytes: i64) -> Tensor {
    Tensor { dtype: DType::Other(crate::xla::ffi::XLA_FFI_DATA_TYPE_U8), dims: vec![bytes.max(0)], data }
}

fn fwd(args: *const XlaSsmSelectiveScanFwdArgs, platform: Platform) -> crate::error::Result<()> {
    let op = "selective_scan_fwd";
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args.as_ref() }.ok_or_else(|| Error::invalid(format!("{op}: args is NULL")))?;
    let k = describe!(op, a)?;
    let t = Described::tensor;
    let out = t(k.dtype, &k.x_dims, a.out);
    let final_state = t(DType::F32, &k.state_dims, a.final_state as *const c_void);
    let checkpoints = Tensor {
        dtype: DType::F32,
        dims: vec![a.batch, a.dim, n_checkpoints(a.seqlen, a.checkpoint_len), a.dstate],
        data: a.checkpoints as *mut c_void,
    };
    let workspace = workspace(a.workspace, a.workspace_bytes);
    let fwd = validate_fwd(&FwdArgs {
        inputs: k.inputs(),
        out: &out,
        final_state: &final_state,
        checkpoints: some(&checkpoints),
        checkpoint_len: a.checkpoint_len,
        workspace: some(&workspace),
    })?;
    run_fwd(&fwd, platform)
}

fn bwd(args: *const XlaSsmSelectiveScanBwdArgs, platform: Platform) -> crate::error::Result<()> {
    let op = "selective_scan_bwd";
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args.as_ref() }.ok_or_else(|| Error::invalid(format!("{op}: args is NULL")))?;
    let k = describe!(op, a)?;
    let t = Described::tensor;
    let f32_at = |dims: &[i64], p: *const f32| t(DType::F32, dims, p as *const c_void);
    let checkpoints = f32_at(&[a.batch, a.dim, n_checkpoints(a.seqlen, a.checkpoint_len), a.dstate], a.checkpoints);
    let dout = t(k.dtype, &k.x_dims, a.dout);
    let dfinal_state = f32_at(&k.state_dims, a.dfinal_state);
    let (du, ddelta) = (t(k.dtype, &k.x_dims, a.du), t(k.dtype, &k.x_dims, a.ddelta));
    let da = f32_at(&[a.dim, a.dstate], a.da);
    let (db, dc) = (t(k.bc_dtype, &k.bc_dims, a.db), t(k.bc_dtype, &k.bc_dims, a.dc));
    let dd = f32_at(&k.per_channel, a.dd);
    let dz = t(k.dtype, &k.x_dims, a.dz);
    let ddelta_bias = f32_at(&k.per_channel, a.ddelta_bias);
    let dinitial_state = f32_at(&k.state_dims, a.dinitial_state);
    let workspace = workspace(a.workspace, a.workspace_bytes);
    let bwd = validate_bwd(&BwdArgs {
        inputs: k.inputs(),
        checkpoints: &checkpoints,
        checkpoint_len: a.checkpoint_len,
        dout: &dout,
        dfinal_state: some(&dfinal_state),
        du: &du,
        ddelta: &ddelta,
        da: &da,
        db: &db,
        dc: &dc,
        dd: some(&dd),
        dz: some(&dz),
        ddelta_bias: some(&ddelta_bias),
        dinitial_state: some(&dinitial_state),
        workspace: some(&workspace),
    })?;
    run_bwd(&bwd, platform)
}

/// Bytes of workspace that let the CUDA forward scan of this shape split its sequence (0: it never
/// does). Depends on the shape only.
#[no_mangle]
pub extern "C" fn xla_ssm_selective_scan_fwd_workspace_bytes(batch: i64, dim: i64, seqlen: i64, dstate: i64) -> i64 {
    crate::ops::selective_scan::workspace_bytes(batch.max(0), dim.max(0), seqlen.max(0), dstate.max(0))
}

/// Forward selective scan on host memory, on the calling thread (and worker threads it joins).
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_fwd_host(args: *const XlaSsmSelectiveScanFwdArgs) -> XlaSsmStatus {
    status_of(catch_unwind(AssertUnwindSafe(|| fwd(args, Platform::Cpu))))
}

/// Forward selective scan on device memory, enqueued on `stream` (a `CUstream`; NULL for the legacy
/// default stream of the current context). Returns once the kernel is enqueued; does not synchronize.
///
/// # Safety
/// As [`xla_ssm_selective_scan_fwd_host`], with device pointers of the stream's context.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_fwd_cuda_launch(
    args: *const XlaSsmSelectiveScanFwdArgs,
    stream: *mut c_void,
) -> XlaSsmStatus {
    status_of(catch_unwind(AssertUnwindSafe(|| fwd(args, Platform::Cuda { stream }))))
}

/// Bytes of device workspace the CUDA backward needs for this shape (`groups` = 0 for
/// time-invariant B/C). Depends on the shape only.
#[no_mangle]
pub extern "C" fn xla_ssm_selective_scan_bwd_workspace_bytes(
    batch: i64,
    dim: i64,
    seqlen: i64,
    dstate: i64,
    groups: i64,
) -> i64 {
    let (batch, dim, seqlen, dstate, groups) = (batch.max(0), dim.max(0), seqlen.max(0), dstate.max(0), groups.max(0));
    if groups > 0 && dim % groups != 0 {
        return 0;
    }
    crate::ops::selective_scan::bwd_workspace_bytes(batch, dim, seqlen, dstate, groups)
}

/// Backward selective scan on host memory, on the calling thread (and worker threads it joins).
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_bwd_host(args: *const XlaSsmSelectiveScanBwdArgs) -> XlaSsmStatus {
    status_of(catch_unwind(AssertUnwindSafe(|| bwd(args, Platform::Cpu))))
}

/// Backward selective scan on device memory, enqueued on `stream` (a `CUstream`; NULL for the
/// legacy default stream of the current context); needs the workspace. Returns once the work is
/// enqueued; does not synchronize.
///
/// # Safety
/// As [`xla_ssm_selective_scan_bwd_host`], with device pointers of the stream's context.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_bwd_cuda_launch(
    args: *const XlaSsmSelectiveScanBwdArgs,
    stream: *mut c_void,
) -> XlaSsmStatus {
    status_of(catch_unwind(AssertUnwindSafe(|| bwd(args, Platform::Cuda { stream }))))
}

// ---- Decode (docs/decode.md): the state update and the fused decode step, states in place.

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
fn update_tensors(a: &XlaSsmStateUpdateArgs) -> crate::error::Result<[Tensor; 11]> {
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
        t(DType::Other(crate::xla::ffi::XLA_FFI_DATA_TYPE_S32), &[a.batch], a.state_batch_indices as *const c_void),
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

fn state_update(args: *const XlaSsmStateUpdateArgs, platform: Platform) -> crate::error::Result<()> {
    use crate::ops::state_update::{run, validate};
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args.as_ref() }.ok_or_else(|| Error::invalid("selective_state_update: args is NULL"))?;
    let t = update_tensors(a)?;
    run(&validate(&update_args(&t, a.dt_softplus))?, platform)
}

fn decode_step(args: *const XlaSsmDecodeStepArgs, platform: Platform) -> crate::error::Result<()> {
    use crate::ops::mamba_decode::{run, validate, DecodeArgs};
    // SAFETY: as in `state_update`.
    let a = unsafe { args.as_ref() }.ok_or_else(|| Error::invalid("mamba_decode_step: args is NULL"))?;
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
    status_of(catch_unwind(AssertUnwindSafe(|| state_update(args, Platform::Cpu))))
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
    status_of(catch_unwind(AssertUnwindSafe(|| state_update(args, Platform::Cuda { stream }))))
}

/// The fused decode step (conv update + SiLU + state update + gate) on host memory; `conv_state` and
/// the ssm state are updated in place.
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_mamba_decode_step_host(args: *const XlaSsmDecodeStepArgs) -> XlaSsmStatus {
    status_of(catch_unwind(AssertUnwindSafe(|| decode_step(args, Platform::Cpu))))
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
    status_of(catch_unwind(AssertUnwindSafe(|| decode_step(args, Platform::Cuda { stream }))))
}

// ---- Mamba-2's chunked SSD scan (docs/ssd.md).

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
    /// (batch, heads, headdim, dstate) f32, optional.
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
    /// Device scratch of at least [`xla_ssm_ssd_fwd_workspace_bytes`] bytes: required by the CUDA
    /// forward, unused on the host.
    pub workspace: *mut c_void,
    pub workspace_bytes: i64,
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
    /// Device scratch of at least [`xla_ssm_ssd_bwd_workspace_bytes`] bytes: required by the CUDA
    /// backward, unused on the host.
    pub workspace: *mut c_void,
    pub workspace_bytes: i64,
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
        let state_dims = vec![batch, heads, headdim, dstate];
        let chunks = crate::ops::ssd::n_chunks(seqlen, a.chunk_size);
        let chunk_dims = vec![batch, heads, headdim, chunks, dstate];
        let t = Described::tensor;
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
            chunk_size: self.chunk_size,
            dt_softplus: self.dt_softplus,
            dt_min: self.dt_min,
            dt_max: self.dt_max,
        }
    }
}

fn ssd_fwd(args: *const XlaSsmSsdFwdArgs, platform: Platform) -> crate::error::Result<()> {
    use crate::ops::ssd::{run_fwd, validate_fwd, FwdArgs};
    let op = "ssd_fwd";
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args.as_ref() }.ok_or_else(|| Error::invalid(format!("{op}: args is NULL")))?;
    let k = describe_ssd!(op, a);
    let t = Described::tensor;
    let y = t(k.dtype, &k.x_dims, a.y);
    let final_states = t(DType::F32, &k.state_dims, a.final_states as *const c_void);
    let chunk_states = t(chunk_states_dtype(op, a.chunk_states_dtype, a.chunk_states)?, &k.chunk_dims, a.chunk_states);
    let workspace = workspace(a.workspace, a.workspace_bytes);
    let ssd = validate_fwd(&FwdArgs {
        inputs: k.inputs(),
        y: &y,
        final_states: &final_states,
        chunk_states: some(&chunk_states),
        workspace: some(&workspace),
    })?;
    run_fwd(&ssd, platform)
}

fn ssd_bwd(args: *const XlaSsmSsdBwdArgs, platform: Platform) -> crate::error::Result<()> {
    use crate::ops::ssd::{run_bwd, validate_bwd, BwdArgs};
    let op = "ssd_bwd";
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args.as_ref() }.ok_or_else(|| Error::invalid(format!("{op}: args is NULL")))?;
    let k = describe_ssd!(op, a);
    let t = Described::tensor;
    let f32_at = |dims: &[i64], p: *const f32| t(DType::F32, dims, p as *const c_void);
    let chunk_states = t(chunk_states_dtype(op, a.chunk_states_dtype, a.chunk_states)?, &k.chunk_dims, a.chunk_states);
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
/// ([`xla_ssm_ssd_chunk_states_dtype`]). Where the pointer is NULL the field is unused (any value).
fn chunk_states_dtype<P>(op: &str, code: XlaSsmDtype, ptr: *const P) -> crate::error::Result<DType> {
    if ptr.is_null() {
        return Ok(DType::F32);
    }
    dtype_of(op, code, "chunk_states_dtype")
}

/// The workspace-sizing shape, or None for an unknown dtype code.
fn ssd_shape(
    [batch, seqlen, heads, headdim, dstate, groups, chunk_size]: [i64; 7],
    dtype: XlaSsmDtype,
) -> Option<crate::ops::ssd::plan::Shape> {
    let elem_bytes = dtype_of("ssd", dtype, "dtype").ok()?.size_bytes();
    Some(crate::ops::ssd::plan::Shape { batch, seqlen, heads, headdim, dstate, groups, chunk_size, elem_bytes })
}

/// The dtype code of `chunk_states` for an SSD call of element type `dtype` (both targets, forward
/// and backward): `dtype` where the tensor-core kernels run (bf16 or f16, headdim 64, dstate 64 or
/// 128, chunk_size 64, 128 or 256), else XLA_SSM_F32; -1 for an unknown dtype code. Depends on
/// these values only (not on batch, seqlen, heads or groups).
#[no_mangle]
pub extern "C" fn xla_ssm_ssd_chunk_states_dtype(
    headdim: i64,
    dstate: i64,
    chunk_size: i64,
    dtype: XlaSsmDtype,
) -> XlaSsmDtype {
    let Ok(t) = dtype_of("ssd", dtype, "dtype") else { return -1 };
    match crate::ops::ssd::plan::chunk_states_dtype(t, headdim, dstate, chunk_size) {
        DType::F32 => XLA_SSM_F32,
        _ => dtype,
    }
}

/// Bytes of device workspace the CUDA SSD forward needs for this shape and dtype (0 for a shape or
/// dtype the call would refuse). Depends on these values only.
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
    ssd_shape([batch, seqlen, heads, headdim, dstate, groups, chunk_size], dtype)
        .map_or(0, |s| crate::ops::ssd::plan::fwd_workspace_bytes(&s))
}

/// Bytes of device workspace the CUDA SSD backward needs for this shape and dtype (0 for a shape or
/// dtype the call would refuse). Depends on these values only.
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
    ssd_shape([batch, seqlen, heads, headdim, dstate, groups, chunk_size], dtype)
        .map_or(0, |s| crate::ops::ssd::plan::bwd_workspace_bytes(&s))
}

/// The SSD forward on host memory, on the calling thread (and worker threads it joins).
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_fwd_host(args: *const XlaSsmSsdFwdArgs) -> XlaSsmStatus {
    status_of(catch_unwind(AssertUnwindSafe(|| ssd_fwd(args, Platform::Cpu))))
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
    status_of(catch_unwind(AssertUnwindSafe(|| ssd_fwd(args, Platform::Cuda { stream }))))
}

/// The SSD backward on host memory, on the calling thread (and worker threads it joins).
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_bwd_host(args: *const XlaSsmSsdBwdArgs) -> XlaSsmStatus {
    status_of(catch_unwind(AssertUnwindSafe(|| ssd_bwd(args, Platform::Cpu))))
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
    status_of(catch_unwind(AssertUnwindSafe(|| ssd_bwd(args, Platform::Cuda { stream }))))
}
