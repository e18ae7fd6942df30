//! The forward selective scan (`selective_scan_fwd`).
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
//!   channel; see [`crate::cpu::math`]), branch-free, so that it vectorizes with the rest of the loop.
//! - **Values, not arrays, in the hot loop** ([`V`]); states are scanned in groups of a compile-time
//!   size ([`scan`]) so that the accumulators of `y` stay in registers too.
//! - **Time in chunks.** The sequence is cut into chunks of at most [`CHUNK`] steps. Per chunk, B and
//!   C of the current (batch, group) are converted to f32 once, into a [step][state] scratch that all
//!   of that group's blocks on this thread share; each block's delta and u (then z, and out) are
//!   transposed between the operand's layout and [step][lane] scratch, 8 steps at a time through
//!   registers, and prefetched one block ahead. A chunk's data stays in L1/L2, operands are read
//!   once and in address order, and scratch does not grow with `seqlen`. A block's state waits in
//!   scratch between chunks.
//! - **Element types at the edges.** Staging converts the operands' elements to f32 scratch and the
//!   results back ([`Elems`], one match per staging call): the scan itself, and the worker around
//!   it, are compiled once per instruction set ([`isa_workers!`]), whatever the dtypes. Each staging
//!   function (and the scan of a chunk, for the backward) is a function of its own per instruction
//!   set ([`isa_fns!`]), which both workers call: compiled once, not inlined at every call.
//! - **Threads over blocks.** Threads (as many as cores: the calling one and persistent workers of
//!   [`pool`]) take segments of consecutive blocks from a shared counter, so a late or slowed thread
//!   takes fewer; each writes only its own channels. Scratch is kept per calling thread and reused
//!   across calls.
//! - **Checkpoints** (for the backward pass, [`super::selective_scan_bwd`]): chunks never cross a
//!   multiple of `checkpoint_len`, so that a block's state at a chunk's start is the checkpoint when
//!   one is due.
//!
//! All arithmetic is f32; `out` is rounded to its dtype once, at the end.

use super::elems::{input, optional, typed, Elems, ElemsOut, Io, Out};
use super::isa::{isa_fns, isa_workers, Isa};
use super::lanes::{build, lane, transpose, V};
use super::math::{exp2, silu, softplus};
use super::pool::{self, in_parallel, take, take_lanes};
use crate::ops::selective_scan::{n_checkpoints, Fwd, FwdParams};
use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

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

/// The operands: inputs as typed slices, outputs as raw arrays (written by several threads at
/// disjoint indices).
struct Ctx<'a> {
    p: Geom,
    u: Elems<'a>,
    delta: Elems<'a>,
    z: Option<Elems<'a>>,
    a: &'a [f32],
    b: Elems<'a>,
    c: Elems<'a>,
    d: Option<&'a [f32]>,
    bias: Option<&'a [f32]>,
    h0: Option<&'a [f32]>,
    out: ElemsOut,
    final_state: Out<f32>,
    /// (batch, dim, n_checkpoints, dstate), when the host asks for checkpoints.
    checkpoints: Option<Out<f32>>,
    /// Packed sequences' boundaries (batch 1; h0 and final_state per sequence), when given.
    cu: Option<Vec<usize>>,
}

