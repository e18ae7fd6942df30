//! The backward selective scan (`selective_scan_bwd`; docs/selective_scan_bwd.md has the math). It
//! is also the CPU training path, so it is built like the forward ([`super::selective_scan`], whose
//! pieces it reuses): channels in SIMD lanes, `W` per *block*, all of one B/C group when B/C vary
//! with time (their values are then broadcast); states in groups whose values stay in registers;
//! inputs staged per piece of time as [step][lane], converted from their element types there, so
//! that the worker is compiled once per instruction set.
//!
//! - **Recomputation from checkpoints.** Time is walked backwards in *pieces* of at most [`PIECE`]
//!   steps that never cross a checkpoint. Per piece, a block's states are recomputed from the
//!   checkpoint into a small history (states and decays of one state group), and the reverse
//!   recurrence `g[l] = a[l+1] g[l+1] + C[l] dy[l]` runs over it. When checkpoints lie more than a
//!   piece apart, one forward pass over a checkpoint's span, when the walk enters it, first leaves the
//!   states entering each of its pieces (sub-checkpoints), so that memory never grows with
//!   `checkpoint_len` beyond one state per piece.
//! - **A fixed partition and ordered sums.** The work is cut into *units* (consecutive blocks of one
//!   batch entry and span: a B/C group, or all channels when B/C are time-invariant) by the shape
//!   alone, never by the thread count. Per-channel results are written by the unit that owns the
//!   channel. Sums over channels and batch (dA, dD, ddelta_bias, dB, dC) go into per-unit partials
//!   (lane vectors summed in lane order, pieces in walk order), which are added in unit order at the
//!   end: the bits depend on neither which thread ran a unit nor how many threads there were.
//! - **Spare lanes.** A block narrower than `W` repeats its last channel in the spare lanes (as in
//!   the forward); their u, cotangents and state gradients are zeroed, so that they add exact zeros.

use super::elems::{input, optional, Elems, ElemsOut, Out};
use super::isa::{isa_fns, isa_workers, Isa};
use super::lanes::{build, lane, lane_sum, lanes, lanes_mut, mask, V};
use super::math::{exp2, sigmoid, softplus};
use super::pool::{self, in_parallel, take, take_lanes};
use super::selective_scan::{scan_states, stage_lane_bc, stage_shared_bc, transpose_in, write_x, Bc, Geom};
use crate::ops::selective_scan::{n_checkpoints, Bwd};
use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Most steps per piece: a state group's history ((2 * PIECE + 1) x GROUP lane vectors) stays in L2.
const PIECE: usize = 64;

/// Bound on the dB and dC lane accumulators of a piece (time-varying B/C: 2 x piece x dstate lane
/// vectors), in floats; large dstate makes pieces shorter.
const PIECE_ACC_FLOATS: usize = 1 << 15;

/// The partition aims for at least this many units (a constant: the partition must not depend on
/// the thread count), so that a small batch x groups still spreads over the cores.
const TARGET_UNITS: usize = 32;

/// Blocks a unit holds at least where the span has them: a piece's B/C staging and dB/dC lane sums
/// are per unit, so that one-block units would pay them once per block.
const MIN_UNIT_BLOCKS: usize = 4;

/// Bound on a unit's per-block state scratch (state gradients and sub-checkpoints), in floats.
const UNIT_STATE_FLOATS: usize = 1 << 15;

/// Most states per register group.
const GROUP: usize = 8;

/// Inputs as slices; per-channel results as shared outputs; partial sums of each unit.
struct Ctx<'a> {
    p: Geom,
    u: Elems<'a>,
    delta: Elems<'a>,
    z: Option<Elems<'a>>,
    dout: Elems<'a>,
    a: &'a [f32],
    b: Elems<'a>,
    c: Elems<'a>,
    d: Option<&'a [f32]>,
    bias: Option<&'a [f32]>,
    checkpoints: &'a [f32],
    dfinal: Option<&'a [f32]>,
    du: ElemsOut,
    ddelta: ElemsOut,
    dz: Option<ElemsOut>,
    dinitial: Option<Out<f32>>,
    /// [block row][lane] each, when D / delta_bias are given.
    part_d: Option<Out<f32>>,
    part_bias: Option<Out<f32>>,
    state_parts: StateParts,
    /// Packed sequences' boundaries (batch 1; the states and their gradients per sequence).
    cu: Option<Vec<usize>>,
    h0: Option<&'a [f32]>,
}

