//! The CPU forward scan.
//!
//! The work is `batch * dim * seqlen * dstate` updates `h = exp(dt * A) * h + dt * B * u`, each with
//! an exponential, so the loop must vectorize, exponential included. It is organised so that it does:
//!
//! - **Channels in SIMD lanes.** Channels are taken `W` at a time (a *block*, one channel per lane).
//!   When B and C vary with time, a block's channels come from one group, so at each (step, state)
//!   every lane reads the same B and C value: a step is, per state, one vector `exp`, a multiply and
//!   an FMA for `h` and an FMA into `y`, with no horizontal reductions. (When B and C are per channel,
//!   or groups are narrower than a block, B and C are per-lane vectors instead: the *lanes* mode.)
//! - **An inlined polynomial exponential** ([`exp2`] for the decays, on A log2 e formed once per
//!   channel; [`exp`], with Cody-Waite range reduction, elsewhere): a degree-5 polynomial, branch-free,
//!   so that it vectorizes with the rest of the loop. `softplus` and `silu` are built on [`exp`]
//!   (plus a polynomial `log1p`) for the same reason.
//! - **Values, not arrays, in the hot loop.** Lane vectors are a `[f32; W]` newtype ([`V`]) passed by
//!   value through small element-wise operations, which LLVM turns into one SIMD instruction each
//!   and keeps in registers (scratch holds plain `[f32; W]`); states are scanned in groups of a
//!   compile-time size ([`scan`]) so that the accumulators of `y` stay in registers too.
//! - **Time in chunks.** The sequence is cut into chunks of at most [`CHUNK`] steps. Per chunk, B and
//!   C of the current (batch, group) are converted to f32 once, into a [step][state] scratch that all
//!   of that group's blocks on this thread share; each block's delta and u (then z, and out) are
//!   transposed between the operand's layout and [step][lane] scratch, 8 steps at a time through
//!   registers, and prefetched one block ahead. A chunk's data stays in L1/L2, operands are read
//!   once and in address order, and scratch does not grow with `seqlen`. A block's state waits in
//!   scratch between chunks.
//! - **Threads over blocks.** Threads (as many as cores: the calling one and persistent workers of
//!   [`pool`]) take segments of consecutive blocks from a shared counter, so a late or slowed thread
//!   takes fewer; each writes only its own channels. Scratch is kept per calling thread and reused
//!   across calls.
//! - **Checkpoints** (for the backward pass, cpu_bwd.rs): chunks never cross a multiple of
//!   `checkpoint_len`, so that a block's state at a chunk's start is the checkpoint when one is due.
//! - **Runtime ISA choice.** The same generic code is compiled three times: AVX-512 (16 lanes),
//!   AVX2+FMA (8 lanes) and baseline (8 lanes, no FMA), picked with `is_x86_feature_detected!`.
//!   FMA changes rounding a little, never the math.
//!
//! All arithmetic is f32; `out` is rounded to its dtype once, at the end.

use super::{n_checkpoints, Fwd, FwdParams};
use crate::ops::pool;
use crate::DType;
use half::{bf16, f16};
use std::cell::RefCell;
use std::ffi::c_void;
use std::ops::{Add, Mul, Range};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

/// Most time steps per chunk: the per-block scratch (dt, dt*u, y: 3 x CHUNK x W floats) and the
/// shared B/C chunk (2 x CHUNK x dstate floats) then fit in L1 for dstate 16.
const CHUNK: usize = 128;

/// Steps transposed at once between an operand's layout and [step][lane] scratch.
const TILE: usize = 8;

/// Bound on the scratch that holds the states of a thread's blocks between chunks (floats); past it,
/// a group's blocks are processed in several segments, each re-staging that group's B/C.
const SEGMENT_STATE_FLOATS: usize = 1 << 15;

/// Bound on the per-lane B/C scratch of the lanes mode with time-varying B/C (floats).
const LANE_BC_FLOATS: usize = 1 << 16;

/// Above this many bytes of delta, u and z, blocks prefetch the next block's rows (smaller operands
/// stay in cache between calls, where the prefetch instructions only cost time).
const PREFETCH_BYTES: usize = 8 << 20;

/// Below this many updates one thread is faster than sharing the work (waking a pool worker takes
/// microseconds, tens when it sleeps; one core does several updates per nanosecond).
pub(super) const PARALLEL_WORK: usize = 1 << 19;

// ------------------------------------------------------------------------------------ lanes

/// `W` f32 lanes, operated on element-wise.
#[derive(Clone, Copy, Debug)]
pub(super) struct V<const W: usize>(pub(super) [f32; W]);

impl<const W: usize> V<W> {
    #[inline(always)]
    pub(super) fn splat(x: f32) -> V<W> {
        V([x; W])
    }

    #[inline(always)]
    pub(super) fn map(self, f: impl Fn(f32) -> f32) -> V<W> {
        let mut r = self.0;
        for x in r.iter_mut() {
            *x = f(*x);
        }
        V(r)
    }

    #[inline(always)]
    pub(super) fn zip(self, o: V<W>, f: impl Fn(f32, f32) -> f32) -> V<W> {
        let mut r = self.0;
        for (x, y) in r.iter_mut().zip(o.0) {
            *x = f(*x, y);
        }
        V(r)
    }