impl Ctx<'_> {
    /// Steps of the chunk at `l0`: [`Plan::chunk_steps`], and never across a sequence boundary.
    fn chunk_steps(&self, plan: &Plan, l0: usize) -> usize {
        let steps = plan.chunk_steps(l0);
        match &self.cu {
            Some(cu) => steps.min(cu[cu.partition_point(|&c| c <= l0).min(cu.len() - 1)].max(l0 + 1) - l0),
            None => steps,
        }
    }

    /// The boundary rule at step `l` of packed sequences (docs/selective_scan_fwd.md), for channels
    /// first..first + width: each sequence ending here leaves `h` as its final state, and one
    /// starting here replaces it with its initial state (or 0).
    fn boundary<const W: usize>(&self, cu: &[usize], l: usize, first: usize, width: usize, h: &mut [[f32; W]]) {
        let (n, dim) = (self.p.dstate, self.p.dim);
        let mut s = cu.partition_point(|&c| c < l);
        while s < cu.len() && cu[s] == l {
            if s >= 1 {
                for (st, hs) in h.iter().enumerate() {
                    for (lane, &v) in hs[..width].iter().enumerate() {
                        // SAFETY: this thread owns channels first..first + width (batch is 1).
                        unsafe { self.final_state.rows(((s - 1) * dim + first + lane) * n + st, 1)[0] = v };
                    }
                }
            }
            if s + 1 < cu.len() {
                for (st, hs) in h.iter_mut().enumerate() {
                    *hs = build(|j| self.h0.map_or(0.0, |h0| h0[(s * dim + first + lane(j, width)) * n + st]));
                }
            }
            s += 1;
        }
    }
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

pub(crate) fn fwd(fwd: &Fwd) {
    let p = &fwd.params();
    let time_varying = fwd.bc_time_varying();
    let geom = Geom::new(p);
    let (batch, dim, seqlen, dstate) = (geom.batch, geom.dim, geom.seqlen, geom.dstate);
    if batch == 0 || dim == 0 {
        return;
    }
    let x_len = batch * dim * seqlen;
    let bc_len = if time_varying { batch * (dim / geom.dim_per_group) * dstate * seqlen } else { dim * dstate };
    let checkpoints_len = batch * dim * dstate * n_checkpoints(p.seqlen, p.checkpoint_len) as usize;
    // SAFETY: validated; the CPU target's buffers are host memory.
    let cu = unsafe { p.host_cu_seqlens() }.map(|cu| cu.iter().map(|&c| c as usize).collect::<Vec<_>>());
    let state_len = cu.as_ref().map_or(batch, |cu| cu.len() - 1) * dim * dstate;
    let (dtype, bc_dtype) = (fwd.dtype(), fwd.bc_dtype());
    // SAFETY: `validate_fwd` checked every operand's shape, dtype and non-nullness against these
    // sizes; inputs are not written during the call (XLA does not alias them to the results, and the
    // C API takes them as const).
    let ctx = unsafe {
        Ctx {
            p: geom,
            u: Elems::new(dtype, p.u, x_len),
            delta: Elems::new(dtype, p.delta, x_len),
            z: Elems::optional(dtype, p.z, x_len),
            a: input(p.a as *const c_void, dim * dstate),
            b: Elems::new(bc_dtype, p.b, bc_len),
            c: Elems::new(bc_dtype, p.c, bc_len),
            d: optional(p.d as *const c_void, dim),
            bias: optional(p.delta_bias as *const c_void, dim),
            h0: optional(p.initial_state as *const c_void, state_len),
            out: ElemsOut::new(dtype, p.out, x_len),
            final_state: Out { ptr: p.final_state, len: state_len },
            checkpoints: (!p.checkpoints.is_null()).then_some(Out { ptr: p.checkpoints, len: checkpoints_len }),
            cu,
        }
    };

    let isa = Isa::detect();
    let plan = Plan::new(&geom, time_varying, isa.lanes(), p.checkpoint_len as usize);
    let threads = pool::threads_for(batch * dim * seqlen.max(1) * dstate.max(1), plan.blocks);
    let plan = plan.schedule(threads);
    // Threads take segments in order from this counter until none is left.
    let next = AtomicUsize::new(0);
    let (ctx, plan, next) = (&ctx, &plan, &next);
    in_parallel(threads, plan.scratch_floats(), |scratch| worker(isa, ctx, plan, next, scratch));
}

