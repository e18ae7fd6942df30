//! `selective_state_update` on the CPU: one pass over the rows, f32 arithmetic, each state element
//! read and written once. Decode is small (batch x dim x dstate updates), so one thread. Operands
//! are converted to f32 scratch per batch entry; the state, read and written in place, by a loop
//! in its element type (one match per batch entry).

use super::elems::{input, optional, typed, Elems, ElemsOut, Io};
use super::math::{silu_std, softplus_std};
use crate::ops::state_update::Update;
use std::ffi::c_void;

pub(crate) fn update(u: &Update) {
    run(u, None)
}

/// Runs the update with `x` replaced by `xs` (batch * dim f32 values): the fused decode step passes
/// its conv output this way.
pub(crate) fn update_row(u: &Update, xs: &[f32]) {
    run(u, Some(xs))
}

fn run(u: &Update, xs: Option<&[f32]>) {
    let p = &u.params();
    let (batch, dim, dstate) = (p.batch as usize, p.dim as usize, p.dstate as usize);
    if batch * dim == 0 {
        return;
    }
    let (groups, per_group) = (p.groups as usize, p.dim_per_group as usize);
    let rows = batch * dim;
    // SAFETY: `validate` checked every operand's shape and dtype against these sizes, and
    // `check_indices_host` the state indices against `n_slots`; only the state and out are written,
    // and they overlap no input.
    let (x, dt, z, b, c, a, d_skip, dt_bias, ix, out, state) = unsafe {
        let bc_len = batch * groups * dstate;
        (
            Elems::new(u.dtype(), p.x, rows),
            Elems::new(u.dtype(), p.dt, rows),
            Elems::optional(u.dtype(), p.z, rows),
            Elems::new(u.bc_dtype(), p.b, bc_len),
            Elems::new(u.bc_dtype(), p.c, bc_len),
            input::<f32>(p.a as *const c_void, dim * dstate),
            optional::<f32>(p.d as *const c_void, dim),
            optional::<f32>(p.dt_bias as *const c_void, dim),
            optional::<i32>(p.state_batch_indices as *const c_void, batch),
            ElemsOut::new(u.dtype(), p.out, rows),
            ElemsOut::new(u.state_dtype(), p.state, p.n_slots as usize * dim * dstate),
        )
    };
    let (mut xv, mut dtv, mut zv, mut y) = (vec![0f32; dim], vec![0f32; dim], vec![0f32; dim], vec![0f32; dim]);
    let (mut bs, mut cs) = (vec![0f32; groups * dstate], vec![0f32; groups * dstate]);
    for bi in 0..batch {
        let slot = ix.map_or(bi as i64, |ix| ix[bi] as i64);
        let row0 = bi * dim;
        if slot < 0 {
            // A padding row: its state is untouched and its output is 0.
            y.fill(0.0);
        } else {
            match xs {
                Some(xs) => xv.copy_from_slice(&xs[row0..row0 + dim]),
                None => x.load(row0, 1, &mut xv),
            }
            dt.load(row0, 1, &mut dtv);
            for (d, v) in dtv.iter_mut().enumerate() {
                *v += dt_bias.map_or(0.0, |b| b[d]);
                if p.dt_softplus != 0 {
                    *v = softplus_std(*v);
                }
            }
            b.load(bi * groups * dstate, 1, &mut bs);
            c.load(bi * groups * dstate, 1, &mut cs);
            let row = Row { dstate, per_group, a, b: &bs, c: &cs, x: &xv, dt: &dtv };
            // SAFETY: validated; this call alone accesses the state, and slot < n_slots.
            unsafe {
                typed!(ElemsOut, state, s => row.update(s.rows(slot as usize * dim * dstate, dim * dstate), &mut y))
            };
            if let Some(z) = z {
                z.load(row0, 1, &mut zv);
            }
            for (d, y) in y.iter_mut().enumerate() {
                *y += d_skip.map_or(0.0, |v| v[d]) * xv[d];
                if z.is_some() {
                    *y *= silu_std(zv[d]);
                }
            }
        }
        // SAFETY: validated; nothing else accesses out during the call.
        unsafe { out.store(row0, 1, &y) };
    }
}

/// One batch entry's inputs in f32: dt after bias and softplus.
struct Row<'a> {
    dstate: usize,
    per_group: usize,
    a: &'a [f32],
    b: &'a [f32],
    c: &'a [f32],
    x: &'a [f32],
    dt: &'a [f32],
}

impl Row<'_> {
    /// Updates the slot's state rows `h` (dim x dstate) in place and sets y = <C, state> per channel.
    fn update<S: Io>(&self, h: &mut [S], y: &mut [f32]) {
        let n = self.dstate;
        for (d, y) in y.iter_mut().enumerate() {
            let (h, a) = (&mut h[d * n..][..n], &self.a[d * n..][..n]);
            let bc = (d / self.per_group) * n;
            let (b, c) = (&self.b[bc..][..n], &self.c[bc..][..n]);
            let (dt, x) = (self.dt[d], self.x[d]);
            let mut acc = 0.0f32;
            for (((h, a), b), c) in h.iter_mut().zip(a).zip(b).zip(c) {
                *h = S::store((dt * a).exp() * h.load() + dt * b * x);
                // y reads the state as stored, so that a bf16 state gives what the next step sees.
                acc += c * h.load();
            }
            *y = acc;
        }
    }
}
