//! The library's error type: what crosses the FFI boundary as an XLA FFI error or a C API status.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Bad shapes, dtypes, ranks, attributes: nothing was launched.
    InvalidArgument(String),
    /// The CUDA driver is missing or reported a failure.
    Cuda(String),
    /// The operation is not available in this build (e.g. CUDA in a CPU-only build).
    Unimplemented(String),
    /// A bug: a panic caught at the boundary, or a broken invariant.
    Internal(String),
}

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    pub fn message(&self) -> &str {
        match self {
            Error::InvalidArgument(m) | Error::Cuda(m) | Error::Unimplemented(m) | Error::Internal(m) => m,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;
