//! Shared by the SSD tests (tests/suite/ssd_reference.rs, tests/suite/ffi_{cpu,cuda}_ssd.rs): random problems,
//! two f64 references of the forward written from the math in docs/ssd.md (the plain recurrence,
//! and the chunked "attention" form), the backward by the reverse recurrence, and the operands,
//! attributes and results of calls to the `xla_ssm_ssd_*` targets.
#![allow(dead_code)]
// Index loops read like the math here.
#![allow(clippy::needless_range_loop)]

use crate::common::xla::{self, Attr, Buf, Frame, Handler};
use crate::common::{assert_close, Dt, Errors, HostBuf, Rng, Tol};

/// How D is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DForm {
    None,
    /// (heads)
    PerHead,
    /// (heads, headdim)
    PerChannel,
}

/// One problem's shape and flags.
#[derive(Clone, Debug)]
pub struct SsdCase {
    pub batch: usize,
    pub seqlen: usize,
    pub heads: usize,
    pub headdim: usize,
    pub dstate: usize,
    pub groups: usize,
    pub chunk_size: usize,
    pub dtype: Dt,
    pub d: DForm,
    pub has_z: bool,
    pub has_dt_bias: bool,
    pub has_initial_states: bool,
    pub softplus: bool,
    /// (dt_min, dt_max): the clamp after bias and softplus.
    pub dt_limit: (f32, f32),
    /// Range of dt before the clamp (after bias and softplus), drawn log-uniformly.
    pub dt_range: (f64, f64),
    pub seed: u64,
}

/// The limits that never clamp.
pub const NO_CLAMP: (f32, f32) = (f32::NEG_INFINITY, f32::INFINITY);
/// Limits that clamp some of the default dt range (0.01..1) at both ends.
pub const CLAMP: (f32, f32) = (0.03, 0.4);

impl SsdCase {
    /// f32, softplus on, the default limits (0, inf), chunk 64, no optional operands.
    pub fn new(batch: usize, seqlen: usize, heads: usize, headdim: usize, dstate: usize) -> SsdCase {
        SsdCase {
            batch,
            seqlen,
            heads,
            headdim,
            dstate,
            groups: 1,
            chunk_size: 64,
            dtype: Dt::F32,
            d: DForm::None,
            has_z: false,
            has_dt_bias: false,
            has_initial_states: false,
            softplus: true,
            dt_limit: (0.0, f32::INFINITY),
            dt_range: (0.01, 1.0),
            seed: 1,
        }
    }

    /// Every optional operand on (D per head).
    pub fn all_optional(self) -> SsdCase {
        SsdCase { d: DForm::PerHead, has_z: true, has_dt_bias: true, has_initial_states: true, ..self }
    }

    pub fn x_len(&self) -> usize {
        self.batch * self.seqlen * self.heads * self.headdim
    }
    pub fn dt_len(&self) -> usize {
        self.batch * self.seqlen * self.heads
    }
    pub fn bc_len(&self) -> usize {
        self.batch * self.seqlen * self.groups * self.dstate
    }
    pub fn state_len(&self) -> usize {
        self.batch * self.heads * self.headdim * self.dstate
    }
    pub fn n_chunks(&self) -> usize {
        self.seqlen.div_ceil(self.chunk_size)
    }
    pub fn chunk_len(&self) -> usize {
        self.state_len() * self.n_chunks()
    }
    pub fn d_dims(&self) -> Vec<usize> {
        match self.d {
            DForm::PerChannel => vec![self.heads, self.headdim],
            _ => vec![self.heads],
        }
    }
    pub fn d_len(&self) -> usize {
        self.d_dims().iter().product()
    }

    pub fn xi(&self, b: usize, t: usize, h: usize, p: usize) -> usize {
        ((b * self.seqlen + t) * self.heads + h) * self.headdim + p
    }
    pub fn dti(&self, b: usize, t: usize, h: usize) -> usize {
        (b * self.seqlen + t) * self.heads + h
    }
    pub fn bci(&self, b: usize, t: usize, g: usize, n: usize) -> usize {
        ((b * self.seqlen + t) * self.groups + g) * self.dstate + n
    }
    pub fn si(&self, b: usize, h: usize, p: usize, n: usize) -> usize {
        ((b * self.heads + h) * self.headdim + p) * self.dstate + n
    }
    pub fn ci(&self, b: usize, h: usize, p: usize, c: usize, n: usize) -> usize {
        (((b * self.heads + h) * self.headdim + p) * self.n_chunks() + c) * self.dstate + n
    }
    pub fn di(&self, h: usize, p: usize) -> usize {
        if self.d == DForm::PerChannel {
            h * self.headdim + p
        } else {
            h
        }
    }
    /// Group of head h.
    pub fn group(&self, h: usize) -> usize {
        h / (self.heads / self.groups)
    }

    /// Whether the op must transform dt itself (a clamp that can bite): then its scan sees dt
    /// rounded to the dtype, and f32 results carry that rounding.
    pub fn transformed(&self) -> bool {
        let (lo, hi) = self.dt_limit;
        !(hi == f32::INFINITY && (lo == f32::NEG_INFINITY || (self.softplus && lo <= 0.0)))
    }

    /// Tolerance of f32 results (states, dA, ...) against the reference.
    pub fn f32_tol(&self) -> Tol {
        if self.transformed() {
            self.dtype.tol()
        } else {
            Tol::F32
        }
    }

    /// Whether the CUDA target runs this case on its tensor-core kernels (plan::mma_applies): their
    /// products take operands in the inputs' dtype, so the f32 states carry its rounding.
    pub fn tensor_cores(&self) -> bool {
        self.dtype != Dt::F32
            && self.headdim >= 32
            && (1..=256).contains(&self.dstate)
            && self.chunk_size.is_multiple_of(64)
    }

    /// The dtype of chunk_states (docs/ssd.md; `xla_ssm_ssd_chunk_states_dtype`): the inputs' where
    /// the tensor-core kernels run, else f32. Both targets take the same.
    pub fn chunk_states_dt(&self) -> Dt {
        if self.tensor_cores() {
            self.dtype
        } else {
            Dt::F32
        }
    }

