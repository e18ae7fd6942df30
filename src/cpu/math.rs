//! The special functions of the CPU kernels.
//!
//! The scans do an exponential per (channel, step, state), so theirs must vectorize with the loop
//! around it: [`exp2`] for the decays (on A log2 e, formed once per channel) and [`exp`], with
//! Cody-Waite range reduction, elsewhere, both a degree-5 polynomial, branch-free and inlined.
//! [`softplus`], [`silu`] and [`sigmoid`] are built on [`exp`] (plus a polynomial `log1p`) for the
//! same reason. The decode-time operations, a few values per call, use std's `exp` / `ln_1p`
//! instead ([`softplus_std`], [`silu_std`], [`silu_grad_std`]), as their references do.

use super::lanes::{fmadd, V};

/// Inputs are clamped to this range, so that `2^k` below can be added into the exponent bits and
/// the result stays a normal float: exp(-86.5) = 2.9e-38, exp(88.3) = 2.2e38. Beyond it the true
/// result underflows (below 2.9e-38: no observable difference in the scan beyond that, in absolute
/// terms) or overflows (f32 would say inf; this says 2.2e38).
const EXP_MIN: f32 = -86.5;
const EXP_MAX: f32 = 88.3;

/// e^x lane-wise, relative error below 2e-7 on the clamped range; NaN in, NaN out.
///
/// x = k ln2 + r with integer k and |r| <= ln2/2 (Cody-Waite: ln2 split in two so that k * LN2_HI is
/// exact); e^r by a minimax polynomial; 2^k added into the exponent bits.
#[inline(always)]
pub(crate) fn exp<const W: usize, const FMA: bool>(x: V<W>) -> V<W> {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln2 = LN2_HI + LN2_LO, LN2_HI = 0.693359375 with 9 significant bits.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer (ties to even) and leaves it in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    // One comparison each, in the form that compiles to max/min instructions; NaN fails both
    // tests and flows through.
    let x = x.map(|x| if x > EXP_MAX { EXP_MAX } else { x });
    let x = x.map(|x| if x < EXP_MIN { EXP_MIN } else { x });
    let t = x.map(|x| fmadd::<FMA>(x, LOG2E, SHIFT));
    let k = t.map(|t| t - SHIFT);
    let r = k.zip(x, |k, x| fmadd::<FMA>(k, -LN2_HI, x));
    let r = k.zip(r, |k, r| fmadd::<FMA>(k, -LN2_LO, r));
    // e^r = 1 + r + r^2 q(r), q minimax on [-ln2/2, ln2/2] (relative error 1.0e-7). The first two
    // coefficients are exact so that e^r has no bias near r = 0: decays there are close to 1 and a
    // scan over thousands of steps multiplies thousands of them (a free-coefficient fit with error
    // 1e-7 at 0 showed up as 5e-5 in such a scan).
    let mut q = V::splat(8.312_521e-3);
    for c in [4.189_015_6e-2, 0.166_671_14, 0.499_992_3] {
        q = q.mul_add::<FMA>(r, V::splat(c));
    }
    let p = q.mul_add::<FMA>(r, V::splat(1.0)).mul_add::<FMA>(r, V::splat(1.0));
    // t's bits are those of 1.5 * 2^23 + k, whose low 9 bits are 0: shifted left by 23 they are
    // k << 23 (mod 2^32), i.e. k added to p's exponent field, which stays in [1, 254] because
    // p is in [0.7, 1.42] and k in [-125, 127].
    p.zip(t, |p, t| f32::from_bits(p.to_bits().wrapping_add(t.to_bits() << 23)))
}

/// Clamp of [`exp2`]'s argument: 2^k then stays a normal float (2^-125 = 2.4e-38; 2^127 = 1.7e38).
const EXP2_MIN: f32 = -125.0;
const EXP2_MAX: f32 = 127.0;

/// 2^r = 1 + r c(r) on [-1/2, 1/2], highest power first: the coefficients of `exp`'s polynomial
/// scaled by powers of ln 2 (no bias at r = 0 for the same reason; relative error 1.1e-7).
const EXP2_POLY: [f32; 6] = [1.330_025_8e-3, 9.669_718e-3, 5.550_56e-2, 0.240_222_81, std::f32::consts::LN_2, 1.0];

