//! The chunk records of a forward scan on the CPU (`selective_scan_chunk_records`,
//! src/ops/selective_scan/records.rs has the definition): each (batch, channel, chunk) scans its
//! chunk's steps from a zero state, [`BLOCK`] at a time, and keeps only its end state and its sum
//! of dt. Items are shared out over the pool's threads. The CPU forward has no split of its own; a
//! host asks for these to fold a shard's end state (docs/sharding.md).

use super::elems::{input, optional, Elems};
use super::math::softplus_std;
use super::pool;
use crate::ops::selective_scan::{split_record_floats, Fwd};
use crate::ops::Records;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Steps loaded at once.
const BLOCK: usize = 32;

/// Where the records go: one (chunk, row) per worker at a time, disjoint.
struct RecordsOut(*mut f32);
// SAFETY: workers write disjoint (chunk, row) records of the validated result.
unsafe impl Sync for RecordsOut {}

pub(crate) fn run(fwd: &Fwd) {
    let Records::Only(records) = fwd.records() else { unreachable!("a records call") };
    let p = fwd.params();
    let u = |x: i64| x as usize;
    let (batch, dim, seqlen, dstate) = (u(p.batch), u(p.dim), u(p.seqlen), u(p.dstate));
    let (chunk_len, n_chunks, floats) = (u(p.chunk_len), u(p.n_chunks), u(split_record_floats(p.dstate)));
    let rows = batch * dim;
    let items = n_chunks * rows;
    let x_len = rows * seqlen;
    let groups = dim / u(p.dim_per_group);
    let bc_len = if p.bc_stride_seq == 0 { dim * dstate } else { batch * groups * dstate * seqlen };
    // SAFETY: `validate_chunk_records` checked every operand's shape, dtype and non-nullness
    // against these sizes.
    let (x, delta, b_in, a, bias) = unsafe {
        (
            Elems::new(fwd.dtype(), p.u, x_len),
            Elems::new(fwd.dtype(), p.delta, x_len),
            Elems::new(fwd.bc_dtype(), p.b, bc_len),
            input::<f32>(p.a as *const c_void, dim * dstate),
            optional::<f32>(p.delta_bias as *const c_void, dim),
        )
    };
    let out = RecordsOut(records);
    let out = &out;
    let next = AtomicUsize::new(0);
    let threads = pool::threads_for(x_len * dstate.max(1), items);
    pool::run(threads, &|_| {
        let mut xv = [0f32; BLOCK];
        let mut dt = [0f32; BLOCK];
        let mut bv = vec![0f32; dstate * BLOCK];
        let mut h = vec![0f32; dstate];
        loop {
            let item = next.fetch_add(1, Ordering::Relaxed);
            if item >= items {
                break;
            }
            let (chunk, row) = (item / rows, item % rows);
            let (b, d) = (row / dim, row % dim);
            let a = &a[d * dstate..(d + 1) * dstate];
            let x0 = b * u(p.x_stride_batch) + d * u(p.x_stride_dim);
            let b0 = b * u(p.bc_stride_batch) + (d / u(p.dim_per_group)) * u(p.bc_stride_group);
            let (xs, bs) = (u(p.x_stride_seq), u(p.bc_stride_seq));
            let bias = bias.map_or(0.0, |bias| bias[d]);
            h.fill(0.0);
            let mut dt_sum = 0f32;
            let end = ((chunk + 1) * chunk_len).min(seqlen);
            for l0 in (chunk * chunk_len..end).step_by(BLOCK) {
                let n_steps = BLOCK.min(end - l0);
                let at = x0 + l0 * xs;
                x.load(at, xs, &mut xv[..n_steps]);
                delta.load(at, xs, &mut dt[..n_steps]);
                for n in 0..dstate {
                    b_in.load(b0 + n * u(p.bc_stride_state) + l0 * bs, bs, &mut bv[n * BLOCK..][..n_steps]);
                }
                for k in 0..n_steps {
                    let mut v = dt[k] + bias;
                    if p.delta_softplus != 0 {
                        v = softplus_std(v);
                    }
                    dt_sum += v;
                    for n in 0..dstate {
                        h[n] = (a[n] * v).exp() * h[n] + v * bv[n * BLOCK + k] * xv[k];
                    }
                }
            }
            // SAFETY: record (chunk, row) of the validated (n_chunks, batch, dim, floats) f32
            // result, this thread only.
            let record = unsafe { std::slice::from_raw_parts_mut(out.0.add(item * floats), floats) };
            record.fill(0.0);
            record[..dstate].copy_from_slice(&h);
            record[floats - 1] = dt_sum;
        }
    });
}