    /// The C API's size fields: batch, seqlen, heads, headdim, dstate, groups, chunk_size.
    pub fn capi_sizes(&self) -> [i64; 7] {
        [self.batch, self.seqlen, self.heads, self.headdim, self.dstate, self.groups, self.chunk_size].map(|n| n as i64)
    }

    /// Tolerance of the forward's f32 states on CUDA.
    pub fn cuda_states_tol(&self) -> Tol {
        if self.tensor_cores() {
            self.dtype.tol()
        } else {
            self.f32_tol()
        }
    }
}

/// (batch, seqlen, heads, headdim, dstate, groups, chunk_size) of the shape matrix both targets'
/// tests run: odd lengths, groups, every chunk size, headdim 1..80, dstate 1..256.
pub const SHAPES: [(usize, usize, usize, usize, usize, usize, usize); 10] = [
    (2, 1, 2, 4, 8, 1, 32),
    (2, 33, 4, 3, 16, 2, 32),
    (1, 100, 4, 8, 1, 4, 64),
    (2, 129, 2, 1, 3, 1, 128),
    (1, 257, 3, 5, 7, 3, 256),
    (1, 300, 6, 16, 32, 2, 64),
    (1, 70, 2, 80, 4, 1, 32),
    (1, 40, 2, 2, 256, 2, 32),
    (3, 64, 8, 4, 16, 8, 64),
    (1, 255, 2, 64, 64, 1, 128),
];

/// Cases of `shapes`, every other one with all the optional inputs.
pub fn shape_cases(shapes: &[(usize, usize, usize, usize, usize, usize, usize)]) -> Vec<SsdCase> {
    shapes
        .iter()
        .enumerate()
        .map(|(k, &(b, l, h, p, n, g, q))| {
            let base = SsdCase { groups: g, chunk_size: q, seed: k as u64, ..SsdCase::new(b, l, h, p, n) };
            if k % 2 == 0 {
                base.all_optional()
            } else {
                base
            }
        })
        .collect()
}

/// The inputs in f64 (the reference's arithmetic; finite differences perturb these).
#[derive(Clone, Debug)]
pub struct In64 {
    pub x: Vec<f64>,
    pub dt: Vec<f64>,
    pub a: Vec<f64>,
    pub b: Vec<f64>,
    pub c: Vec<f64>,
    pub d: Option<Vec<f64>>,
    pub z: Option<Vec<f64>>,
    pub dt_bias: Option<Vec<f64>>,
    pub h0: Option<Vec<f64>>,
}

/// A problem: inputs as f32 values already rounded to their dtypes, and the cotangents.
#[derive(Clone, Debug)]
pub struct SsdProblem {
    pub case: SsdCase,
    pub x: Vec<f32>,
    pub dt: Vec<f32>,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub c: Vec<f32>,
    pub d: Option<Vec<f32>>,
    pub z: Option<Vec<f32>>,
    pub dt_bias: Option<Vec<f32>>,
    pub h0: Option<Vec<f32>>,
    pub dy: Vec<f32>,
    pub dfinal: Option<Vec<f32>>,
    /// Packed sequences (batch 1): the boundaries; h0 and dfinal then have a row per sequence.
    pub cu: Option<Vec<i32>>,
}