    /// `self * b + c`, fused where the ISA has FMA.
    #[inline(always)]
    pub(super) fn mul_add<const FMA: bool>(self, b: V<W>, c: V<W>) -> V<W> {
        let mut r = self.0;
        for ((x, b), c) in r.iter_mut().zip(b.0).zip(c.0) {
            *x = fmadd::<FMA>(*x, b, c);
        }
        V(r)
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

// ------------------------------------------------------------------------------------ math

/// `a * b + c`, fused where the ISA has FMA (without it, `mul_add` would be a libm call).
#[inline(always)]
fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

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
pub(super) fn exp<const W: usize, const FMA: bool>(x: V<W>) -> V<W> {
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
pub(super) fn exp2<const W: usize, const FMA: bool>(x: V<W>) -> V<W> {
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
pub(super) fn softplus<const FMA: bool>(x: f32) -> f32 {
    let sp = x.max(0.0) + log1p_01::<FMA>(exp1::<FMA>(-x.abs()));
    if x > 20.0 {
        x
    } else {
        sp
    }
}

/// silu(x) = x / (1 + exp(-x)).
#[inline(always)]
fn silu<const FMA: bool>(x: f32) -> f32 {
    x / (1.0 + exp1::<FMA>(-x))
}

// ------------------------------------------------------------------------------------ elements

/// Conversion of an element to and from f32. Local rather than `crate::dtype::Element` because the
/// bf16 conversions here are branch-free bit operations that vectorize.
pub(super) trait Io: Copy + Default + Send + Sync + 'static {
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

// ------------------------------------------------------------------------------------ operands

/// Sizes and element strides (`FwdParams` without its pointers).
#[derive(Clone, Copy)]
pub(super) struct Geom {
    pub(super) batch: usize,
    pub(super) dim: usize,
    pub(super) seqlen: usize,
    pub(super) dstate: usize,
    pub(super) dim_per_group: usize,
    pub(super) x_stride_batch: usize,
    pub(super) x_stride_dim: usize,
    pub(super) x_stride_seq: usize,
    pub(super) bc_stride_batch: usize,
    pub(super) bc_stride_group: usize,
    pub(super) bc_stride_state: usize,
    pub(super) bc_stride_seq: usize,
    pub(super) delta_softplus: bool,
}

impl Geom {
    pub(super) fn new(p: &FwdParams) -> Geom {
        // Validation made every size and stride non-negative.
        let u = |x: i64| x as usize;
        Geom {
            batch: u(p.batch),
            dim: u(p.dim),
            seqlen: u(p.seqlen),
            dstate: u(p.dstate),
            dim_per_group: u(p.dim_per_group),
            x_stride_batch: u(p.x_stride_batch),
            x_stride_dim: u(p.x_stride_dim),
            x_stride_seq: u(p.x_stride_seq),
            bc_stride_batch: u(p.bc_stride_batch),
            bc_stride_group: u(p.bc_stride_group),
            bc_stride_state: u(p.bc_stride_state),
            bc_stride_seq: u(p.bc_stride_seq),
            delta_softplus: p.delta_softplus != 0,
        }
    }

    /// Index of x[b, d, l] (u, delta, z, out).
    #[inline(always)]
    pub(super) fn x(&self, b: usize, d: usize, l: usize) -> usize {
        b * self.x_stride_batch + d * self.x_stride_dim + l * self.x_stride_seq
    }

    /// Index of B[b, group of channel d, s, l] (C alike).
    #[inline(always)]
    pub(super) fn bc(&self, b: usize, d: usize, s: usize, l: usize) -> usize {
        b * self.bc_stride_batch
            + (d / self.dim_per_group) * self.bc_stride_group
            + s * self.bc_stride_state
            + l * self.bc_stride_seq
    }
}

/// The operands as slices (inputs) and raw pointers (outputs, written by several threads at
/// disjoint indices).
struct Ctx<'a, T, TB> {
    p: Geom,
    u: &'a [T],
    delta: &'a [T],
    z: Option<&'a [T]>,
    a: &'a [f32],
    b: &'a [TB],
    c: &'a [TB],
    d: Option<&'a [f32]>,
    bias: Option<&'a [f32]>,
    h0: Option<&'a [f32]>,
    out: Out<T>,
    final_state: Out<f32>,
    /// (batch, dim, n_checkpoints, dstate), when the host asks for checkpoints.
    checkpoints: Option<Out<f32>>,
}

/// An output array shared by the worker threads.
#[derive(Clone, Copy)]
pub(super) struct Out<E> {
    pub(super) ptr: *mut E,
    pub(super) len: usize,
}

// SAFETY: workers write disjoint indices (each owns whole channels) and nobody reads.
unsafe impl<E: Send> Send for Out<E> {}
unsafe impl<E: Send> Sync for Out<E> {}

impl<E> Out<E> {
    /// Elements `start..start + len`, bounds-checked.
    ///
    /// # Safety
    /// No other thread accesses them while the slice lives.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn rows(&self, start: usize, len: usize) -> &mut [E] {
        assert!(start <= self.len && len <= self.len - start);
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// # Safety
/// `p` addresses `len` initialized elements that nothing writes while the slice lives (or `len` is 0).
pub(super) unsafe fn input<'a, E>(p: *const c_void, len: usize) -> &'a [E] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(p as *const E, len)
    }
}

/// # Safety
/// As [`input`], when `p` is not null.
pub(super) unsafe fn optional<'a, E>(p: *const c_void, len: usize) -> Option<&'a [E]> {
    (!p.is_null()).then(|| input(p, len))
}

// ------------------------------------------------------------------------------------ plan

/// How the channels are cut into blocks, and the sizes of the pieces of scratch.
#[derive(Clone, Copy)]
struct Plan {
    /// Lanes per block.
    w: usize,
    /// B/C are broadcast from a shared [step][state] scratch (time-varying, groups >= w channels);
    /// otherwise each lane reads its own B/C ("lanes" mode).
    shared: bool,
    /// B/C vary with time.
    time_varying: bool,
    /// Channels whose blocks never mix: a group in shared mode, all of dim otherwise.
    span: usize,
    spans: usize,
    blocks_per_span: usize,
    blocks: usize,
    dstate: usize,
    seqlen: usize,
    chunk: usize,
    /// Steps between checkpoints (0: none); chunks never cross a checkpoint.
    checkpoint_len: usize,
    /// Blocks per segment: the unit of work a thread takes (consecutive blocks of one span, which
    /// share each chunk's B/C staging).
    segment: usize,
    segments_per_span: usize,
    segments: usize,
}

impl Plan {
    fn new(p: &Geom, time_varying: bool, w: usize, checkpoint_len: usize) -> Plan {
        let (dim, dstate) = (p.dim, p.dstate);
        let shared = time_varying && p.dim_per_group >= w;
        let span = if shared { p.dim_per_group } else { dim };
        let blocks_per_span = span.div_ceil(w);
        let spans = dim / span.max(1);
        let lane_floats = dstate.max(1) * w;
        let chunk = if time_varying && !shared { (LANE_BC_FLOATS / (2 * lane_floats)).clamp(1, CHUNK) } else { CHUNK };
        Plan {
            w,
            shared,
            time_varying,
            span,
            spans,
            blocks_per_span,
            blocks: p.batch * spans * blocks_per_span,
            dstate,
            seqlen: p.seqlen,
            chunk,
            checkpoint_len,
            segment: 0,
            segments_per_span: 0,
            segments: 0,
        }
        .with_segments((SEGMENT_STATE_FLOATS / lane_floats).max(1))
    }

    fn with_segments(mut self, segment: usize) -> Plan {
        self.segment = segment.clamp(1, self.blocks_per_span.max(1));
        self.segments_per_span = self.blocks_per_span.div_ceil(self.segment);
        self.segments = self.blocks / self.blocks_per_span.max(1) * self.segments_per_span;
        self
    }

    /// Cuts the work into about four segments per thread, so that threads that start late or run
    /// slow (a busy core) take fewer (a single thread keeps the largest segments).
    fn schedule(self, threads: usize) -> Plan {
        if threads <= 1 {
            return self;
        }
        let segment = self.segment.min(self.blocks.div_ceil(4 * threads));
        self.with_segments(segment)
    }

    /// Steps of the chunk that starts at step `l0`: at most `chunk`, up to the next checkpoint.
    fn chunk_steps(&self, l0: usize) -> usize {
        let steps = self.chunk.min(self.seqlen - l0);
        match self.checkpoint_len {
            0 => steps,
            len => steps.min(len - l0 % len),
        }
    }

    /// The blocks of segment `i` (consecutive, of one (batch, span)).
    fn segment_blocks(&self, i: usize) -> Range<usize> {
        let (span, j) = (i / self.segments_per_span, i % self.segments_per_span);
        let start = span * self.blocks_per_span + j * self.segment;
        start..(start + self.segment).min((span + 1) * self.blocks_per_span)
    }

    /// (batch, span, first channel, channels) of block `i`.
    fn block(&self, i: usize) -> (usize, usize, usize, usize) {
        let per_batch = self.spans * self.blocks_per_span;
        let (b, rest) = (i / per_batch, i % per_batch);
        let (g, j) = (rest / self.blocks_per_span, rest % self.blocks_per_span);
        let first = g * self.span + j * self.w;
        (b, g, first, self.w.min(self.span - j * self.w))
    }

    /// Floats of per-lane B (or C) scratch.
    fn lane_bc(&self) -> usize {
        let rows = if self.shared {
            0
        } else if self.time_varying {
            self.chunk
        } else {
            1
        };
        rows * self.dstate * self.w
    }

    /// Floats of shared B (or C) scratch, rounded up to whole lane vectors.
    fn shared_bc(&self) -> usize {
        if self.shared {
            (self.chunk * self.dstate).next_multiple_of(self.w)
        } else {
            0
        }
    }

    /// Scratch floats one worker needs (a multiple of `w`, so every piece stays lane-aligned).
    fn scratch_floats(&self) -> usize {
        let (n, w, chunk) = (self.dstate, self.w, self.chunk);
        (self.segment * n + n + 3 * chunk) * w + 2 * self.lane_bc() + 2 * self.shared_bc()
    }
}

// ------------------------------------------------------------------------------------ entry

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Isa {
    /// The best the CPU has. `XLA_SSM_CPU_ISA=avx2|portable` asks for less (to compare them).
    pub(super) fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let cap = std::env::var("XLA_SSM_CPU_ISA").unwrap_or_default();
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            let avx512 = avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl");
            match cap.as_str() {
                "portable" => {}
                "avx2" if avx2 => return Isa::Avx2,
                _ if avx512 => return Isa::Avx512,
                _ if avx2 => return Isa::Avx2,
                _ => {}
            }
        }
        Isa::Portable
    }