/// 2^x lane-wise, relative error below 2e-7 on the clamped range; NaN in, NaN out. The scan's
/// decay exp(dt * A) is computed as 2^(dt * (A log2 e)), with A log2 e formed once per channel:
/// cheaper than [`exp`] (no range-reduction multiplies), and the rounding of A log2 e is a
/// relative error of 6e-8 on the exponent, which over the steps a decay is felt for (about
/// 1 / |dt A|) adds up to 6e-8, not to a bias that grows with the sequence.
#[inline(always)]
pub(crate) fn exp2<const W: usize, const FMA: bool>(x: V<W>) -> V<W> {
    #[cfg(target_arch = "x86_64")]
    if W == 16 {
        // SAFETY: 16 lanes are compiled only into the AVX-512 workers (`Isa::lanes`), which run only
        // where `Isa::detect` saw AVX-512F.
        return unsafe { exp2_avx512(x) };
    }
    const SHIFT: f32 = 12_582_912.0; // as in `exp`
    let x = x.map(|x| if x > EXP2_MAX { EXP2_MAX } else { x });
    let x = x.map(|x| if x < EXP2_MIN { EXP2_MIN } else { x });
    let t = x.map(|x| x + SHIFT);
    // r is exact, in [-1/2, 1/2].
    let r = t.zip(x, |t, x| x - (t - SHIFT));
    let mut p = V::splat(EXP2_POLY[0]);
    for c in &EXP2_POLY[1..] {
        p = p.mul_add::<FMA>(r, V::splat(*c));
    }
    p.zip(t, |p, t| f32::from_bits(p.to_bits().wrapping_add(t.to_bits() << 23)))
}

/// [`exp2`] in AVX-512 instructions, 16 lanes (`W` must be 16): the same clamps and polynomial, with
/// the rounding to an integer in one `vrndscaleps` and 2^k applied by `vscalefps`: 10 instructions a
/// vector where the portable form takes 13, and the scan does one per (step, state).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp2_avx512<const W: usize>(x: V<W>) -> V<W> {
    use std::arch::x86_64::*;
    debug_assert_eq!(W, 16);
    // min/max return their second operand when either is NaN: NaN in, NaN out.
    let x = _mm512_loadu_ps(x.0.as_ptr());
    let x = _mm512_min_ps(_mm512_set1_ps(EXP2_MAX), x);
    let x = _mm512_max_ps(_mm512_set1_ps(EXP2_MIN), x);
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let r = _mm512_sub_ps(x, k);
    let mut p = _mm512_set1_ps(EXP2_POLY[0]);
    for c in &EXP2_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
    }
    let mut out = [0f32; W];
    _mm512_storeu_ps(out.as_mut_ptr(), _mm512_scalef_ps(p, k));
    V(out)
}

/// log1p(t) for t in [0, 1]: t * P(t), P minimax for log1p(t) / t (relative error 3e-8), so small t
/// keep full relative accuracy.
#[inline(always)]
fn log1p_01<const FMA: bool>(t: f32) -> f32 {
    let mut p = 5.232_606e-3;
    for c in [
        -2.950_486_4e-2,
        7.822_529e-2,
        -1.366_318_5e-1,
        1.910_597_4e-1,
        -2.484_297_3e-1,
        3.331_909_5e-1,
        -4.999_949_3e-1,
        9.999_999_4e-1,
    ] {
        p = fmadd::<FMA>(p, t, c);
    }
    t * p
}

/// One lane of [`exp`].
#[inline(always)]
fn exp1<const FMA: bool>(x: f32) -> f32 {
    exp::<1, FMA>(V([x])).0[0]
}

/// softplus(x) = log1p(exp(x)), = x for x > 20 (as the reference defines it), computed as
/// max(x, 0) + log1p(exp(-|x|)): the same function, with the log1p argument in [0, 1] where a
/// polynomial does (no division, no frexp).
#[inline(always)]
pub(crate) fn softplus<const FMA: bool>(x: f32) -> f32 {
    let sp = x.max(0.0) + log1p_01::<FMA>(exp1::<FMA>(-x.abs()));
    if x > 20.0 {
        x
    } else {
        sp
    }
}

/// silu(x) = x / (1 + exp(-x)).
#[inline(always)]
pub(crate) fn silu<const FMA: bool>(x: f32) -> f32 {
    x / (1.0 + exp1::<FMA>(-x))
}

/// sigmoid(x) = 1 / (1 + exp(-x)), lane-wise.
#[inline(always)]
pub(crate) fn sigmoid<const W: usize, const FMA: bool>(x: V<W>) -> V<W> {
    exp::<W, FMA>(x.map(|x| -x)).map(|e| 1.0 / (1.0 + e))
}