fn up(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

impl SsdProblem {
    /// A = -exp(N(0, 0.5^2)); dt (after bias and softplus) log-uniform in `dt_range`; x, z, B, C, D,
    /// h0, dy, dfinal ~ N(0, 1); dt_bias ~ U(-0.5, 0.5). `with_dfinal`: a cotangent of final_states.
    pub fn random(case: &SsdCase, with_dfinal: bool) -> SsdProblem {
        let mut rng = Rng::new(case.seed.wrapping_mul(0x100_0000_01b3) ^ (case.x_len() + 7 * case.bc_len()) as u64);
        let t = case.dtype;
        let normal =
            |rng: &mut Rng, n: usize, dt: Dt| -> Vec<f32> { (0..n).map(|_| dt.round(rng.normal() as f32)).collect() };
        let a = (0..case.heads).map(|_| -((0.5 * rng.normal()).exp() as f32)).collect();
        let dt_bias: Option<Vec<f32>> =
            case.has_dt_bias.then(|| (0..case.heads).map(|_| rng.range(-0.5, 0.5) as f32).collect());
        let mut dt = vec![0f32; case.dt_len()];
        for (i, v) in dt.iter_mut().enumerate() {
            let eff = rng.range(case.dt_range.0.ln(), case.dt_range.1.ln()).exp();
            let pre = if case.softplus { eff.exp_m1().ln() } else { eff };
            let bias = dt_bias.as_ref().map_or(0.0, |b| b[i % case.heads] as f64);
            *v = t.round((pre - bias) as f32);
        }
        let x = normal(&mut rng, case.x_len(), t);
        let b = normal(&mut rng, case.bc_len(), t);
        let c = normal(&mut rng, case.bc_len(), t);
        let d = (case.d != DForm::None).then(|| normal(&mut rng, case.d_len(), Dt::F32));
        let z = case.has_z.then(|| normal(&mut rng, case.x_len(), t));
        let h0 = case.has_initial_states.then(|| normal(&mut rng, case.state_len(), Dt::F32));
        let dy = normal(&mut rng, case.x_len(), t);
        let dfinal = with_dfinal.then(|| normal(&mut rng, case.state_len(), Dt::F32));
        SsdProblem { case: case.clone(), x, dt, a, b, c, d, z, dt_bias, h0, dy, dfinal, cu: None }
    }

    /// A packed problem: sequences of these lengths along seqlen of one batch row (the case's batch
    /// and seqlen are replaced), initial states and final-state cotangents per sequence.
    pub fn packed(case: &SsdCase, lens: &[usize], with_dfinal: bool) -> SsdProblem {
        let case = SsdCase { batch: 1, seqlen: lens.iter().sum(), ..case.clone() };
        let mut p = SsdProblem::random(&case, with_dfinal);
        let mut cu = vec![0i32];
        for &l in lens {
            cu.push(cu.last().unwrap() + l as i32);
        }
        let rows = lens.len() * case.heads * case.headdim * case.dstate;
        let mut rng = Rng::new(case.seed ^ 0x9ac4_ed5e_0000 ^ lens.len() as u64);
        let mut normal = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
        p.h0 = case.has_initial_states.then(|| normal(rows));
        p.dfinal = with_dfinal.then(|| normal(rows));
        p.cu = Some(cu);
        p
    }

    /// Sequences of a packed problem: (first step, length).
    pub fn sequences(&self) -> Vec<(usize, usize)> {
        let cu = self.cu.as_ref().expect("a packed problem");
        cu.windows(2).map(|w| (w[0] as usize, (w[1] - w[0]) as usize)).collect()
    }

    /// Sequence `s` of a packed problem as an unpacked one (batch 1), its state rows included.
    pub fn sequence(&self, s: usize) -> SsdProblem {
        let (l0, len) = self.sequences()[s];
        let c = &self.case;
        let case = SsdCase { seqlen: len, ..c.clone() };
        let steps = |v: &[f32], per_step: usize| v[l0 * per_step..(l0 + len) * per_step].to_vec();
        let (xs, hs, bcs) = (c.heads * c.headdim, c.heads, c.groups * c.dstate);
        let state = c.heads * c.headdim * c.dstate;
        let row = |v: &Option<Vec<f32>>| v.as_ref().map(|v| v[s * state..(s + 1) * state].to_vec());
        SsdProblem {
            case,
            x: steps(&self.x, xs),
            dt: steps(&self.dt, hs),
            a: self.a.clone(),
            b: steps(&self.b, bcs),
            c: steps(&self.c, bcs),
            d: self.d.clone(),
            z: self.z.as_ref().map(|z| steps(z, xs)),
            dt_bias: self.dt_bias.clone(),
            h0: row(&self.h0),
            dy: steps(&self.dy, xs),
            dfinal: row(&self.dfinal),
            cu: None,
        }
    }

    pub fn in64(&self) -> In64 {
        In64 {
            x: up(&self.x),
            dt: up(&self.dt),
            a: up(&self.a),
            b: up(&self.b),
            c: up(&self.c),
            d: self.d.as_deref().map(up),
            z: self.z.as_deref().map(up),
            dt_bias: self.dt_bias.as_deref().map(up),
            h0: self.h0.as_deref().map(up),
        }
    }

    // ------------------------------------------------------------------ calls

    /// The inputs in operand order (optional ones when present).
    pub fn operands(&self) -> Vec<Arr> {
        let c = &self.case;
        let (t, f) = (c.dtype, Dt::F32);
        let xd = [c.batch, c.seqlen, c.heads, c.headdim];
        let bcd = [c.batch, c.seqlen, c.groups, c.dstate];
        let mut ops = vec![
            arr("x", t, &xd, &self.x),
            arr("dt", t, &[c.batch, c.seqlen, c.heads], &self.dt),
            arr("A", f, &[c.heads], &self.a),
            arr("B", t, &bcd, &self.b),
            arr("C", t, &bcd, &self.c),
        ];
        if let Some(d) = &self.d {
            ops.push(arr("D", f, &c.d_dims(), d));
        }
        if let Some(z) = &self.z {
            ops.push(arr("z", t, &xd, z));
        }
        if let Some(v) = &self.dt_bias {
            ops.push(arr("dt_bias", f, &[c.heads], v));
        }
        if let Some(v) = &self.h0 {
            ops.push(arr("initial_states", f, &self.state_dims(), v));
        }
        if let Some(cu) = &self.cu {
            let bytes = cu.iter().flat_map(|v| v.to_le_bytes()).collect();
            ops.push(Arr { name: "cu_seqlens", dtype: xla::S32, dims: vec![cu.len() as i64], bytes });
        }
        ops
    }

    /// Rows of the states: batch, or the packed sequences.
    pub fn state_rows(&self) -> usize {
        self.cu.as_ref().map_or(self.case.batch, |cu| cu.len() - 1)
    }

    pub fn state_dims(&self) -> Vec<usize> {
        let c = &self.case;
        vec![self.state_rows(), c.heads, c.headdim, c.dstate]
    }

    pub fn chunk_dims(&self) -> Vec<usize> {
        let c = &self.case;
        vec![c.batch, c.heads, c.headdim, c.n_chunks(), c.dstate]
    }

    fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let c = &self.case;
        vec![
            ("chunk_size", Attr::Scalar(xla::S64, (c.chunk_size as i64).to_le_bytes().to_vec())),
            ("has_d", Attr::Bool(c.d != DForm::None)),
            ("has_z", Attr::Bool(c.has_z)),
            ("has_dt_bias", Attr::Bool(c.has_dt_bias)),
            ("has_initial_states", Attr::Bool(c.has_initial_states)),
            ("dt_softplus", Attr::Bool(c.softplus)),
            ("dt_min", Attr::Scalar(xla::F32, c.dt_limit.0.to_le_bytes().to_vec())),
            ("dt_max", Attr::Scalar(xla::F32, c.dt_limit.1.to_le_bytes().to_vec())),
        ]
        .into_iter()
        .chain(self.cu.is_some().then_some(("has_cu_seqlens", Attr::Bool(true))))
        .collect()
    }

    pub fn fwd_attrs(&self, save: bool) -> Vec<(&'static str, Attr)> {
        let mut a = self.attrs();
        a.push(("save_chunk_states", Attr::Bool(save)));
        a
    }

    pub fn bwd_attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut a = self.attrs();
        a.push(("has_dfinal_states", Attr::Bool(self.dfinal.is_some())));
        a
    }

    /// y, final_states[, chunk_states], poisoned with NaN.
    pub fn fwd_results(&self, save: bool) -> Vec<Arr> {
        let c = &self.case;
        let mut rets = vec![
            poisoned("y", c.dtype, &[c.batch, c.seqlen, c.heads, c.headdim]),
            poisoned("final_states", Dt::F32, &self.state_dims()),
        ];
        if save {
            rets.push(poisoned("chunk_states", c.chunk_states_dt(), &self.chunk_dims()));
        }
        rets
    }

    /// The backward's operands, with these chunk_states (in their dtype: values the forward
    /// returned go back unchanged).
    pub fn bwd_operands(&self, chunk_states: &[f32]) -> Vec<Arr> {
        let c = &self.case;
        let mut ops = self.operands();
        ops.push(arr("chunk_states", c.chunk_states_dt(), &self.chunk_dims(), chunk_states));
        ops.push(arr("dy", c.dtype, &[c.batch, c.seqlen, c.heads, c.headdim], &self.dy));
        if let Some(v) = &self.dfinal {
            ops.push(arr("dfinal_states", Dt::F32, &self.state_dims(), v));
        }
        ops
    }

    /// The gradients (each like its primal), poisoned with NaN.
    pub fn bwd_results(&self) -> Vec<Arr> {
        self.operands()
            .into_iter()
            .filter(|o| o.name != "cu_seqlens") // integers: no gradient
            .map(|o| {
                let name = GRADS.iter().find(|(primal, _)| *primal == o.name).unwrap().1;
                let dt = [Dt::F32, Dt::BF16, Dt::F16].into_iter().find(|d| d.xla() == o.dtype).unwrap();
                let n = o.dims.iter().product::<i64>() as usize;
                Arr { name, dtype: o.dtype, dims: o.dims, bytes: dt.nans(n) }
            })
            .collect()
    }

    /// The forward through the CPU handler: (y, final_states, chunk_states if saved).
    pub fn run_fwd_cpu(&self, save: bool) -> Result<FwdOut, (i32, String)> {
        let out = run_host(
            xla_ssm::xla::handlers::xla_ssm_ssd_fwd_cpu,
            &self.operands(),
            &self.fwd_results(save),
            &self.fwd_attrs(save),
        )?;
        Ok(FwdOut::decode(&self.case, &out))
    }

    pub fn run_bwd_cpu(&self, chunk_states: &[f32]) -> Result<Grads<f32>, (i32, String)> {
        let rets = self.bwd_results();
        let out = run_host(
            xla_ssm::xla::handlers::xla_ssm_ssd_bwd_cpu,
            &self.bwd_operands(chunk_states),
            &rets,
            &self.bwd_attrs(),
        )?;
        Ok(Grads::decode(&rets, &out))
    }
}

