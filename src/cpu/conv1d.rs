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

/// The sequences of a row as (start, end) steps: the whole row, or the packed sequences.
fn sequences(p: &ConvParams) -> Vec<(usize, usize)> {
    // SAFETY: validated, and the boundaries were checked on the host (conv1d::run).
    match unsafe { p.host_cu_seqlens() } {
        Some(cu) => cu.windows(2).map(|w| (w[0] as usize, w[1] as usize)).collect(),
        None => vec![(0, p.seqlen as usize)],
    }
}

/// Rows of the initial states: batch, or num_seqs with packed sequences.
fn state_rows(p: &ConvParams) -> usize {
    if p.cu_seqlens.is_null() {
        p.batch as usize
    } else {
        p.num_seqs as usize
    }
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
            initial: Elems::optional(conv.dtype(), p.initial_states, state_rows(p) * dim * (wd - 1)),
        }
    }

    /// x[b, d, ..] into `xs` (seqlen steps).
    fn x_row(&self, p: &ConvParams, b: usize, d: usize, xs: &mut [f32]) {
        self.x.load(x_row(p, b, d), p.x_stride_seq as usize, xs);
    }

    /// The width - 1 inputs before a sequence: initial_states[row, d] (or 0).
    fn before(&self, p: &ConvParams, row: usize, d: usize, out: &mut [f32]) {
        match self.initial {
            Some(initial) => initial.load((row * p.dim as usize + d) * out.len(), 1, out),
            None => out.fill(0.0),
        }
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

// Both passes hold a row as xpad[s + width - 1] = x[s] and take the sequences in order: the width - 1
// entries before a sequence's start (inputs of earlier sequences, done with) are overwritten with its
// initial state, so one window formula serves every step.

fn fwd(conv: &Conv) {
    let p = &conv.params();
    let (batch, dim, len, wd) = sizes(p);
    let k = wd - 1;
    let (w, bias) = weights(conv);
    let (seqs, packed) = (sequences(p), !p.cu_seqlens.is_null());
    // SAFETY: validated shapes and dtypes; out overlaps no input.
    let (inputs, out) = unsafe { (Inputs::new(conv), ElemsOut::new(conv.dtype(), p.out, batch * dim * len)) };
    let (mut xpad, mut y) = (vec![0f32; k + len], vec![0f32; len]);
    for d in 0..dim {
        let w = &w[d * wd..][..wd];
        for b in 0..batch {
            inputs.x_row(p, b, d, &mut xpad[k..]);
            for (i, &(start, end)) in seqs.iter().enumerate() {
                inputs.before(p, if packed { i } else { b }, d, &mut xpad[start..start + k]);
                for (t, y) in y[start..end].iter_mut().enumerate() {
                    let v = pre(w, bias[d], &xpad, start + t);
                    *y = if p.silu != 0 { silu_std(v) } else { v };
                }
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
    let (seqs, packed) = (sequences(p), !p.cu_seqlens.is_null());
    // SAFETY: validated shapes and dtypes; the gradients overlap no input, nor each other.
    let (inputs, dout, dx, dinitial, dweight, dbias) = unsafe {
        (
            Inputs::new(conv),
            Elems::new(conv.dtype(), p.dout, batch * dim * len),
            ElemsOut::new(conv.dtype(), p.out, batch * dim * len),
            ElemsOut::optional(conv.dtype(), p.dinitial_states, state_rows(p) * dim * k),
            ElemsOut::new(conv.weight_dtype(), p.dweight, dim * wd),
            ElemsOut::optional(conv.weight_dtype(), p.dbias, dim),
        )
    };
    let (mut xpad, mut dxrow, mut g) = (vec![0f32; k + len], vec![0f32; len], vec![0f32; len]);
    let mut dbefore = [0f32; 3];
    for d in 0..dim {
        let w = &w[d * wd..][..wd];
        let (mut dw, mut db) = ([0f32; 4], 0f32);
        for b in 0..batch {
            inputs.x_row(p, b, d, &mut xpad[k..]);
            dout.load(x_row(p, b, d), p.x_stride_seq as usize, &mut g);
            for (i, &(start, end)) in seqs.iter().enumerate() {
                let row = if packed { i } else { b };
                inputs.before(p, row, d, &mut xpad[start..start + k]);
                let g = &mut g[start..end];
                if p.silu != 0 {
                    for (t, g) in g.iter_mut().enumerate() {
                        *g *= silu_grad_std(pre(w, bias[d], &xpad, start + t));
                    }
                }
                // The gradient of the sequence's padded step j (j < W - 1: its initial state):
                // sum_k w[k] g[j - k].
                for j in 0..k + g.len() {
                    let mut acc = 0f32;
                    for (kk, w) in w.iter().enumerate() {
                        if let Some(&g) = j.checked_sub(kk).and_then(|t| g.get(t)) {
                            acc += w * g;
                        }
                    }
                    if j < k {
                        dbefore[j] = acc;
                    } else {
                        dxrow[start + j - k] = acc;
                    }
                }
                if let Some(dinitial) = dinitial {
                    // SAFETY: as above; nothing else accesses the gradients during the call.
                    unsafe { dinitial.store((row * dim + d) * k, 1, &dbefore[..k]) };
                }
                for (t, &gt) in g.iter().enumerate() {
                    db += gt;
                    for (kk, dw) in dw[..wd].iter_mut().enumerate() {
                        *dw += gt * xpad[start + t + kk];
                    }
                }
            }
            // SAFETY: as above.
            unsafe { dx.store(x_row(p, b, d), p.x_stride_seq as usize, &dxrow) };
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