    pub(super) fn lanes(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => 16,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => 8,
            Isa::Portable => 8,
        }
    }
}

/// Runs `$body` with `$t` and `$tb` bound to the element types of u (`$dtype`) and of B/C
/// (`$bc_dtype`): the pairs validation allows (f32 B/C, or B/C of u's type), and no others, so that
/// only those are compiled.
macro_rules! with_io_types {
    ($dtype:expr, $bc_dtype:expr, $t:ident, $tb:ident => $body:expr) => {
        match ($dtype, $bc_dtype) {
            (DType::F32, _) => {
                type $t = f32;
                type $tb = f32;
                $body
            }
            (DType::BF16, DType::F32) => {
                type $t = half::bf16;
                type $tb = f32;
                $body
            }
            (DType::BF16, _) => {
                type $t = half::bf16;
                type $tb = half::bf16;
                $body
            }
            (DType::F16, DType::F32) => {
                type $t = half::f16;
                type $tb = f32;
                $body
            }
            (DType::F16, _) => {
                type $t = half::f16;
                type $tb = half::f16;
                $body
            }
            // Validation rejects every other dtype first; a panic becomes an INTERNAL error.
            (other, _) => panic!("unsupported dtype {}", other.name()),
        }
    };
}
pub(super) use with_io_types;