impl Ctx<'_> {
    /// Pieces of `l0..l0 + steps`, cut at the sequence boundaries inside it.
    fn sub_pieces(&self, l0: usize, steps: usize) -> Vec<(usize, usize)> {
        let mut cuts = vec![l0];
        if let Some(cu) = &self.cu {
            cuts.extend(cu.iter().copied().filter(|&c| c > l0 && c < l0 + steps));
            cuts.dedup();
        }
        cuts.push(l0 + steps);
        cuts.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
    }

    /// Packed: the first sequence starting at step `l` (it is a boundary), if one does.
    fn starting(&self, l: usize) -> Option<usize> {
        let cu = self.cu.as_ref()?;
        let s = cu.partition_point(|&c| c < l);
        (s + 1 < cu.len() && cu[s] == l).then(|| cu[..cu.len() - 1].partition_point(|&c| c <= l) - 1)
    }

    /// The forward's boundary rule for the recompute: at step `l` the state of channels first..
    /// first + width becomes the initial state of the sequence starting there (the last of those
    /// that start there: the others are empty), or 0.
    fn reset_state<const W: usize>(&self, l: usize, first: usize, width: usize, h: &mut [[f32; W]]) {
        if let Some(s) = self.starting(l) {
            let (n, dim) = (self.p.dstate, self.p.dim);
            for (st, hs) in h.iter_mut().enumerate() {
                *hs = build(|j| self.h0.map_or(0.0, |h0| h0[(s * dim + first + lane(j, width)) * n + st]));
            }
        }
    }

    /// The backward's boundary rule at step `l` (docs/selective_scan_bwd.md): each sequence starting
    /// here takes `g` as its initial state's gradient, and `g` becomes the final-state cotangent of
    /// the sequence before it (or 0).
    fn reset_grads<const W: usize>(&self, cu: &[usize], l: usize, first: usize, width: usize, g: &mut [[f32; W]]) {
        let (n, dim) = (self.p.dstate, self.p.dim);
        let mut s = cu.partition_point(|&c| c <= l);
        while s > 0 && cu[s - 1] == l {
            s -= 1;
            if s + 1 < cu.len() {
                if let Some(dinitial) = &self.dinitial {
                    for lane in 0..width {
                        // SAFETY: this unit owns channels first..first + width (batch is 1).
                        let row = unsafe { dinitial.rows(((s * dim) + first + lane) * n, n) };
                        for (o, gs) in row.iter_mut().zip(g.iter()) {
                            *o = gs[lane];
                        }
                    }
                }
            }
            if s >= 1 {
                for (st, gs) in g.iter_mut().enumerate() {
                    *gs = build(|j| {
                        if j < width {
                            self.dfinal.map_or(0.0, |f| f[((s - 1) * dim + first + j) * n + st])
                        } else {
                            0.0
                        }
                    });
                }
            }
        }
    }
}

/// The per-state partial sums, which the state loop adds to.
struct StateParts {
    /// Per (batch, channel) sums over time, by lane: [block row][state][lane] (see [`Plan::block_row`]),
    /// so that blocks add whole lane vectors.
    a: Out<f32>,
    /// Time-varying B/C: [unit][dstate][seqlen], the sums over the unit's channels; time-invariant:
    /// as `a`.
    b: Out<f32>,
    c: Out<f32>,
}

/// The partition into units and blocks, and the piece length.
#[derive(Clone, Copy)]
struct Plan {
    w: usize,
    time_varying: bool,
    /// Channels whose blocks a unit may hold: a B/C group when time-varying, else all of dim.
    span: usize,
    spans: usize,
    blocks_per_span: usize,
    unit_blocks: usize,
    units_per_span: usize,
    units: usize,
    dstate: usize,
    seqlen: usize,
    checkpoint_len: usize,
    piece: usize,
    /// Most sub-checkpoints per checkpoint (pieces per checkpoint - 1).
    subs: usize,
}

impl Plan {
    fn new(p: &Geom, time_varying: bool, w: usize, checkpoint_len: usize) -> Plan {
        let n = p.dstate.max(1);
        let span = if time_varying { p.dim_per_group } else { p.dim };
        let spans = p.dim / span;
        let blocks_per_span = span.div_ceil(w);
        let piece = if time_varying { (PIECE_ACC_FLOATS / (2 * n * w)).clamp(8, PIECE) } else { PIECE };
        let piece = piece.min(checkpoint_len);
        let subs = checkpoint_len.div_ceil(piece) - 1;
        let max_unit_blocks = (UNIT_STATE_FLOATS / ((subs + 1) * n * w)).max(1);
        let units_per_span = TARGET_UNITS
            .div_ceil(p.batch * spans)
            .min(blocks_per_span.div_ceil(MIN_UNIT_BLOCKS))
            .max(blocks_per_span.div_ceil(max_unit_blocks))
            .clamp(1, blocks_per_span);
        let unit_blocks = blocks_per_span.div_ceil(units_per_span);
        let units_per_span = blocks_per_span.div_ceil(unit_blocks);
        Plan {
            w,
            time_varying,
            span,
            spans,
            blocks_per_span,
            unit_blocks,
            units_per_span,
            units: p.batch * spans * units_per_span,
            dstate: p.dstate,
            seqlen: p.seqlen,
            checkpoint_len,
            piece,
            subs,
        }
    }

    /// (batch, span, its blocks) of unit `i`.
    fn unit(&self, i: usize) -> (usize, usize, Range<usize>) {
        let (bg, k) = (i / self.units_per_span, i % self.units_per_span);
        let start = k * self.unit_blocks;
        (bg / self.spans, bg % self.spans, start..(start + self.unit_blocks).min(self.blocks_per_span))
    }

    /// Index of block `j` of span `g` of batch entry `b` among all blocks.
    fn block_row(&self, b: usize, g: usize, j: usize) -> usize {
        (b * self.spans + g) * self.blocks_per_span + j
    }

    /// (span, block, lane) of channel `d`.
    fn channel(&self, d: usize) -> (usize, usize, usize) {
        let (g, r) = (d / self.span, d % self.span);
        (g, r / self.w, r % self.w)
    }

    /// (first channel, channels) of block `j` of span `g`.
    fn block(&self, g: usize, j: usize) -> (usize, usize) {
        (g * self.span + j * self.w, self.w.min(self.span - j * self.w))
    }

    /// Floats of B (or C) staged as [step][state] scalars for a piece (time-varying), rounded up to
    /// whole lane vectors.
    fn shared_bc(&self) -> usize {
        if self.time_varying {
            (self.piece * self.dstate).next_multiple_of(self.w)
        } else {
            0
        }
    }

    /// Scratch floats one worker needs (a multiple of `w`, so every piece stays lane-aligned).
    fn scratch_floats(&self) -> usize {
        let (n, w, piece) = (self.dstate, self.w, self.piece);
        let per_block = self.unit_blocks * (1 + self.subs) * n;
        let lanes_bc = if self.time_varying { 0 } else { 2 * n };
        let acc = if self.time_varying { 2 * piece * n } else { 0 };
        let history = (2 * piece + 1) * GROUP;
        (per_block + 3 * n + lanes_bc + acc + history + STAGED * piece) * w + 2 * self.shared_bc()
    }
}