/// (primal, gradient) names in result order.
pub const GRADS: [(&str, &str); 9] = [
    ("x", "dx"),
    ("dt", "ddt"),
    ("A", "dA"),
    ("B", "dB"),
    ("C", "dC"),
    ("D", "dD"),
    ("z", "dz"),
    ("dt_bias", "ddt_bias"),
    ("initial_states", "dinitial_states"),
];

/// An operand or result: name, dtype code, dims, bytes.
#[derive(Clone, Debug)]
pub struct Arr {
    pub name: &'static str,
    pub dtype: i32,
    pub dims: Vec<i64>,
    pub bytes: Vec<u8>,
}

pub fn arr(name: &'static str, dt: Dt, dims: &[usize], values: &[f32]) -> Arr {
    Arr { name, dtype: dt.xla(), dims: dims.iter().map(|&d| d as i64).collect(), bytes: dt.encode(values) }
}

pub fn poisoned(name: &'static str, dt: Dt, dims: &[usize]) -> Arr {
    let n = dims.iter().product();
    Arr { name, dtype: dt.xla(), dims: dims.iter().map(|&d| d as i64).collect(), bytes: dt.nans(n) }
}

pub fn dt_of(code: i32) -> Dt {
    [Dt::F32, Dt::BF16, Dt::F16].into_iter().find(|d| d.xla() == code).expect("a float dtype")
}

/// Runs a handler on host copies of `args` and `rets`; the results' bytes afterwards.
pub fn run_host(
    handler: Handler,
    args: &[Arr],
    rets: &[Arr],
    attrs: &[(&str, Attr)],
) -> Result<Vec<Vec<u8>>, (i32, String)> {
    let mut hargs: Vec<HostBuf> = args.iter().map(|a| HostBuf::from_bytes(&a.bytes)).collect();
    let mut hrets: Vec<HostBuf> = rets.iter().map(|a| HostBuf::from_bytes(&a.bytes)).collect();
    let bufs = |list: &[Arr], hs: &mut [HostBuf]| -> Vec<Buf> {
        list.iter()
            .zip(hs.iter_mut())
            .map(|(a, h)| Buf { dtype: a.dtype, dims: a.dims.clone(), data: h.ptr() })
            .collect()
    };
    let (ab, rb) = (bufs(args, &mut hargs), bufs(rets, &mut hrets));
    let mut frame = Frame::new(&ab, &rb, attrs, std::ptr::null_mut());
    xla::call(handler, &mut frame)?;
    Ok(hrets.iter().map(|h| h.bytes().to_vec()).collect())
}

/// The forward's results as f32.
#[derive(Clone, Debug)]
pub struct FwdOut {
    pub y: Vec<f32>,
    pub final_states: Vec<f32>,
    pub chunk_states: Option<Vec<f32>>,
}

impl FwdOut {
    /// From the result bytes in `fwd_results` order (a trailing workspace is ignored).
    pub fn decode(case: &SsdCase, out: &[Vec<u8>]) -> FwdOut {
        FwdOut {
            y: case.dtype.decode(&out[0]),
            final_states: Dt::F32.decode(&out[1]),
            chunk_states: out
                .get(2)
                .filter(|b| b.len() == case.chunk_len() * case.chunk_states_dt().size())
                .map(|b| case.chunk_states_dt().decode(b)),
        }
    }
}

/// Gradients in memory order, each shaped like its primal.
#[derive(Clone, Debug)]
pub struct Grads<E> {
    pub dx: Vec<E>,
    pub ddt: Vec<E>,
    pub da: Vec<E>,
    pub db: Vec<E>,
    pub dc: Vec<E>,
    pub dd: Option<Vec<E>>,
    pub dz: Option<Vec<E>>,
    pub ddt_bias: Option<Vec<E>>,
    pub dh0: Option<Vec<E>>,
}

