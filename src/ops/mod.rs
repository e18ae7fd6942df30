//! The operations: one module each, holding validated parameters, the CPU implementation and the
//! CUDA launch. Validation happens once, on [`Tensor`] descriptions that both the XLA handlers and
//! the C API build, so both hosts get the same checks and messages.

use crate::error::{Error, Result};
use crate::DType;
use std::ffi::c_void;

/// Declares a validated call: a struct whose fields are private, with a getter each. Only the
/// op's `validate` can build one, so a backend that holds one holds parameters that passed every
/// check (what the `unsafe` kernel launches rely on).
macro_rules! validated {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        pub struct $name { $($(#[$fmeta])* $field: $ty,)* }
        impl $name {
            $($(#[$fmeta])* pub fn $field(&self) -> $ty { self.$field })*
        }
    };
}

pub mod selective_scan;
pub mod signature;
pub mod ssd;

/// Where a forward call's first-pass records come from (the scan's chunk records, SSD's part
/// records: the split's first pass, which a seqlen-sharded forward runs before its exchange).
#[derive(Debug, Clone, Copy)]
pub enum Records {
    /// The forward's own first pass makes them (in its workspace).
    Made,
    /// Made beforehand by the records call on the same inputs (an operand): the split reads them.
    Given(*const f32),
    /// A records call: the records (and, for SSD, the end states) are all it writes.
    Only(*mut f32),
}

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

/// Most elements any one array may have: 2^48 (a petabyte of f32, far past any device). Every size
/// the library derives (workspaces, offsets) is a product of such counts with factors below 2^13,
/// so with this bound checked first none of that arithmetic can overflow an i64.
pub const MAX_ELEMENTS: i64 = 1 << 48;

/// Checks caller-given sizes before any arithmetic on them: each named shape has non-negative dims
/// whose product is at most [`MAX_ELEMENTS`].
pub fn check_sizes(op: &str, shapes: &[(&str, &[i64])]) -> Result<()> {
    for (name, dims) in shapes {
        check_elements(&format!("{op}: `{name}`"), dims)?;
    }
    Ok(())
}

/// `dims` are non-negative and the product of the nonzero ones is at most [`MAX_ELEMENTS`] (so that
/// no product of some of them can overflow, even where another is 0); `what` names the array.
pub fn check_elements(what: &str, dims: &[i64]) -> Result<()> {
    if let Some(d) = dims.iter().find(|&&d| d < 0) {
        return Err(Error::invalid(format!("{what}: sizes must be non-negative, got {d}")));
    }
    let fits = dims.iter().try_fold(1i64, |n, &d| n.checked_mul(d.max(1)).filter(|&n| n <= MAX_ELEMENTS));
    if fits.is_none() {
        return Err(Error::invalid(format!(
            "{what} of shape {} is too large: its nonzero sizes multiply to more than 2^48",
            fmt_dims(dims)
        )));
    }
    Ok(())
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
    check_elements(what, &t.dims)?;
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
pub mod alias;
pub mod buffers;
pub mod conv1d;
pub mod mamba_decode;
pub mod state_update;
