//! `causal_conv1d_fwd` / `_bwd` / `_update` on the CPU: per (batch, channel), the row of inputs
//! (after the `width - 1` earlier ones: initial or conv state) in f32 scratch, a window of `width`
//! of them per output. Weights and bias are converted to f32 once per call, rows per (batch, channel).

use super::elems::{optional, Elems, ElemsOut};
use super::math::{silu_grad_std, silu_std};
use crate::ops::conv1d::{Conv, ConvParams, Kind};
use std::ffi::c_void;

pub(crate) fn run(conv: &Conv) {
    match conv.kind() {
        Kind::Fwd => fwd(conv),
        Kind::Bwd => bwd(conv),
        Kind::Update => update(conv, None),
    }
}

/// The update of a validated single-token call with `out` unused: the fused decode step's conv.
/// Returns the (activated) outputs in f32, batch * dim of them (0 for padding rows).
pub(crate) fn update_values(conv: &Conv) -> Vec<f32> {
    let mut values = vec![0f32; (conv.params().batch * conv.params().dim) as usize];
    update(conv, Some(&mut values));
    values
}

/// batch, dim, seqlen, width (validated: non-negative, width in 2..=4).
fn sizes(p: &ConvParams) -> (usize, usize, usize, usize) {
    (p.batch as usize, p.dim as usize, p.seqlen as usize, p.width as usize)
}

/// Index of x[b, d, 0] (out, dout and dx alike); steps are `p.x_stride_seq` apart.
fn x_row(p: &ConvParams, b: usize, d: usize) -> usize {
    b * p.x_stride_batch as usize + d * p.x_stride_dim as usize
}

/// Weights (dim, width) and bias (dim; 0 without one) in f32.
fn weights(conv: &Conv) -> (Vec<f32>, Vec<f32>) {
    let p = &conv.params();
    let (_, dim, _, wd) = sizes(p);
    let (mut w, mut bias) = (vec![0f32; dim * wd], vec![0f32; dim]);
    // SAFETY: validated: weight (dim, width) and bias (dim) of the weights' dtype.
    unsafe {
        Elems::new(conv.weight_dtype(), p.weight, dim * wd).load(0, 1, &mut w);
        if let Some(b) = Elems::optional(conv.weight_dtype(), p.bias, dim) {
            b.load(0, 1, &mut bias);
        }
    }
    (w, bias)
}

/// x's inputs and initial states.
struct Inputs<'a> {
    x: Elems<'a>,
    initial: Option<Elems<'a>>,
}

impl Inputs<'_> {
    /// # Safety
    /// `conv` was validated (fwd or bwd).
    unsafe fn new(conv: &Conv) -> Inputs<'_> {
        let p = &conv.params();
        let (batch, dim, len, wd) = sizes(p);
        Inputs {
            x: Elems::new(conv.dtype(), p.x, batch * dim * len),
            initial: Elems::optional(conv.dtype(), p.initial_states, batch * dim * (wd - 1)),
        }
    }

    /// xpad[s + width - 1] for s in -(width - 1)..seqlen: x[b, d, s] after the initial states (or 0).
    fn row(&self, p: &ConvParams, b: usize, d: usize, xpad: &mut [f32]) {
        let k = p.width as usize - 1;
        match self.initial {
            Some(initial) => initial.load((b * p.dim as usize + d) * k, 1, &mut xpad[..k]),
            None => xpad[..k].fill(0.0),
        }
        self.x.load(x_row(p, b, d), p.x_stride_seq as usize, &mut xpad[k..]);
    }
}

/// The pre-activation at step t: bias + sum_k w[k] xpad[t + k].
#[inline(always)]
fn pre(w: &[f32], bias: f32, xpad: &[f32], t: usize) -> f32 {
    let mut acc = bias;
    for (k, w) in w.iter().enumerate() {
        acc += w * xpad[t + k];
    }
    acc
}

fn fwd(conv: &Conv) {
    let p = &conv.params();
    let (batch, dim, len, wd) = sizes(p);
    let (w, bias) = weights(conv);
    // SAFETY: validated shapes and dtypes; out overlaps no input.
    let (inputs, out) = unsafe { (Inputs::new(conv), ElemsOut::new(conv.dtype(), p.out, batch * dim * len)) };
    let (mut xpad, mut y) = (vec![0f32; wd - 1 + len], vec![0f32; len]);
    for d in 0..dim {
        let w = &w[d * wd..][..wd];
        for b in 0..batch {
            inputs.row(p, b, d, &mut xpad);
            for (t, y) in y.iter_mut().enumerate() {
                let v = pre(w, bias[d], &xpad, t);
                *y = if p.silu != 0 { silu_std(v) } else { v };
            }
            // SAFETY: as above; nothing else accesses out during the call.
            unsafe { out.store(x_row(p, b, d), p.x_stride_seq as usize, &y) };
        }
    }
}