pub(super) fn fwd(fwd: &Fwd) {
    with_io_types!(fwd.dtype, fwd.bc_dtype, T, TB => run::<T, TB>(&fwd.params, fwd.bc_time_varying))
}

thread_local! {
    /// Scratch of the calling thread, reused by later calls (it does not grow with seqlen).
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

fn run<T: Io, TB: Io>(p: &FwdParams, time_varying: bool) {
    let geom = Geom::new(p);
    let (batch, dim, seqlen, dstate) = (geom.batch, geom.dim, geom.seqlen, geom.dstate);
    if batch == 0 || dim == 0 {
        return;
    }
    let x_len = batch * dim * seqlen;
    let bc_len = if time_varying { batch * (dim / geom.dim_per_group) * dstate * seqlen } else { dim * dstate };
    let state_len = batch * dim * dstate;
    let checkpoints_len = state_len * n_checkpoints(p.seqlen, p.checkpoint_len) as usize;
    // SAFETY: `validate_fwd` checked every operand's shape and non-nullness against these sizes;
    // inputs are not written during the call (XLA does not alias them to the results, and the C API
    // takes them as const).
    let ctx = unsafe {
        Ctx::<T, TB> {
            p: geom,
            u: input(p.u, x_len),
            delta: input(p.delta, x_len),
            z: optional(p.z, x_len),
            a: input(p.a as *const c_void, dim * dstate),
            b: input(p.b, bc_len),
            c: input(p.c, bc_len),
            d: optional(p.d as *const c_void, dim),
            bias: optional(p.delta_bias as *const c_void, dim),
            h0: optional(p.initial_state as *const c_void, state_len),
            out: Out { ptr: p.out as *mut T, len: x_len },
            final_state: Out { ptr: p.final_state, len: state_len },
            checkpoints: (!p.checkpoints.is_null()).then_some(Out { ptr: p.checkpoints, len: checkpoints_len }),
        }
    };

    let isa = Isa::detect();
    let plan = Plan::new(&geom, time_varying, isa.lanes(), p.checkpoint_len as usize);
    let work = batch * dim * seqlen.max(1) * dstate.max(1);
    let threads = if work < PARALLEL_WORK {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(plan.blocks)
    };
    let plan = plan.schedule(threads);
    // Threads take segments in order from this counter until none is left.
    let next = AtomicUsize::new(0);
    let (ctx, plan, next) = (&ctx, &plan, &next);
    in_parallel(threads, plan.scratch_floats(), |scratch| worker(isa, ctx, plan, next, scratch));
}

/// Runs `work` on `threads` threads (the calling one and pool workers, see [`pool`]), each with its
/// own 64-byte-aligned scratch of `floats` floats (contents undefined). Scratch is one allocation
/// kept by the calling thread and reused by later calls.
pub(super) fn in_parallel(threads: usize, floats: usize, work: impl Fn(&mut [f32]) + Sync) {
    // 16 spare floats to align the first piece.
    let per_thread = floats.next_multiple_of(16).max(16);
    let needed = per_thread * threads + 16;
    let mut own = Vec::new();
    SCRATCH.with(|cell| {
        // A nested call on this thread (not expected) would find the cell borrowed: it then
        // allocates for itself.
        let mut guard = cell.try_borrow_mut();
        let buf = match guard.as_deref_mut() {
            Ok(buf) => buf,
            Err(_) => &mut own,
        };
        if buf.len() < needed {
            *buf = vec![0f32; needed];
        }
        let skip = buf.as_ptr().align_offset(64).min(16);
        // One piece per part; each lock is taken once, by the part's thread.
        let pieces: Vec<Mutex<&mut [f32]>> =
            buf[skip..].chunks_exact_mut(per_thread).take(threads).map(Mutex::new).collect();
        pool::run(threads, &|part| work(&mut pieces[part].lock().unwrap_or_else(PoisonError::into_inner)));
    });
}

/// Defines `fn worker<T, TB>(isa, ctx, plan, next, scratch)`, which runs `$body::<T, TB, lanes, fma>`
/// (an `#[inline(always)]` loop over the work) compiled for the CPU's instruction set. Each set's
/// copy lives in a module of its own because rustc makes one codegen unit per module: the copies
/// (fully inlined, ~150 kB of code each in the backward) are then optimized in parallel. In one
/// module they were one unit, compiled on one core for most of the crate's ~15 min release build.
macro_rules! isa_workers {
    ($body:ident) => {
        fn worker<T: Io, TB: Io>(isa: Isa, ctx: &Ctx<T, TB>, plan: &Plan, next: &AtomicUsize, scratch: &mut [f32]) {
            // SAFETY (both unsafe calls): `Isa::detect` saw the features these functions are compiled for.
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { avx512::worker(ctx, plan, next, scratch) },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::worker(ctx, plan, next, scratch) },
                Isa::Portable => portable::worker(ctx, plan, next, scratch),
            }
        }

        #[cfg(target_arch = "x86_64")]
        mod avx512 {
            use super::*;
            #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
            pub(super) fn worker<T: Io, TB: Io>(
                ctx: &Ctx<T, TB>,
                plan: &Plan,
                next: &AtomicUsize,
                scratch: &mut [f32],
            ) {
                $body::<T, TB, 16, true>(ctx, plan, next, scratch)
            }
        }

        #[cfg(target_arch = "x86_64")]
        mod avx2 {
            use super::*;
            #[target_feature(enable = "avx2,fma")]
            pub(super) fn worker<T: Io, TB: Io>(
                ctx: &Ctx<T, TB>,
                plan: &Plan,
                next: &AtomicUsize,
                scratch: &mut [f32],
            ) {
                $body::<T, TB, 8, true>(ctx, plan, next, scratch)
            }
        }

        mod portable {
            use super::*;
            pub(super) fn worker<T: Io, TB: Io>(
                ctx: &Ctx<T, TB>,
                plan: &Plan,
                next: &AtomicUsize,
                scratch: &mut [f32],
            ) {
                $body::<T, TB, 8, false>(ctx, plan, next, scratch)
            }
        }
    };
}
pub(super) use isa_workers;

