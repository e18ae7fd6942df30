//! Element types. The codes are XLA's `XLA_FFI_DataType` values (the host adapters map theirs onto
//! these), so that an unknown type can still be named in an error.

use half::{bf16, f16};

/// An element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
    F64,
    Pred,
    S8,
    S16,
    S32,
    S64,
    U8,
    /// Any other type, by its XLA code; always rejected by the operations, but named in errors.
    Other(i32),
}

impl DType {
    /// The short name used in kernel names and error messages.
    pub fn name(self) -> String {
        match self {
            DType::F32 => "f32".into(),
            DType::BF16 => "bf16".into(),
            DType::F16 => "f16".into(),
            DType::F64 => "f64".into(),
            DType::Pred => "pred".into(),
            DType::S8 => "s8".into(),
            DType::S16 => "s16".into(),
            DType::S32 => "s32".into(),
            DType::S64 => "s64".into(),
            DType::U8 => "u8".into(),
            DType::Other(code) => format!("xla dtype #{code}"),
        }
    }

    /// Bytes per element (0 for types this library does not know).
    pub fn size_bytes(self) -> i64 {
        match self {
            DType::F64 | DType::S64 => 8,
            DType::F32 | DType::S32 => 4,
            DType::BF16 | DType::F16 | DType::S16 => 2,
            DType::Pred | DType::S8 | DType::U8 => 1,
            DType::Other(_) => 0,
        }
    }
}

/// A floating-point element the kernels read and write; all arithmetic is in f32.
pub trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

/// Runs `$body` with `$t` bound to the Rust type of a float [`DType`]; other dtypes never get here
/// (validation rejects them first), so they panic, which the FFI boundary reports as INTERNAL.
#[macro_export]
macro_rules! with_element_type {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => panic!("unsupported element type {}", other.name()),
        }
    };
}
