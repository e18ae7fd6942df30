//! Element types at the staging boundaries.
//!
//! The kernels compute in f32. An operand's dtype is matched once per call, into a typed slice
//! ([`Elems`]; [`ElemsOut`] for results, [`ElemVec`] for owned arrays); a staging function matches
//! that once with [`typed!`], around a small loop generic over the element type ([`Io`]) that
//! converts to or from f32 scratch. Only those loops are compiled once per element type.

use crate::DType;
use half::{bf16, f16};
use std::ffi::c_void;

/// Conversion of an element to and from f32. Rather than `crate::dtype::Element` because the bf16
/// conversions here are branch-free bit operations that vectorize.
pub(crate) trait Io: Copy + Default + Send + Sync + 'static {
    fn load(self) -> f32;
    fn store(x: f32) -> Self;
}

impl Io for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(x: f32) -> f32 {
        x
    }
}

impl Io for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    /// Round to nearest, ties to even; NaN stays NaN (quieted), like `half::bf16::from_f32`.
    #[inline(always)]
    fn store(x: f32) -> bf16 {
        let bits = x.to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
        let quiet_nan = (bits >> 16) | 0x40;
        bf16::from_bits(if x.is_nan() { quiet_nan } else { rounded } as u16)
    }
}

impl Io for f16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(x: f32) -> f16 {
        f16::from_f32(x)
    }
}

/// `typed!(Kind, value, s => body)`: `body` with `s` bound to the typed contents of `value`, an
/// [`Elems`], [`ElemsOut`] or [`ElemVec`] (`Kind`): the one match on an operand's element type.
macro_rules! typed {
    ($kind:ident, $e:expr, $s:ident => $body:expr) => {
        match $e {
            $crate::cpu::elems::$kind::F32($s) => $body,
            $crate::cpu::elems::$kind::Bf16($s) => $body,
            $crate::cpu::elems::$kind::F16($s) => $body,
        }
    };
}
pub(crate) use typed;

/// An input operand: a slice of its element type.
#[derive(Clone, Copy)]
pub(crate) enum Elems<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

/// Validation rejects every other dtype first; a panic becomes an INTERNAL error.
fn unsupported(dtype: DType) -> ! {
    panic!("unsupported dtype {}", dtype.name())
}

impl<'a> Elems<'a> {
    /// # Safety
    /// `p` addresses `len` initialized elements of `dtype` that nothing writes while the slice lives
    /// (or `len` is 0).
    pub(crate) unsafe fn new(dtype: DType, p: *const c_void, len: usize) -> Elems<'a> {
        match dtype {
            DType::F32 => Elems::F32(input(p, len)),
            DType::BF16 => Elems::Bf16(input(p, len)),
            DType::F16 => Elems::F16(input(p, len)),
            other => unsupported(other),
        }
    }

    /// # Safety
    /// As [`Elems::new`], when `p` is not null.
    pub(crate) unsafe fn optional(dtype: DType, p: *const c_void, len: usize) -> Option<Elems<'a>> {
        (!p.is_null()).then(|| Elems::new(dtype, p, len))
    }

    pub(crate) fn bytes(self) -> usize {
        typed!(Elems, self, s => std::mem::size_of_val(s))
    }

    /// dst[k] = element start + k * stride, as f32.
    pub(crate) fn load(self, start: usize, stride: usize, dst: &mut [f32]) {
        if !dst.is_empty() {
            typed!(Elems, self, s => load_strided(&s[start..], stride, dst))
        }
    }
}

#[inline(always)]
fn load_strided<E: Io>(src: &[E], stride: usize, dst: &mut [f32]) {
    if stride == 1 {
        let n = dst.len();
        for (o, e) in dst.iter_mut().zip(&src[..n]) {
            *o = e.load();
        }
    } else {
        for (k, o) in dst.iter_mut().enumerate() {
            *o = src[k * stride].load();
        }
    }
}

#[inline(always)]
fn store_strided<E: Io>(dst: &mut [E], stride: usize, src: &[f32]) {
    if stride == 1 {
        for (o, &v) in dst[..src.len()].iter_mut().zip(src) {
            *o = E::store(v);
        }
    } else {
        for (k, &v) in src.iter().enumerate() {
            dst[k * stride] = E::store(v);
        }
    }
}

/// Elements spanned by `n` > 0 of them `stride` apart.
fn span(n: usize, stride: usize) -> usize {
    (n - 1) * stride + 1
}

/// An output array shared by the worker threads (raw: several write it, at disjoint indices).
#[derive(Clone, Copy)]
pub(crate) struct Out<E> {
    pub(crate) ptr: *mut E,
    pub(crate) len: usize,
}

// SAFETY: workers write disjoint indices (each owns whole channels) and nobody reads.
unsafe impl<E: Send> Send for Out<E> {}
unsafe impl<E: Send> Sync for Out<E> {}

impl<E> Out<E> {
    /// The `len` elements at `p` (which may be null when `len` is 0).
    pub(crate) fn new(p: *mut c_void, len: usize) -> Out<E> {
        let ptr = if p.is_null() { std::ptr::NonNull::dangling().as_ptr() } else { p as *mut E };
        Out { ptr, len }
    }