pub(crate) fn bwd(bwd: &Bwd) {
    let p = &bwd.params();
    // Groups of time-varying B/C; 0 when they are time-invariant.
    let groups = bwd.groups() as usize;
    let (dtype, bc_dtype) = (bwd.dtype(), bwd.bc_dtype());
    let time_varying = groups > 0;
    let geom = Geom::new(&p.fwd);
    let (batch, dim, seqlen, n) = (geom.batch, geom.dim, geom.seqlen, geom.dstate);
    // Past seqlen a longer checkpoint_len changes nothing (one checkpoint), except the sub-checkpoint
    // scratch it would size.
    let checkpoint_len = (p.fwd.checkpoint_len as usize).min(seqlen.max(1));
    let isa = Isa::detect();
    let plan = (batch > 0 && dim > 0).then(|| Plan::new(&geom, time_varying, isa.lanes(), checkpoint_len));
    let x_len = batch * dim * seqlen;
    let bc_len = if time_varying { batch * groups * n * seqlen } else { dim * n };
    let checkpoints_len = batch * dim * n * n_checkpoints(p.fwd.seqlen, p.fwd.checkpoint_len) as usize;
    // SAFETY: validated; the CPU target's buffers are host memory.
    let cu = unsafe { p.fwd.host_cu_seqlens() }.map(|cu| cu.iter().map(|&c| c as usize).collect::<Vec<_>>());
    let state_len = cu.as_ref().map_or(batch, |cu| cu.len() - 1) * dim * n;
    let lanes = plan.map_or(0, |plan| batch * plan.spans * plan.blocks_per_span * plan.w);
    let part_bc_len = match plan {
        Some(plan) if time_varying => plan.units * n * seqlen,
        _ => lanes * n,
    };
    // Each partial is written by one unit only (time-varying dB/dC: once per element; the others
    // accumulate from zero).
    let mut part_a = vec![0f32; lanes * n];
    let mut part_d = vec![0f32; if p.fwd.d.is_null() { 0 } else { lanes }];
    let mut part_bias = vec![0f32; if p.fwd.delta_bias.is_null() { 0 } else { lanes }];
    let mut part_b = vec![0f32; part_bc_len];
    let mut part_c = vec![0f32; part_bc_len];
    let out = |v: &mut Vec<f32>| Out { ptr: v.as_mut_ptr(), len: v.len() };
    let some_out = |v: &mut Vec<f32>, present: bool| present.then_some(Out { ptr: v.as_mut_ptr(), len: v.len() });
    // SAFETY: `validate_bwd` checked every operand's shape, dtype and non-nullness against these
    // sizes; inputs are not written during the call.
    let ctx = unsafe {
        Ctx {
            p: geom,
            u: Elems::new(dtype, p.fwd.u, x_len),
            delta: Elems::new(dtype, p.fwd.delta, x_len),
            z: Elems::optional(dtype, p.fwd.z, x_len),
            dout: Elems::new(dtype, p.dout, x_len),
            a: input(p.fwd.a as *const c_void, dim * n),
            b: Elems::new(bc_dtype, p.fwd.b, bc_len),
            c: Elems::new(bc_dtype, p.fwd.c, bc_len),
            d: optional(p.fwd.d as *const c_void, dim),
            bias: optional(p.fwd.delta_bias as *const c_void, dim),
            checkpoints: input(p.fwd.checkpoints as *const c_void, checkpoints_len),
            dfinal: optional(p.dfinal_state as *const c_void, state_len),
            du: ElemsOut::new(dtype, p.du, x_len),
            ddelta: ElemsOut::new(dtype, p.ddelta, x_len),
            dz: ElemsOut::optional(dtype, p.dz, x_len),
            dinitial: (!p.dinitial_state.is_null()).then_some(Out { ptr: p.dinitial_state, len: state_len }),
            part_d: some_out(&mut part_d, !p.fwd.d.is_null()),
            part_bias: some_out(&mut part_bias, !p.fwd.delta_bias.is_null()),
            state_parts: StateParts { a: out(&mut part_a), b: out(&mut part_b), c: out(&mut part_c) },
            cu,
            h0: optional(p.fwd.initial_state as *const c_void, state_len),
        }
    };

    if let Some(plan) = plan {
        let threads = pool::threads_for(batch * dim * seqlen.max(1) * n.max(1), plan.units);
        let next = AtomicUsize::new(0);
        let (ctx, plan, next) = (&ctx, &plan, &next);
        in_parallel(threads, plan.scratch_floats(), |scratch| worker(isa, ctx, plan, next, scratch));
    }

    // The ordered sums: over batch, then (time-varying dB/dC) over the units of a span.
    // SAFETY (every slice below): validation checked the shapes; the workers are done.
    let (da, mut dd, mut dbias) = unsafe {
        let per_channel = |p: *mut f32| (!p.is_null()).then(|| std::slice::from_raw_parts_mut(p, dim));
        (std::slice::from_raw_parts_mut(p.da, dim * n), per_channel(p.dd), per_channel(p.ddelta_bias))
    };
    let (db, dc) = unsafe { (ElemsOut::new(bc_dtype, p.db, bc_len), ElemsOut::new(bc_dtype, p.dc, bc_len)) };
    let Some(plan) = plan else {
        // batch or dim 0: no channel contributes.
        da.fill(0.0);
        dd.into_iter().chain(dbias).for_each(|v| v.fill(0.0));
        // SAFETY (both): the workers are done; nothing else accesses the results.
        unsafe { db.fill(0.0) };
        unsafe { dc.fill(0.0) };
        return;
    };
    let w = plan.w;
    let (mut db_row, mut dc_row) = (vec![0f32; n], vec![0f32; n]);
    for d in 0..dim {
        let (g, j, lane) = plan.channel(d);
        let sum = |part: &[f32], row: usize, s: usize| {
            (0..batch).fold(0f32, |acc, b| acc + part[(plan.block_row(b, g, j) * row + s) * w + lane])
        };
        for s in 0..n {
            da[d * n + s] = sum(&part_a, n, s);
            if !time_varying {
                db_row[s] = sum(&part_b, n, s);
                dc_row[s] = sum(&part_c, n, s);
            }
        }
        if !time_varying {
            // SAFETY (both): as above.
            unsafe { db.store(d * n, 1, &db_row) };
            unsafe { dc.store(d * n, 1, &dc_row) };
        }
        for (out, part) in [(dd.as_deref_mut(), &part_d), (dbias.as_deref_mut(), &part_bias)] {
            if let Some(out) = out {
                out[d] = sum(part, 1, 0);
            }
        }
    }
    if time_varying {
        sum_units(&geom, &plan, &part_b, db);
        sum_units(&geom, &plan, &part_c, dc);
    }
}

