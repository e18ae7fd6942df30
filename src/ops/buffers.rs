//! The checks every call's buffers get once their shapes and dtypes are known, whatever the op and
//! the host: each data pointer aligned to its elements, and no result overlapping another buffer.
//! XLA's buffers always pass; a C caller's might not, and either fault would read or write memory
//! the call does not own.

use super::Tensor;
use crate::error::{Error, Result};

/// A named buffer of a call; `None` when the optional buffer is absent.
pub type Named<'a> = (&'a str, Option<&'a Tensor>);

/// Each present buffer's data is aligned to its element size, and each result's bytes overlap no
/// other buffer's, except a result that is exactly the operand of the same name (an in-place
/// state that XLA aliased). Empty buffers take no bytes and never overlap.
pub fn check_buffers(op: &str, operands: &[Named], results: &[Named]) -> Result<()> {
    let all: Vec<(&str, &str, &Tensor)> = operands
        .iter()
        .map(|&(n, t)| ("operand", n, t))
        .chain(results.iter().map(|&(n, t)| ("result", n, t)))
        .filter_map(|(kind, n, t)| t.filter(|t| !t.data.is_null()).map(|t| (kind, n, t)))
        .collect();
    for &(kind, name, t) in &all {
        let align = t.dtype.size_bytes() as usize;
        if align > 1 && !(t.data as usize).is_multiple_of(align) {
            return Err(Error::invalid(format!(
                "{op}: {kind} `{name}`: data pointer {:p} is not aligned to its {align}-byte {} elements",
                t.data,
                t.dtype.name()
            )));
        }
    }
    let span = |t: &Tensor| (t.data as usize, (t.numel() * t.dtype.size_bytes()) as usize);
    for (i, &(kind, name, t)) in all.iter().enumerate().filter(|(_, b)| b.0 == "result") {
        let (start, len) = span(t);
        for (j, &(other_kind, other, u)) in all.iter().enumerate() {
            let (other_start, other_len) = span(u);
            let disjoint = start.saturating_add(len) <= other_start || other_start.saturating_add(other_len) <= start;
            if i == j || len == 0 || other_len == 0 || disjoint {
                continue;
            }
            let in_place = other_kind == "operand" && other == name && (start, len) == (other_start, other_len);
            if !in_place {
                return Err(Error::invalid(format!("{op}: {kind} `{name}` overlaps {other_kind} `{other}`")));
            }
        }
    }
    Ok(())
}