    /// Elements `start..start + len`, bounds-checked.
    ///
    /// # Safety
    /// No other thread accesses them while the slice lives.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn rows(&self, start: usize, len: usize) -> &mut [E] {
        assert!(start <= self.len && len <= self.len - start);
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// A result operand (or one read and written in place): an [`Out`] of its element type.
#[derive(Clone, Copy)]
pub(crate) enum ElemsOut {
    F32(Out<f32>),
    Bf16(Out<bf16>),
    F16(Out<f16>),
}

impl ElemsOut {
    /// # Safety
    /// `p` addresses `len` elements of `dtype` (or `len` is 0), accessed only through this value
    /// while it is used.
    pub(crate) unsafe fn new(dtype: DType, p: *mut c_void, len: usize) -> ElemsOut {
        match dtype {
            DType::F32 => ElemsOut::F32(Out::new(p, len)),
            DType::BF16 => ElemsOut::Bf16(Out::new(p, len)),
            DType::F16 => ElemsOut::F16(Out::new(p, len)),
            other => unsupported(other),
        }
    }

    /// # Safety
    /// As [`ElemsOut::new`], when `p` is not null.
    pub(crate) unsafe fn optional(dtype: DType, p: *mut c_void, len: usize) -> Option<ElemsOut> {
        (!p.is_null()).then(|| ElemsOut::new(dtype, p, len))
    }

    /// Element start + k * stride = src[k], rounded to the element type.
    ///
    /// # Safety
    /// No other thread accesses those elements meanwhile.
    pub(crate) unsafe fn store(self, start: usize, stride: usize, src: &[f32]) {
        if !src.is_empty() {
            typed!(ElemsOut, self, o => store_strided(o.rows(start, span(src.len(), stride)), stride, src))
        }
    }

    /// dst[k] = element start + k * stride, as f32.
    ///
    /// # Safety
    /// As [`ElemsOut::store`].
    pub(crate) unsafe fn load(self, start: usize, stride: usize, dst: &mut [f32]) {
        if !dst.is_empty() {
            typed!(ElemsOut, self, o => load_strided(o.rows(start, span(dst.len(), stride)), stride, dst))
        }
    }

    /// # Safety
    /// As [`ElemsOut::store`].
    pub(crate) unsafe fn put(self, i: usize, v: f32) {
        self.store(i, 1, &[v])
    }

    /// Sets every element to `v`.
    ///
    /// # Safety
    /// As [`ElemsOut::store`].
    pub(crate) unsafe fn fill(self, v: f32) {
        typed!(ElemsOut, self, o => o.rows(0, o.len).fill(Io::store(v)))
    }
}

/// An owned array of an element type, for scratch that another operation reads in its dtype.
pub(crate) enum ElemVec {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl ElemVec {
    pub(crate) fn zeros(dtype: DType, len: usize) -> ElemVec {
        match dtype {
            DType::F32 => ElemVec::F32(vec![0.0; len]),
            DType::BF16 => ElemVec::Bf16(vec![bf16::ZERO; len]),
            DType::F16 => ElemVec::F16(vec![f16::ZERO; len]),
            other => unsupported(other),
        }
    }

    pub(crate) fn len(&self) -> usize {
        typed!(ElemVec, self, v => v.len())
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut c_void {
        typed!(ElemVec, self, v => v.as_mut_ptr() as *mut c_void)
    }

    pub(crate) fn view(&self) -> Elems<'_> {
        match self {
            ElemVec::F32(v) => Elems::F32(v),
            ElemVec::Bf16(v) => Elems::Bf16(v),
            ElemVec::F16(v) => Elems::F16(v),
        }
    }
}

/// # Safety
/// `p` addresses `len` initialized elements that nothing writes while the slice lives (or `len` is 0).
pub(crate) unsafe fn input<'a, E>(p: *const c_void, len: usize) -> &'a [E] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(p as *const E, len)
    }
}

/// # Safety
/// As [`input`], when `p` is not null.
pub(crate) unsafe fn optional<'a, E>(p: *const c_void, len: usize) -> Option<&'a [E]> {
    (!p.is_null()).then(|| input(p, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half() {
        let special = [0x7f7f_ffff, 0x7fc0_0001, 0xff80_0000, 0x3f80_8000, 0x3f81_8000, 0x0000_8000];
        for bits in (0..=u32::MAX).step_by(9973).chain(special) {
            let x = f32::from_bits(bits);
            let (ours, theirs) = (<bf16 as Io>::store(x), bf16::from_f32(x));
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "{x:e} ({bits:#x})");
        }
    }

    #[test]
    fn strided_loads_and_stores() {
        let mut raw = [bf16::ZERO; 7];
        // SAFETY (the three calls): `raw` holds 7 elements and is used only through `out` here.
        let out = unsafe { ElemsOut::new(DType::BF16, raw.as_mut_ptr() as *mut c_void, 7) };
        unsafe { out.store(1, 3, &[1.0, 2.0]) };
        let mut back = [0f32; 2];
        unsafe { out.load(1, 3, &mut back) };
        assert_eq!(back, [1.0, 2.0]);
        let view = Elems::Bf16(&raw);
        assert_eq!(view.bytes(), 14);
        let mut all = [9f32; 7];
        view.load(0, 1, &mut all);
        assert_eq!(all, [0.0, 1.0, 0.0, 0.0, 2.0, 0.0, 0.0]);
    }
}