/// dB (or dC) of time-varying B/C: per (batch, group, state), the unit partials of that span added
/// in unit order, written in B's layout.
fn sum_units(p: &Geom, plan: &Plan, part: &[f32], dst: ElemsOut) {
    let (n, len) = (plan.dstate, plan.seqlen);
    let mut row = vec![0f32; len];
    for b in 0..p.batch {
        for g in 0..plan.spans {
            for s in 0..n {
                row.fill(0.0);
                for k in 0..plan.units_per_span {
                    let unit = (b * plan.spans + g) * plan.units_per_span + k;
                    for (r, &x) in row.iter_mut().zip(&part[(unit * n + s) * len..][..len]) {
                        *r += x;
                    }
                }
                // SAFETY: the workers are done; nothing else accesses the result.
                unsafe { dst.store(p.bc(b, g * p.dim_per_group, s, 0), p.bc_stride_seq, &row) };
            }
        }
    }
}

isa_workers!(units(ctx: &Ctx<'_>, plan: &Plan, next: &AtomicUsize, scratch: &mut [f32]));

/// Runs units taken from `next` until there are none left.
#[inline(always)]
fn units<const W: usize, const FMA: bool>(ctx: &Ctx, plan: &Plan, next: &AtomicUsize, scratch: &mut [f32]) {
    debug_assert_eq!(plan.w, W);
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= plan.units {
            break;
        }
        unit::<W, FMA>(ctx, plan, i, scratch);
    }
}

/// Per-step lane vectors of one block's piece ([`STAGED`] of them).
struct Staged<'a, const W: usize> {
    /// dt after bias and softplus.
    dt: &'a mut [[f32; W]],
    /// dt * u.
    dtu: &'a mut [[f32; W]],
    u: &'a mut [[f32; W]],
    /// d softplus / d its argument (sigmoid), when softplus is on.
    sig: &'a mut [[f32; W]],
    dout: &'a mut [[f32; W]],
    /// dout * silu(z) (dout without z).
    dy: &'a mut [[f32; W]],
    /// silu'(z).
    dsilu: &'a mut [[f32; W]],
    /// The forward's y before the gate (D * u + <C, h>): for dz.
    y: &'a mut [[f32; W]],
    /// sum_n g B; then du.
    gb: &'a mut [[f32; W]],
    /// sum_n A g a h[l-1]; then ddelta.
    gah: &'a mut [[f32; W]],
}

const STAGED: usize = 10;

