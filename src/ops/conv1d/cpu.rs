//! The CPU causal conv1d: per (batch, channel), a window of the last `width` inputs in f32.

use super::{Conv, ConvParams, Kind};
use crate::dtype::Element;
use crate::ops::state_update::cpu::{silu, silu_grad};
use crate::with_element_type;

pub(super) fn run(conv: &Conv) {
    with_element_type!(conv.dtype, T => with_element_type!(conv.weight_dtype, WT => match conv.kind {
        Kind::Fwd => fwd::<T, WT>(&conv.params),
        Kind::Bwd => bwd::<T, WT>(&conv.params),
        Kind::Update => {
            update::<T, WT>(&conv.params, None);
        }
    }))
}

/// The update of a validated single-token call with `out` unused: the fused decode step's conv.
/// Returns the (activated) outputs in f32, batch * dim of them (0 for padding rows).
pub fn update_values(conv: &Conv) -> Vec<f32> {
    let mut values = vec![0f32; (conv.params.batch * conv.params.dim) as usize];
    with_element_type!(conv.dtype, T => with_element_type!(conv.weight_dtype, WT => {
        update::<T, WT>(&conv.params, Some(&mut values))
    }));
    values
}

/// Reads element `i` of a dtype-`E` array.
unsafe fn get<E: Element>(p: *const std::ffi::c_void, i: i64) -> f32 {
    (*(p as *const E).offset(i as isize)).to_f32()
}

unsafe fn put<E: Element>(p: *mut std::ffi::c_void, i: i64, v: f32) {
    *(p as *mut E).offset(i as isize) = E::from_f32(v);
}

/// (weight row, bias) of channel d in f32.
unsafe fn weights<WT: Element>(p: &ConvParams, d: i64) -> ([f32; 4], f32) {
    let mut w = [0f32; 4];
    for (k, wk) in w.iter_mut().enumerate().take(p.width as usize) {
        *wk = get::<WT>(p.weight, d * p.width + k as i64);
    }
    let bias = if p.bias.is_null() { 0.0 } else { get::<WT>(p.bias, d) };
    (w, bias)
}

fn x_index(p: &ConvParams, b: i64, d: i64, t: i64) -> i64 {
    b * p.x_stride_batch + d * p.x_stride_dim + t * p.x_stride_seq
}

/// xpad[s] for s in -(width - 1)..seqlen.
unsafe fn xpad<T: Element>(p: &ConvParams, b: i64, d: i64, s: i64) -> f32 {
    if s >= 0 {
        get::<T>(p.x, x_index(p, b, d, s))
    } else if p.initial_states.is_null() {
        0.0
    } else {
        get::<T>(p.initial_states, (b * p.dim + d) * (p.width - 1) + p.width - 1 + s)
    }
}

/// The pre-activation at step t.
unsafe fn pre<T: Element>(p: &ConvParams, w: &[f32; 4], bias: f32, b: i64, d: i64, t: i64) -> f32 {
    let mut acc = bias;
    for k in 0..p.width {
        acc += w[k as usize] * xpad::<T>(p, b, d, t - (p.width - 1) + k);
    }
    acc
}

fn fwd<T: Element, WT: Element>(p: &ConvParams) {
    // SAFETY: validated shapes and dtypes.
    unsafe {
        for d in 0..p.dim {
            let (w, bias) = weights::<WT>(p, d);
            for b in 0..p.batch {
                for t in 0..p.seqlen {
                    let v = pre::<T>(p, &w, bias, b, d, t);
                    put::<T>(p.out, x_index(p, b, d, t), if p.silu != 0 { silu(v) } else { v });
                }
            }
        }
    }
}

fn bwd<T: Element, WT: Element>(p: &ConvParams) {
    let (wd, l) = (p.width, p.seqlen);
    let mut g = vec![0f32; l as usize];
    // SAFETY: validated shapes and dtypes.
    unsafe {
        for d in 0..p.dim {
            let (w, bias) = weights::<WT>(p, d);
            let (mut dw, mut db) = ([0f32; 4], 0f32);
            for b in 0..p.batch {
                for t in 0..l {
                    let dout = get::<T>(p.dout, x_index(p, b, d, t));
                    g[t as usize] = if p.silu != 0 { dout * silu_grad(pre::<T>(p, &w, bias, b, d, t)) } else { dout };
                }
                // dxpad[s] = sum_k w[k] g[s + (W - 1) - k].
                for s in -(wd - 1)..l {
                    let mut acc = 0f32;
                    for k in 0..wd {
                        let t = s + wd - 1 - k;
                        if (0..l).contains(&t) {
                            acc += w[k as usize] * g[t as usize];
                        }
                    }
                    if s >= 0 {
                        put::<T>(p.out, x_index(p, b, d, s), acc);
                    } else if !p.dinitial_states.is_null() {
                        put::<T>(p.dinitial_states, (b * p.dim + d) * (wd - 1) + wd - 1 + s, acc);
                    }
                }
                for t in 0..l {
                    let gt = g[t as usize];
                    db += gt;
                    for k in 0..wd {
                        dw[k as usize] += gt * xpad::<T>(p, b, d, t - (wd - 1) + k);
                    }
                }
            }
            for k in 0..wd {
                put::<WT>(p.dweight, d * wd + k, dw[k as usize]);
            }
            if !p.dbias.is_null() {
                put::<WT>(p.dbias, d, db);
            }
        }
    }
}

/// Token by token from conv_state (in place); outputs to `p.out` or, when given, to `values`.
fn update<T: Element, WT: Element>(p: &ConvParams, mut values: Option<&mut [f32]>) {
    let wd = p.width as usize;
    // SAFETY: validated shapes and dtypes; indices checked against n_slots.
    unsafe {
        for b in 0..p.batch {
            let slot =
                if p.state_batch_indices.is_null() { b } else { *p.state_batch_indices.offset(b as isize) as i64 };
            for d in 0..p.dim {
                if slot < 0 {
                    // A padding row: conv_state untouched, outputs 0.
                    for t in 0..p.seqlen {
                        match values.as_deref_mut() {
                            Some(v) => v[(b * p.dim + d) as usize] = 0.0,
                            None => put::<T>(p.out, x_index(p, b, d, t), 0.0),
                        }
                    }
                    continue;
                }
                let (w, bias) = weights::<WT>(p, d);
                let base = (slot * p.dim + d) * (p.width - 1);
                let mut win = [0f32; 4];
                for (k, v) in win.iter_mut().enumerate().take(wd - 1) {
                    *v = get::<T>(p.conv_state, base + k as i64);
                }
                for t in 0..p.seqlen {
                    win[wd - 1] = get::<T>(p.x, x_index(p, b, d, t));
                    let mut acc = bias;
                    for k in 0..wd {
                        acc += w[k] * win[k];
                    }
                    let v = if p.silu != 0 { silu(acc) } else { acc };
                    match values.as_deref_mut() {
                        Some(vals) => vals[(b * p.dim + d) as usize] = v,
                        None => put::<T>(p.out, x_index(p, b, d, t), v),
                    }
                    win.copy_within(1..wd, 0);
                }
                for (k, &v) in win.iter().enumerate().take(wd - 1) {
                    put::<T>(p.conv_state, base + k as i64, v);
                }
            }
        }
    }
}
