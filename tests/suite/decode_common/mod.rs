//! Shared by tests/suite/ffi_{cpu,cuda}_decode.rs: random problems for the decode-time targets, their
//! references written from the math in f64 (on the inputs as rounded to their dtypes), and calls
//! described platform-independently (operands, results, which result aliases which operand).
#![allow(dead_code)]

use crate::common::xla::{Attr, S32};
use crate::common::{Dt, Rng, Tol};

/// An operand or result: dtype code, dims, bytes (results: poisoned with NaN).
#[derive(Clone, Debug)]
pub struct Arr {
    pub dtype: i32,
    pub dims: Vec<i64>,
    pub bytes: Vec<u8>,
}

/// One call of a target: results with `alias: Some(i)` are operand i's buffer (in place).
#[derive(Clone, Debug)]
pub struct Call {
    pub args: Vec<Arr>,
    pub rets: Vec<(Arr, Option<usize>)>,
    pub attrs: Vec<(&'static str, Attr)>,
}

/// An expected result: index into the call's results, its dtype, the f64 values, the tolerance.
pub struct Want {
    pub ret: usize,
    pub name: &'static str,
    pub dtype: Dt,
    pub values: Vec<f64>,
    pub tol: Tol,
}

pub fn arr(dt: Dt, dims: &[usize], values: &[f32]) -> Arr {
    Arr { dtype: dt.xla(), dims: dims.iter().map(|&d| d as i64).collect(), bytes: dt.encode(values) }
}

pub fn poisoned(dt: Dt, dims: &[usize]) -> Arr {
    let n = dims.iter().product();
    Arr { dtype: dt.xla(), dims: dims.iter().map(|&d| d as i64).collect(), bytes: dt.nans(n) }
}

pub fn indices_arr(ix: &[i32]) -> Arr {
    Arr { dtype: S32, dims: vec![ix.len() as i64], bytes: ix.iter().flat_map(|v| v.to_le_bytes()).collect() }
}

/// Random values rounded to `dt` (what the kernel will read).
pub fn randn(rng: &mut Rng, dt: Dt, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| dt.round((rng.normal() * scale) as f32)).collect()
}

pub fn uniform(rng: &mut Rng, dt: Dt, n: usize, lo: f64, hi: f64) -> Vec<f32> {
    (0..n).map(|_| dt.round(rng.range(lo, hi) as f32)).collect()
}

fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn silu_grad(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

/// Tolerance of a result in `dt` (the state: f32 arithmetic, then its dtype's rounding).
pub fn tol(dt: Dt) -> Tol {
    dt.tol()
}

// ---------------------------------------------------------------------------------------------
// selective_state_update

#[derive(Clone, Debug)]
pub struct SsuCase {
    pub batch: usize,
    pub dim: usize,
    pub dstate: usize,
    pub groups: usize,
    pub dtype: Dt,
    pub bc_dtype: Dt,
    pub state_dtype: Dt,
    pub has_d: bool,
    pub has_z: bool,
    pub has_bias: bool,
    pub softplus: bool,
    /// Some(slots): a pool of `slots` states addressed by random distinct indices, some -1.
    pub pool: Option<usize>,
    pub seed: u64,
}

impl SsuCase {
    pub fn new(batch: usize, dim: usize, dstate: usize, groups: usize) -> SsuCase {
        SsuCase {
            batch,
            dim,
            dstate,
            groups,
            dtype: Dt::F32,
            bc_dtype: Dt::F32,
            state_dtype: Dt::F32,
            has_d: true,
            has_z: true,
            has_bias: true,
            softplus: true,
            pool: None,
            seed: 1,
        }
    }
}

/// The raw inputs of a state update (f32 values, already rounded to their dtypes).
pub struct SsuInputs {
    pub state: Vec<f32>,
    pub x: Vec<f32>,
    pub dt: Vec<f32>,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub c: Vec<f32>,
    pub d: Vec<f32>,
    pub z: Vec<f32>,
    pub bias: Vec<f32>,
    pub indices: Option<Vec<i32>>,
    pub slots: usize,
}

pub fn ssu_inputs(k: &SsuCase) -> SsuInputs {
    let mut rng = Rng::new(k.seed * 7919 + 17);
    let (bd, n) = (k.batch * k.dim, k.dstate);
    let slots = k.pool.unwrap_or(k.batch);
    let indices = k.pool.map(|slots| {
        // Distinct slots from a shuffled pool; every third row is padding (-1).
        let mut perm: Vec<i32> = (0..slots as i32).collect();
        for i in (1..perm.len()).rev() {
            perm.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        (0..k.batch).map(|i| if i % 3 == 2 || i >= slots { -1 } else { perm[i] }).collect::<Vec<i32>>()
    });
    let f = Dt::F32;
    SsuInputs {
        state: randn(&mut rng, k.state_dtype, slots * k.dim * n, 1.0),
        x: randn(&mut rng, k.dtype, bd, 1.0),
        dt: if k.softplus { randn(&mut rng, k.dtype, bd, 1.0) } else { uniform(&mut rng, k.dtype, bd, 0.001, 0.5) },
        a: uniform(&mut rng, f, k.dim * n, -2.0, -0.05),
        b: randn(&mut rng, k.bc_dtype, k.batch * k.groups * n, 1.0),
        c: randn(&mut rng, k.bc_dtype, k.batch * k.groups * n, 1.0),
        d: randn(&mut rng, f, k.dim, 1.0),
        z: randn(&mut rng, k.dtype, bd, 1.0),
        bias: uniform(&mut rng, f, k.dim, -0.5, 0.5),
        indices,
        slots,
    }
}

/// (out, state after) of one update; `xs` replaces x (the fused step's conv output).
pub fn ssu_reference(k: &SsuCase, i: &SsuInputs, xs: Option<&[f64]>) -> (Vec<f64>, Vec<f64>) {
    let (dim, n) = (k.dim, k.dstate);
    let mut state: Vec<f64> = i.state.iter().map(|&v| v as f64).collect();
    let mut out = vec![0f64; k.batch * dim];
    for b in 0..k.batch {
        let slot = i.indices.as_ref().map_or(b as i64, |ix| ix[b] as i64);
        if slot < 0 {
            continue;
        }
        for d in 0..dim {
            let row = b * dim + d;
            let x = xs.map_or(i.x[row] as f64, |xs| xs[row]);
            let mut dt = i.dt[row] as f64 + if k.has_bias { i.bias[d] as f64 } else { 0.0 };
            if k.softplus {
                dt = softplus(dt);
            }
            let g = d / (dim / k.groups);
            let mut y = 0.0;
            for s in 0..n {
                let h = &mut state[(slot as usize * dim + d) * n + s];
                let bc = (b * k.groups + g) * n + s;
                *h = (dt * i.a[d * n + s] as f64).exp() * *h + dt * i.b[bc] as f64 * x;
                // The state is stored in its dtype; the output reads it as stored.
                *h = k.state_dtype.round(*h as f32) as f64;
                y += i.c[bc] as f64 * *h;
            }
            if k.has_d {
                y += i.d[d] as f64 * x;
            }
            if k.has_z {
                y *= silu(i.z[row] as f64);
            }
            out[row] = y;
        }
    }
    (out, state)
}

/// Operands in the target's order; results out, state (aliased to operand 0 when `alias`).
pub fn ssu_call(k: &SsuCase, i: &SsuInputs, alias: bool) -> Call {
    let (bd, dn) = (vec![k.batch, k.dim], vec![k.dim, k.dstate]);
    let bc = vec![k.batch, k.groups, k.dstate];
    let mut args = vec![
        arr(k.state_dtype, &[i.slots, k.dim, k.dstate], &i.state),
        arr(k.dtype, &bd, &i.x),
        arr(k.dtype, &bd, &i.dt),
        arr(Dt::F32, &dn, &i.a),
        arr(k.bc_dtype, &bc, &i.b),
        arr(k.bc_dtype, &bc, &i.c),
    ];
    if k.has_d {
        args.push(arr(Dt::F32, &[k.dim], &i.d));
    }
    if k.has_z {
        args.push(arr(k.dtype, &bd, &i.z));
    }
    if k.has_bias {
        args.push(arr(Dt::F32, &[k.dim], &i.bias));
    }
    if let Some(ix) = &i.indices {
        args.push(indices_arr(ix));
    }
    let state_ret = if alias { args[0].clone() } else { poisoned(k.state_dtype, &[i.slots, k.dim, k.dstate]) };
    Call {
        args,
        rets: vec![(poisoned(k.dtype, &bd), None), (state_ret, alias.then_some(0))],
        attrs: vec![
            ("dt_softplus", Attr::Bool(k.softplus)),
            ("has_d", Attr::Bool(k.has_d)),
            ("has_z", Attr::Bool(k.has_z)),
            ("has_dt_bias", Attr::Bool(k.has_bias)),
            ("has_state_batch_indices", Attr::Bool(i.indices.is_some())),
        ],
    }
}

pub fn ssu_wants(k: &SsuCase, i: &SsuInputs) -> Vec<Want> {
    let (out, state) = ssu_reference(k, i, None);
    vec![
        Want { ret: 0, name: "out", dtype: k.dtype, values: out, tol: tol(k.dtype) },
        Want { ret: 1, name: "state", dtype: k.state_dtype, values: state, tol: tol(k.state_dtype) },
    ]
}

// ---------------------------------------------------------------------------------------------
// causal_conv1d

#[derive(Clone, Debug)]
pub struct ConvCase {
    pub batch: usize,
    pub dim: usize,
    pub seqlen: usize,
    pub width: usize,
    pub dtype: Dt,
    pub wdtype: Dt,
    /// Channel-last (batch, seqlen, dim).
    pub bld: bool,
    pub has_bias: bool,
    pub has_init: bool,
    pub silu: bool,
    pub seed: u64,
}

impl ConvCase {
    pub fn new(batch: usize, dim: usize, seqlen: usize, width: usize) -> ConvCase {
        ConvCase {
            batch,
            dim,
            seqlen,
            width,
            dtype: Dt::F32,
            wdtype: Dt::F32,
            bld: false,
            has_bias: true,
            has_init: true,
            silu: true,
            seed: 1,
        }
    }

    pub fn x_dims(&self) -> Vec<usize> {
        if self.bld {
            vec![self.batch, self.seqlen, self.dim]
        } else {
            vec![self.batch, self.dim, self.seqlen]
        }
    }

    pub fn xi(&self, b: usize, d: usize, t: usize) -> usize {
        if self.bld {
            (b * self.seqlen + t) * self.dim + d
        } else {
            (b * self.dim + d) * self.seqlen + t
        }
    }

    fn layout(&self) -> Attr {
        Attr::Str(if self.bld { "bld" } else { "bdl" }.into())
    }
}

pub struct ConvInputs {
    pub x: Vec<f32>,
    pub w: Vec<f32>,
    pub bias: Vec<f32>,
    pub init: Vec<f32>,
    pub dout: Vec<f32>,
}

pub fn conv_inputs(k: &ConvCase) -> ConvInputs {
    let mut rng = Rng::new(k.seed * 104_729 + 3);
    let n = k.batch * k.dim * k.seqlen;
    ConvInputs {
        x: randn(&mut rng, k.dtype, n, 1.0),
        w: randn(&mut rng, k.wdtype, k.dim * k.width, 0.5),
        bias: randn(&mut rng, k.wdtype, k.dim, 0.5),
        init: randn(&mut rng, k.dtype, k.batch * k.dim * (k.width - 1), 1.0),
        dout: randn(&mut rng, k.dtype, n, 1.0),
    }
}

fn xpad(k: &ConvCase, i: &ConvInputs, b: usize, d: usize, s: i64) -> f64 {
    let w1 = k.width as i64 - 1;
    if s >= 0 {
        i.x[k.xi(b, d, s as usize)] as f64
    } else if k.has_init {
        i.init[(b * k.dim + d) * w1 as usize + (w1 + s) as usize] as f64
    } else {
        0.0
    }
}

fn conv_pre(k: &ConvCase, i: &ConvInputs, b: usize, d: usize, t: usize) -> f64 {
    let w1 = k.width as i64 - 1;
    let mut acc = if k.has_bias { i.bias[d] as f64 } else { 0.0 };
    for j in 0..k.width {
        acc += i.w[d * k.width + j] as f64 * xpad(k, i, b, d, t as i64 - w1 + j as i64);
    }
    acc
}

pub fn conv_fwd_reference(k: &ConvCase, i: &ConvInputs) -> Vec<f64> {
    let mut out = vec![0f64; i.x.len()];
    for b in 0..k.batch {
        for d in 0..k.dim {
            for t in 0..k.seqlen {
                let v = conv_pre(k, i, b, d, t);
                out[k.xi(b, d, t)] = if k.silu { silu(v) } else { v };
            }
        }
    }
    out
}

/// (dx, dweight, dbias, dinitial_states).
pub fn conv_bwd_reference(k: &ConvCase, i: &ConvInputs) -> [Vec<f64>; 4] {
    let (w1, l) = (k.width as i64 - 1, k.seqlen as i64);
    let mut dx = vec![0f64; i.x.len()];
    let mut dw = vec![0f64; k.dim * k.width];
    let mut db = vec![0f64; k.dim];
    let mut dinit = vec![0f64; k.batch * k.dim * w1 as usize];
    for b in 0..k.batch {
        for d in 0..k.dim {
            let g: Vec<f64> = (0..k.seqlen)
                .map(|t| {
                    let g = i.dout[k.xi(b, d, t)] as f64;
                    if k.silu {
                        g * silu_grad(conv_pre(k, i, b, d, t))
                    } else {
                        g
                    }
                })
                .collect();
            for s in -w1..l {
                let mut acc = 0.0;
                for j in 0..k.width as i64 {
                    let t = s + w1 - j;
                    if (0..l).contains(&t) {
                        acc += i.w[d * k.width + j as usize] as f64 * g[t as usize];
                    }
                }
                if s >= 0 {
                    dx[k.xi(b, d, s as usize)] = acc;
                } else {
                    dinit[(b * k.dim + d) * w1 as usize + (w1 + s) as usize] = acc;
                }
            }
            for (t, &gt) in g.iter().enumerate() {
                db[d] += gt;
                for j in 0..k.width {
                    dw[d * k.width + j] += gt * xpad(k, i, b, d, t as i64 - w1 + j as i64);
                }
            }
        }
    }
    [dx, dw, db, dinit]
}

fn conv_common_args(k: &ConvCase, i: &ConvInputs) -> Vec<Arr> {
    vec![arr(k.dtype, &k.x_dims(), &i.x), arr(k.wdtype, &[k.dim, k.width], &i.w)]
}

fn conv_attrs(k: &ConvCase) -> Vec<(&'static str, Attr)> {
    vec![
        ("silu", Attr::Bool(k.silu)),
        ("layout", k.layout()),
        ("has_bias", Attr::Bool(k.has_bias)),
        ("has_initial_states", Attr::Bool(k.has_init)),
    ]
}

fn conv_optional(k: &ConvCase, i: &ConvInputs, args: &mut Vec<Arr>) {
    if k.has_bias {
        args.push(arr(k.wdtype, &[k.dim], &i.bias));
    }
    if k.has_init {
        args.push(arr(k.dtype, &[k.batch, k.dim, k.width - 1], &i.init));
    }
}

pub fn conv_fwd_call(k: &ConvCase, i: &ConvInputs) -> (Call, Vec<Want>) {
    let mut args = conv_common_args(k, i);
    conv_optional(k, i, &mut args);
    let call = Call { args, rets: vec![(poisoned(k.dtype, &k.x_dims()), None)], attrs: conv_attrs(k) };
    let want = Want { ret: 0, name: "out", dtype: k.dtype, values: conv_fwd_reference(k, i), tol: tol(k.dtype) };
    (call, vec![want])
}

/// Gradients are sums over batch x seqlen terms: f32 accumulation in another order than the
/// reference's, so a looser bound for dweight and dbias in f32.
const SUM_F32: Tol = Tol { rel_l2: 1e-5, rel_max: 1e-4 };

pub fn conv_bwd_call(k: &ConvCase, i: &ConvInputs) -> (Call, Vec<Want>) {
    let mut args = conv_common_args(k, i);
    args.push(arr(k.dtype, &k.x_dims(), &i.dout));
    conv_optional(k, i, &mut args);
    let [dx, dw, db, dinit] = conv_bwd_reference(k, i);
    let wtol = if k.wdtype == Dt::F32 { SUM_F32 } else { tol(k.wdtype) };
    let mut rets = vec![(poisoned(k.dtype, &k.x_dims()), None), (poisoned(k.wdtype, &[k.dim, k.width]), None)];
    let mut wants = vec![
        Want { ret: 0, name: "dx", dtype: k.dtype, values: dx, tol: tol(k.dtype) },
        Want { ret: 1, name: "dweight", dtype: k.wdtype, values: dw, tol: wtol },
    ];
    if k.has_bias {
        wants.push(Want { ret: rets.len(), name: "dbias", dtype: k.wdtype, values: db, tol: wtol });
        rets.push((poisoned(k.wdtype, &[k.dim]), None));
    }
    if k.has_init {
        wants.push(Want { ret: rets.len(), name: "dinitial_states", dtype: k.dtype, values: dinit, tol: tol(k.dtype) });
        rets.push((poisoned(k.dtype, &[k.batch, k.dim, k.width - 1]), None));
    }
    (Call { args, rets, attrs: conv_attrs(k) }, wants)
}

/// The update: the first W - 1 steps of x (as `init` would be) are the conv state; the case's
/// seqlen tokens run from it. x rank 2 when seqlen is 1 and `rank2`. Pool / indices as in SsuCase.
pub fn conv_update_call(
    k: &ConvCase,
    i: &ConvInputs,
    pool: Option<usize>,
    rank2: bool,
    alias: bool,
) -> (Call, Vec<Want>) {
    let w1 = k.width - 1;
    let slots = pool.unwrap_or(k.batch);
    let indices: Option<Vec<i32>> =
        pool.map(|s| (0..k.batch).map(|b| if b % 3 == 2 || b >= s { -1 } else { (s - 1 - b) as i32 }).collect());
    // Pool rows hold random states; row slot(b) is the batch row's initial state.
    let mut rng = Rng::new(k.seed + 99);
    let mut pool_state = randn(&mut rng, k.dtype, slots * k.dim * w1, 1.0);
    let slot_of = |b: usize| indices.as_ref().map_or(b as i64, |ix| ix[b] as i64);
    for b in 0..k.batch {
        if slot_of(b) >= 0 {
            let s = slot_of(b) as usize;
            pool_state[s * k.dim * w1..][..k.dim * w1].copy_from_slice(&i.init[b * k.dim * w1..][..k.dim * w1]);
        }
    }
    // The reference: the forward conv from init over these tokens; the state after is the last W - 1
    // inputs of [init, x].
    let full = ConvCase { has_init: true, ..k.clone() };
    let out_full = conv_fwd_reference(&full, i);
    let mut out = vec![0f64; i.x.len()];
    let mut state_after: Vec<f64> = pool_state.iter().map(|&v| v as f64).collect();
    for b in 0..k.batch {
        if slot_of(b) < 0 {
            continue;
        }
        let s = slot_of(b) as usize;
        for d in 0..k.dim {
            for t in 0..k.seqlen {
                out[k.xi(b, d, t)] = out_full[k.xi(b, d, t)];
            }
            for j in 0..w1 {
                state_after[(s * k.dim + d) * w1 + j] = xpad(&full, i, b, d, k.seqlen as i64 - w1 as i64 + j as i64);
            }
        }
    }
    let x_dims = if rank2 { vec![k.batch, k.dim] } else { k.x_dims() };
    let mut args = vec![
        arr(k.dtype, &x_dims, &i.x),
        arr(k.dtype, &[slots, k.dim, w1], &pool_state),
        arr(k.wdtype, &[k.dim, k.width], &i.w),
    ];
    if k.has_bias {
        args.push(arr(k.wdtype, &[k.dim], &i.bias));
    }
    if let Some(ix) = &indices {
        args.push(indices_arr(ix));
    }
    let state_ret = if alias { args[1].clone() } else { poisoned(k.dtype, &[slots, k.dim, w1]) };
    let call = Call {
        args,
        rets: vec![(poisoned(k.dtype, &x_dims), None), (state_ret, alias.then_some(1))],
        attrs: vec![
            ("silu", Attr::Bool(k.silu)),
            ("layout", k.layout()),
            ("has_bias", Attr::Bool(k.has_bias)),
            ("has_state_batch_indices", Attr::Bool(indices.is_some())),
        ],
    };
    let wants = vec![
        Want { ret: 0, name: "out", dtype: k.dtype, values: out, tol: tol(k.dtype) },
        // The state is a copy of inputs: exact.
        Want {
            ret: 1,
            name: "conv_state",
            dtype: k.dtype,
            values: state_after,
            tol: Tol { rel_l2: 0.0, rel_max: 0.0 },
        },
    ];
    (call, wants)
}

// ---------------------------------------------------------------------------------------------
// mamba_decode_step

/// The fused step: a state-update case (its x is the conv input) plus a conv of `width`, with
/// weight dtype `wdtype` and optional bias.
pub fn decode_call(k: &SsuCase, width: usize, wdtype: Dt, has_conv_bias: bool, alias: bool) -> (Call, Vec<Want>) {
    let i = ssu_inputs(k);
    let mut rng = Rng::new(k.seed + 5);
    let w1 = width - 1;
    let conv_state = randn(&mut rng, k.dtype, i.slots * k.dim * w1, 1.0);
    let w = randn(&mut rng, wdtype, k.dim * width, 0.5);
    let bias = randn(&mut rng, wdtype, k.dim, 0.5);
    let slot_of = |b: usize| i.indices.as_ref().map_or(b as i64, |ix| ix[b] as i64);
    let mut xc = vec![0f64; k.batch * k.dim];
    let mut conv_after: Vec<f64> = conv_state.iter().map(|&v| v as f64).collect();
    for b in 0..k.batch {
        if slot_of(b) < 0 {
            continue;
        }
        let s = slot_of(b) as usize;
        for d in 0..k.dim {
            let row = (s * k.dim + d) * w1;
            let mut win: Vec<f64> = conv_state[row..row + w1].iter().map(|&v| v as f64).collect();
            win.push(i.x[b * k.dim + d] as f64);
            let mut acc = if has_conv_bias { bias[d] as f64 } else { 0.0 };
            for j in 0..width {
                acc += w[d * width + j] as f64 * win[j];
            }
            xc[b * k.dim + d] = silu(acc);
            conv_after[row..row + w1].copy_from_slice(&win[1..]);
        }
    }
    let (out, state) = ssu_reference(k, &i, Some(&xc));
    let base = ssu_call(k, &i, alias);
    // Operands: x, conv_state, conv_weight, ssm_state, dt, A, B, C, then conv_bias and the optional ones.
    let mut args = vec![
        base.args[1].clone(),
        arr(k.dtype, &[i.slots, k.dim, w1], &conv_state),
        arr(wdtype, &[k.dim, width], &w),
        base.args[0].clone(),
    ];
    args.extend(base.args[2..6].iter().cloned());
    if has_conv_bias {
        args.push(arr(wdtype, &[k.dim], &bias));
    }
    args.extend(base.args[6..].iter().cloned());
    let conv_ret = if alias { args[1].clone() } else { poisoned(k.dtype, &[i.slots, k.dim, w1]) };
    let ssm_ret = if alias { args[3].clone() } else { poisoned(k.state_dtype, &[i.slots, k.dim, k.dstate]) };
    let mut attrs = base.attrs.clone();
    attrs.push(("has_conv_bias", Attr::Bool(has_conv_bias)));
    let call = Call {
        args,
        rets: vec![
            (poisoned(k.dtype, &[k.batch, k.dim]), None),
            (conv_ret, alias.then_some(1)),
            (ssm_ret, alias.then_some(3)),
        ],
        attrs,
    };
    let wants = vec![
        Want { ret: 0, name: "out", dtype: k.dtype, values: out, tol: tol(k.dtype) },
        Want { ret: 1, name: "conv_state", dtype: k.dtype, values: conv_after, tol: Tol { rel_l2: 0.0, rel_max: 0.0 } },
        Want { ret: 2, name: "ssm_state", dtype: k.state_dtype, values: state, tol: tol(k.state_dtype) },
    ];
    (call, wants)
}

/// Checks results (as bytes, in the call's order) against the wants.
pub fn check(what: &str, case: &dyn std::fmt::Debug, results: &[Vec<u8>], wants: &[Want]) {
    for w in wants {
        let got = w.dtype.decode(&results[w.ret]);
        crate::common::assert_close(&format!("{what}: {}", w.name), case, &got, &w.values, w.tol);
    }
}