/// One unit: its blocks, walked backwards through time piece by piece.
#[inline(always)]
fn unit<const W: usize, const FMA: bool>(ctx: &Ctx, plan: &Plan, i: usize, mut scratch: &mut [f32]) {
    let p = &ctx.p;
    let (n, tv) = (plan.dstate, plan.time_varying);
    let (b, g, blocks) = plan.unit(i);
    let nb = blocks.len();
    let buf = &mut scratch;
    let grads = take_lanes::<W>(buf, nb * n);
    let subs = take_lanes::<W>(buf, nb * plan.subs * n);
    let start = take_lanes::<W>(buf, n);
    let a2 = take_lanes::<W>(buf, n);
    let av = take_lanes::<W>(buf, n);
    let (bv, cv) =
        if tv { (take_lanes::<W>(buf, 0), take_lanes::<W>(buf, 0)) } else { (take_lanes(buf, n), take_lanes(buf, n)) };
    let acc_len = if tv { plan.piece * n } else { 0 };
    let (db_acc, dc_acc) = (take_lanes::<W>(buf, acc_len), take_lanes::<W>(buf, acc_len));
    let hist = take_lanes::<W>(buf, (plan.piece + 1) * GROUP);
    let dec = take_lanes::<W>(buf, plan.piece * GROUP);
    let mut x = Staged {
        dt: take_lanes(buf, plan.piece),
        dtu: take_lanes(buf, plan.piece),
        u: take_lanes(buf, plan.piece),
        sig: take_lanes(buf, plan.piece),
        dout: take_lanes(buf, plan.piece),
        dy: take_lanes(buf, plan.piece),
        dsilu: take_lanes(buf, plan.piece),
        y: take_lanes(buf, plan.piece),
        gb: take_lanes(buf, plan.piece),
        gah: take_lanes(buf, plan.piece),
    };
    let bs = take(buf, plan.shared_bc());
    let cs = take(buf, plan.shared_bc());

    // The state gradient g (times the next step's decay) starts as dfinal_state (packed: as the
    // backward's boundary rule at seqlen leaves it).
    for (k, j) in blocks.clone().enumerate() {
        let (first, width) = plan.block(g, j);
        let grads = &mut grads[k * n..(k + 1) * n];
        let dfinal = if ctx.cu.is_some() { None } else { ctx.dfinal };
        for (s, gs) in grads.iter_mut().enumerate() {
            *gs = build(|l| if l < width { dfinal.map_or(0.0, |f| f[(b * p.dim + first + l) * n + s]) } else { 0.0 });
        }
        if let Some(cu) = &ctx.cu {
            ctx.reset_grads(cu, plan.seqlen, first, width, grads);
        }
    }

    let len = plan.checkpoint_len;
    for k in (0..plan.seqlen.div_ceil(len)).rev() {
        let (c0, c1) = (k * len, ((k + 1) * len).min(plan.seqlen));
        let pieces = (c1 - c0).div_ceil(plan.piece);
        // Sub-checkpoints: the states entering pieces 1.. of this checkpoint's span (before the
        // boundary rule at their first step).
        for j in 0..pieces - 1 {
            for (kb, blk) in blocks.clone().enumerate() {
                let (first, width) = plan.block(g, blk);
                let own = &mut subs[kb * plan.subs * n..(kb + 1) * plan.subs * n];
                let (before, h) = own.split_at_mut(j * n);
                if j == 0 {
                    load_checkpoint(ctx, plan, b, first, width, k, &mut h[..n]);
                } else {
                    h[..n].copy_from_slice(&before[(j - 1) * n..]);
                }
            }
            for (l0, steps) in ctx.sub_pieces(c0 + j * plan.piece, plan.piece) {
                if tv {
                    stage_shared_bc::<W, FMA>(ctx.b, p, b, g, l0, steps, bs);
                }
                for (kb, blk) in blocks.clone().enumerate() {
                    let (first, width) = plan.block(g, blk);
                    stage_a(ctx, first, width, a2, av);
                    stage_dt::<W, FMA>(ctx, b, first, width, l0, steps, &mut x);
                    let h = &mut subs[(kb * plan.subs + j) * n..][..n];
                    ctx.reset_state(l0, first, width, h);
                    // Only the states matter here: C is a stand-in and y is discarded.
                    let bc = if tv {
                        Bc::Shared { b: &bs[..steps * n], c: &bs[..steps * n] }
                    } else {
                        stage_lane_bc::<W, FMA>(ctx.b, p, b, first, width, l0, bv.as_flattened_mut());
                        Bc::Lanes { b: bv.as_flattened(), c: bv.as_flattened(), row: 0 }
                    };
                    let (dt, dtu) = (x.dt[..steps].as_flattened(), x.dtu[..steps].as_flattened());
                    let (h, a2, y) = (h.as_flattened_mut(), a2.as_flattened(), x.y[..steps].as_flattened_mut());
                    scan_states::<W, FMA>(h, a2, dt, dtu, y, bc);
                }
            }
        }
        for j in (0..pieces).rev() {
            let grid_l0 = c0 + j * plan.piece;
            for (l0, steps) in ctx.sub_pieces(grid_l0, plan.piece.min(c1 - grid_l0)).into_iter().rev() {
                if tv {
                    stage_shared_bc::<W, FMA>(ctx.b, p, b, g, l0, steps, bs);
                    stage_shared_bc::<W, FMA>(ctx.c, p, b, g, l0, steps, cs);
                    db_acc[..steps * n].fill([0.0; W]);
                    dc_acc[..steps * n].fill([0.0; W]);
                }
                for (kb, blk) in blocks.clone().enumerate() {
                    let (first, width) = plan.block(g, blk);
                    stage_a(ctx, first, width, a2, av);
                    stage_dt::<W, FMA>(ctx, b, first, width, l0, steps, &mut x);
                    stage_dout::<W, FMA>(ctx, b, first, width, l0, steps, &mut x);
                    // A piece after the first of its grid piece starts at a boundary, where the
                    // rule sets the state whatever it was.
                    if j == 0 {
                        load_checkpoint(ctx, plan, b, first, width, k, start);
                    } else {
                        start.copy_from_slice(&subs[(kb * plan.subs + j - 1) * n..][..n]);
                    }
                    ctx.reset_state(l0, first, width, start);
                    let ch = Channels { b, first, width, block: plan.block_row(b, g, blk) };
                    let mut piece = Piece {
                        ch,
                        steps,
                        start: start.as_flattened(),
                        grads: grads[kb * n..(kb + 1) * n].as_flattened_mut(),
                        a2: a2.as_flattened(),
                        av: av.as_flattened(),
                        dt: x.dt.as_flattened(),
                        dtu: x.dtu.as_flattened(),
                        dy: x.dy.as_flattened(),
                        y: x.y.as_flattened_mut(),
                        gb: x.gb.as_flattened_mut(),
                        gah: x.gah.as_flattened_mut(),
                        acc: tv.then(|| BcGrads {
                            db: db_acc[..steps * n].as_flattened_mut(),
                            dc: dc_acc[..steps * n].as_flattened_mut(),
                        }),
                        hist: hist.as_flattened_mut(),
                        dec: dec.as_flattened_mut(),
                    };
                    if tv {
                        states_shared::<W, FMA>(&ctx.state_parts, &mut piece, &bs[..steps * n], &cs[..steps * n]);
                    } else {
                        stage_lane_bc::<W, FMA>(ctx.b, p, b, first, width, l0, bv.as_flattened_mut());
                        stage_lane_bc::<W, FMA>(ctx.c, p, b, first, width, l0, cv.as_flattened_mut());
                        states_lanes::<W, FMA>(&ctx.state_parts, &mut piece, bv.as_flattened(), cv.as_flattened());
                    }
                    finish::<W, FMA>(ctx, ch, l0, steps, &mut x);
                    if let Some(cu) = &ctx.cu {
                        ctx.reset_grads(cu, l0, first, width, &mut grads[kb * n..(kb + 1) * n]);
                    }
                }
                if tv {
                    // dB and dC of this piece: the lanes (channels) summed in order.
                    let unit_rows = i * n * plan.seqlen;
                    for (acc, part) in [(&*db_acc, &ctx.state_parts.b), (&*dc_acc, &ctx.state_parts.c)] {
                        for s in 0..n {
                            // SAFETY: this unit owns its rows of the partial.
                            let row = unsafe { part.rows(unit_rows + s * plan.seqlen + l0, steps) };
                            for (l, o) in row.iter_mut().enumerate() {
                                *o = lane_sum(acc[l * n + s]);
                            }
                        }
                    }
                }
            }
        }
    }

    if let (Some(dinitial), None) = (&ctx.dinitial, &ctx.cu) {
        for (k, j) in blocks.enumerate() {
            let (first, width) = plan.block(g, j);
            for l in 0..width {
                // SAFETY: this unit owns channels first..first + width of batch b.
                let row = unsafe { dinitial.rows((b * p.dim + first + l) * n, n) };
                for (o, gs) in row.iter_mut().zip(&grads[k * n..(k + 1) * n]) {
                    *o = gs[l];
                }
            }
        }
    }
}