fn bwd(conv: &Conv) {
    let p = &conv.params();
    let (batch, dim, len, wd) = sizes(p);
    let k = wd - 1;
    let (w, bias) = weights(conv);
    // SAFETY: validated shapes and dtypes; the gradients overlap no input, nor each other.
    let (inputs, dout, dx, dinitial, dweight, dbias) = unsafe {
        (
            Inputs::new(conv),
            Elems::new(conv.dtype(), p.dout, batch * dim * len),
            ElemsOut::new(conv.dtype(), p.out, batch * dim * len),
            ElemsOut::optional(conv.dtype(), p.dinitial_states, batch * dim * k),
            ElemsOut::new(conv.weight_dtype(), p.dweight, dim * wd),
            ElemsOut::optional(conv.weight_dtype(), p.dbias, dim),
        )
    };
    let (mut xpad, mut dxpad, mut g) = (vec![0f32; k + len], vec![0f32; k + len], vec![0f32; len]);
    for d in 0..dim {
        let w = &w[d * wd..][..wd];
        let (mut dw, mut db) = ([0f32; 4], 0f32);
        for b in 0..batch {
            inputs.row(p, b, d, &mut xpad);
            dout.load(x_row(p, b, d), p.x_stride_seq as usize, &mut g);
            if p.silu != 0 {
                for (t, g) in g.iter_mut().enumerate() {
                    *g *= silu_grad_std(pre(w, bias[d], &xpad, t));
                }
            }
            // dxpad[s] = sum_k w[k] g[s + (W - 1) - k].
            for (i, o) in dxpad.iter_mut().enumerate() {
                let mut acc = 0f32;
                for (kk, w) in w.iter().enumerate() {
                    // t = s + (W - 1) - kk with s = i - (W - 1).
                    if let Some(&g) = i.checked_sub(kk).and_then(|t| g.get(t)) {
                        acc += w * g;
                    }
                }
                *o = acc;
            }
            // SAFETY (both): as above; nothing else accesses the gradients during the call.
            unsafe { dx.store(x_row(p, b, d), p.x_stride_seq as usize, &dxpad[k..]) };
            if let Some(dinitial) = dinitial {
                unsafe { dinitial.store((b * dim + d) * k, 1, &dxpad[..k]) };
            }
            for (t, &gt) in g.iter().enumerate() {
                db += gt;
                for (kk, dw) in dw[..wd].iter_mut().enumerate() {
                    *dw += gt * xpad[t + kk];
                }
            }
        }
        // SAFETY (both): as above.
        unsafe { dweight.store(d * wd, 1, &dw[..wd]) };
        if let Some(dbias) = dbias {
            unsafe { dbias.put(d, db) };
        }
    }
}

/// Token by token from conv_state (in place); outputs to `p.out` or, when given, to `values`.
fn update(conv: &Conv, mut values: Option<&mut [f32]>) {
    let p = &conv.params();
    let (batch, dim, len, wd) = sizes(p);
    let k = wd - 1;
    let (w, bias) = weights(conv);
    // SAFETY: validated shapes and dtypes, the state indices checked against n_slots; conv_state
    // and out overlap no input, nor each other.
    let (x, ix, state, out) = unsafe {
        (
            Elems::new(conv.dtype(), p.x, batch * dim * len),
            optional::<i32>(p.state_batch_indices as *const c_void, batch),
            ElemsOut::new(conv.dtype(), p.conv_state, p.n_slots as usize * dim * k),
            ElemsOut::new(conv.dtype(), p.out, if values.is_some() { 0 } else { batch * dim * len }),
        )
    };
    let (mut xrow, mut y) = (vec![0f32; len], vec![0f32; len]);
    for b in 0..batch {
        let slot = ix.map_or(b as i64, |ix| ix[b] as i64);
        for d in 0..dim {
            if slot < 0 {
                // A padding row: conv_state untouched, outputs 0.
                y.fill(0.0);
            } else {
                let w = &w[d * wd..][..wd];
                let base = (slot as usize * dim + d) * k;
                let mut win = [0f32; 4];
                // SAFETY (the state's load and store): as above; nothing else accesses it.
                unsafe { state.load(base, 1, &mut win[..k]) };
                x.load(x_row(p, b, d), p.x_stride_seq as usize, &mut xrow);
                for (y, &xt) in y.iter_mut().zip(&xrow) {
                    win[k] = xt;
                    let acc = pre(w, bias[d], &win, 0);
                    *y = if p.silu != 0 { silu_std(acc) } else { acc };
                    win.copy_within(1..wd, 0);
                }
                unsafe { state.store(base, 1, &win[..k]) };
            }
            match values.as_deref_mut() {
                Some(values) => {
                    if let Some(&last) = y.last() {
                        values[b * dim + d] = last;
                    }
                }
                // SAFETY: as above.
                None => unsafe { out.store(x_row(p, b, d), p.x_stride_seq as usize, &y) },
            }
        }
    }
}
