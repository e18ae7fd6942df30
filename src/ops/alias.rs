//! In-place operands (decode states): whether XLA aliased a result to its operand.

use super::Tensor;
use crate::error::{Error, Result};

/// How an in-place operand reaches its result buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alias {
    /// XLA aliased them (`input_output_aliases`): the result is the operand's buffer; update it.
    InPlace,
    /// Distinct buffers: the operand is copied into the result first, which is then updated.
    Copy,
}

/// Whether `result` is `operand`'s buffer. Distinct buffers that overlap partially would make
/// either strategy write the wrong memory: refused.
pub fn alias(op: &str, name: &str, operand: &Tensor, result: &Tensor) -> Result<Alias> {
    if operand.data == result.data {
        return Ok(Alias::InPlace);
    }
    let bytes = operand.numel() * operand.dtype.size_bytes();
    let (a, b) = (operand.data as usize, result.data as usize);
    if bytes > 0 && a < b + bytes as usize && b < a + bytes as usize {
        return Err(Error::invalid(format!(
            "{op}: result `{name}` overlaps operand `{name}` without being the same buffer"
        )));
    }
    Ok(Alias::Copy)
}

/// The copy a call whose in-place state XLA did not alias makes first: the operand's bytes into
/// the result, which the kernel then updates.
#[derive(Debug, Clone, Copy)]
pub struct StateCopy {
    pub from: *const std::ffi::c_void,
    pub to: *mut std::ffi::c_void,
    pub bytes: usize,
}

impl StateCopy {
    /// The copy of `bytes` from `from` to `to`, when `alias` says there is one to make.
    pub(crate) fn of(
        alias: Alias,
        from: *const std::ffi::c_void,
        to: *mut std::ffi::c_void,
        bytes: usize,
    ) -> Option<StateCopy> {
        (alias == Alias::Copy).then_some(StateCopy { from, to, bytes })
    }

    /// Makes the copy in host memory.
    ///
    /// # Safety
    /// `from` and `to` address distinct host buffers of at least `bytes` bytes (as validation
    /// checked for the buffers this copy was made from).
    pub(crate) unsafe fn on_host(self) {
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(self.from as *const u8, self.to as *mut u8, self.bytes) }
    }
}