/// Channels first..first + width of batch entry b: block `block` of [`Plan::block_row`].
#[derive(Clone, Copy)]
struct Channels {
    b: usize,
    first: usize,
    width: usize,
    block: usize,
}

/// A log2 e (for [`exp2`]) and A, per lane.
#[inline(always)]
fn stage_a<const W: usize>(ctx: &Ctx, first: usize, width: usize, a2: &mut [[f32; W]], av: &mut [[f32; W]]) {
    let n = ctx.p.dstate;
    for (s, (a2, av)) in a2.iter_mut().zip(av.iter_mut()).enumerate() {
        *av = build(|j| ctx.a[(first + lane(j, width)) * n + s]);
        *a2 = av.map(|a| a * std::f32::consts::LOG2_E);
    }
}

/// The states entering step k * checkpoint_len, [state][lane].
#[inline(always)]
fn load_checkpoint<const W: usize>(
    ctx: &Ctx,
    plan: &Plan,
    b: usize,
    first: usize,
    width: usize,
    k: usize,
    h: &mut [[f32; W]],
) {
    let (n, dim) = (plan.dstate, ctx.p.dim);
    let per_channel = plan.seqlen.div_ceil(plan.checkpoint_len) * n;
    for (s, hs) in h.iter_mut().enumerate() {
        *hs = build(|j| ctx.checkpoints[(b * dim + first + lane(j, width)) * per_channel + k * n + s]);
    }
}

/// dt (after bias and softplus), its softplus derivative, u (spare lanes 0) and dt * u.
#[inline(always)]
fn stage_dt<const W: usize, const FMA: bool>(
    ctx: &Ctx,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    steps: usize,
    x: &mut Staged<W>,
) {
    let p = &ctx.p;
    let (dt, u, dtu, sig) = (&mut x.dt[..steps], &mut x.u[..steps], &mut x.dtu[..steps], &mut x.sig[..steps]);
    transpose_in::<W, FMA>(ctx.delta, p, b, first, width, l0, dt.as_flattened_mut());
    transpose_in::<W, FMA>(ctx.u, p, b, first, width, l0, u.as_flattened_mut());
    mask(u, width);
    let bias = V::<W>(build(|i| ctx.bias.map_or(0.0, |v| v[first + lane(i, width)])));
    for (((dt, u), dtu), sig) in dt.iter_mut().zip(u.iter()).zip(dtu.iter_mut()).zip(sig.iter_mut()) {
        let v = V(*dt) + bias;
        let v = if p.delta_softplus {
            *sig = sigmoid::<W, FMA>(v).0;
            v.map(softplus::<FMA>)
        } else {
            v
        };
        *dt = v.0;
        *dtu = (v * V(*u)).0;
    }
}

/// dout (spare lanes 0), dy = dout * silu(z), silu'(z), and y's first term D * u.
#[inline(always)]
fn stage_dout<const W: usize, const FMA: bool>(
    ctx: &Ctx,
    b: usize,
    first: usize,
    width: usize,
    l0: usize,
    steps: usize,
    x: &mut Staged<W>,
) {
    let p = &ctx.p;
    let (dout, dy, dsilu) = (&mut x.dout[..steps], &mut x.dy[..steps], &mut x.dsilu[..steps]);
    transpose_in::<W, FMA>(ctx.dout, p, b, first, width, l0, dout.as_flattened_mut());
    mask(dout, width);
    if let Some(z) = ctx.z {
        transpose_in::<W, FMA>(z, p, b, first, width, l0, dsilu.as_flattened_mut());
        for ((dy, dsilu), dout) in dy.iter_mut().zip(dsilu.iter_mut()).zip(dout.iter()) {
            let z = V(*dsilu);
            let s = sigmoid::<W, FMA>(z);
            *dy = (V(*dout) * z * s).0;
            // silu'(z) = s (1 + z (1 - s))
            *dsilu = (s * (V::splat(1.0) + z * (V::splat(1.0) + s.map(|s| -s)))).0;
        }
    } else {
        dy.copy_from_slice(dout);
    }
    let skip = V::<W>(build(|i| ctx.d.map_or(0.0, |v| v[first + lane(i, width)])));
    for ((y, u), (gb, gah)) in
        x.y[..steps].iter_mut().zip(&x.u[..steps]).zip(x.gb[..steps].iter_mut().zip(x.gah[..steps].iter_mut()))
    {
        *y = (skip * V(*u)).0;
        *gb = [0.0; W];
        *gah = [0.0; W];
    }
}

