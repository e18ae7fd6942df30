//! Operands and results of call frames, shared by the targets: counted and named as the
//! attributes say (required operands first, then the optional ones whose `has_<name>` attributes
//! say they are present, in a fixed order), with errors prefixed by the operation.

use super::frame::Frame;
use crate::error::{Error, Result};
use crate::ops::Tensor;

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

/// Names errors from frame decoding with `op` (validation's own messages already do).
pub fn prefixed(op: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::InvalidArgument(m) if !m.starts_with(op) => Error::InvalidArgument(format!("{op}: {m}")),
        other => other,
    }
}

/// Decodes the operands of `names` (checking their count) and returns them with a lookup by name.
pub fn frame_operands(frame: &Frame, op: &'static str, names: &[&'static str]) -> Result<Vec<Tensor>> {
    if frame.num_args() != names.len() {
        return Err(Error::invalid(format!(
            "{op}: expected {} operands ({}) as the attributes say, got {}",
            names.len(),
            names.join(", "),
            frame.num_args()
        )));
    }
    names.iter().enumerate().map(|(i, n)| frame.arg(i, n)).collect::<Result<_>>().map_err(prefixed(op))
}

/// The results of `names` (optional ones absent), then an optional `workspace`.
pub fn frame_results(frame: &Frame, op: &'static str, names: &[&'static str]) -> Result<(Vec<Tensor>, Option<Tensor>)> {
    let n = names.len();
    if frame.num_rets() != n && frame.num_rets() != n + 1 {
        return Err(Error::invalid(format!(
            "{op}: expected {n} or {} results ({}[, workspace]) as the attributes say, got {}",
            n + 1,
            names.join(", "),
            frame.num_rets()
        )));
    }
    let prefix = prefixed(op);
    let rets: Vec<Tensor> =
        names.iter().enumerate().map(|(i, r)| frame.ret(i, r)).collect::<Result<_>>().map_err(&prefix)?;
    let workspace = if frame.num_rets() == n + 1 { Some(frame.ret(n, "workspace").map_err(&prefix)?) } else { None };
    Ok((rets, workspace))
}

pub fn find<'t>(names: &[&str], tensors: &'t [Tensor], name: &str) -> Option<&'t Tensor> {
    names.iter().position(|n| *n == name).map(|i| &tensors[i])
}
