//! The carried state of a seqlen shard on the CPU (`selective_scan_carry_fwd` / `_bwd`,
//! src/ops/selective_scan/carry.rs has the definition): each segment of each (batch, channel) row
//! walks its steps in blocks of [`BLOCK`] from the cumulative dt before it, and stops once every
//! remaining term has fallen below f32's smallest normal (with softplus, where dt >= 0). Segments
//! are shared out over the pool's threads.

use super::elems::{input, optional, Elems, ElemsOut};
use super::math::{silu_std, softplus_std};
use super::pool;
use crate::ops::selective_scan::carry::{Carry, Direction};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Steps between checks of whether a row is done (the CUDA kernel's warp).
const BLOCK: usize = 32;

/// Whether every `exp(a[n] cs) * |scale[n]|` is below f32's smallest normal.
fn carried_out(a: &[f32], scale: Option<&[f32]>, cs: f32) -> bool {
    a.iter().enumerate().all(|(n, &a)| ((a * cs).exp() * scale.map_or(1.0, |s| s[n].abs())) < f32::MIN_POSITIVE)
}

/// Where the bwd's f32 parts go: one (row, segment) per worker at a time, disjoint.
struct PartsOut(*mut f32);
// SAFETY: workers write disjoint (row, segment) entries of the validated result.
unsafe impl Sync for PartsOut {}

pub(crate) fn run(carry: &Carry) {
    if let Some(copy) = carry.out_copy() {
        // SAFETY: validated, distinct host buffers of that size.
        unsafe { copy.on_host() };
    }
    let cp = carry.params();
    let p = cp.scan;
    let u = |x: i64| x as usize;
    let (batch, dim, seqlen, dstate) = (u(p.batch), u(p.dim), u(p.seqlen), u(p.dstate));
    let rows = batch * dim;
    if rows == 0 {
        return;
    }
    let x_len = rows * seqlen;
    let groups = dim / u(p.dim_per_group);
    let bc_len = if p.bc_stride_seq == 0 { dim * dstate } else { batch * groups * dstate * seqlen };
    let (dtype, fwd) = (carry.dtype(), carry.direction() == Direction::Fwd);
    // SAFETY: `validate_carry` checked every operand's shape, dtype and non-nullness against these
    // sizes; the fwd reads and writes its result only (`u` and `out` are the result's buffer), and
    // each segment's elements are touched by one thread.
    let (x_in, x_out, delta, z, c, a, bias, state, sums) = unsafe {
        (
            (!fwd).then(|| Elems::new(dtype, p.u, x_len)),
            fwd.then(|| ElemsOut::new(dtype, p.out, x_len)),
            Elems::new(dtype, p.delta, x_len),
            Elems::optional(dtype, p.z, x_len),
            Elems::new(carry.bc_dtype(), p.c, bc_len),
            input::<f32>(p.a as *const c_void, dim * dstate),
            optional::<f32>(p.delta_bias as *const c_void, dim),
            optional::<f32>(p.initial_state as *const c_void, rows * dstate),
            input::<f32>(cp.dt_sums as *const c_void, rows * u(cp.n_segments)),
        )
    };
    let (n_segments, segment_len) = (u(cp.n_segments), u(cp.segment_len));
    let parts_out = PartsOut(cp.dstate_parts);
    let parts_out = &parts_out;
    let next = AtomicUsize::new(0);
    let threads = pool::threads_for(x_len * dstate.max(1), rows * n_segments);
    pool::run(threads, &|_| {
        let mut x = [0f32; BLOCK];
        let mut dt = [0f32; BLOCK];
        let mut gate = [1f32; BLOCK];
        let mut cv = vec![0f32; dstate * BLOCK];
        let mut acc = vec![0f32; dstate];
        loop {
            let item = next.fetch_add(1, Ordering::Relaxed);
            if item >= rows * n_segments {
                break;
            }
            let (row, segment) = (item / n_segments, item % n_segments);
            let (b, d) = (row / dim, row % dim);
            let a = &a[d * dstate..(d + 1) * dstate];
            let h = state.map(|s| &s[row * dstate..(row + 1) * dstate]);
            let x0 = b * u(p.x_stride_batch) + d * u(p.x_stride_dim);
            let c0 = b * u(p.bc_stride_batch) + (d / u(p.dim_per_group)) * u(p.bc_stride_group);
            let (xs, cs_stride) = (u(p.x_stride_seq), u(p.bc_stride_seq));
            acc.fill(0.0);
            // The cumulative dt before the segment (the CUDA kernel sums in another order).
            let mut cs = sums[row * n_segments..][..segment].iter().fold(0f32, |s, &v| s + v);
            let first = (segment * segment_len).min(seqlen);
            // A segment that starts with nothing left to add runs no step.
            let starts_done = p.delta_softplus != 0 && carried_out(a, h, cs);
            let end = if starts_done { first } else { ((segment + 1) * segment_len).min(seqlen) };
            for l0 in (first..end).step_by(BLOCK) {
                let n_steps = BLOCK.min(end - l0);
                let at = x0 + l0 * xs;
                match (x_in, x_out) {
                    (Some(e), _) => e.load(at, xs, &mut x[..n_steps]),
                    // SAFETY: this segment's elements, this thread only.
                    (_, Some(o)) => unsafe { o.load(at, xs, &mut x[..n_steps]) },
                    _ => unreachable!(),
                }
                delta.load(at, xs, &mut dt[..n_steps]);
                if let Some(z) = z {
                    z.load(at, xs, &mut gate[..n_steps]);
                    gate[..n_steps].iter_mut().for_each(|g| *g = silu_std(*g));
                }
                for n in 0..dstate {
                    c.load(c0 + n * u(p.bc_stride_state) + l0 * cs_stride, cs_stride, &mut cv[n * BLOCK..][..n_steps]);
                }
                for k in 0..n_steps {
                    let mut v = dt[k] + bias.map_or(0.0, |bias| bias[d]);
                    if p.delta_softplus != 0 {
                        v = softplus_std(v);
                    }
                    cs += v;
                    match h {
                        Some(h) => {
                            let add: f32 = (0..dstate).map(|n| cv[n * BLOCK + k] * (a[n] * cs).exp() * h[n]).sum();
                            x[k] += add * gate[k];
                        }
                        None => {
                            let g = x[k] * gate[k];
                            for n in 0..dstate {
                                acc[n] += g * cv[n * BLOCK + k] * (a[n] * cs).exp();
                            }
                        }
                    }
                }
                if let Some(o) = x_out {
                    // SAFETY: as the load above.
                    unsafe { o.store(at, xs, &x[..n_steps]) };
                }
                if p.delta_softplus != 0 && carried_out(a, h, cs) {
                    break;
                }
            }
            if !fwd {
                // SAFETY: entry (row, segment) of the validated (batch, dim, n_segments, dstate) f32
                // result, this thread only.
                let out = unsafe { std::slice::from_raw_parts_mut(parts_out.0.add(item * dstate), dstate) };
                out.copy_from_slice(&acc);
            }
        }
    });
}