impl Grads<f32> {
    /// From the result bytes of `rets` (names and dtypes), in that order.
    pub fn decode(rets: &[Arr], out: &[Vec<u8>]) -> Grads<f32> {
        let get = |name: &str| rets.iter().position(|r| r.name == name).map(|i| dt_of(rets[i].dtype).decode(&out[i]));
        Grads {
            dx: get("dx").unwrap(),
            ddt: get("ddt").unwrap(),
            da: get("dA").unwrap(),
            db: get("dB").unwrap(),
            dc: get("dC").unwrap(),
            dd: get("dD"),
            dz: get("dz"),
            ddt_bias: get("ddt_bias"),
            dh0: get("dinitial_states"),
        }
    }

    /// Every gradient's bits (determinism checks).
    pub fn bits(&self) -> Vec<u32> {
        let opt = [&self.dd, &self.dz, &self.ddt_bias, &self.dh0];
        [&self.dx, &self.ddt, &self.da, &self.db, &self.dc]
            .into_iter()
            .chain(opt.into_iter().flatten())
            .flat_map(|v| v.iter().map(|x| x.to_bits()))
            .collect()
    }
}

// ------------------------------------------------------------------------------ references

pub fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// dt after bias, softplus and clamp, and its derivative w.r.t. the raw dt.
pub fn dt_eff(case: &SsdCase, i: &In64, b: usize, t: usize, h: usize) -> (f64, f64) {
    let pre = i.dt[case.dti(b, t, h)] + i.dt_bias.as_ref().map_or(0.0, |v| v[h]);
    let (v, dv) = if case.softplus { (softplus(pre), sigmoid(pre)) } else { (pre, 1.0) };
    let (lo, hi) = (case.dt_limit.0 as f64, case.dt_limit.1 as f64);
    if v < lo {
        (lo, 0.0)
    } else if v > hi {
        (hi, 0.0)
    } else {
        (v, dv)
    }
}

/// The forward's results in f64.
#[derive(Clone, Debug)]
pub struct Fwd64 {
    pub y: Vec<f64>,
    pub final_states: Vec<f64>,
    pub chunk_states: Vec<f64>,
}