isa_workers!(segments);

// ------------------------------------------------------------------------------------ worker

/// Takes the next `len` floats of `buf`.
pub(super) fn take<'a>(buf: &mut &'a mut [f32], len: usize) -> &'a mut [f32] {
    let (head, tail) = std::mem::take(buf).split_at_mut(len);
    *buf = tail;
    head
}

/// The same, as `len` lane vectors.
pub(super) fn take_lanes<'a, const W: usize>(buf: &mut &'a mut [f32], len: usize) -> &'a mut [[f32; W]] {
    take(buf, len * W).as_chunks_mut::<W>().0
}

/// Runs segments taken from `next` until there are none left.
#[inline(always)]
fn segments<T: Io, TB: Io, const W: usize, const FMA: bool>(
    ctx: &Ctx<T, TB>,
    plan: &Plan,
    next: &AtomicUsize,
    mut scratch: &mut [f32],
) {
    debug_assert_eq!(plan.w, W);
    let p = &ctx.p;
    let n = plan.dstate;
    let buf = &mut scratch;
    let states = take_lanes::<W>(buf, plan.segment * n);
    let a = take_lanes::<W>(buf, n);
    let dt = take_lanes::<W>(buf, plan.chunk);
    let dtu = take_lanes::<W>(buf, plan.chunk);
    let y = take_lanes::<W>(buf, plan.chunk);
    let bv = take_lanes::<W>(buf, plan.lane_bc() / W);
    let cv = take_lanes::<W>(buf, plan.lane_bc() / W);
    let bs = take(buf, plan.shared_bc());
    let cs = take(buf, plan.shared_bc());
    let x_bytes = std::mem::size_of_val(ctx.u) * if ctx.z.is_some() { 3 } else { 2 };
    let prefetching = x_bytes > PREFETCH_BYTES;

    loop {
        let segment = next.fetch_add(1, Ordering::Relaxed);
        if segment >= plan.segments {
            break;
        }
        let Range { start, end } = plan.segment_blocks(segment);
        let (b, g, _, _) = plan.block(start);
        let seg_states = &mut states[..(end - start) * n];

        for (k, i) in (start..end).enumerate() {
            let (_, _, first, width) = plan.block(i);
            for (s, hs) in seg_states[k * n..(k + 1) * n].iter_mut().enumerate() {
                *hs = build(|j| ctx.h0.map_or(0.0, |h0| h0[(b * p.dim + first + lane(j, width)) * n + s]));
            }
        }

        let mut l0 = 0;
        while l0 < plan.seqlen {
            let steps = plan.chunk_steps(l0);
            if plan.shared {
                stage_shared_bc(ctx.b, p, b, g, l0, steps, bs);
                stage_shared_bc(ctx.c, p, b, g, l0, steps, cs);
            }
            for (k, i) in (start..end).enumerate() {
                let (_, _, first, width) = plan.block(i);
                // The next block's chunk (or the first block's next chunk) arrives while this one
                // computes.
                let (next, next_l0) = if i + 1 < end { (i + 1, l0) } else { (start, l0 + steps) };
                if prefetching && next_l0 < plan.seqlen {
                    let (_, _, next_first, next_width) = plan.block(next);
                    let next_steps = plan.chunk_steps(next_l0);
                    for x in [Some(ctx.delta), Some(ctx.u), ctx.z].into_iter().flatten() {
                        prefetch_x(x, p, b, next_first, next_width, next_l0, next_steps);
                    }
                }
                let h = &mut seg_states[k * n..(k + 1) * n];
                if let Some(checkpoints) = &ctx.checkpoints {
                    if l0 % plan.checkpoint_len == 0 {
                        write_checkpoint(checkpoints, p, plan, b, first, width, l0 / plan.checkpoint_len, h);
                    }
                }
                let (dt, dtu, y) = (&mut dt[..steps], &mut dtu[..steps], &mut y[..steps]);
                for (s, av) in a.iter_mut().enumerate() {
                    *av = build(|j| ctx.a[(first + lane(j, width)) * n + s] * std::f32::consts::LOG2_E);
                }
                stage_inputs::<T, TB, W, FMA>(ctx, b, first, width, l0, dt, dtu, y);
                let bc = if plan.shared {
                    Bc::Shared { b: &bs[..steps * n], c: &cs[..steps * n] }
                } else {
                    let rows = if plan.time_varying { steps } else { 1 };
                    let (bv, cv) = (&mut bv[..rows * n], &mut cv[..rows * n]);
                    stage_lane_bc(ctx.b, p, b, first, width, l0, bv);
                    stage_lane_bc(ctx.c, p, b, first, width, l0, cv);
                    Bc::Lanes { b: bv, c: cv, row: if plan.time_varying { n } else { 0 } }
                };
                scan_states::<W, FMA>(h, a, dt, dtu, y, bc);
                write_out::<T, TB, W, FMA>(ctx, b, first, width, l0, dt, y);
            }
            l0 += steps;
        }

        for (k, i) in (start..end).enumerate() {
            let (_, _, first, width) = plan.block(i);
            for (s, hs) in seg_states[k * n..(k + 1) * n].iter().enumerate() {
                for (lane, &v) in hs[..width].iter().enumerate() {
                    // SAFETY: this thread owns channels first..first + width of batch b.
                    unsafe { ctx.final_state.rows((b * p.dim + first + lane) * n + s, 1)[0] = v };
                }
            }
        }
    }
}

