//! Operand decoding shared by the decode-time targets (state update, conv1d, fused step): required
//! operands first, then the optional ones that their `has_<name>` attributes say are present, in a
//! fixed order; and the in-place (aliased) results.

use super::Tensor;
use crate::error::{Error, Result};
use crate::xla::frame::Frame;

/// Prefixes an error with the operation's name (frame errors do not know it).
pub fn prefixed(op: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::InvalidArgument(m) if !m.starts_with(op) => Error::InvalidArgument(format!("{op}: {m}")),
        other => other,
    }
}

/// The operands of one call: `required` in order, then each of `optional` when `has_<lowercase name>`
/// is true. Returns the required tensors and one `Option` per optional name.
pub fn operands(
    frame: &Frame,
    op: &str,
    required: &[&str],
    optional: &[&str],
) -> Result<(Vec<Tensor>, Vec<Option<Tensor>>)> {
    let pre = prefixed(op);
    let mut present = Vec::with_capacity(optional.len());
    for name in optional {
        present.push(frame.attr_bool(&format!("has_{}", name.to_lowercase())).map_err(&pre)?);
    }
    let mut names: Vec<&str> = required.to_vec();
    names.extend(optional.iter().zip(&present).filter(|(_, p)| **p).map(|(n, _)| *n));
    if frame.num_args() != names.len() {
        return Err(Error::invalid(format!(
            "{op}: expected {} operands ({}) as the has_* attributes say, got {}",
            names.len(),
            names.join(", "),
            frame.num_args()
        )));
    }
    let mut tensors =
        names.iter().enumerate().map(|(i, n)| frame.arg(i, n)).collect::<Result<Vec<_>>>().map_err(&pre)?;
    let mut opt: Vec<Option<Tensor>> = Vec::with_capacity(optional.len());
    let tail = tensors.split_off(required.len());
    let mut tail = tail.into_iter();
    for p in present {
        opt.push(if p { tail.next() } else { None });
    }
    Ok((tensors, opt))
}

/// The results of one call, named; their count must be `names.len()`.
pub fn results(frame: &Frame, op: &str, names: &[&str]) -> Result<Vec<Tensor>> {
    if frame.num_rets() != names.len() {
        return Err(Error::invalid(format!(
            "{op}: expected {} results ({}), got {}",
            names.len(),
            names.join(", "),
            frame.num_rets()
        )));
    }
    names.iter().enumerate().map(|(i, n)| frame.ret(i, n)).collect::<Result<Vec<_>>>().map_err(prefixed(op))
}

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
