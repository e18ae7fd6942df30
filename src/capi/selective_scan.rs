//! The selective scan's C API (docs/selective_scan_fwd.md, docs/selective_scan_bwd.md).

use super::{args_ref, call, dtype_of, size, some, tensor, workspace, XlaSsmDtype, XlaSsmStatus};
use crate::error::{Error, Result};
use crate::ops::selective_scan::{
    n_checkpoints, run_bwd, run_fwd, validate_bwd, validate_fwd, BwdArgs, FwdArgs, Inputs, Layout,
};
use crate::ops::{Platform, Tensor};
use crate::DType;
use std::ffi::c_void;

/// Largest `dstate` the selective scan supports.
pub const XLA_SSM_MAX_DSTATE: i64 = 256;
const _: () = assert!(XLA_SSM_MAX_DSTATE == crate::ops::selective_scan::MAX_DSTATE);

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
    /// Packed sequences (docs/selective_scan_fwd.md): NULL, or int32 (num_seqs + 1) boundaries along
    /// seqlen of a batch-1 input; the states are then (num_seqs, dim, dstate).
    pub cu_seqlens: *const i32,
    pub num_seqs: i64,
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
    /// As in [`XlaSsmSelectiveScanFwdArgs`].
    pub cu_seqlens: *const i32,
    pub num_seqs: i64,
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
    cu_seqlens: Tensor,
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
            (a.cu_seqlens, a.num_seqs),
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
    (cu_seqlens, num_seqs): (*const i32, i64),
) -> Result<Described> {
    check_scan_sizes(op, [batch, dim, seqlen, dstate, groups])?;
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
    if !cu_seqlens.is_null() {
        crate::ops::check_sizes(op, &[("state", &[num_seqs, dim, dstate])])?;
    }
    let state_rows = if cu_seqlens.is_null() { batch } else { num_seqs };
    let (state_dims, per_channel) = (vec![state_rows, dim, dstate], vec![dim]);
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
        cu_seqlens: t(DType::S32, &vec![num_seqs.saturating_add(1)], cu_seqlens as *mut c_void),
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
            cu_seqlens: some(&self.cu_seqlens),
            delta_softplus: self.delta_softplus,
            layout: self.layout,
        }
    }
}

fn fwd(args: *const XlaSsmSelectiveScanFwdArgs, platform: Platform) -> Result<()> {
    let op = "selective_scan_fwd";
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args_ref(op, args) }?;
    let k = describe!(op, a)?;
    let t = tensor;
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
        chunk_records: None,
    })?;
    run_fwd(&fwd, platform)
}

fn bwd(args: *const XlaSsmSelectiveScanBwdArgs, platform: Platform) -> Result<()> {
    let op = "selective_scan_bwd";
    // SAFETY: the caller passes a valid struct (or NULL, refused here).
    let a = unsafe { args_ref(op, args) }?;
    let k = describe!(op, a)?;
    let t = tensor;
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

/// The sizes a sizer is given, checked as a call with them would be (before any arithmetic).
fn check_scan_sizes(op: &str, [batch, dim, seqlen, dstate, groups]: [i64; 5]) -> Result<()> {
    use crate::ops::selective_scan::MAX_DSTATE;
    if dstate > MAX_DSTATE {
        return Err(Error::invalid(format!("{op}: dstate must be at most {MAX_DSTATE}, got {dstate}")));
    }
    crate::ops::check_sizes(op, &[("u", &[batch, dim, seqlen]), ("state", &[batch, dim, dstate])])?;
    if groups < 0 || (groups > 0 && dim % groups != 0) {
        return Err(Error::invalid(format!("{op}: groups (= {groups}) must be 0 or divide dim (= {dim})")));
    }
    crate::ops::check_sizes(op, &[("B", &[batch, groups, dstate, seqlen])])
}

/// Bytes of workspace that let the CUDA forward scan of this shape split its sequence (0: it never
/// does); -1 for sizes a call would refuse (`xla_ssm_last_error()` says why). Depends on the shape
/// only.
#[no_mangle]
pub extern "C" fn xla_ssm_selective_scan_fwd_workspace_bytes(batch: i64, dim: i64, seqlen: i64, dstate: i64) -> i64 {
    let op = "xla_ssm_selective_scan_fwd_workspace_bytes";
    size(|| {
        check_scan_sizes(op, [batch, dim, seqlen, dstate, 0])?;
        Ok(crate::ops::selective_scan::workspace_bytes(batch, dim, seqlen, dstate))
    })
}

/// Chunks of the records `xla_ssm_selective_scan_chunk_records` makes for this shape (the CUDA
/// forward's sequence split; 1 where it never splits); -1 for sizes a call would refuse
/// (`xla_ssm_last_error()` says why). Its result is (chunks, batch, dim,
/// [`xla_ssm_selective_scan_chunk_record_floats`]) f32.
#[no_mangle]
pub extern "C" fn xla_ssm_selective_scan_chunk_records_count(batch: i64, dim: i64, seqlen: i64, dstate: i64) -> i64 {
    let op = "xla_ssm_selective_scan_chunk_records_count";
    size(|| {
        check_scan_sizes(op, [batch, dim, seqlen, dstate, 0])?;
        Ok(crate::ops::selective_scan::chunk_records_count(batch, dim, seqlen))
    })
}

/// f32s of one chunk record at this dstate: the end state padded to the CUDA kernel's states, then
/// the sum of dt; -1 for a dstate a call would refuse.
#[no_mangle]
pub extern "C" fn xla_ssm_selective_scan_chunk_record_floats(dstate: i64) -> i64 {
    let op = "xla_ssm_selective_scan_chunk_record_floats";
    size(|| {
        check_scan_sizes(op, [1, 1, 1, dstate, 0])?;
        Ok(crate::ops::selective_scan::split_record_floats(dstate))
    })
}

/// Forward selective scan on host memory, on the calling thread (and worker threads it joins).
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_fwd_host(args: *const XlaSsmSelectiveScanFwdArgs) -> XlaSsmStatus {
    call(|| fwd(args, Platform::Cpu))
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
    call(|| fwd(args, Platform::Cuda { stream }))
}

/// Bytes of device workspace the CUDA backward needs for this shape (`groups` = 0 for
/// time-invariant B/C); -1 for sizes a call would refuse (`xla_ssm_last_error()` says why).
/// Depends on the shape only.
#[no_mangle]
pub extern "C" fn xla_ssm_selective_scan_bwd_workspace_bytes(
    batch: i64,
    dim: i64,
    seqlen: i64,
    dstate: i64,
    groups: i64,
) -> i64 {
    let op = "xla_ssm_selective_scan_bwd_workspace_bytes";
    size(|| {
        check_scan_sizes(op, [batch, dim, seqlen, dstate, groups])?;
        Ok(crate::ops::selective_scan::bwd_workspace_bytes(batch, dim, seqlen, dstate, groups))
    })
}

/// Backward selective scan on host memory, on the calling thread (and worker threads it joins).
///
/// # Safety
/// `args` points at a valid struct whose pointers address arrays of the sizes it describes.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_bwd_host(args: *const XlaSsmSelectiveScanBwdArgs) -> XlaSsmStatus {
    call(|| bwd(args, Platform::Cpu))
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
    call(|| bwd(args, Platform::Cuda { stream }))
}
