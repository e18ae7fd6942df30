//! The plain C API (`include/xla_ssm.h`) for hosts without XLA: the same validation and kernels as
//! the XLA targets, on host pointers (`*_host`) or device pointers and a `CUstream` (`*_cuda_launch`).
//! One file per operation; here, what they share: status and dtype codes, the thread's last error,
//! and the panic boundary every exported function runs behind ([`call`], [`size`], [`guard`]).
//! Every call returns an [`XlaSsmStatus`] (or, for sizers, -1) and on failure
//! [`xla_ssm_last_error`] tells why.

use crate::error::{Error, Result};
use crate::ops::Tensor;
use crate::DType;
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub mod decode;
pub mod selective_scan;
pub mod ssd;

pub use decode::*;
pub use selective_scan::*;
pub use ssd::*;

/// Status codes returned by every function of the C API.
pub type XlaSsmStatus = i32;
pub const XLA_SSM_OK: XlaSsmStatus = 0;
pub const XLA_SSM_INVALID_ARGUMENT: XlaSsmStatus = 1;
pub const XLA_SSM_CUDA_ERROR: XlaSsmStatus = 2;
pub const XLA_SSM_UNIMPLEMENTED: XlaSsmStatus = 3;
pub const XLA_SSM_INTERNAL: XlaSsmStatus = 4;

/// Element types.
pub type XlaSsmDtype = i32;
pub const XLA_SSM_F32: XlaSsmDtype = 0;
pub const XLA_SSM_BF16: XlaSsmDtype = 1;
pub const XLA_SSM_F16: XlaSsmDtype = 2;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let msg = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // A thread being torn down has no slot left; the message is then dropped.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = msg);
}

/// The message of the last failed call on this thread ("" if none); valid until the next call.
#[no_mangle]
pub extern "C" fn xla_ssm_last_error() -> *const c_char {
    guard(c"".as_ptr(), || LAST_ERROR.with(|e| e.borrow().as_ptr()))
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
        guard(0, || i32::try_from(crate::cuda::device_count()).unwrap_or(i32::MAX))
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// The panic boundary of an exported function: `body`'s value, or `fallback` if it panics (the
/// message then goes to [`xla_ssm_last_error`]). Nothing unwinds into the host.
pub(crate) fn guard<R>(fallback: R, body: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|panic| {
        set_last_error(&format!("xla_ssm panicked: {}", panic_message(&*panic)));
        fallback
    })
}

/// What a caught panic says.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic")
}

/// An exported call that returns a status: runs `body` behind the panic boundary and records its
/// error (or clears the last one).
pub(crate) fn call(body: impl FnOnce() -> Result<()>) -> XlaSsmStatus {
    guard(XLA_SSM_INTERNAL, || status(body()))
}

/// An exported size query: the size, or -1 with the reason in [`xla_ssm_last_error`].
pub(crate) fn size(body: impl FnOnce() -> Result<i64>) -> i64 {
    guard(-1, || match body() {
        Ok(bytes) => {
            set_last_error("");
            bytes
        }
        Err(e) => {
            set_last_error(e.message());
            -1
        }
    })
}

/// The status of `result`, recorded as the thread's last error.
pub(crate) fn status(result: Result<()>) -> XlaSsmStatus {
    let Err(err) = result else {
        set_last_error("");
        return XLA_SSM_OK;
    };
    set_last_error(err.message());
    match err {
        Error::InvalidArgument(_) => XLA_SSM_INVALID_ARGUMENT,
        Error::Cuda(_) => XLA_SSM_CUDA_ERROR,
        Error::Unimplemented(_) => XLA_SSM_UNIMPLEMENTED,
        Error::Internal(_) => XLA_SSM_INTERNAL,
    }
}

fn dtype_of(op: &str, code: XlaSsmDtype, field: &str) -> Result<DType> {
    match code {
        XLA_SSM_F32 => Ok(DType::F32),
        XLA_SSM_BF16 => Ok(DType::BF16),
        XLA_SSM_F16 => Ok(DType::F16),
        other => Err(Error::invalid(format!("{op}: `{field}`: unknown dtype code {other}"))),
    }
}

/// The caller's argument struct, or an error when the pointer is NULL.
///
/// # Safety
/// `args` is NULL or points at a valid `T`.
unsafe fn args_ref<'a, T>(op: &str, args: *const T) -> Result<&'a T> {
    args.as_ref().ok_or_else(|| Error::invalid(format!("{op}: args is NULL")))
}

/// A tensor of `dims` and `dtype` at `data`.
fn tensor(dtype: DType, dims: &[i64], data: *const c_void) -> Tensor {
    Tensor { dtype, dims: dims.to_vec(), data: data as *mut c_void }
}

/// `t` when its pointer is not NULL (the C API's way of leaving an optional array out).
fn some(t: &Tensor) -> Option<&Tensor> {
    (!t.data.is_null()).then_some(t)
}

/// A byte workspace of `bytes` at `data`.
fn workspace(data: *mut c_void, bytes: i64) -> Tensor {
    Tensor { dtype: DType::U8, dims: vec![bytes.max(0)], data }
}