/// One block's piece: what its state groups read and add to. Lane vectors (`[f32; W]`) are
/// flattened, so that it passes to the state loops compiled per instruction set ([`states_shared`],
/// [`states_lanes`]).
struct Piece<'a> {
    ch: Channels,
    steps: usize,
    /// The states entering the piece, [state][lane].
    start: &'a [f32],
    /// The state gradients: a[l+1] g[l+1] while walking back, [state][lane].
    grads: &'a mut [f32],
    /// A log2 e (for [`exp2`]) and A, [state][lane].
    a2: &'a [f32],
    av: &'a [f32],
    /// Per step, as in [`Staged`]: read.
    dt: &'a [f32],
    dtu: &'a [f32],
    dy: &'a [f32],
    /// Per step, as in [`Staged`]: added to.
    y: &'a mut [f32],
    gb: &'a mut [f32],
    gah: &'a mut [f32],
    /// Time-varying B/C: the piece's dB and dC per (step, state), lane vectors summed over the unit's
    /// blocks.
    acc: Option<BcGrads<'a>>,
    /// One state group's states after each step (after the states entering the piece), and decays.
    hist: &'a mut [f32],
    dec: &'a mut [f32],
}

/// dB and dC accumulators, [step * dstate + state][lane].
struct BcGrads<'a> {
    db: &'a mut [f32],
    dc: &'a mut [f32],
}

