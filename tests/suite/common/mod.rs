//! Shared by the integration tests: a seeded RNG, an f64 reference of the forward scan written from
//! docs/selective_scan_fwd.md, random problems ([`Case`], [`Problem`]), tolerances, host buffers,
//! and (in [`xla`]) a fake XLA runtime that builds real call frames.
#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod xla;

use half::{bf16, f16};
use std::ffi::c_void;
use xla::{Attr, Buf};

// ---------------------------------------------------------------------------------------------
// RNG: splitmix64.

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5eed_5eed_5eed_5eed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Boundaries of `num_seqs` sequences packed along `seqlen` (docs/selective_scan_fwd.md, "Packed
/// sequences"): 0 first, non-decreasing, `seqlen` last, cut at random; with two sequences or more,
/// one of them is empty.
pub fn random_cu_seqlens(rng: &mut Rng, num_seqs: usize, seqlen: usize) -> Vec<i32> {
    if num_seqs == 0 {
        return vec![0];
    }
    let mut cu: Vec<i32> = (1..num_seqs).map(|_| (rng.next_u64() % (seqlen as u64 + 1)) as i32).collect();
    cu.extend([0, seqlen as i32]);
    cu.sort_unstable();
    if num_seqs >= 2 {
        let j = 1 + (rng.next_u64() % (num_seqs as u64 - 1)) as usize;
        cu[j] = cu[j - 1];
    }
    cu
}

// ---------------------------------------------------------------------------------------------
// Element types.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dt {
    F32,
    BF16,
    F16,
}

impl Dt {
    /// XLA FFI dtype code.
    pub fn xla(self) -> i32 {
        match self {
            Dt::F32 => xla::F32,
            Dt::BF16 => xla::BF16,
            Dt::F16 => xla::F16,
        }
    }

    /// C API dtype code (XLA_SSM_F32, XLA_SSM_BF16, XLA_SSM_F16).
    pub fn capi(self) -> i32 {
        match self {
            Dt::F32 => 0,
            Dt::BF16 => 1,
            Dt::F16 => 2,
        }
    }

    pub fn size(self) -> usize {
        match self {
            Dt::F32 => 4,
            Dt::BF16 | Dt::F16 => 2,
        }
    }

    pub fn round(self, x: f32) -> f32 {
        match self {
            Dt::F32 => x,
            Dt::BF16 => bf16::from_f32(x).to_f32(),
            Dt::F16 => f16::from_f32(x).to_f32(),
        }
    }