/// Checkpoint `k` of channels first..first + width of batch b: their states `h`, [state][lane].
#[allow(clippy::too_many_arguments)]
fn write_checkpoint<const W: usize>(
    checkpoints: &Out<f32>,
    p: &Geom,
    plan: &Plan,
    b: usize,
    first: usize,
    width: usize,
    k: usize,
    h: &[[f32; W]],
) {
    let n = p.dstate;
    let n_checkpoints = plan.seqlen.div_ceil(plan.checkpoint_len);
    for lane in 0..width {
        // SAFETY: this thread owns channels first..first + width of batch b.
        let row = unsafe { checkpoints.rows(((b * p.dim + first + lane) * n_checkpoints + k) * n, n) };
        for (o, hs) in row.iter_mut().zip(h) {
            *o = hs[lane];
        }
    }
}

/// Asks for the cache lines of x[b, first.., l0..l0 + steps] ahead of use: the operands stream
/// from memory once, W rows at a time, which the hardware prefetchers alone do not keep up with.
#[inline(always)]
fn prefetch_x<T>(x: &[T], p: &Geom, b: usize, first: usize, width: usize, l0: usize, steps: usize) {
    if p.x_stride_seq == 1 {
        for lane in 0..width {
            prefetch(&x[p.x(b, first + lane, l0)..][..steps]);
        }
    } else {
        for step in 0..steps {
            prefetch(&x[p.x(b, first, l0 + step)..][..width]);
        }
    }
}

/// Prefetches the cache lines of `s` into L1 (a hint: no effect on results).
#[inline(always)]
fn prefetch<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (start, bytes) = (s.as_ptr() as *const i8, std::mem::size_of_val(s));
        if bytes == 0 {
            return;
        }
        let mut offset = 0;
        while offset < bytes {
            // SAFETY: the address is inside `s`; a prefetch reads nothing architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(offset)) };
            offset += 64;
        }
        // The last line, when `s` does not start on a line boundary. SAFETY: as above.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(start.add(bytes - 1)) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

/// Copies x[b, first + lane, l0 + step] into dst[step] as f32. Lanes past `width` repeat the last
/// channel (see [`lane`]). Reads in address order for either layout; channel-first data goes through
/// registers TILE steps at a time, so that LLVM transposes it with shuffles.
#[inline(always)]
pub(super) fn transpose_in<T: Io, const W: usize>(
    x: &[T],
    p: &Geom,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    dst: &mut [[f32; W]],
) {
    if p.x_stride_seq != 1 {
        // Channel-last: the lanes of a step are contiguous.
        for (step, v) in dst.iter_mut().enumerate() {
            let row = &x[p.x(b, first, l0 + step)..][..width];
            if let Ok(row) = <&[T; W]>::try_from(row) {
                for (o, e) in v.iter_mut().zip(row) {
                    *o = e.load();
                }
            } else {
                for (i, o) in v.iter_mut().enumerate() {
                    *o = row[lane(i, width)].load();
                }
            }
        }
        return;
    }
    let rows: [usize; W] = build(|i| p.x(b, first + lane(i, width), l0));
    let done = dst.len() - dst.len() % TILE;
    for (t, out) in dst[..done].chunks_exact_mut(TILE).enumerate() {
        let out: &mut [[f32; W]; TILE] = out.try_into().unwrap();
        let mut tile = [[0f32; TILE]; W];
        for (row, &start) in tile.iter_mut().zip(&rows) {
            let src: &[T; TILE] = x[start + t * TILE..][..TILE].try_into().unwrap();
            for (o, e) in row.iter_mut().zip(src) {
                *o = e.load();
            }
        }
        transpose(&tile, out);
    }
    for (k, v) in dst[done..].iter_mut().enumerate() {
        *v = build(|i| x[rows[i] + done + k].load());
    }
}

/// dst[j][i] = src[i][j], in the plain form that LLVM turns into shuffles for the shapes used here
/// (W x 8 and 8 x 8; 8 x 16 came out as scalar moves, and 16 x 16 as gathers).
#[inline(always)]
fn transpose<const R: usize, const C: usize>(src: &[[f32; C]; R], dst: &mut [[f32; R]; C]) {
    for i in 0..R {
        for j in 0..C {
            dst[j][i] = src[i][j];
        }
    }
}

/// `std::array::from_fn`, which LLVM does not always inline (the hot transposes need it inlined).
#[inline(always)]
pub(super) fn build<E: Copy + Default, const N: usize>(mut f: impl FnMut(usize) -> E) -> [E; N] {
    let mut r = [E::default(); N];
    for (i, e) in r.iter_mut().enumerate() {
        *e = f(i);
    }
    r
}

/// The channel that lane `i` of a block of `width` channels computes: lanes past the last channel
/// repeat it, so that they compute finite, unused values rather than need masking.
#[inline(always)]
pub(super) fn lane(i: usize, width: usize) -> usize {
    i.min(width - 1)
}

/// dt = softplus?(delta + bias), dtu = dt * u, y = D * u for the chunk, [step][lane].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn stage_inputs<T: Io, TB: Io, const W: usize, const FMA: bool>(
    ctx: &Ctx<T, TB>,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    dt: &mut [[f32; W]],
    dtu: &mut [[f32; W]],
    y: &mut [[f32; W]],
) {
    let p = &ctx.p;
    transpose_in(ctx.delta, p, b, first, width, l0, dt);
    transpose_in(ctx.u, p, b, first, width, l0, dtu);
    let per_lane = |v: Option<&[f32]>| V::<W>(build(|i| v.map_or(0.0, |v| v[first + lane(i, width)])));
    let (bias, skip) = (per_lane(ctx.bias), per_lane(ctx.d));
    let softplus_on = p.delta_softplus;
    for ((dt, dtu), y) in dt.iter_mut().zip(dtu.iter_mut()).zip(y.iter_mut()) {
        let v = V(*dt) + bias;
        let v = if softplus_on { v.map(softplus::<FMA>) } else { v };
        let u = V(*dtu);
        *dt = v.0;
        *dtu = (v * u).0;
        *y = (skip * u).0;
    }
}

