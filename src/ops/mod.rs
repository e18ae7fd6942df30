//! The operations: one module each, holding validated parameters, the CPU implementation and the
//! CUDA launch. Validation happens once, on [`Tensor`] descriptions that both the XLA handlers and
//! the C API build, so both hosts get the same checks and messages.

use crate::error::{Error, Result};
use crate::DType;
use std::ffi::c_void;

pub mod selective_scan;
pub mod ssd;

/// Where an operation runs.
#[derive(Debug, Clone, Copy)]
pub enum Platform {
    /// Host memory, this thread (plus the library's worker threads, which the call waits for).
    Cpu,
    /// Device memory; enqueued on this `CUstream` (null: the legacy default stream).
    Cuda { stream: *mut c_void },
}

/// A borrowed dense row-major array: what an XLA buffer or a C API argument describes.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub dtype: DType,
    pub dims: Vec<i64>,
    pub data: *mut c_void,
}

impl Tensor {
    pub fn numel(&self) -> i64 {
        self.dims.iter().product()
    }
}

/// Formats dims as `(2, 3, 4)`.
pub fn fmt_dims(dims: &[i64]) -> String {
    let inner: Vec<String> = dims.iter().map(i64::to_string).collect();
    if dims.len() == 1 {
        format!("({},)", inner[0])
    } else {
        format!("({})", inner.join(", "))
    }
}

/// Checks one operand: exact dims and one of the allowed dtypes. `what` names it in errors.
pub fn expect(t: &Tensor, what: &str, dims: &[i64], dims_meaning: &str, dtypes: &[DType]) -> Result<()> {
    if t.dims != dims {
        return Err(Error::invalid(format!(
            "{what}: expected shape {} {dims_meaning}, got {}",
            fmt_dims(dims),
            fmt_dims(&t.dims)
        )));
    }
    expect_dtype(t, what, dtypes)
}

pub fn expect_dtype(t: &Tensor, what: &str, dtypes: &[DType]) -> Result<()> {
    if !dtypes.contains(&t.dtype) {
        let names: Vec<String> = dtypes.iter().map(|d| d.name()).collect();
        return Err(Error::invalid(format!("{what}: expected dtype {}, got {}", names.join(" or "), t.dtype.name())));
    }
    Ok(())
}

pub fn expect_nonnull(t: &Tensor, what: &str) -> Result<()> {
    if t.data.is_null() && t.numel() > 0 {
        return Err(Error::invalid(format!("{what}: data pointer is null")));
    }
    Ok(())
}

// Decode-time operations (docs/decode.md).
pub mod args;
pub mod conv1d;
pub mod mamba_decode;
pub(crate) mod pool;
pub mod state_update;
