//! Operands and results of call frames, decoded by the target's [`Signature`]: the attributes say
//! which optional ones are present, the frame must have exactly those (plus, where the target takes
//! one, a trailing workspace result), and no attribute the target does not read.

use super::frame::Frame;
use crate::error::{Error, Result};
use crate::ops::signature::{Arg, Signature, When};
use crate::ops::Tensor;

/// A call frame's buffers, by the names of its target's signature.
pub struct Call {
    operands: Vec<(&'static str, Tensor)>,
    results: Vec<(&'static str, Tensor)>,
    /// The scratch result, where the target takes one and the call passes it.
    pub workspace: Option<Tensor>,
}

impl Call {
    pub fn decode(frame: &Frame, sig: &Signature) -> Result<Call> {
        let op = sig.op;
        let pre = prefixed(op);
        let names = frame.attr_names();
        // A misspelt attribute is reported as the one the call lacks, where that is required.
        if let Some(missing) = sig.attrs.iter().find(|a| !a.optional && !names.iter().any(|n| n == a.name)) {
            return Err(Error::invalid(format!(
                "{op}: attribute `{}` is missing (the call has: [{}])",
                missing.name,
                names.join(", ")
            )));
        }
        for name in names {
            if !sig.attrs.iter().any(|a| a.name == name) {
                let known: Vec<&str> = sig.attrs.iter().map(|a| a.name).collect();
                return Err(Error::invalid(format!(
                    "{op}: unknown attribute `{name}` (the target reads: {})",
                    known.join(", ")
                )));
            }
        }
        let operand_names = present(frame, sig, sig.operands).map_err(&pre)?;
        let result_names = present(frame, sig, sig.results).map_err(&pre)?;
        if frame.num_args() != operand_names.len() {
            return Err(Error::invalid(format!(
                "{op}: expected {} operands ({}) as the attributes say, got {}",
                operand_names.len(),
                operand_names.join(", "),
                frame.num_args()
            )));
        }
        let n = result_names.len();
        let counts = frame.num_rets() == n || (sig.workspace && frame.num_rets() == n + 1);
        if !counts {
            let (expected, tail) =
                if sig.workspace { (format!("{n} or {}", n + 1), "[, workspace]") } else { (n.to_string(), "") };
            return Err(Error::invalid(format!(
                "{op}: expected {expected} results ({}{tail}) as the attributes say, got {}",
                result_names.join(", "),
                frame.num_rets()
            )));
        }
        let operands = (operand_names.iter().enumerate())
            .map(|(i, &name)| Ok((name, frame.arg(i, name)?)))
            .collect::<Result<_>>()
            .map_err(&pre)?;
        let results = (result_names.iter().enumerate())
            .map(|(i, &name)| Ok((name, frame.ret(i, name)?)))
            .collect::<Result<_>>()
            .map_err(&pre)?;
        let workspace = if frame.num_rets() == n + 1 { Some(frame.ret(n, "workspace").map_err(&pre)?) } else { None };
        Ok(Call { operands, results, workspace })
    }

    /// The operand `name`, if the call has it.
    pub fn operand(&self, name: &str) -> Option<&Tensor> {
        self.operands.iter().find(|(n, _)| *n == name).map(|(_, t)| t)
    }

    /// The result `name`, if the call has it.
    pub fn result(&self, name: &str) -> Option<&Tensor> {
        self.results.iter().find(|(n, _)| *n == name).map(|(_, t)| t)
    }

    /// An operand the signature always has.
    pub fn input(&self, name: &str) -> &Tensor {
        self.operand(name).unwrap_or_else(|| panic!("`{name}` is not an operand every call of this target has"))
    }

    /// A result the signature always has.
    pub fn output(&self, name: &str) -> &Tensor {
        self.result(name).unwrap_or_else(|| panic!("`{name}` is not a result every call of this target has"))
    }
}

/// The names of `args` that this call has, as its attributes say.
fn present(frame: &Frame, sig: &Signature, args: &[Arg]) -> Result<Vec<&'static str>> {
    let mut names = Vec::with_capacity(args.len());
    for a in args {
        let here = match a.when {
            When::Always => true,
            When::Flag(flag) if sig.attrs.iter().any(|a| a.name == flag && a.optional) => {
                frame.attr_opt(flag, Frame::attr_bool)?.unwrap_or(false)
            }
            When::Flag(flag) => frame.attr_bool(flag)?,
            When::NonZero(attr) => frame.attr_opt(attr, Frame::attr_i64)?.unwrap_or(0) != 0,
        };
        if here {
            names.push(a.name);
        }
    }
    Ok(names)
}

/// Names errors from frame decoding with `op` (validation's own messages already do).
pub fn prefixed(op: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::InvalidArgument(m) if !m.starts_with(op) => Error::InvalidArgument(format!("{op}: {m}")),
        other => other,
    }
}