/// B (or C) of (b, group g) for steps l0.., as f32 [step][state]. Reads in address order.
#[inline(always)]
pub(super) fn stage_shared_bc<TB: Io>(
    src: &[TB],
    p: &Geom,
    b: usize,
    g: usize,
    l0: usize,
    steps: usize,
    dst: &mut [f32],
) {
    let (n, d) = (p.dstate, g * p.dim_per_group); // d: any channel of the group
    if n == 0 {
        return;
    }
    if p.bc_stride_seq == 1 {
        // [state][step] rows: transposed through registers in TILE x TILE pieces where the sizes
        // allow, element by element for the rest.
        let done = if n % TILE == 0 { steps - steps % TILE } else { 0 };
        for s0 in (0..n).step_by(TILE).filter(|_| done > 0) {
            for t0 in (0..done).step_by(TILE) {
                let piece: [[f32; TILE]; TILE] = build(|i| {
                    let row: &[TB; TILE] = src[p.bc(b, d, s0 + i, l0 + t0)..][..TILE].try_into().unwrap();
                    build(|k| row[k].load())
                });
                let mut tile = [[0f32; TILE]; TILE];
                transpose(&piece, &mut tile);
                for (k, row) in tile.iter().enumerate() {
                    dst[(t0 + k) * n + s0..][..TILE].copy_from_slice(row);
                }
            }
        }
        for s in 0..n {
            for (step, e) in src[p.bc(b, d, s, l0 + done)..][..steps - done].iter().enumerate() {
                dst[(done + step) * n + s] = e.load();
            }
        }
    } else {
        for (step, out) in dst[..steps * n].chunks_exact_mut(n).enumerate() {
            for (o, e) in out.iter_mut().zip(&src[p.bc(b, d, 0, l0 + step)..][..n]) {
                *o = e.load();
            }
        }
    }
}

/// B (or C) per lane, dst[step * dstate + s] for steps l0.. (one step when B/C are time-invariant:
/// their strides over time are 0).
#[inline(always)]
pub(super) fn stage_lane_bc<TB: Io, const W: usize>(
    src: &[TB],
    p: &Geom,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    dst: &mut [[f32; W]],
) {
    let n = p.dstate;
    for (i, v) in dst.iter_mut().enumerate() {
        let (step, s) = (i / n, i % n);
        *v = build(|j| src[p.bc(b, first + lane(j, width), s, l0 + step)].load());
    }
}

/// B and C of a chunk: shared by the lanes ([step][state] scalars), or per lane
/// (`row` vectors per step: dstate, or 0 when time-invariant).
#[derive(Clone, Copy)]
pub(super) enum Bc<'a, const W: usize> {
    Shared { b: &'a [f32], c: &'a [f32] },
    Lanes { b: &'a [[f32; W]], c: &'a [[f32; W]], row: usize },
}

/// The scan of one block over one chunk, states taken in groups whose size is a compile-time
/// constant (16, 8, 4, 1), so that each group's states and the accumulator of y stay in registers.
#[inline(always)]
pub(super) fn scan_states<const W: usize, const FMA: bool>(
    h: &mut [[f32; W]],
    a: &[[f32; W]],
    dt: &[[f32; W]],
    dtu: &[[f32; W]],
    y: &mut [[f32; W]],
    bc: Bc<W>,
) {
    let n = h.len();
    let mut s0 = 0;
    while s0 < n {
        let left = n - s0;
        s0 += if left >= 16 {
            scan::<W, FMA, 16>(h, a, s0, dt, dtu, y, bc)
        } else if left >= 8 {
            scan::<W, FMA, 8>(h, a, s0, dt, dtu, y, bc)
        } else if left >= 4 {
            scan::<W, FMA, 4>(h, a, s0, dt, dtu, y, bc)
        } else {
            scan::<W, FMA, 1>(h, a, s0, dt, dtu, y, bc)
        };
    }
}

/// States s0..s0 + G over the chunk: for each step, for each of them,
/// h = exp(dt * A) * h + (dt * u) * B;  y += C * h.  `a` holds A log2 e (see [`exp2`]). Returns G.
#[inline(always)]
fn scan<const W: usize, const FMA: bool, const G: usize>(
    h: &mut [[f32; W]],
    a: &[[f32; W]],
    s0: usize,
    dt: &[[f32; W]],
    dtu: &[[f32; W]],
    y: &mut [[f32; W]],
    bc: Bc<W>,
) -> usize {
    let n = h.len();
    let h: &mut [[f32; W]; G] = (&mut h[s0..s0 + G]).try_into().unwrap();
    let a: &[[f32; W]; G] = a[s0..s0 + G].try_into().unwrap();
    let a = a.map(V);
    let mut hg = h.map(V);
    for (l, ((dt, dtu), y)) in dt.iter().zip(dtu).zip(y.iter_mut()).enumerate() {
        let (dt, dtu, y0) = (V(*dt), V(*dtu), V(*y));
        let acc = match bc {
            Bc::Shared { b, c } => {
                let b: &[f32; G] = b[l * n + s0..][..G].try_into().unwrap();
                let c: &[f32; G] = c[l * n + s0..][..G].try_into().unwrap();
                step::<W, FMA, G>(&mut hg, &a, dt, dtu, y0, |j| (V::splat(b[j]), V::splat(c[j])))
            }
            Bc::Lanes { b, c, row } => {
                let b: &[[f32; W]; G] = b[l * row + s0..][..G].try_into().unwrap();
                let c: &[[f32; W]; G] = c[l * row + s0..][..G].try_into().unwrap();
                step::<W, FMA, G>(&mut hg, &a, dt, dtu, y0, |j| (V(b[j]), V(c[j])))
            }
        };
        *y = acc.0;
    }
    *h = hg.map(|v| v.0);
    G
}