isa_workers!(segments(ctx: &Ctx<'_>, plan: &Plan, next: &AtomicUsize, scratch: &mut [f32]));

// ------------------------------------------------------------------------------------ worker

/// Runs segments taken from `next` until there are none left.
#[inline(always)]
fn segments<const W: usize, const FMA: bool>(ctx: &Ctx, plan: &Plan, next: &AtomicUsize, mut scratch: &mut [f32]) {
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
    let x_bytes = ctx.u.bytes() * if ctx.z.is_some() { 3 } else { 2 };
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
            // Packed: the state before the first sequence is 0 (the rule at step 0 sets it).
            let h0 = if ctx.cu.is_some() { None } else { ctx.h0 };
            for (s, hs) in seg_states[k * n..(k + 1) * n].iter_mut().enumerate() {
                *hs = build(|j| h0.map_or(0.0, |h0| h0[(b * p.dim + first + lane(j, width)) * n + s]));
            }
        }

        let mut l0 = 0;
        while l0 < plan.seqlen {
            let steps = ctx.chunk_steps(plan, l0);
            if plan.shared {
                stage_shared_bc::<W, FMA>(ctx.b, p, b, g, l0, steps, bs);
                stage_shared_bc::<W, FMA>(ctx.c, p, b, g, l0, steps, cs);
            }
            for (k, i) in (start..end).enumerate() {
                let (_, _, first, width) = plan.block(i);
                // The next block's chunk (or the first block's next chunk) arrives while this one
                // computes.
                let (next, next_l0) = if i + 1 < end { (i + 1, l0) } else { (start, l0 + steps) };
                if prefetching && next_l0 < plan.seqlen {
                    let (_, _, next_first, next_width) = plan.block(next);
                    let next_steps = ctx.chunk_steps(plan, next_l0);
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
                if let Some(cu) = &ctx.cu {
                    ctx.boundary(cu, l0, first, width, h);
                }
                let (dt, dtu, y) = (&mut dt[..steps], &mut dtu[..steps], &mut y[..steps]);
                for (s, av) in a.iter_mut().enumerate() {
                    *av = build(|j| ctx.a[(first + lane(j, width)) * n + s] * std::f32::consts::LOG2_E);
                }
                stage_inputs::<W, FMA>(ctx, b, first, width, l0, dt, dtu, y);
                let bc = if plan.shared {
                    Bc::Shared { b: &bs[..steps * n], c: &cs[..steps * n] }
                } else {
                    let rows = if plan.time_varying { steps } else { 1 };
                    let (bv, cv) = (&mut bv[..rows * n], &mut cv[..rows * n]);
                    stage_lane_bc::<W, FMA>(ctx.b, p, b, first, width, l0, bv.as_flattened_mut());
                    stage_lane_bc::<W, FMA>(ctx.c, p, b, first, width, l0, cv.as_flattened_mut());
                    Bc::Lanes { b: bv.as_flattened(), c: cv.as_flattened(), row: if plan.time_varying { n } else { 0 } }
                };
                let (h, y_flat) = (h.as_flattened_mut(), y.as_flattened_mut());
                // Inlined here rather than the per-ISA `scan_states`: with AVX2 (16 vector registers)
                // the call cost the forward 4-8% (measured), with the other sets nothing.
                scan_states_body::<W, FMA>(h, a.as_flattened(), dt.as_flattened(), dtu.as_flattened(), y_flat, bc);
                write_out::<W, FMA>(ctx, b, first, width, l0, dt, y);
            }
            l0 += steps;
        }

        for (k, i) in (start..end).enumerate() {
            let (_, _, first, width) = plan.block(i);
            if let Some(cu) = &ctx.cu {
                ctx.boundary(cu, plan.seqlen, first, width, &mut seg_states[k * n..(k + 1) * n]);
                continue;
            }
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
fn prefetch_x(x: Elems, p: &Geom, b: usize, first: usize, width: usize, l0: usize, steps: usize) {
    typed!(Elems, x, x => if p.x_stride_seq == 1 {
        for lane in 0..width {
            prefetch(&x[p.x(b, first + lane, l0)..][..steps]);
        }
    } else {
        for step in 0..steps {
            prefetch(&x[p.x(b, first, l0 + step)..][..width]);
        }
    })
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

isa_fns! {
    /// Copies x[b, first + lane, l0 + step] into dst[step] (`[f32; W]`s, flattened) as f32. Lanes
    /// past `width` repeat the last channel (see [`lane`]). Reads in address order for either
    /// layout; channel-first data goes through registers TILE steps at a time, so that LLVM
    /// transposes it with shuffles.
    pub(super) fn transpose_in(
        x: Elems<'_>, p: &Geom, b: usize, first: usize, width: usize, l0: usize, dst: &mut [f32]
    ) = transpose_in_body;

    /// Writes src[step] (lanes 0..width of `[f32; W]`s, flattened) to x[b, first + lane, l0 + step],
    /// rounded to the element type, in the operand's layout: the reverse of [`transpose_in`].
    pub(super) fn write_x(
        out: ElemsOut, p: &Geom, b: usize, first: usize, width: usize, l0: usize, src: &[f32]
    ) = write_x_body;

    /// B (or C) of (b, group g) for steps l0.., as f32 [step][state]. Reads in address order.
    pub(super) fn stage_shared_bc(
        src: Elems<'_>, p: &Geom, b: usize, g: usize, l0: usize, steps: usize, dst: &mut [f32]
    ) = stage_shared_bc_body;

    /// B (or C) per lane, dst[step * dstate + s] (`[f32; W]`s, flattened) for steps l0.. (one step
    /// when B/C are time-invariant: their strides over time are 0).
    pub(super) fn stage_lane_bc(
        src: Elems<'_>, p: &Geom, b: usize, first: usize, width: usize, l0: usize, dst: &mut [f32]
    ) = stage_lane_bc_body;

    /// The scan of one block over one chunk (see [`scan_states_body`]), for the backward's
    /// recomputation.
    pub(super) fn scan_states(
        h: &mut [f32], a: &[f32], dt: &[f32], dtu: &[f32], y: &mut [f32], bc: Bc<'_>
    ) = scan_states_body;
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn transpose_in_body<const W: usize, const FMA: bool>(
    x: Elems,
    p: &Geom,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    dst: &mut [f32],
) {
    let dst = dst.as_chunks_mut::<W>().0;
    typed!(Elems, x, x => transpose_in_typed(x, p, b, first, width, l0, dst))
}

#[inline(always)]
fn transpose_in_typed<T: Io, const W: usize>(
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

/// dt = softplus?(delta + bias), dtu = dt * u, y = D * u for the chunk, [step][lane].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn stage_inputs<const W: usize, const FMA: bool>(
    ctx: &Ctx,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    dt: &mut [[f32; W]],
    dtu: &mut [[f32; W]],
    y: &mut [[f32; W]],
) {
    let p = &ctx.p;
    transpose_in::<W, FMA>(ctx.delta, p, b, first, width, l0, dt.as_flattened_mut());
    transpose_in::<W, FMA>(ctx.u, p, b, first, width, l0, dtu.as_flattened_mut());
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

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn stage_shared_bc_body<const W: usize, const FMA: bool>(
    src: Elems,
    p: &Geom,
    b: usize,
    g: usize,
    l0: usize,
    steps: usize,
    dst: &mut [f32],
) {
    typed!(Elems, src, src => stage_shared_bc_typed(src, p, b, g, l0, steps, dst))
}

#[inline(always)]
fn stage_shared_bc_typed<TB: Io>(src: &[TB], p: &Geom, b: usize, g: usize, l0: usize, steps: usize, dst: &mut [f32]) {
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

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn stage_lane_bc_body<const W: usize, const FMA: bool>(
    src: Elems,
    p: &Geom,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    dst: &mut [f32],
) {
    let (n, dst) = (p.dstate, dst.as_chunks_mut::<W>().0);
    typed!(Elems, src, src => for (i, v) in dst.iter_mut().enumerate() {
        let (step, s) = (i / n, i % n);
        *v = build(|j| src[p.bc(b, first + lane(j, width), s, l0 + step)].load());
    })
}

/// B and C of a chunk: shared by the lanes ([step][state] scalars), or per lane (`row` vectors per
/// step: dstate, or 0 when time-invariant; `[f32; W]`s, flattened).
#[derive(Clone, Copy)]
pub(super) enum Bc<'a> {
    Shared { b: &'a [f32], c: &'a [f32] },
    Lanes { b: &'a [f32], c: &'a [f32], row: usize },
}

/// [`Bc`] with the lane vectors re-chunked.
#[derive(Clone, Copy)]
enum BcLanes<'a, const W: usize> {
    Shared { b: &'a [f32], c: &'a [f32] },
    Lanes { b: &'a [[f32; W]], c: &'a [[f32; W]], row: usize },
}

/// The scan of one block over one chunk, states taken in groups whose size is a compile-time
/// constant (16, 8, 4, 1), so that each group's states and the accumulator of y stay in registers.
#[inline(always)]
fn scan_states_body<const W: usize, const FMA: bool>(
    h: &mut [f32],
    a: &[f32],
    dt: &[f32],
    dtu: &[f32],
    y: &mut [f32],
    bc: Bc,
) {
    let (h, y) = (h.as_chunks_mut::<W>().0, y.as_chunks_mut::<W>().0);
    let (a, dt, dtu) = (a.as_chunks::<W>().0, dt.as_chunks::<W>().0, dtu.as_chunks::<W>().0);
    let bc = match bc {
        Bc::Shared { b, c } => BcLanes::Shared { b, c },
        Bc::Lanes { b, c, row } => BcLanes::Lanes { b: b.as_chunks::<W>().0, c: c.as_chunks::<W>().0, row },
    };
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
    bc: BcLanes<W>,
) -> usize {
    let n = h.len();
    let h: &mut [[f32; W]; G] = (&mut h[s0..s0 + G]).try_into().unwrap();
    let a: &[[f32; W]; G] = a[s0..s0 + G].try_into().unwrap();
    let a = a.map(V);
    let mut hg = h.map(V);
    for (l, ((dt, dtu), y)) in dt.iter().zip(dtu).zip(y.iter_mut()).enumerate() {
        let (dt, dtu, y0) = (V(*dt), V(*dtu), V(*y));
        let acc = match bc {
            BcLanes::Shared { b, c } => {
                let b: &[f32; G] = b[l * n + s0..][..G].try_into().unwrap();
                let c: &[f32; G] = c[l * n + s0..][..G].try_into().unwrap();
                step::<W, FMA, G>(&mut hg, &a, dt, dtu, y0, |j| (V::splat(b[j]), V::splat(c[j])))
            }
            BcLanes::Lanes { b, c, row } => {
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

/// out = y * silu(z) (z staged into `zbuf`, free once the scan is done), rounded to out's dtype and
/// written in the operand's layout (the reverse of [`transpose_in`]).
#[inline(always)]
fn write_out<const W: usize, const FMA: bool>(
    ctx: &Ctx,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    zbuf: &mut [[f32; W]],
    y: &mut [[f32; W]],
) {
    let p = &ctx.p;
    if let Some(z) = ctx.z {
        transpose_in::<W, FMA>(z, p, b, first, width, l0, zbuf.as_flattened_mut());
        for (y, z) in y.iter_mut().zip(zbuf.iter()) {
            *y = (V(*y) * V(*z).map(silu::<FMA>)).0;
        }
    }
    write_x::<W, FMA>(ctx.out, p, b, first, width, l0, y.as_flattened());
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn write_x_body<const W: usize, const FMA: bool>(
    out: ElemsOut,
    p: &Geom,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    src: &[f32],
) {
    let y = src.as_chunks::<W>().0;
    typed!(ElemsOut, out, out => write_x_typed(&out, p, b, first, width, l0, y))
}

#[inline(always)]
fn write_x_typed<T: Io, const W: usize>(
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