isa_fns! {
    /// The state loop of a piece with time-varying B/C: `bs`, `cs` [step][state], shared by the
    /// lanes.
    fn states_shared(parts: &StateParts, piece: &mut Piece<'_>, bs: &[f32], cs: &[f32]) = states_shared_body;

    /// The state loop of a piece with time-invariant B/C: `bv`, `cv` per lane, [state][lane].
    fn states_lanes(parts: &StateParts, piece: &mut Piece<'_>, bv: &[f32], cv: &[f32]) = states_lanes_body;
}

#[inline(always)]
fn states_shared_body<const W: usize, const FMA: bool>(parts: &StateParts, piece: &mut Piece, bs: &[f32], cs: &[f32]) {
    let n = piece.start.len() / W;
    states::<W, FMA, true>(parts, piece, |l, s| (V::splat(bs[l * n + s]), V::splat(cs[l * n + s])));
}

#[inline(always)]
fn states_lanes_body<const W: usize, const FMA: bool>(parts: &StateParts, piece: &mut Piece, bv: &[f32], cv: &[f32]) {
    let (bv, cv) = (lanes::<W>(bv), lanes::<W>(cv));
    states::<W, FMA, false>(parts, piece, |_, s| (V(bv[s]), V(cv[s])));
}

/// Every state of one block over one piece, in register groups of [`GROUP`], 4 and 1 states.
/// `bc(step, state)` gives B and C; `TV`: they vary with time (`piece.acc` is then given).
#[inline(always)]
fn states<const W: usize, const FMA: bool, const TV: bool>(
    parts: &StateParts,
    piece: &mut Piece,
    bc: impl Fn(usize, usize) -> (V<W>, V<W>) + Copy,
) {
    debug_assert_eq!(piece.acc.is_some(), TV);
    let n = piece.start.len() / W;
    let mut s0 = 0;
    while s0 < n {
        let left = n - s0;
        s0 += if left >= GROUP {
            group::<W, FMA, GROUP, TV>(parts, piece, s0, bc)
        } else if left >= 4 {
            group::<W, FMA, 4, TV>(parts, piece, s0, bc)
        } else {
            group::<W, FMA, 1, TV>(parts, piece, s0, bc)
        };
    }
}

/// States s0..s0 + G of one block over one piece: recomputes their states from those entering the
/// piece (keeping each step's state and decay), then runs the reverse recurrence, adding to the
/// per-step sums (y, sum_n g B, sum_n A g a h[l-1]) and to dB/dC, and the sums over the piece (dA;
/// dB and dC when time-invariant, `!TV`) to the unit's partials. Returns G.
#[inline(always)]
fn group<const W: usize, const FMA: bool, const G: usize, const TV: bool>(
    parts: &StateParts,
    piece: &mut Piece,
    s0: usize,
    bc: impl Fn(usize, usize) -> (V<W>, V<W>),
) -> usize {
    let (n, steps, ch) = (piece.start.len() / W, piece.steps, piece.ch);
    let (dt, dtu, dy) =
        (&lanes::<W>(piece.dt)[..steps], &lanes::<W>(piece.dtu)[..steps], &lanes::<W>(piece.dy)[..steps]);
    let y = &mut lanes_mut::<W>(piece.y)[..steps];
    let gb = &mut lanes_mut::<W>(piece.gb)[..steps];
    let gah = &mut lanes_mut::<W>(piece.gah)[..steps];
    let hist = &mut lanes_mut::<W>(piece.hist)[..(steps + 1) * G];
    let dec = &mut lanes_mut::<W>(piece.dec)[..steps * G];
    let (a2, av, start) = (lanes::<W>(piece.a2), lanes::<W>(piece.av), lanes::<W>(piece.start));
    let a2: [V<W>; G] = build(|j| V(a2[s0 + j]));
    let av: [V<W>; G] = build(|j| V(av[s0 + j]));

    // Recompute: hist[i + 1] = states after step i (hist[0]: entering the piece), dec[i] = decays.
    let mut h: [V<W>; G] = build(|j| V(start[s0 + j]));
    for (o, h) in hist[..G].iter_mut().zip(h) {
        *o = h.0;
    }
    for (i, (dec, after)) in dec.chunks_exact_mut(G).zip(hist[G..].chunks_exact_mut(G)).enumerate() {
        let (dt, dtu) = (V(dt[i]), V(dtu[i]));
        let mut acc = V(y[i]);
        for j in 0..G {
            let (b, c) = bc(i, s0 + j);
            let a = exp2::<W, FMA>(dt * a2[j]);
            h[j] = a.mul_add::<FMA>(h[j], dtu * b);
            dec[j] = a.0;
            after[j] = h[j].0;
            acc = c.mul_add::<FMA>(h[j], acc);
        }
        y[i] = acc.0;
    }

    // Reverse: gs holds a[l+1] g[l+1] entering step l; g = g[l].
    let zero = V::splat(0.0);
    let grads = lanes_mut::<W>(piece.grads);
    let mut gs: [V<W>; G] = build(|j| V(grads[s0 + j]));
    let (mut da, mut db, mut dc) = ([zero; G], [zero; G], [zero; G]);
    let hist = &*hist;
    let rows = dec.chunks_exact(G).zip(hist.chunks_exact(G).zip(hist[G..].chunks_exact(G))).enumerate().rev();
    for (i, (dec, (before, after))) in rows {
        let (dt, dtu, dy) = (V(dt[i]), V(dtu[i]), V(dy[i]));
        let (mut sum_gb, mut sum_gah) = (zero, zero);
        // Time-varying: g[l] per state, for dB below.
        let mut g_row = [zero; G];
        for j in 0..G {
            let (b, c) = bc(i, s0 + j);
            let (a, before, after) = (V(dec[j]), V(before[j]), V(after[j]));
            let g = c.mul_add::<FMA>(dy, gs[j]);
            sum_gb = g.mul_add::<FMA>(b, sum_gb);
            let gah_j = g * a * before;
            sum_gah = gah_j.mul_add::<FMA>(av[j], sum_gah);
            da[j] = gah_j.mul_add::<FMA>(dt, da[j]);
            if TV {
                g_row[j] = g;
            } else {
                db[j] = g.mul_add::<FMA>(dtu, db[j]);
                dc[j] = dy.mul_add::<FMA>(after, dc[j]);
            }
            gs[j] = a * g;
        }
        if let (true, Some(acc)) = (TV, piece.acc.as_mut()) {
            let k = i * n + s0;
            for (o, g) in lanes_mut::<W>(acc.db)[k..k + G].iter_mut().zip(g_row) {
                *o = g.mul_add::<FMA>(dtu, V(*o)).0;
            }
            for (o, &h) in lanes_mut::<W>(acc.dc)[k..k + G].iter_mut().zip(after) {
                *o = dy.mul_add::<FMA>(V(h), V(*o)).0;
            }
        }
        gb[i] = (V(gb[i]) + sum_gb).0;
        gah[i] = (V(gah[i]) + sum_gah).0;
    }
    for (o, g) in grads[s0..s0 + G].iter_mut().zip(gs) {
        *o = g.0;
    }

    let sums = [(true, &parts.a, da), (!TV, &parts.b, db), (!TV, &parts.c, dc)];
    for (_, part, sums) in sums.into_iter().filter(|(on, _, _)| *on) {
        // SAFETY: this unit owns its blocks' rows.
        let out = unsafe { part.rows((ch.block * n + s0) * W, G * W) };
        for (o, v) in out.as_chunks_mut::<W>().0.iter_mut().zip(sums) {
            *o = (V(*o) + v).0;
        }
    }
    G
}

/// From the per-step sums: du = D dy + dt sum_n g B; ddelta = (u sum_n g B + sum_n A g a h[l-1]),
/// times sigmoid with softplus; dz = dout y silu'(z). Writes them, and adds this piece's dD and
/// ddelta_bias to the unit's partials.
#[inline(always)]
fn finish<const W: usize, const FMA: bool>(ctx: &Ctx, ch: Channels, l0: usize, steps: usize, x: &mut Staged<W>) {
    let p = &ctx.p;
    let skip = V::<W>(build(|i| ctx.d.map_or(0.0, |v| v[ch.first + lane(i, ch.width)])));
    let (mut dd, mut dbias) = (V::splat(0.0), V::splat(0.0));
    for i in 0..steps {
        let (u, dt, dy, gb) = (V(x.u[i]), V(x.dt[i]), V(x.dy[i]), V(x.gb[i]));
        let ddt = u.mul_add::<FMA>(gb, V(x.gah[i]));
        let ddelta = if p.delta_softplus { ddt * V(x.sig[i]) } else { ddt };
        x.gb[i] = skip.mul_add::<FMA>(dy, dt * gb).0;
        x.gah[i] = ddelta.0;
        x.y[i] = (V(x.dout[i]) * V(x.y[i]) * V(x.dsilu[i])).0;
        dd = dy.mul_add::<FMA>(u, dd);
        dbias = dbias + ddelta;
    }
    let (b, first, width) = (ch.b, ch.first, ch.width);
    write_x::<W, FMA>(ctx.du, p, b, first, width, l0, x.gb[..steps].as_flattened());
    write_x::<W, FMA>(ctx.ddelta, p, b, first, width, l0, x.gah[..steps].as_flattened());
    if let Some(dz) = ctx.dz {
        write_x::<W, FMA>(dz, p, b, first, width, l0, x.y[..steps].as_flattened());
    }
    for (part, v) in [(&ctx.part_d, dd), (&ctx.part_bias, dbias)] {
        if let Some(part) = part {
            // SAFETY: this unit owns its blocks' rows.
            let out = unsafe { part.rows(ch.block * W, W) };
            for (o, e) in out.iter_mut().zip(v.0) {
                *o += e;
            }
        }
    }
}