    pub fn encode(self, xs: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(xs.len() * self.size());
        for &x in xs {
            match self {
                Dt::F32 => out.extend_from_slice(&x.to_le_bytes()),
                Dt::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_le_bytes()),
                Dt::F16 => out.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
            }
        }
        out
    }

    pub fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            Dt::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
            Dt::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dt::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        }
    }

    /// `n` NaNs in this dtype (to poison outputs).
    pub fn nans(self, n: usize) -> Vec<u8> {
        self.encode(&vec![f32::NAN; n])
    }

    /// Tolerance of an output of this dtype against the f64 reference.
    pub fn tol(self) -> Tol {
        match self {
            Dt::F32 => Tol::F32,
            Dt::BF16 => Tol::BF16,
            Dt::F16 => Tol::F16,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tolerances and comparison.

/// Bounds on ||got - want||_2 / ||want||_2 and on max|got - want| / max|want|.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rel_l2: f64,
    pub rel_max: f64,
}

impl Tol {
    /// f32 arithmetic throughout: typically 1e-7..1e-6; up to ~2e-5 on the GPU (approximate
    /// exponentials) in long scans whose states decay slowly, where per-step errors add up.
    pub const F32: Tol = Tol { rel_l2: 5e-5, rel_max: 1e-4 };
    /// The output rounded to bf16 (8 bits): up to 2^-9 of each element.
    pub const BF16: Tol = Tol { rel_l2: 6e-3, rel_max: 1e-2 };
    /// The output rounded to f16 (11 bits): up to 2^-11 of each element.
    pub const F16: Tol = Tol { rel_l2: 1e-3, rel_max: 2e-3 };
}

/// Relative errors of `got` against `want` (NaN when `got` has a NaN or an infinity).
#[derive(Clone, Copy, Debug)]
pub struct Errors {
    pub rel_l2: f64,
    pub rel_max: f64,
}

pub fn errors(got: &[f32], want: &[f64]) -> Errors {
    assert_eq!(got.len(), want.len(), "length mismatch");
    if got.iter().any(|x| !x.is_finite()) {
        return Errors { rel_l2: f64::NAN, rel_max: f64::NAN };
    }
    let (mut diff2, mut ref2, mut max_diff, mut max_ref) = (0f64, 0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = g as f64 - w;
        diff2 += d * d;
        ref2 += w * w;
        max_diff = max_diff.max(d.abs());
        max_ref = max_ref.max(w.abs());
    }
    // An all-zero reference must be matched to within f32 noise.
    let (norm, scale) = (ref2.sqrt().max(1e-30), max_ref.max(1e-30));
    Errors { rel_l2: diff2.sqrt() / norm, rel_max: max_diff / scale }
}

/// Panics (naming `what` and `case`) unless `got` is within `tol` of `want`; NaN never passes.
pub fn assert_close(what: &str, case: &dyn std::fmt::Debug, got: &[f32], want: &[f64], tol: Tol) -> Errors {
    let e = errors(got, want);
    // Written so that NaN (which compares false) fails.
    let within = e.rel_l2 <= tol.rel_l2 && e.rel_max <= tol.rel_max;
    if !within {
        let first_bad = got
            .iter()
            .zip(want)
            .position(|(&g, &w)| !g.is_finite() || (g as f64 - w).abs() > tol.rel_max * w.abs().max(1e-3));
        let detail = first_bad
            .map(|i| format!("; e.g. at flat index {i}: got {}, want {}", got[i], want[i]))
            .unwrap_or_default();
        panic!(
            "{what}: rel L2 error {:.3e} (bound {:.1e}), max error / max|ref| {:.3e} (bound {:.1e}){detail}\ncase: {case:?}",
            e.rel_l2, tol.rel_l2, e.rel_max, tol.rel_max
        );
    }
    e
}

/// The worst errors seen over many cases, per output dtype, for a summary line.
#[derive(Default)]
pub struct Worst {
    out: [Option<Errors>; 3],
    state: Option<Errors>,
    cases: usize,
}

fn worse(a: Option<Errors>, b: Errors) -> Option<Errors> {
    let a = a.unwrap_or(Errors { rel_l2: 0.0, rel_max: 0.0 });
    Some(Errors { rel_l2: a.rel_l2.max(b.rel_l2), rel_max: a.rel_max.max(b.rel_max) })
}

impl Worst {
    /// Records one case (and prints its errors when `XLA_SSM_TEST_VERBOSE` is set).
    pub fn add(&mut self, case: &Case, out: Errors, state: Errors) {
        if std::env::var_os("XLA_SSM_TEST_VERBOSE").is_some() {
            println!(
                "  rel L2 / max errors: out {:.1e} / {:.1e}, final_state {:.1e} / {:.1e}: {case:?}",
                out.rel_l2, out.rel_max, state.rel_l2, state.rel_max
            );
        }
        let i = case.dtype as usize;
        self.out[i] = worse(self.out[i], out);
        self.state = worse(self.state, state);
        self.cases += 1;
    }

    /// `"<what>: N cases ok; worst rel L2 / max errors: out f32 a / b, ...; final_state c / d"`.
    pub fn summary(&self, what: &str) -> String {
        let fmt = |e: &Option<Errors>| e.map_or("-".into(), |e| format!("{:.1e} / {:.1e}", e.rel_l2, e.rel_max));
        let names = ["f32", "bf16", "f16"];
        let outs: Vec<String> =
            (0..3).filter(|&i| self.out[i].is_some()).map(|i| format!("{} {}", names[i], fmt(&self.out[i]))).collect();
        format!(
            "{what}: {} cases ok; worst rel L2 / max errors: out {}; final_state {}",
            self.cases,
            outs.join(", "),
            fmt(&self.state)
        )
    }
}

/// Reruns `tests` of this test executable in a child process with `var=value` (to cover a code path
/// the library picks once per process, e.g. a kernel or instruction set), asserts they all pass,
/// and prints the child's summary lines (those holding "cases ok").
pub fn rerun_with_env(var: &str, value: &str, module: &str, tests: &[&str]) {
    let exe = std::env::current_exe().expect("current_exe");
    // Test names in the suite binary are module paths without the crate: `ffi_cpu::dtypes`.
    let module = module.split_once("::").map_or(module, |(_, m)| m);
    let output = std::process::Command::new(exe)
        .arg("--exact")
        .args(tests.iter().map(|t| format!("{module}::{t}")))
        .args(["--include-ignored", "--nocapture", "--test-threads=1"])
        .env(var, value)
        .output()
        .expect("could not rerun the test executable");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    let passed = format!("{} passed; 0 failed", tests.len());
    assert!(output.status.success() && text.contains(&passed), "with {var}={value}:\n{text}");
    for line in text.lines() {
        if let Some(end) = line.find(" cases ok") {
            // libtest may print "test name ... " on the same line first.
            let start = line[..end].rfind("... ").map_or(0, |i| i + 4);
            println!("{var}={value}: {}", &line[start..]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Problems.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// u: (batch, dim, seqlen); B, C: (batch, groups, dstate, seqlen).
    Bdl,
    /// u: (batch, seqlen, dim); B, C: (batch, seqlen, groups, dstate).
    Bld,
}

impl Layout {
    pub fn attr(self) -> &'static str {
        match self {
            Layout::Bdl => "bdl",
            Layout::Bld => "bld",
        }
    }

    pub fn capi(self) -> i32 {
        match self {
            Layout::Bdl => 0,
            Layout::Bld => 1,
        }
    }
}

/// One forward problem. `groups == 0` means time-invariant B/C of shape (dim, dstate).
#[derive(Clone, Debug)]
pub struct Case {
    pub batch: usize,
    pub dim: usize,
    pub seqlen: usize,
    pub dstate: usize,
    pub groups: usize,
    pub dtype: Dt,
    pub bc_dtype: Dt,
    pub layout: Layout,
    pub has_d: bool,
    pub has_z: bool,
    pub has_delta_bias: bool,
    pub has_initial_state: bool,
    pub softplus: bool,
    /// Range of dt = softplus(delta + delta_bias) (or delta + delta_bias without softplus), drawn
    /// log-uniformly; (0.01, 1) by default.
    pub dt_range: (f64, f64),
    pub seed: u64,
}

impl Case {
    /// The C API's forward arguments for this case: each operand's address by name through
    /// `operand` (null for one the case lacks), the results `out` and `final_state`; no workspace
    /// and no checkpoints.
    pub fn fwd_capi_args(
        &self,
        mut operand: impl FnMut(&str) -> *mut c_void,
        out: *mut c_void,
        final_state: *mut f32,
    ) -> xla_ssm::capi::XlaSsmSelectiveScanFwdArgs {
        xla_ssm::capi::XlaSsmSelectiveScanFwdArgs {
            cu_seqlens: std::ptr::null(),
            num_seqs: 0,
            batch: self.batch as i64,
            dim: self.dim as i64,
            seqlen: self.seqlen as i64,
            dstate: self.dstate as i64,
            groups: self.groups as i64,
            dtype: self.dtype.capi(),
            bc_dtype: self.bc_dtype.capi(),
            layout: self.layout.capi(),
            delta_softplus: self.softplus,
            u: operand("u"),
            delta: operand("delta"),
            a: operand("A") as *const f32,
            b: operand("B"),
            c: operand("C"),
            d: operand("D") as *const f32,
            z: operand("z"),
            delta_bias: operand("delta_bias") as *const f32,
            initial_state: operand("initial_state") as *const f32,
            out,
            final_state,
            workspace: std::ptr::null_mut(),
            workspace_bytes: 0,
            checkpoint_len: 0,
            checkpoints: std::ptr::null_mut(),
        }
    }

    /// f32, one group, layout "bdl", no optional operands, softplus on.
    pub fn new(batch: usize, dim: usize, seqlen: usize, dstate: usize) -> Case {
        Case {
            batch,
            dim,
            seqlen,
            dstate,
            groups: 1,
            dtype: Dt::F32,
            bc_dtype: Dt::F32,
            layout: Layout::Bdl,
            has_d: false,
            has_z: false,
            has_delta_bias: false,
            has_initial_state: false,
            softplus: true,
            dt_range: (0.01, 1.0),
            seed: 1,
        }
    }

    /// Every optional operand on.
    pub fn all_optional(self) -> Case {
        Case { has_d: true, has_z: true, has_delta_bias: true, has_initial_state: true, ..self }
    }

    pub fn x_dims(&self) -> Vec<usize> {
        match self.layout {
            Layout::Bdl => vec![self.batch, self.dim, self.seqlen],
            Layout::Bld => vec![self.batch, self.seqlen, self.dim],
        }
    }

    pub fn bc_dims(&self) -> Vec<usize> {
        match (self.groups, self.layout) {
            (0, _) => vec![self.dim, self.dstate],
            (g, Layout::Bdl) => vec![self.batch, g, self.dstate, self.seqlen],
            (g, Layout::Bld) => vec![self.batch, self.seqlen, g, self.dstate],
        }
    }

    pub fn state_dims(&self) -> Vec<usize> {
        vec![self.batch, self.dim, self.dstate]
    }

    pub fn x_len(&self) -> usize {
        self.batch * self.dim * self.seqlen
    }

    pub fn bc_len(&self) -> usize {
        self.bc_dims().iter().product()
    }

    pub fn state_len(&self) -> usize {
        self.batch * self.dim * self.dstate
    }

    /// Flat index of element (b, d, l) of u, delta, z, out.
    pub fn x_index(&self, b: usize, d: usize, l: usize) -> usize {
        match self.layout {
            Layout::Bdl => (b * self.dim + d) * self.seqlen + l,
            Layout::Bld => (b * self.seqlen + l) * self.dim + d,
        }
    }

    /// Flat index of B/C's entry for batch b, channel d, state n, step l.
    pub fn bc_index(&self, b: usize, d: usize, n: usize, l: usize) -> usize {
        if self.groups == 0 {
            return d * self.dstate + n;
        }
        let g = d / (self.dim / self.groups);
        match self.layout {
            Layout::Bdl => ((b * self.groups + g) * self.dstate + n) * self.seqlen + l,
            Layout::Bld => ((b * self.seqlen + l) * self.groups + g) * self.dstate + n,
        }
    }

    /// Work of one scan, for splitting the reference over threads.
    pub fn work(&self) -> usize {
        self.batch * self.dim * self.seqlen.max(1) * self.dstate.max(1)
    }
}

/// Inputs of a [`Case`], as f32 values already rounded to their dtypes, in memory order.
#[derive(Clone, Debug)]
pub struct Problem {
    pub case: Case,
    pub u: Vec<f32>,
    pub delta: Vec<f32>,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub c: Vec<f32>,
    pub d: Option<Vec<f32>>,
    pub z: Option<Vec<f32>>,
    pub delta_bias: Option<Vec<f32>>,
    pub initial_state: Option<Vec<f32>>,
}

/// An operand, encoded: name, dtype code, dims, bytes.
pub struct Operand {
    pub name: &'static str,
    pub dtype: i32,
    pub dims: Vec<i64>,
    pub bytes: Vec<u8>,
}

fn dims_i64(d: &[usize]) -> Vec<i64> {
    d.iter().map(|&x| x as i64).collect()
}

impl Problem {
    /// Realistic magnitudes: A = -exp(N(0,1)); dt (after bias and softplus) log-uniform in
    /// `case.dt_range` (default 0.01..1); u, z, B, C, D, h0 ~ N(0,1); delta_bias ~ U(-0.5, 0.5). Each input is rounded to
    /// its dtype.
    pub fn random(case: &Case) -> Problem {
        let mut rng = Rng::new(case.seed.wrapping_mul(0x100_0000_01b3) ^ case.work() as u64);
        let (t, tb) = (case.dtype, case.bc_dtype);
        let normal =
            |rng: &mut Rng, n: usize, dt: Dt| -> Vec<f32> { (0..n).map(|_| dt.round(rng.normal() as f32)).collect() };
        let a: Vec<f32> = (0..case.dim * case.dstate).map(|_| -(rng.normal().exp() as f32)).collect();
        let delta_bias: Option<Vec<f32>> =
            case.has_delta_bias.then(|| (0..case.dim).map(|_| rng.range(-0.5, 0.5) as f32).collect());
        let mut delta = vec![0f32; case.x_len()];
        for b in 0..case.batch {
            for d in 0..case.dim {
                for l in 0..case.seqlen {
                    let dt = rng.range(case.dt_range.0.ln(), case.dt_range.1.ln()).exp();
                    let pre = if case.softplus { dt.exp_m1().ln() } else { dt };
                    let bias = delta_bias.as_ref().map_or(0.0, |v| v[d] as f64);
                    delta[case.x_index(b, d, l)] = t.round((pre - bias) as f32);
                }
            }
        }
        let u = normal(&mut rng, case.x_len(), t);
        let bm = normal(&mut rng, case.bc_len(), tb);
        let cm = normal(&mut rng, case.bc_len(), tb);
        let d = case.has_d.then(|| normal(&mut rng, case.dim, Dt::F32));
        let z = case.has_z.then(|| normal(&mut rng, case.x_len(), t));
        let initial_state = case.has_initial_state.then(|| normal(&mut rng, case.state_len(), Dt::F32));
        Problem { case: case.clone(), u, delta, a, b: bm, c: cm, d, z, delta_bias, initial_state }
    }

    /// The operands in call order (optional ones only when present).
    pub fn operands(&self) -> Vec<Operand> {
        let c = &self.case;
        let (x, bc) = (dims_i64(&c.x_dims()), dims_i64(&c.bc_dims()));
        let mut ops = vec![
            Operand { name: "u", dtype: c.dtype.xla(), dims: x.clone(), bytes: c.dtype.encode(&self.u) },
            Operand { name: "delta", dtype: c.dtype.xla(), dims: x.clone(), bytes: c.dtype.encode(&self.delta) },
            Operand {
                name: "A",
                dtype: xla::F32,
                dims: vec![c.dim as i64, c.dstate as i64],
                bytes: Dt::F32.encode(&self.a),
            },
            Operand { name: "B", dtype: c.bc_dtype.xla(), dims: bc.clone(), bytes: c.bc_dtype.encode(&self.b) },
            Operand { name: "C", dtype: c.bc_dtype.xla(), dims: bc, bytes: c.bc_dtype.encode(&self.c) },
        ];
        if let Some(d) = &self.d {
            ops.push(Operand { name: "D", dtype: xla::F32, dims: vec![c.dim as i64], bytes: Dt::F32.encode(d) });
        }
        if let Some(z) = &self.z {
            ops.push(Operand { name: "z", dtype: c.dtype.xla(), dims: x, bytes: c.dtype.encode(z) });
        }
        if let Some(bias) = &self.delta_bias {
            ops.push(Operand {
                name: "delta_bias",
                dtype: xla::F32,
                dims: vec![c.dim as i64],
                bytes: Dt::F32.encode(bias),
            });
        }
        if let Some(h0) = &self.initial_state {
            ops.push(Operand {
                name: "initial_state",
                dtype: xla::F32,
                dims: dims_i64(&c.state_dims()),
                bytes: Dt::F32.encode(h0),
            });
        }
        ops
    }

    /// The results (out, final_state), poisoned with NaN.
    pub fn poisoned_results(&self) -> Vec<Operand> {
        let c = &self.case;
        vec![
            Operand { name: "out", dtype: c.dtype.xla(), dims: dims_i64(&c.x_dims()), bytes: c.dtype.nans(c.x_len()) },
            Operand {
                name: "final_state",
                dtype: xla::F32,
                dims: dims_i64(&c.state_dims()),
                bytes: Dt::F32.nans(c.state_len()),
            },
        ]
    }

    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        attrs(&self.case)
    }

    pub fn reference(&self) -> Reference {
        reference(
            &self.case,
            &RefInputs {
                u: &self.u,
                delta: &self.delta,
                a: &self.a,
                b: &self.b,
                c: &self.c,
                d: self.d.as_deref(),
                z: self.z.as_deref(),
                delta_bias: self.delta_bias.as_deref(),
                initial_state: self.initial_state.as_deref(),
            },
        )
    }

    /// The sub-problem of steps [l0, l1), with `initial_state` as its h0 (`None`: none).
    pub fn slice_seq(&self, l0: usize, l1: usize, initial_state: Option<Vec<f32>>) -> Problem {
        let c = &self.case;
        let sub_case = Case { seqlen: l1 - l0, has_initial_state: initial_state.is_some(), ..c.clone() };
        let mut sub = Problem {
            case: sub_case.clone(),
            u: vec![0.0; sub_case.x_len()],
            delta: vec![0.0; sub_case.x_len()],
            a: self.a.clone(),
            b: self.b.clone(),
            c: self.c.clone(),
            d: self.d.clone(),
            z: self.z.as_ref().map(|_| vec![0.0; sub_case.x_len()]),
            delta_bias: self.delta_bias.clone(),
            initial_state,
        };
        for b in 0..c.batch {
            for d in 0..c.dim {
                for l in l0..l1 {
                    let (from, to) = (c.x_index(b, d, l), sub_case.x_index(b, d, l - l0));
                    sub.u[to] = self.u[from];
                    sub.delta[to] = self.delta[from];
                    if let (Some(zs), Some(zd)) = (&self.z, &mut sub.z) {
                        zd[to] = zs[from];
                    }
                }
            }
        }
        if c.groups > 0 {
            sub.b = vec![0.0; sub_case.bc_len()];
            sub.c = vec![0.0; sub_case.bc_len()];
            for b in 0..c.batch {
                for g in 0..c.groups {
                    let d = g * (c.dim / c.groups);
                    for n in 0..c.dstate {
                        for l in l0..l1 {
                            let (from, to) = (c.bc_index(b, d, n, l), sub_case.bc_index(b, d, n, l - l0));
                            sub.b[to] = self.b[from];
                            sub.c[to] = self.c[from];
                        }
                    }
                }
            }
        }
        sub
    }
}

/// The attributes of a call for `case`.
pub fn attrs(case: &Case) -> Vec<(&'static str, Attr)> {
    vec![
        ("delta_softplus", Attr::Bool(case.softplus)),
        ("has_d", Attr::Bool(case.has_d)),
        ("has_z", Attr::Bool(case.has_z)),
        ("has_delta_bias", Attr::Bool(case.has_delta_bias)),
        ("has_initial_state", Attr::Bool(case.has_initial_state)),
        ("layout", Attr::Str(case.layout.attr().to_string())),
    ]
}

// ---------------------------------------------------------------------------------------------
// The reference, in f64, from docs/selective_scan_fwd.md.

/// The reference's inputs: f32 values (already rounded to their dtypes), in memory order.
pub struct RefInputs<'a> {
    pub u: &'a [f32],
    pub delta: &'a [f32],
    pub a: &'a [f32],
    pub b: &'a [f32],
    pub c: &'a [f32],
    pub d: Option<&'a [f32]>,
    pub z: Option<&'a [f32]>,
    pub delta_bias: Option<&'a [f32]>,
    pub initial_state: Option<&'a [f32]>,
}

#[derive(Clone, Debug)]
pub struct Reference {
    /// Like u (memory order of the case's layout).
    pub out: Vec<f64>,
    /// (batch, dim, dstate).
    pub final_state: Vec<f64>,
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

/// Channels `[start, end)` (channel = b * dim + d): (out values by (channel, l), states by (channel, n)).
fn reference_channels(case: &Case, x: &RefInputs, start: usize, end: usize) -> (Vec<f64>, Vec<f64>) {
    let (len, ns) = (case.seqlen, case.dstate);
    let mut out = vec![0f64; (end - start) * len];
    let mut states = vec![0f64; (end - start) * ns];
    let mut h = vec![0f64; ns];
    for channel in start..end {
        let (b, d) = (channel / case.dim, channel % case.dim);
        for (n, hn) in h.iter_mut().enumerate() {
            *hn = x.initial_state.map_or(0.0, |h0| h0[(b * case.dim + d) * ns + n] as f64);
        }
        for l in 0..len {
            let xi = case.x_index(b, d, l);
            let mut dt = x.delta[xi] as f64 + x.delta_bias.map_or(0.0, |v| v[d] as f64);
            if case.softplus {
                dt = softplus(dt);
            }
            let u = x.u[xi] as f64;
            let mut y = 0.0;
            for (n, hn) in h.iter_mut().enumerate() {
                let bi = case.bc_index(b, d, n, l);
                let a = x.a[d * ns + n] as f64;
                *hn = (dt * a).exp() * *hn + dt * x.b[bi] as f64 * u;
                y += x.c[bi] as f64 * *hn;
            }
            y += x.d.map_or(0.0, |v| v[d] as f64) * u;
            if let Some(z) = x.z {
                y *= silu(z[xi] as f64);
            }
            out[(channel - start) * len + l] = y;
        }
        states[(channel - start) * ns..(channel - start + 1) * ns].copy_from_slice(&h);
    }
    (out, states)
}

/// The forward scan in f64. Large problems are split over threads by channel (each channel is the
/// same sequential loop).
pub fn reference(case: &Case, x: &RefInputs) -> Reference {
    assert_eq!(x.u.len(), case.x_len());
    assert_eq!(x.delta.len(), case.x_len());
    assert_eq!(x.a.len(), case.dim * case.dstate);
    assert_eq!(x.b.len(), case.bc_len());
    assert_eq!(x.c.len(), case.bc_len());
    let channels = case.batch * case.dim;
    let threads = if case.work() < (1 << 22) {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(channels).max(1)
    };
    let per = channels.div_ceil(threads).max(1);
    let parts: Vec<(usize, usize, Vec<f64>, Vec<f64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..channels)
            .step_by(per)
            .map(|start| {
                let end = (start + per).min(channels);
                s.spawn(move || {
                    let (o, st) = reference_channels(case, x, start, end);
                    (start, end, o, st)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (len, ns) = (case.seqlen, case.dstate);
    let mut out = vec![0f64; case.x_len()];
    let mut final_state = vec![0f64; case.state_len()];
    for (start, end, o, st) in parts {
        for channel in start..end {
            let (b, d, i) = (channel / case.dim, channel % case.dim, channel - start);
            for l in 0..len {
                out[case.x_index(b, d, l)] = o[i * len + l];
            }
            final_state[channel * ns..(channel + 1) * ns].copy_from_slice(&st[i * ns..(i + 1) * ns]);
        }
    }
    Reference { out, final_state }
}

// ---------------------------------------------------------------------------------------------
// Host memory.

/// An 8-byte-aligned host buffer.
pub struct HostBuf {
    words: Vec<u64>,
    len: usize,
}

impl HostBuf {
    pub fn from_bytes(bytes: &[u8]) -> HostBuf {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `words` holds at least bytes.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), words.as_mut_ptr() as *mut u8, bytes.len()) };
        HostBuf { words, len: bytes.len() }
    }

    pub fn ptr(&mut self) -> *mut c_void {
        self.words.as_mut_ptr() as *mut c_void
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes of `words` were written.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }
}

/// Host copies of a problem's operands and (poisoned) results, ready for a frame.
pub struct HostCall {
    pub args: Vec<(Operand, HostBuf)>,
    pub rets: Vec<(Operand, HostBuf)>,
}

impl HostCall {
    pub fn new(p: &Problem) -> HostCall {
        let own = |o: Operand| {
            let buf = HostBuf::from_bytes(&o.bytes);
            (o, buf)
        };
        HostCall {
            args: p.operands().into_iter().map(own).collect(),
            rets: p.poisoned_results().into_iter().map(own).collect(),
        }
    }

    pub fn arg_bufs(&mut self) -> Vec<Buf> {
        self.args.iter_mut().map(|(o, h)| Buf { dtype: o.dtype, dims: o.dims.clone(), data: h.ptr() }).collect()
    }

    pub fn ret_bufs(&mut self) -> Vec<Buf> {
        self.rets.iter_mut().map(|(o, h)| Buf { dtype: o.dtype, dims: o.dims.clone(), data: h.ptr() }).collect()
    }

    /// (out, final_state) as f32 values.
    pub fn outputs(&self, case: &Case) -> (Vec<f32>, Vec<f32>) {
        (case.dtype.decode(self.rets[0].1.bytes()), Dt::F32.decode(self.rets[1].1.bytes()))
    }
}

/// Runs `p` through the CPU handler. `Ok((out, final_state))` or the handler's error.
pub fn run_cpu(p: &Problem) -> Result<(Vec<f32>, Vec<f32>), (i32, String)> {
    let mut call = HostCall::new(p);
    let (args, rets) = (call.arg_bufs(), call.ret_bufs());
    let mut frame = xla::Frame::new(&args, &rets, &p.attrs(), std::ptr::null_mut());
    xla::call(xla_ssm::xla::handlers::xla_ssm_selective_scan_fwd_cpu, &mut frame)?;
    Ok(call.outputs(&p.case))
}

/// Checks (out, final_state) of `p` against the reference; returns the errors for reporting.
pub fn check_outputs(p: &Problem, reference: &Reference, out: &[f32], state: &[f32]) -> (Errors, Errors) {
    let case = &p.case;
    let e_out = assert_close("out", case, out, &reference.out, case.dtype.tol());
    // The state never leaves f32, whatever the input dtypes.
    let e_state = assert_close("final_state", case, state, &reference.final_state, Tol::F32);
    (e_out, e_state)
}

// ---------------------------------------------------------------------------------------------
// The backward pass: an f64 reference written from docs/selective_scan_bwd.md (plain loops over
// channels, a full state history), the forward's checkpoints, and problems with cotangents.

/// Gradients in memory order, each shaped like its primal.
#[derive(Clone, Debug)]
pub struct Grads<E> {
    pub du: Vec<E>,
    pub ddelta: Vec<E>,
    pub da: Vec<E>,
    pub db: Vec<E>,
    pub dc: Vec<E>,
    pub dd: Option<Vec<E>>,
    pub dz: Option<Vec<E>>,
    pub ddelta_bias: Option<Vec<E>>,
    pub dinitial_state: Option<Vec<E>>,
}

impl Grads<f32> {
    /// Every gradient's bits, in result order (for determinism checks).
    pub fn bits(&self) -> Vec<u32> {
        let optional = [&self.dd, &self.dz, &self.ddelta_bias, &self.dinitial_state];
        [&self.du, &self.ddelta, &self.da, &self.db, &self.dc]
            .into_iter()
            .chain(optional.into_iter().flatten())
            .flat_map(|v| v.iter().map(|x| x.to_bits()))
            .collect()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// One channel's forward in f64: dt per step, the states (`h[l]` enters step l, `h[seqlen]` is the
/// final state) and y before the gate.
struct ChannelForward {
    dt: Vec<f64>,
    h: Vec<Vec<f64>>,
    y: Vec<f64>,
}

fn channel_forward(case: &Case, x: &RefInputs, b: usize, d: usize) -> ChannelForward {
    let ns = case.dstate;
    let mut h =
        vec![(0..ns).map(|n| x.initial_state.map_or(0.0, |h0| h0[(b * case.dim + d) * ns + n] as f64)).collect()];
    let (mut dts, mut ys) = (Vec::new(), Vec::new());
    for l in 0..case.seqlen {
        let xi = case.x_index(b, d, l);
        let mut dt = x.delta[xi] as f64 + x.delta_bias.map_or(0.0, |v| v[d] as f64);
        if case.softplus {
            dt = softplus(dt);
        }
        let u = x.u[xi] as f64;
        let prev: &Vec<f64> = h.last().unwrap();
        let next: Vec<f64> = (0..ns)
            .map(|n| (dt * x.a[d * ns + n] as f64).exp() * prev[n] + dt * x.b[case.bc_index(b, d, n, l)] as f64 * u)
            .collect();
        let y = (0..ns).map(|n| x.c[case.bc_index(b, d, n, l)] as f64 * next[n]).sum::<f64>()
            + x.d.map_or(0.0, |v| v[d] as f64) * u;
        dts.push(dt);
        ys.push(y);
        h.push(next);
    }
    ChannelForward { dt: dts, h, y: ys }
}

/// The states entering every `checkpoint_len`-th step, (batch, dim, n_checkpoints, dstate).
pub fn reference_checkpoints(case: &Case, x: &RefInputs, checkpoint_len: usize) -> Vec<f64> {
    let (ns, nck) = (case.dstate, case.seqlen.div_ceil(checkpoint_len));
    let mut out = vec![0f64; case.batch * case.dim * nck * ns];
    for b in 0..case.batch {
        for d in 0..case.dim {
            let f = channel_forward(case, x, b, d);
            for k in 0..nck {
                let at = ((b * case.dim + d) * nck + k) * ns;
                out[at..at + ns].copy_from_slice(&f.h[k * checkpoint_len]);
            }
        }
    }
    out
}

/// The gradients of sum(dout * out) + sum(dfinal_state * final_state), by the backward recurrence.
pub fn reference_bwd(case: &Case, x: &RefInputs, dout: &[f32], dfinal_state: Option<&[f32]>) -> Grads<f64> {
    let (ns, dim) = (case.dstate, case.dim);
    let mut g = Grads {
        du: vec![0f64; case.x_len()],
        ddelta: vec![0f64; case.x_len()],
        da: vec![0f64; dim * ns],
        db: vec![0f64; case.bc_len()],
        dc: vec![0f64; case.bc_len()],
        dd: x.d.map(|_| vec![0f64; dim]),
        dz: x.z.map(|_| vec![0f64; case.x_len()]),
        ddelta_bias: x.delta_bias.map(|_| vec![0f64; dim]),
        dinitial_state: x.initial_state.map(|_| vec![0f64; case.state_len()]),
    };
    for b in 0..case.batch {
        for d in 0..dim {
            let f = channel_forward(case, x, b, d);
            let state = (b * dim + d) * ns;
            // gs[n]: a[l+1] g[l+1] while walking back (dfinal_state at the end).
            let mut gs: Vec<f64> = (0..ns).map(|n| dfinal_state.map_or(0.0, |v| v[state + n] as f64)).collect();
            for l in (0..case.seqlen).rev() {
                let xi = case.x_index(b, d, l);
                let (u, dt, dout) = (x.u[xi] as f64, f.dt[l], dout[xi] as f64);
                let dy = match x.z {
                    Some(z) => {
                        let (zv, s) = (z[xi] as f64, sigmoid(z[xi] as f64));
                        g.dz.as_mut().unwrap()[xi] = dout * f.y[l] * s * (1.0 + zv * (1.0 - s));
                        dout * silu(zv)
                    }
                    None => dout,
                };
                let (mut du, mut ddt) = (0.0, 0.0);
                for (n, gn) in gs.iter_mut().enumerate() {
                    let bi = case.bc_index(b, d, n, l);
                    let (a_n, bv, cv) = (x.a[d * ns + n] as f64, x.b[bi] as f64, x.c[bi] as f64);
                    let decay = (dt * a_n).exp();
                    let gl = *gn + cv * dy;
                    g.dc[bi] += dy * f.h[l + 1][n];
                    g.db[bi] += gl * dt * u;
                    du += gl * dt * bv;
                    ddt += gl * (bv * u + a_n * decay * f.h[l][n]);
                    g.da[d * ns + n] += gl * decay * f.h[l][n] * dt;
                    *gn = decay * gl;
                }
                g.du[xi] = du + x.d.map_or(0.0, |v| v[d] as f64) * dy;
                let ddelta = if case.softplus {
                    ddt * sigmoid(x.delta[xi] as f64 + x.delta_bias.map_or(0.0, |v| v[d] as f64))
                } else {
                    ddt
                };
                g.ddelta[xi] = ddelta;
                if let Some(v) = g.dd.as_mut() {
                    v[d] += dy * u;
                }
                if let Some(v) = g.ddelta_bias.as_mut() {
                    v[d] += ddelta;
                }
            }
            if let Some(v) = g.dinitial_state.as_mut() {
                v[state..state + ns].copy_from_slice(&gs);
            }
        }
    }
    g
}

/// A forward [`Problem`] with the backward's extra inputs: cotangents and the checkpoint spacing.
#[derive(Clone, Debug)]
pub struct BwdProblem {
    pub p: Problem,
    pub checkpoint_len: usize,
    pub dout: Vec<f32>,
    pub dfinal_state: Option<Vec<f32>>,
}

impl BwdProblem {
    /// `Problem::random(case)` plus dout ~ N(0, 1) (rounded to the dtype) and, when asked,
    /// dfinal_state ~ N(0, 1).
    pub fn random(case: &Case, checkpoint_len: usize, has_dfinal_state: bool) -> BwdProblem {
        let p = Problem::random(case);
        let mut rng = Rng::new(case.seed ^ 0xb4c4_3a2d);
        let dout = (0..case.x_len()).map(|_| case.dtype.round(rng.normal() as f32)).collect();
        let dfinal_state = has_dfinal_state.then(|| (0..case.state_len()).map(|_| rng.normal() as f32).collect());
        BwdProblem { p, checkpoint_len, dout, dfinal_state }
    }

    pub fn case(&self) -> &Case {
        &self.p.case
    }

    pub fn inputs(&self) -> RefInputs<'_> {
        let p = &self.p;
        RefInputs {
            u: &p.u,
            delta: &p.delta,
            a: &p.a,
            b: &p.b,
            c: &p.c,
            d: p.d.as_deref(),
            z: p.z.as_deref(),
            delta_bias: p.delta_bias.as_deref(),
            initial_state: p.initial_state.as_deref(),
        }
    }

    pub fn reference(&self) -> Grads<f64> {
        reference_bwd(self.case(), &self.inputs(), &self.dout, self.dfinal_state.as_deref())
    }

    pub fn reference_checkpoints(&self) -> Vec<f64> {
        reference_checkpoints(self.case(), &self.inputs(), self.checkpoint_len)
    }

    pub fn n_checkpoints(&self) -> usize {
        self.case().seqlen.div_ceil(self.checkpoint_len)
    }

    pub fn checkpoint_dims(&self) -> Vec<i64> {
        let c = self.case();
        dims_i64(&[c.batch, c.dim, self.n_checkpoints(), c.dstate])
    }

    /// The forward's attributes, asking for checkpoints.
    pub fn fwd_attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut attrs = attrs(self.case());
        attrs.push(("checkpoint_len", Attr::Scalar(xla::S64, (self.checkpoint_len as i64).to_le_bytes().to_vec())));
        attrs
    }

    pub fn bwd_attrs(&self) -> Vec<(&'static str, Attr)> {
        let mut attrs = self.fwd_attrs();
        attrs.push(("has_dfinal_state", Attr::Bool(self.dfinal_state.is_some())));
        attrs
    }

    /// The forward's results with checkpoints (out, final_state, checkpoints), poisoned with NaN.
    pub fn poisoned_fwd_results(&self) -> Vec<Operand> {
        let mut rets = self.p.poisoned_results();
        let len = self.checkpoint_dims().iter().product::<i64>() as usize;
        rets.push(Operand {
            name: "checkpoints",
            dtype: xla::F32,
            dims: self.checkpoint_dims(),
            bytes: Dt::F32.nans(len),
        });
        rets
    }

    /// The backward's operands in call order, with these checkpoints.
    pub fn bwd_operands(&self, checkpoints: &[f32]) -> Vec<Operand> {
        let c = self.case();
        let mut ops = self.p.operands();
        ops.push(Operand {
            name: "checkpoints",
            dtype: xla::F32,
            dims: self.checkpoint_dims(),
            bytes: Dt::F32.encode(checkpoints),
        });
        ops.push(Operand {
            name: "dout",
            dtype: c.dtype.xla(),
            dims: dims_i64(&c.x_dims()),
            bytes: c.dtype.encode(&self.dout),
        });
        if let Some(v) = &self.dfinal_state {
            ops.push(Operand {
                name: "dfinal_state",
                dtype: xla::F32,
                dims: dims_i64(&c.state_dims()),
                bytes: Dt::F32.encode(v),
            });
        }
        ops
    }

    /// The backward's results in call order (each gradient like its primal), poisoned with NaN.
    pub fn poisoned_grads(&self) -> Vec<Operand> {
        self.p
            .operands()
            .into_iter()
            .filter(|o| o.name != "initial_state" || self.p.initial_state.is_some())
            .map(|o| {
                let name = GRAD_NAMES.iter().find(|(primal, _)| *primal == o.name).unwrap().1;
                let dt = [Dt::F32, Dt::BF16, Dt::F16].into_iter().find(|d| d.xla() == o.dtype).unwrap();
                let len = o.dims.iter().product::<i64>() as usize;
                Operand { name, dtype: o.dtype, dims: o.dims, bytes: dt.nans(len) }
            })
            .collect()
    }

    /// Gradients from the backward's result bytes (in [`Self::poisoned_grads`] order), as f32.
    pub fn decode_grads(&self, rets: &[(&str, i32, &[u8])]) -> Grads<f32> {
        let get = |name: &str| {
            rets.iter().find(|(n, _, _)| *n == name).map(|(_, dtype, bytes)| {
                let dt = [Dt::F32, Dt::BF16, Dt::F16].into_iter().find(|d| d.xla() == *dtype).unwrap();
                dt.decode(bytes)
            })
        };
        Grads {
            du: get("du").unwrap(),
            ddelta: get("ddelta").unwrap(),
            da: get("dA").unwrap(),
            db: get("dB").unwrap(),
            dc: get("dC").unwrap(),
            dd: get("dD"),
            dz: get("dz"),
            ddelta_bias: get("ddelta_bias"),
            dinitial_state: get("dinitial_state"),
        }
    }

    /// The forward through the CPU handler with checkpoints: (out, final_state, checkpoints).
    pub fn run_fwd_cpu(&self) -> Result<FwdOutputs, (i32, String)> {
        let mut call = HostCall { args: own(self.p.operands()), rets: own(self.poisoned_fwd_results()) };
        let (args, rets) = (call.arg_bufs(), call.ret_bufs());
        let mut frame = xla::Frame::new(&args, &rets, &self.fwd_attrs(), std::ptr::null_mut());
        xla::call(xla_ssm::xla::handlers::xla_ssm_selective_scan_fwd_cpu, &mut frame)?;
        let (out, state) = call.outputs(self.case());
        Ok((out, state, Dt::F32.decode(call.rets[2].1.bytes())))
    }

    /// The backward through the CPU handler, with these checkpoints.
    pub fn run_bwd_cpu(&self, checkpoints: &[f32]) -> Result<Grads<f32>, (i32, String)> {
        let mut call = HostCall { args: own(self.bwd_operands(checkpoints)), rets: own(self.poisoned_grads()) };
        let (args, rets) = (call.arg_bufs(), call.ret_bufs());
        let mut frame = xla::Frame::new(&args, &rets, &self.bwd_attrs(), std::ptr::null_mut());
        xla::call(xla_ssm::xla::handlers::xla_ssm_selective_scan_bwd_cpu, &mut frame)?;
        let rets: Vec<(&str, i32, &[u8])> = call.rets.iter().map(|(o, h)| (o.name, o.dtype, h.bytes())).collect();
        Ok(self.decode_grads(&rets))
    }

    /// Forward (for the checkpoints), then backward, both through the CPU handlers.
    pub fn run_cpu(&self) -> Result<Grads<f32>, (i32, String)> {
        let (_, _, checkpoints) = self.run_fwd_cpu()?;
        self.run_bwd_cpu(&checkpoints)
    }
}

/// The forward's results with checkpoints: (out, final_state, checkpoints).
pub type FwdOutputs = (Vec<f32>, Vec<f32>, Vec<f32>);

/// (primal, gradient) result names, in result order.
pub const GRAD_NAMES: [(&str, &str); 9] = [
    ("u", "du"),
    ("delta", "ddelta"),
    ("A", "dA"),
    ("B", "dB"),
    ("C", "dC"),
    ("D", "dD"),
    ("z", "dz"),
    ("delta_bias", "ddelta_bias"),
    ("initial_state", "dinitial_state"),
];

fn own(ops: Vec<Operand>) -> Vec<(Operand, HostBuf)> {
    ops.into_iter()
        .map(|o| {
            let buf = HostBuf::from_bytes(&o.bytes);
            (o, buf)
        })
        .collect()
}

/// Tolerance of a gradient against the f64 reference: its dtype's rounding, plus what f32 sums of
/// many terms of both signs lose (dA, dB, dC, dD and ddelta_bias sum over batch and time).
pub fn grad_tol(dtype: Dt) -> Tol {
    match dtype {
        Dt::F32 => Tol { rel_l2: 1e-4, rel_max: 2e-4 },
        other => other.tol(),
    }
}

/// Asserts every gradient of `got` is within its dtype's tolerance of `want`; returns the worst
/// errors (for a summary).
pub fn check_grads(bp: &BwdProblem, want: &Grads<f64>, got: &Grads<f32>) -> Errors {
    let c = bp.case();
    let mut worst = Errors { rel_l2: 0.0, rel_max: 0.0 };
    let mut check = |name: &str, got: &[f32], want: &[f64], dtype: Dt| {
        let e = assert_close(name, c, got, want, grad_tol(dtype));
        worst = Errors { rel_l2: worst.rel_l2.max(e.rel_l2), rel_max: worst.rel_max.max(e.rel_max) };
    };
    check("du", &got.du, &want.du, c.dtype);
    check("ddelta", &got.ddelta, &want.ddelta, c.dtype);
    check("dA", &got.da, &want.da, Dt::F32);
    check("dB", &got.db, &want.db, c.bc_dtype);
    check("dC", &got.dc, &want.dc, c.bc_dtype);
    let pairs = [
        ("dD", &got.dd, &want.dd, Dt::F32),
        ("dz", &got.dz, &want.dz, c.dtype),
        ("ddelta_bias", &got.ddelta_bias, &want.ddelta_bias, Dt::F32),
        ("dinitial_state", &got.dinitial_state, &want.dinitial_state, Dt::F32),
    ];
    for (name, got, want, dtype) in pairs {
        match (got, want) {
            (Some(g), Some(w)) => check(name, g, w, dtype),
            (None, None) => {}
            _ => panic!("{name}: present in one of result and reference only; case {c:?}"),
        }
    }
    worst
}