/// softplus(x) = log1p(exp(x)), = x for x > 20, with std's functions.
pub(crate) fn softplus_std(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// silu(x) = x / (1 + exp(-x)), with std's `exp`.
pub(crate) fn silu_std(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// d silu(x) / dx = s (1 + x (1 - s)), s = sigmoid(x), with std's `exp`.
pub(crate) fn silu_grad_std(x: f32) -> f32 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::lanes::build;

    fn rel(a: f32, b: f64) -> f64 {
        ((a as f64 - b) / b).abs()
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = EXP_MIN;
        while x <= EXP_MAX {
            worst = worst.max(rel(exp1::<true>(x), (x as f64).exp()));
            worst = worst.max(rel(exp1::<false>(x), (x as f64).exp()));
            x += 1.3e-3;
        }
        assert!(worst < 2.5e-7, "exp: worst relative error {worst}");
        assert!(exp1::<true>(f32::NAN).is_nan());
        assert!(exp1::<false>(f32::NAN).is_nan());
        let tiny = exp1::<true>(-1e30);
        assert!(tiny > 0.0 && tiny < 3e-38, "{tiny}");
        assert!(exp1::<true>(1e30).is_finite());
    }

    #[test]
    fn exp2_is_accurate() {
        let mut worst = 0f64;
        let mut x = EXP2_MIN;
        while x <= EXP2_MAX {
            for v in [x, x * 1e-3] {
                let want = (v as f64).exp2();
                worst = worst.max(rel(exp2::<1, true>(V([v])).0[0], want));
                worst = worst.max(rel(exp2::<1, false>(V([v])).0[0], want));
            }
            x += 1.7e-3;
        }
        assert!(worst < 2.5e-7, "exp2: worst relative error {worst}");
        assert!(exp2::<1, true>(V([f32::NAN])).0[0].is_nan());
        let tiny = exp2::<1, true>(V([-1e30])).0[0];
        assert!(tiny > 0.0 && tiny < 3e-38, "{tiny}");
    }

    /// The AVX-512 form ([`exp2_avx512`]), which the scans use for 16 lanes, on every lane.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp2_avx512_is_accurate() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512F on this CPU");
            return;
        }
        let mut worst = 0f64;
        let mut x = EXP2_MIN;
        while x <= EXP2_MAX {
            let v: [f32; 16] =
                build(|i| if i % 2 == 0 { (x + i as f32 * 1.1e-4).min(EXP2_MAX) } else { (x - i as f32) * 1e-3 });
            // SAFETY: AVX-512F is present (checked above).
            let got = unsafe { exp2_avx512(V(v)) }.0;
            for (g, v) in got.iter().zip(v) {
                worst = worst.max(rel(*g, (v as f64).exp2()));
            }
            x += 1.7e-3;
        }
        assert!(worst < 2.5e-7, "exp2 (AVX-512): worst relative error {worst}");
        let special: [f32; 16] = build(|i| [f32::NAN, -1e30, f32::NEG_INFINITY, 1e30, f32::INFINITY][i % 5]);
        // SAFETY: as above.
        let got = unsafe { exp2_avx512(V(special)) }.0;
        for (g, v) in got.iter().zip(special) {
            match v {
                v if v.is_nan() => assert!(g.is_nan(), "2^NaN gave {g}"),
                v if v < 0.0 => assert!(*g > 0.0 && *g < 3e-38, "2^{v} gave {g}"),
                v => assert!(g.is_finite() && *g > 1e38, "2^{v} gave {g}"),
            }
        }
    }

    #[test]
    fn softplus_and_silu_are_accurate() {
        let mut worst = 0f64;
        let mut x = -80f32;
        while x <= 40.0 {
            let want = if x > 20.0 { x as f64 } else { (x as f64).exp().ln_1p() };
            worst = worst.max(rel(softplus::<true>(x), want));
            worst = worst.max(rel(softplus::<false>(x), want));
            if x != 0.0 {
                let want = x as f64 / (1.0 + (-(x as f64)).exp());
                worst = worst.max(rel(silu::<true>(x), want));
            }
            x += 7.7e-3;
        }
        assert!(worst < 5e-7, "softplus/silu: worst relative error {worst}");
        assert!(softplus::<true>(f32::NAN).is_nan());
    }
}
