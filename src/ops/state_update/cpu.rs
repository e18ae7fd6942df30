//! The CPU state update: one pass over the rows, f32 arithmetic, each state element read and written
//! once. Decode is small (batch x dim x dstate updates), so one thread.

use super::{Update, UpdateParams};
use crate::dtype::Element;
use crate::with_element_type;

pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// d silu(x) / dx = s (1 + x (1 - s)), s = sigmoid(x).
pub(crate) fn silu_grad(x: f32) -> f32 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

pub(super) fn update(u: &Update) {
    with_element_type!(u.dtype, T => with_element_type!(u.bc_dtype, W => with_element_type!(u.state_dtype, S => {
        update_typed::<T, W, S>(&u.params, None)
    })))
}

/// Runs the update with `x` replaced by `xs` (batch * dim f32 values) when given: the fused decode
/// step passes its conv output this way.
pub fn update_row(u: &Update, xs: &[f32]) {
    with_element_type!(u.dtype, T => with_element_type!(u.bc_dtype, W => with_element_type!(u.state_dtype, S => {
        update_typed::<T, W, S>(&u.params, Some(xs))
    })))
}

/// # Safety (internal)
/// `p` was validated: every pointer addresses an array of the described shape and dtype, and the
/// state indices were checked against `n_slots`.
fn update_typed<T: Element, W: Element, S: Element>(p: &UpdateParams, xs: Option<&[f32]>) {
    let (batch, dim, dstate) = (p.batch as usize, p.dim as usize, p.dstate as usize);
    if batch * dim == 0 {
        return;
    }
    let groups = p.groups as usize;
    // SAFETY: validated shapes (see above).
    let (x, dt, a, b, c, out) = unsafe {
        (
            std::slice::from_raw_parts(p.x as *const T, batch * dim),
            std::slice::from_raw_parts(p.dt as *const T, batch * dim),
            std::slice::from_raw_parts(p.a, dim * dstate),
            std::slice::from_raw_parts(p.b as *const W, batch * groups * dstate),
            std::slice::from_raw_parts(p.c as *const W, batch * groups * dstate),
            std::slice::from_raw_parts_mut(p.out as *mut T, batch * dim),
        )
    };
    let opt = |ptr: *const f32| (!ptr.is_null()).then(|| unsafe { std::slice::from_raw_parts(ptr, dim) });
    let (d_skip, dt_bias) = (opt(p.d), opt(p.dt_bias));
    let z = (!p.z.is_null()).then(|| unsafe { std::slice::from_raw_parts(p.z as *const T, batch * dim) });
    let ix =
        (!p.state_batch_indices.is_null()).then(|| unsafe { std::slice::from_raw_parts(p.state_batch_indices, batch) });
    let state = unsafe { std::slice::from_raw_parts_mut(p.state as *mut S, p.n_slots as usize * dim * dstate) };
    let per_group = p.dim_per_group as usize;
    for bi in 0..batch {
        let slot = ix.map_or(bi as i64, |ix| ix[bi] as i64);
        for d in 0..dim {
            let row = bi * dim + d;
            if slot < 0 {
                // A padding row: its state is untouched and its output is 0.
                out[row] = T::from_f32(0.0);
                continue;
            }
            let xv = xs.map_or_else(|| x[row].to_f32(), |xs| xs[row]);
            let mut dtv = dt[row].to_f32() + dt_bias.map_or(0.0, |v| v[d]);
            if p.dt_softplus != 0 {
                dtv = softplus(dtv);
            }
            let bc = (bi * groups + d / per_group) * dstate;
            let h = &mut state[(slot as usize * dim + d) * dstate..][..dstate];
            let mut y = 0.0f32;
            for n in 0..dstate {
                let hn = (dtv * a[d * dstate + n]).exp() * h[n].to_f32() + dtv * b[bc + n].to_f32() * xv;
                h[n] = S::from_f32(hn);
                // y reads the state as stored, so that a bf16 state gives what the next step sees.
                y += c[bc + n].to_f32() * h[n].to_f32();
            }
            y += d_skip.map_or(0.0, |v| v[d]) * xv;
            if let Some(z) = z {
                y *= silu(z[row].to_f32());
            }
            out[row] = T::from_f32(y);
        }
    }
}
