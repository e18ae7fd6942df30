//! `W` f32 lanes operated on element-wise, and the array helpers of the vectorized loops.
//!
//! Lane vectors are a `[f32; W]` newtype passed by value through small element-wise operations,
//! which LLVM turns into one SIMD instruction each and keeps in registers (scratch holds plain
//! `[f32; W]`). Everything here is `#[inline(always)]`: it must be compiled into its caller, whose
//! instruction set (see [`super::isa`]) it then gets.

use std::ops::{Add, Mul};

/// `W` f32 lanes, operated on element-wise.
#[derive(Clone, Copy, Debug)]
pub(crate) struct V<const W: usize>(pub(crate) [f32; W]);

impl<const W: usize> V<W> {
    #[inline(always)]
    pub(crate) fn splat(x: f32) -> V<W> {
        V([x; W])
    }

    #[inline(always)]
    pub(crate) fn map(self, f: impl Fn(f32) -> f32) -> V<W> {
        let mut r = self.0;
        for x in r.iter_mut() {
            *x = f(*x);
        }
        V(r)
    }

    #[inline(always)]
    pub(crate) fn zip(self, o: V<W>, f: impl Fn(f32, f32) -> f32) -> V<W> {
        let mut r = self.0;
        for (x, y) in r.iter_mut().zip(o.0) {
            *x = f(*x, y);
        }
        V(r)
    }

    /// `self * b + c`, fused where the ISA has FMA.
    #[inline(always)]
    pub(crate) fn mul_add<const FMA: bool>(self, b: V<W>, c: V<W>) -> V<W> {
        let mut r = self.0;
        for ((x, b), c) in r.iter_mut().zip(b.0).zip(c.0) {
            *x = fmadd::<FMA>(*x, b, c);
        }
        V(r)
    }
}

impl<const W: usize> Default for V<W> {
    #[inline(always)]
    fn default() -> V<W> {
        V([0.0; W])
    }
}

impl<const W: usize> Add for V<W> {
    type Output = V<W>;
    #[inline(always)]
    fn add(self, o: V<W>) -> V<W> {
        self.zip(o, |a, b| a + b)
    }
}

impl<const W: usize> Mul for V<W> {
    type Output = V<W>;
    #[inline(always)]
    fn mul(self, o: V<W>) -> V<W> {
        self.zip(o, |a, b| a * b)
    }
}

/// `a * b + c`, fused where the ISA has FMA (without it, `mul_add` would be a libm call).
#[inline(always)]
pub(crate) fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `std::array::from_fn`, which LLVM does not always inline (the hot transposes need it inlined).
#[inline(always)]
pub(crate) fn build<E: Copy + Default, const N: usize>(mut f: impl FnMut(usize) -> E) -> [E; N] {
    let mut r = [E::default(); N];
    for (i, e) in r.iter_mut().enumerate() {
        *e = f(i);
    }
    r
}

/// The channel that lane `i` of a block of `width` channels computes: lanes past the last channel
/// repeat it, so that they compute finite, unused values rather than need masking.
#[inline(always)]
pub(crate) fn lane(i: usize, width: usize) -> usize {
    i.min(width - 1)
}

/// dst[j][i] = src[i][j], in the plain form that LLVM turns into shuffles for the shapes used here
/// (W x 8 and 8 x 8; 8 x 16 came out as scalar moves, and 16 x 16 as gathers).
#[inline(always)]
pub(crate) fn transpose<const R: usize, const C: usize>(src: &[[f32; C]; R], dst: &mut [[f32; R]; C]) {
    for i in 0..R {
        for j in 0..C {
            dst[j][i] = src[i][j];
        }
    }
}

/// The sum of a vector's lanes, in a fixed order (a tree, halving).
#[inline(always)]
pub(crate) fn lane_sum<const W: usize>(mut v: [f32; W]) -> f32 {
    let mut half = W / 2;
    while half > 0 {
        for l in 0..half {
            v[l] += v[l + half];
        }
        half /= 2;
    }
    v[0]
}

/// Zeroes the spare lanes (width..) of each vector.
#[inline(always)]
pub(crate) fn mask<const W: usize>(v: &mut [[f32; W]], width: usize) {
    if width < W {
        for x in v {
            x[width..].fill(0.0);
        }
    }
}

/// A flattened slice of `[f32; W]`s, re-chunked.
#[inline(always)]
pub(crate) fn lanes<const W: usize>(x: &[f32]) -> &[[f32; W]] {
    x.as_chunks::<W>().0
}

/// A flattened mutable slice of `[f32; W]`s, re-chunked.
#[inline(always)]
pub(crate) fn lanes_mut<const W: usize>(x: &mut [f32]) -> &mut [[f32; W]] {
    x.as_chunks_mut::<W>().0
}