/// Runs `f(b, h)` for every (batch, head) pair over threads (when the problem is large); each
/// returns its pieces, which `merge` writes in.
fn per_head<R: Send>(case: &SsdCase, f: impl Fn(usize, usize) -> R + Sync, mut merge: impl FnMut(usize, usize, R)) {
    let pairs: Vec<(usize, usize)> = (0..case.batch).flat_map(|b| (0..case.heads).map(move |h| (b, h))).collect();
    let work = case.x_len() * case.dstate;
    let threads = if work < (1 << 22) { 1 } else { std::thread::available_parallelism().map_or(1, |n| n.get()) };
    let per = pairs.len().div_ceil(threads.max(1)).max(1);
    let results: Vec<Vec<(usize, usize, R)>> = std::thread::scope(|s| {
        let handles: Vec<_> = pairs
            .chunks(per)
            .map(|chunk| {
                let f = &f;
                s.spawn(move || chunk.iter().map(|&(b, h)| (b, h, f(b, h))).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (b, h, r) in results.into_iter().flatten() {
        merge(b, h, r);
    }
}

/// y before the gate, gated, for head h at step t: y_pre + D x, times silu(z).
fn gate(case: &SsdCase, i: &In64, b: usize, t: usize, h: usize, p: usize, ssm: f64) -> f64 {
    let xi = case.xi(b, t, h, p);
    let y = ssm + i.d.as_ref().map_or(0.0, |d| d[case.di(h, p)] * i.x[xi]);
    match &i.z {
        Some(z) => y * silu(z[xi]),
        None => y,
    }
}

/// One (b, h) of the plain recurrence: y (t, p), final state (p, n), chunk-entering states (c, p, n).
fn recurrence_head(case: &SsdCase, i: &In64, b: usize, h: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (pd, ns, g) = (case.headdim, case.dstate, case.group(h));
    let mut s: Vec<f64> =
        (0..pd * ns).map(|k| i.h0.as_ref().map_or(0.0, |v| v[case.si(b, h, k / ns, k % ns)])).collect();
    let mut y = vec![0f64; case.seqlen * pd];
    let mut chunks = vec![0f64; case.n_chunks() * pd * ns];
    for t in 0..case.seqlen {
        if t % case.chunk_size == 0 {
            chunks[(t / case.chunk_size) * pd * ns..][..pd * ns].copy_from_slice(&s);
        }
        let (dt, _) = dt_eff(case, i, b, t, h);
        let decay = (dt * i.a[h]).exp();
        for p in 0..pd {
            let xv = i.x[case.xi(b, t, h, p)];
            let mut acc = 0.0;
            for n in 0..ns {
                let k = p * ns + n;
                s[k] = decay * s[k] + dt * xv * i.b[case.bci(b, t, g, n)];
                acc += s[k] * i.c[case.bci(b, t, g, n)];
            }
            y[t * pd + p] = gate(case, i, b, t, h, p, acc);
        }
    }
    (y, s, chunks)
}

/// The plain recurrence S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t (gated).
pub fn reference_recurrence(case: &SsdCase, i: &In64) -> Fwd64 {
    collect(case, |b, h| recurrence_head(case, i, b, h))
}

/// Scatters per-(b, h) pieces into the result arrays.
fn collect(case: &SsdCase, f: impl Fn(usize, usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) + Sync) -> Fwd64 {
    let (pd, ns) = (case.headdim, case.dstate);
    let mut out = Fwd64 {
        y: vec![0.0; case.x_len()],
        final_states: vec![0.0; case.state_len()],
        chunk_states: vec![0.0; case.chunk_len()],
    };
    per_head(case, f, |b, h, (y, s, chunks)| {
        for t in 0..case.seqlen {
            for p in 0..pd {
                out.y[case.xi(b, t, h, p)] = y[t * pd + p];
            }
        }
        for p in 0..pd {
            for n in 0..ns {
                out.final_states[case.si(b, h, p, n)] = s[p * ns + n];
                for c in 0..case.n_chunks() {
                    out.chunk_states[case.ci(b, h, p, c, n)] = chunks[(c * pd + p) * ns + n];
                }
            }
        }
    });
    out
}

/// One (b, h) of the chunked form. Per chunk [t0, t1) with cum[t] = sum_{t0 <= s <= t} dt_s A:
///   y_t = sum_{t0 <= s <= t} (C_t . B_s) exp(cum[t] - cum[s]) dt_s x_s   (the masked "attention")
///       + exp(cum[t]) (S_in C_t)                                          (the state entering)
///   S_out = exp(cum[t1 - 1]) S_in + sum_s exp(cum[t1 - 1] - cum[s]) dt_s x_s B_s^T
/// and the states entering the chunks pass from one to the next by that short scan.
fn chunked_head(case: &SsdCase, i: &In64, b: usize, h: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (pd, ns, g) = (case.headdim, case.dstate, case.group(h));
    let mut s: Vec<f64> =
        (0..pd * ns).map(|k| i.h0.as_ref().map_or(0.0, |v| v[case.si(b, h, k / ns, k % ns)])).collect();
    let mut y = vec![0f64; case.seqlen * pd];
    let mut chunks = vec![0f64; case.n_chunks() * pd * ns];
    let bv = |t: usize, n: usize| i.b[case.bci(b, t, g, n)];
    let cv = |t: usize, n: usize| i.c[case.bci(b, t, g, n)];
    for c in 0..case.n_chunks() {
        let (t0, t1) = (c * case.chunk_size, ((c + 1) * case.chunk_size).min(case.seqlen));
        chunks[c * pd * ns..][..pd * ns].copy_from_slice(&s);
        let dts: Vec<f64> = (t0..t1).map(|t| dt_eff(case, i, b, t, h).0).collect();
        let mut cum = vec![0f64; t1 - t0];
        let mut acc = 0.0;
        for (k, dt) in dts.iter().enumerate() {
            acc += dt * i.a[h];
            cum[k] = acc;
        }
        for t in t0..t1 {
            let k = t - t0;
            // The (t, s) entries of L o (C B^T): decay from s to t, times C_t . B_s.
            let scores: Vec<f64> = (t0..=t)
                .map(|s_| (cum[k] - cum[s_ - t0]).exp() * (0..ns).map(|n| cv(t, n) * bv(s_, n)).sum::<f64>())
                .collect();
            for p in 0..pd {
                let intra: f64 = (t0..=t).map(|s_| scores[s_ - t0] * dts[s_ - t0] * i.x[case.xi(b, s_, h, p)]).sum();
                let inter: f64 = cum[k].exp() * (0..ns).map(|n| s[p * ns + n] * cv(t, n)).sum::<f64>();
                y[t * pd + p] = gate(case, i, b, t, h, p, intra + inter);
            }
        }
        let last = cum[t1 - t0 - 1];
        for p in 0..pd {
            for n in 0..ns {
                let input: f64 = (t0..t1)
                    .map(|s_| (last - cum[s_ - t0]).exp() * dts[s_ - t0] * i.x[case.xi(b, s_, h, p)] * bv(s_, n))
                    .sum();
                s[p * ns + n] = last.exp() * s[p * ns + n] + input;
            }
        }
    }
    (y, s, chunks)
}

/// The chunked "state space duality" form (quadratic within a chunk, a scan across chunks).
pub fn reference_chunked(case: &SsdCase, i: &In64) -> Fwd64 {
    collect(case, |b, h| chunked_head(case, i, b, h))
}

/// One (b, h) of the backward: (dx (t, p), ddt (t), dA, dB (t, n) and dC (t, n) contributions of
/// this head, dD (p), ddt_bias, dz (t, p), dh0 (p, n)).
struct HeadGrads {
    dx: Vec<f64>,
    ddt: Vec<f64>,
    da: f64,
    db: Vec<f64>,
    dc: Vec<f64>,
    dd: Vec<f64>,
    ddt_bias: f64,
    dz: Vec<f64>,
    dh0: Vec<f64>,
}

fn bwd_head(case: &SsdCase, i: &In64, dy: &[f64], dfinal: Option<&[f64]>, b: usize, h: usize) -> HeadGrads {
    let (pd, ns, g, len) = (case.headdim, case.dstate, case.group(h), case.seqlen);
    let bv = |t: usize, n: usize| i.b[case.bci(b, t, g, n)];
    let cv = |t: usize, n: usize| i.c[case.bci(b, t, g, n)];
    // Forward, keeping every state: states[t] enters step t, states[len] is the final one.
    let mut states = vec![(0..pd * ns)
        .map(|k| i.h0.as_ref().map_or(0.0, |v| v[case.si(b, h, k / ns, k % ns)]))
        .collect::<Vec<f64>>()];
    let mut dts = Vec::with_capacity(len);
    for t in 0..len {
        let (dt, ddt_draw) = dt_eff(case, i, b, t, h);
        dts.push((dt, ddt_draw));
        let decay = (dt * i.a[h]).exp();
        let prev = states.last().unwrap();
        let next: Vec<f64> =
            (0..pd * ns).map(|k| decay * prev[k] + dt * i.x[case.xi(b, t, h, k / ns)] * bv(t, k % ns)).collect();
        states.push(next);
    }
    let mut r = HeadGrads {
        dx: vec![0.0; len * pd],
        ddt: vec![0.0; len],
        da: 0.0,
        db: vec![0.0; len * ns],
        dc: vec![0.0; len * ns],
        dd: vec![0.0; pd],
        ddt_bias: 0.0,
        dz: vec![0.0; len * pd],
        dh0: vec![],
    };
    // gs[k] = dL/dS_t (after the step's own output), carried back through the decay.
    let mut gs: Vec<f64> = (0..pd * ns).map(|k| dfinal.map_or(0.0, |v| v[case.si(b, h, k / ns, k % ns)])).collect();
    for t in (0..len).rev() {
        let (dt, ddt_draw) = dts[t];
        let decay = (dt * i.a[h]).exp();
        let (before, after) = (&states[t], &states[t + 1]);
        let mut ddt_eff = 0.0;
        for p in 0..pd {
            let xi = case.xi(b, t, h, p);
            let xv = i.x[xi];
            // dL/dy_pre (the SSM output plus D x, before the gate).
            let dout = dy[xi];
            let dyp = match &i.z {
                Some(z) => {
                    let ssm: f64 = (0..ns).map(|n| after[p * ns + n] * cv(t, n)).sum();
                    let y_pre = ssm + i.d.as_ref().map_or(0.0, |d| d[case.di(h, p)] * xv);
                    let (zv, s) = (z[xi], sigmoid(z[xi]));
                    r.dz[t * pd + p] = dout * y_pre * s * (1.0 + zv * (1.0 - s));
                    dout * silu(zv)
                }
                None => dout,
            };
            let dval = i.d.as_ref().map_or(0.0, |d| d[case.di(h, p)]);
            r.dd[p] += dyp * xv;
            let mut dx = dval * dyp;
            for n in 0..ns {
                let k = p * ns + n;
                gs[k] += cv(t, n) * dyp;
                r.dc[t * ns + n] += dyp * after[k];
                r.db[t * ns + n] += gs[k] * dt * xv;
                dx += gs[k] * dt * bv(t, n);
                ddt_eff += gs[k] * (bv(t, n) * xv + i.a[h] * decay * before[k]);
                r.da += gs[k] * decay * before[k] * dt;
                gs[k] *= decay;
            }
            r.dx[t * pd + p] = dx;
        }
        r.ddt[t] = ddt_eff * ddt_draw;
        r.ddt_bias += r.ddt[t];
    }
    r.dh0 = gs;
    r
}

/// The gradients of sum(dy * y) + sum(dfinal * final_states), by the reverse recurrence.
pub fn reference_bwd(case: &SsdCase, i: &In64, dy: &[f64], dfinal: Option<&[f64]>) -> Grads<f64> {
    let (pd, ns) = (case.headdim, case.dstate);
    let mut g = Grads {
        dx: vec![0.0; case.x_len()],
        ddt: vec![0.0; case.dt_len()],
        da: vec![0.0; case.heads],
        db: vec![0.0; case.bc_len()],
        dc: vec![0.0; case.bc_len()],
        dd: i.d.as_ref().map(|_| vec![0.0; case.d_len()]),
        dz: i.z.as_ref().map(|_| vec![0.0; case.x_len()]),
        ddt_bias: i.dt_bias.as_ref().map(|_| vec![0.0; case.heads]),
        dh0: i.h0.as_ref().map(|_| vec![0.0; case.state_len()]),
    };
    per_head(
        case,
        |b, h| bwd_head(case, i, dy, dfinal, b, h),
        |b, h, r| {
            let grp = case.group(h);
            for t in 0..case.seqlen {
                for p in 0..pd {
                    g.dx[case.xi(b, t, h, p)] = r.dx[t * pd + p];
                    if let Some(dz) = g.dz.as_mut() {
                        dz[case.xi(b, t, h, p)] = r.dz[t * pd + p];
                    }
                }
                g.ddt[case.dti(b, t, h)] = r.ddt[t];
                for n in 0..ns {
                    g.db[case.bci(b, t, grp, n)] += r.db[t * ns + n];
                    g.dc[case.bci(b, t, grp, n)] += r.dc[t * ns + n];
                }
            }
            g.da[h] += r.da;
            if let Some(dd) = g.dd.as_mut() {
                for p in 0..pd {
                    dd[case.di(h, p)] += r.dd[p];
                }
            }
            if let Some(v) = g.ddt_bias.as_mut() {
                v[h] += r.ddt_bias;
            }
            if let Some(v) = g.dh0.as_mut() {
                for k in 0..pd * ns {
                    v[case.si(b, h, k / ns, k % ns)] = r.dh0[k];
                }
            }
        },
    );
    g
}

/// The plain recurrence over packed sequences (batch 1): at each boundary the state passes to the
/// ending sequence's final state and resets to the next one's initial state (or 0); chunk c's
/// state is the one entering step c * chunk_size before that (0 at step 0).
pub fn reference_packed(case: &SsdCase, i: &In64, cu: &[i32]) -> Fwd64 {
    let (pd, ns) = (case.headdim, case.dstate);
    let seqs = cu.len() - 1;
    let state = case.heads * pd * ns;
    let mut out = Fwd64 {
        y: vec![0.0; case.x_len()],
        final_states: vec![0.0; seqs * state],
        chunk_states: vec![0.0; case.chunk_len()],
    };
    for h in 0..case.heads {
        let g = case.group(h);
        let mut s = vec![0f64; pd * ns];
        for t in 0..=case.seqlen {
            if t < case.seqlen && t % case.chunk_size == 0 {
                for k in 0..pd * ns {
                    out.chunk_states[case.ci(0, h, k / ns, t / case.chunk_size, k % ns)] = s[k];
                }
            }
            for q in (0..=seqs).filter(|&q| cu[q] as usize == t) {
                if q >= 1 {
                    for k in 0..pd * ns {
                        out.final_states[(q - 1) * state + (h * pd * ns) + k] = s[k];
                    }
                }
                if q < seqs {
                    for k in 0..pd * ns {
                        s[k] = i.h0.as_ref().map_or(0.0, |v| v[q * state + h * pd * ns + k]);
                    }
                }
            }
            if t == case.seqlen {
                break;
            }
            let (dt, _) = dt_eff(case, i, 0, t, h);
            let decay = (dt * i.a[h]).exp();
            for p in 0..pd {
                let xv = i.x[case.xi(0, t, h, p)];
                let mut acc = 0.0;
                for n in 0..ns {
                    let k = p * ns + n;
                    s[k] = decay * s[k] + dt * xv * i.b[case.bci(0, t, g, n)];
                    acc += s[k] * i.c[case.bci(0, t, g, n)];
                }
                out.y[case.xi(0, t, h, p)] = gate(case, i, 0, t, h, p, acc);
            }
        }
    }
    out
}

impl SsdProblem {
    pub fn reference(&self) -> Fwd64 {
        match &self.cu {
            Some(cu) => reference_packed(&self.case, &self.in64(), cu),
            None => reference_recurrence(&self.case, &self.in64()),
        }
    }

    /// The gradients by the reverse recurrence; for a packed problem, each sequence's put together
    /// (steps in place, per-sequence states in their rows, per-head parameters summed).
    pub fn reference_bwd(&self) -> Grads<f64> {
        if self.cu.is_none() {
            let dfinal = self.dfinal.as_deref().map(up);
            return reference_bwd(&self.case, &self.in64(), &up(&self.dy), dfinal.as_deref());
        }
        let parts: Vec<Grads<f64>> = (0..self.sequences().len()).map(|s| self.sequence(s).reference_bwd()).collect();
        self.stitch(&parts)
    }

    /// Per-sequence gradients (of [`SsdProblem::sequence`]s, in order) as the packed problem's.
    pub fn stitch<E: Copy + Default + std::ops::AddAssign>(&self, parts: &[Grads<E>]) -> Grads<E> {
        let c = &self.case;
        let (xs, hs, bcs) = (c.heads * c.headdim, c.heads, c.groups * c.dstate);
        let zeros = |n: usize| vec![E::default(); n];
        let opt = |present: bool, n: usize| present.then(|| zeros(n));
        let mut all = Grads {
            dx: zeros(c.x_len()),
            ddt: zeros(c.dt_len()),
            da: zeros(c.heads),
            db: zeros(c.bc_len()),
            dc: zeros(c.bc_len()),
            dd: opt(self.d.is_some(), c.d_len()),
            dz: opt(self.z.is_some(), c.x_len()),
            ddt_bias: opt(self.dt_bias.is_some(), c.heads),
            dh0: opt(self.h0.is_some(), self.state_rows() * c.heads * c.headdim * c.dstate),
        };
        let place = |whole: &mut [E], part: &[E], at: usize| whole[at..at + part.len()].copy_from_slice(part);
        let add = |whole: &mut [E], part: &[E]| whole.iter_mut().zip(part).for_each(|(w, &p)| *w += p);
        for ((l0, _), (s, g)) in self.sequences().into_iter().zip(parts.iter().enumerate()) {
            place(&mut all.dx, &g.dx, l0 * xs);
            place(&mut all.ddt, &g.ddt, l0 * hs);
            place(&mut all.db, &g.db, l0 * bcs);
            place(&mut all.dc, &g.dc, l0 * bcs);
            add(&mut all.da, &g.da);
            for (whole, part) in [(&mut all.dd, &g.dd), (&mut all.ddt_bias, &g.ddt_bias)] {
                if let (Some(w), Some(p)) = (whole.as_mut(), part.as_ref()) {
                    add(w, p);
                }
            }
            if let (Some(w), Some(p)) = (all.dz.as_mut(), g.dz.as_ref()) {
                place(w, p, l0 * xs);
            }
            if let (Some(w), Some(p)) = (all.dh0.as_mut(), g.dh0.as_ref()) {
                place(w, p, s * p.len());
            }
        }
        all
    }
}

// ------------------------------------------------------------------------------ checks

/// Asserts the forward's results against the reference, the f32 states within `states_tol` (chunk
/// states in T within T's); returns the worst errors (y, states).
pub fn check_fwd(case: &SsdCase, want: &Fwd64, got: &FwdOut, states_tol: Tol) -> (Errors, Errors) {
    let ey = assert_close("y", case, &got.y, &want.y, case.dtype.tol());
    let es = assert_close("final_states", case, &got.final_states, &want.final_states, states_tol);
    if let Some(cs) = &got.chunk_states {
        let tol = if case.chunk_states_dt() == Dt::F32 { states_tol } else { case.dtype.tol() };
        assert_close("chunk_states", case, cs, &want.chunk_states, tol);
    }
    (ey, es)
}

/// Tolerance of a gradient against the f64 reference. f32: sums of many terms of both signs (dA,
/// dB, dC, dD, ddt_bias sum over batch, time and channels). Half types: the inputs' and outputs'
/// rounding, and ddt sums headdim values the selective scan rounded to the dtype first.
pub fn grad_tol(case: &SsdCase, name: &str) -> Tol {
    match (case.dtype, name) {
        (Dt::F32, _) if !case.transformed() => Tol { rel_l2: 1e-4, rel_max: 2e-4 },
        (Dt::F32, _) => Tol { rel_l2: 2e-4, rel_max: 5e-4 },
        // Transformed: ddt_bias sums over batch and steps the row sums of values rounded to the
        // dtype, of both signs (measured up to 1.3e-2 rel L2 in bf16 on the GPU).
        (t, "ddt_bias") if case.transformed() => Tol { rel_l2: 4.0 * t.tol().rel_l2, rel_max: 4.0 * t.tol().rel_max },
        // dA sums dt times the suffix sums of the cum gradient over every step, terms of both signs
        // built from products of T-rounded operands (the tensor-core backward rounds S and dS to T
        // as mma operands): measured up to 1.1e-2 rel L2 in bf16 on the H100. dD sums x times dy
        // through the gate (rounded to T on the tensor cores) over every step and channel, also of
        // both signs: 1.6e-3 in f16 (packed, z, H200).
        (t, "ddt") | (t, "ddt_bias") | (t, "dA") | (t, "dD") => {
            Tol { rel_l2: 2.0 * t.tol().rel_l2, rel_max: 2.0 * t.tol().rel_max }
        }
        (t, _) => t.tol(),
    }
}

/// Asserts every gradient against the reference; returns the worst errors.
pub fn check_grads(case: &SsdCase, want: &Grads<f64>, got: &Grads<f32>) -> Errors {
    let mut worst = Errors { rel_l2: 0.0, rel_max: 0.0 };
    let mut check = |name: &str, got: &[f32], want: &[f64]| {
        let e = assert_close(name, case, got, want, grad_tol(case, name));
        worst = Errors { rel_l2: worst.rel_l2.max(e.rel_l2), rel_max: worst.rel_max.max(e.rel_max) };
    };
    check("dx", &got.dx, &want.dx);
    check("ddt", &got.ddt, &want.ddt);
    check("dA", &got.da, &want.da);
    check("dB", &got.db, &want.db);
    check("dC", &got.dc, &want.dc);
    let opt = [
        ("dD", &got.dd, &want.dd),
        ("dz", &got.dz, &want.dz),
        ("ddt_bias", &got.ddt_bias, &want.ddt_bias),
        ("dinitial_states", &got.dh0, &want.dh0),
    ];
    for (name, g, w) in opt {
        match (g, w) {
            (Some(g), Some(w)) => check(name, g, w),
            (None, None) => {}
            _ => panic!("{name}: present in one of result and reference only; case {case:?}"),
        }
    }
    worst
}