/// `$body` with `$i` = 0, 1, ... for each `$i < $n` (`$n` at most 8): a loop unrolled in the source.
/// Left to LLVM, the loop over state pairs in [`step`] stays rolled at some inlining budgets (they
/// change with the crate's codegen units) and is then vectorized across pairs with shuffles:
/// 30% slower.
macro_rules! unrolled {
    ($n:expr, |$i:ident| $body:block) => {
        unrolled!(@ $n, $i, $body, 0 1 2 3 4 5 6 7)
    };
    (@ $n:expr, $i:ident, $body:block, $($k:literal)*) => {
        $(
            if $k < $n {
                let $i: usize = $k;
                $body
            }
        )*
    };
}

/// One step for G states: h[j] = 2^(dt * a[j]) * h[j] + dtu * B[j] (a = A log2 e, so the factor is
/// exp(dt * A)); returns y + sum_j C[j] * h[j], summed in two chains (even and odd j) to halve the
/// dependent FMAs.
#[inline(always)]
fn step<const W: usize, const FMA: bool, const G: usize>(
    h: &mut [V<W>; G],
    a: &[V<W>; G],
    dt: V<W>,
    dtu: V<W>,
    y: V<W>,
    bc: impl Fn(usize) -> (V<W>, V<W>),
) -> V<W> {
    const { assert!(G <= 16) };
    let (mut even, mut odd) = (y, V::splat(0.0));
    unrolled!(G / 2, |pair| {
        let (j0, j1) = (2 * pair, 2 * pair + 1);
        let ((b0, c0), (b1, c1)) = (bc(j0), bc(j1));
        let (d0, d1) = (exp2::<W, FMA>(dt * a[j0]), exp2::<W, FMA>(dt * a[j1]));
        h[j0] = d0.mul_add::<FMA>(h[j0], dtu * b0);
        h[j1] = d1.mul_add::<FMA>(h[j1], dtu * b1);
        even = c0.mul_add::<FMA>(h[j0], even);
        odd = c1.mul_add::<FMA>(h[j1], odd);
    });
    if G % 2 == 1 {
        let (b, c) = bc(G - 1);
        h[G - 1] = exp2::<W, FMA>(dt * a[G - 1]).mul_add::<FMA>(h[G - 1], dtu * b);
        even = c.mul_add::<FMA>(h[G - 1], even);
    }
    even + odd
}

/// out = y * silu(z) (z staged into `zbuf`, free once the scan is done), rounded to T and written
/// in the operand's layout (the reverse of [`transpose_in`]).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn write_out<T: Io, TB: Io, const W: usize, const FMA: bool>(
    ctx: &Ctx<T, TB>,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    zbuf: &mut [[f32; W]],
    y: &mut [[f32; W]],
) {
    let p = &ctx.p;
    if let Some(z) = ctx.z {
        transpose_in(z, p, b, first, width, l0, zbuf);
        for (y, z) in y.iter_mut().zip(zbuf.iter()) {
            *y = (V(*y) * V(*z).map(silu::<FMA>)).0;
        }
    }
    write_x(&ctx.out, p, b, first, width, l0, y);
}

/// Writes src[step] (lanes 0..width) to x[b, first + lane, l0 + step], rounded to T, in the
/// operand's layout: the reverse of [`transpose_in`]. Inlined so that it is compiled for the
/// caller's ISA (see [`Isa`]); on its own it would be baseline x86-64.
#[inline(always)]
pub(super) fn write_x<T: Io, const W: usize>(
    out: &Out<T>,
    p: &Geom,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    y: &[[f32; W]],
) {
    // SAFETY (every `rows` below): the caller's thread owns channels first..first + width of batch b.
    if p.x_stride_seq != 1 {
        for (step, v) in y.iter().enumerate() {
            let out = unsafe { out.rows(p.x(b, first, l0 + step), width) };
            for (o, &e) in out.iter_mut().zip(v) {
                *o = T::store(e);
            }
        }
        return;
    }
    let mut tiles = y.chunks_exact(TILE);
    for (t, rows) in (&mut tiles).enumerate() {
        // TILE x TILE pieces: see `transpose` for the shapes LLVM shuffles well.
        for half in (0..W / TILE).map(|h| h * TILE).filter(|&h| h < width) {
            let piece: [[f32; TILE]; TILE] = build(|k| rows[k][half..half + TILE].try_into().unwrap());
            let mut tile = [[0f32; TILE]; TILE];
            transpose(&piece, &mut tile);
            for (i, row) in tile[..TILE.min(width - half)].iter().enumerate() {
                let out = unsafe { out.rows(p.x(b, first + half + i, l0 + t * TILE), TILE) };
                let out: &mut [T; TILE] = out.try_into().unwrap();
                *out = build(|k| T::store(row[k]));
            }
        }
    }
    let done = y.len() - tiles.remainder().len();
    for (k, v) in y[done..].iter().enumerate() {
        for (i, &e) in v[..width].iter().enumerate() {
            unsafe { out.rows(p.x(b, first + i, l0 + done + k), 1)[0] = T::store(e) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn bf16_rounding_matches_half() {
        let special = [0x7f7f_ffff, 0x7fc0_0001, 0xff80_0000, 0x3f80_8000, 0x3f81_8000, 0x0000_8000];
        for bits in (0..=u32::MAX).step_by(9973).chain(special) {
            let x = f32::from_bits(bits);
            let (ours, theirs) = (<bf16 as Io>::store(x), bf16::from_f32(x));
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "{x:e} ({bits:#x})");
        }
    }
}
