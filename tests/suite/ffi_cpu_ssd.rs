//! The SSD CPU targets (`xla_ssm_ssd_fwd_cpu`, `xla_ssm_ssd_bwd_cpu`) through call frames of the
//! fake XLA runtime, against the f64 references of tests/suite/ssd_common: shapes (odd seqlen, groups,
//! headdim, dstate, chunk sizes), dtypes, every optional operand, the clamp, zero sizes, the
//! chunk-entering states, determinism, every validation error, and the C API.

use crate::common::xla::{self, Attr};
use crate::common::{Dt, Errors, HostBuf};
use crate::ssd_common::*;
use std::ffi::c_void;
use xla_ssm::capi::*;
use xla_ssm::xla::handlers::{xla_ssm_ssd_bwd_cpu, xla_ssm_ssd_fwd_cpu};

/// Forward (saving chunk states) and backward through the CPU handlers, checked against the
/// references; the worst forward and gradient errors.
fn roundtrip(case: &SsdCase, with_dfinal: bool) -> (Errors, Errors) {
    let p = SsdProblem::random(case, with_dfinal);
    let got = p.run_fwd_cpu(true).unwrap_or_else(|(c, m)| panic!("forward failed ({c}): {m}\ncase: {case:?}"));
    let (ey, _) = check_fwd(case, &p.reference(), &got, case.f32_tol());
    let cs = got.chunk_states.expect("chunk_states");
    let grads = p.run_bwd_cpu(&cs).unwrap_or_else(|(c, m)| panic!("backward failed ({c}): {m}\ncase: {case:?}"));
    (ey, check_grads(case, &p.reference_bwd(), &grads))
}

fn roundtrip_all(what: &str, cases: &[SsdCase]) {
    let (mut y, mut g) = (0f64, 0f64);
    for (k, case) in cases.iter().enumerate() {
        let (ey, eg) = roundtrip(case, k % 2 == 0);
        y = y.max(ey.rel_l2);
        g = g.max(eg.rel_l2);
    }
    println!("{what}: {} cases ok; worst rel L2: y {y:.1e}, gradients {g:.1e}", cases.len());
}

/// Where the tensor-core kernels run, chunk_states are in T on the CPU too (either target reads the
/// other's residuals): the forward rounds the scan's f32 checkpoints, the backward widens them.
#[test]
fn chunk_states_in_t_at_tensor_core_shapes() {
    let mut cases = Vec::new();
    for (dtype, dstate, chunk_size) in [(Dt::BF16, 64, 64), (Dt::F16, 128, 128), (Dt::BF16, 128, 256)] {
        let case = SsdCase { dtype, chunk_size, ..SsdCase::new(1, 150, 2, 64, dstate).all_optional() };
        assert_eq!(case.chunk_states_dt(), dtype);
        cases.push(case);
    }
    roundtrip_all("chunk states in T", &cases);
}

#[test]
fn shapes_groups_chunks() {
    let cases = shape_cases(&SHAPES);
    roundtrip_all("shapes", &cases);
}

#[test]
fn dtypes() {
    let mut cases = Vec::new();
    for dtype in [Dt::F32, Dt::BF16, Dt::F16] {
        for (limit, d) in [((0.0, f32::INFINITY), DForm::PerHead), (CLAMP, DForm::PerChannel)] {
            let base = SsdCase { dtype, dt_limit: limit, groups: 2, chunk_size: 32, ..SsdCase::new(2, 77, 4, 16, 16) };
            cases.push(SsdCase { d, ..base.all_optional() });
        }
    }
    roundtrip_all("dtypes", &cases);
}

/// Every combination of D (none, per head, per channel), z, dt_bias, initial_states, with and
/// without softplus and the clamp.
#[test]
fn every_combination_of_optional_operands() {
    let mut cases = Vec::new();
    let mut k = 0;
    for d in [DForm::None, DForm::PerHead, DForm::PerChannel] {
        for mask in 0..8 {
            for (softplus, limit) in [(true, (0.0, f32::INFINITY)), (true, CLAMP), (false, NO_CLAMP), (false, CLAMP)] {
                k += 1;
                if k % 2 == 1 && d != DForm::PerChannel {
                    continue; // half of the grid is plenty where D is simpler
                }
                cases.push(SsdCase {
                    d,
                    has_z: mask & 1 != 0,
                    has_dt_bias: mask & 2 != 0,
                    has_initial_states: mask & 4 != 0,
                    softplus,
                    dt_limit: limit,
                    groups: 2,
                    chunk_size: 32,
                    seed: k,
                    ..SsdCase::new(2, 45, 4, 3, 5)
                });
            }
        }
    }
    roundtrip_all("optional operands", &cases);
}

/// Without softplus, the default limits (0, inf) clamp negative dt to 0 (ssd_dt in kernels/ssd.cuh);
/// -inf keeps them.
#[test]
fn default_limits_zero_negative_dt_without_softplus() {
    for limit in [(0.0, f32::INFINITY), NO_CLAMP] {
        let case = SsdCase { softplus: false, dt_limit: limit, dt_range: (0.01, 0.3), ..SsdCase::new(1, 40, 2, 4, 4) };
        let mut p = SsdProblem::random(&case, true);
        for (i, v) in p.dt.iter_mut().enumerate() {
            if i % 3 == 0 {
                *v = -*v; // some negative dt
            }
        }
        let got = p.run_fwd_cpu(true).unwrap();
        check_fwd(&case, &p.reference(), &got, case.f32_tol());
        let grads = p.run_bwd_cpu(got.chunk_states.as_ref().unwrap()).unwrap();
        check_grads(&case, &p.reference_bwd(), &grads);
        if limit.0 == 0.0 {
            assert!(grads.ddt.iter().step_by(3).all(|&g| g == 0.0), "clamped dt have no gradient");
        }
    }
}

#[test]
fn zero_sized_dims() {
    for (b, l, h, p, g) in [(0, 9, 2, 3, 1), (2, 0, 2, 3, 1), (2, 9, 0, 3, 1), (2, 9, 2, 0, 2), (2, 0, 2, 0, 1)] {
        let case = SsdCase { groups: g, chunk_size: 32, ..SsdCase::new(b, l, h, p, 4).all_optional() };
        let pr = SsdProblem::random(&case, true);
        let got = pr.run_fwd_cpu(true).unwrap();
        check_fwd(&case, &pr.reference(), &got, case.f32_tol());
        let grads = pr.run_bwd_cpu(got.chunk_states.as_ref().unwrap()).unwrap();
        check_grads(&case, &pr.reference_bwd(), &grads);
        if l == 0 {
            assert_eq!(&got.final_states, pr.h0.as_ref().unwrap());
            assert_eq!(grads.dh0.as_ref().unwrap(), pr.dfinal.as_ref().unwrap());
        }
        // dA, dD and ddt_bias are written (zeros where nothing contributes), never left as NaN.
        assert!(grads.da.iter().chain(grads.dd.as_ref().unwrap()).all(|x| x.is_finite()));
    }
}

/// Without save_chunk_states the forward has two results and the same outputs.
#[test]
fn forward_without_chunk_states() {
    let case = SsdCase { dtype: Dt::BF16, ..SsdCase::new(2, 100, 4, 8, 16).all_optional() };
    let p = SsdProblem::random(&case, false);
    let (with, without) = (p.run_fwd_cpu(true).unwrap(), p.run_fwd_cpu(false).unwrap());
    assert!(without.chunk_states.is_none());
    assert_eq!(with.y, without.y);
    assert_eq!(with.final_states, without.final_states);
}

/// The same calls twice give the same bits.
#[test]
fn deterministic() {
    for case in [
        SsdCase { groups: 2, ..SsdCase::new(2, 300, 4, 32, 16).all_optional() },
        SsdCase { dt_limit: CLAMP, dtype: Dt::BF16, chunk_size: 128, ..SsdCase::new(2, 200, 8, 16, 64).all_optional() },
    ] {
        let p = SsdProblem::random(&case, true);
        let (f1, f2) = (p.run_fwd_cpu(true).unwrap(), p.run_fwd_cpu(true).unwrap());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&f1.y), bits(&f2.y));
        assert_eq!(bits(f1.chunk_states.as_ref().unwrap()), bits(f2.chunk_states.as_ref().unwrap()));
        let cs = f1.chunk_states.unwrap();
        assert!(p.run_bwd_cpu(&cs).unwrap().bits() == p.run_bwd_cpu(&cs).unwrap().bits(), "{case:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// A valid call whose pieces a test changes. Buffers are zero-padded to 8 bytes per element of
/// their (possibly changed) dims, so that a handler that read a changed operand anyway would not
/// read past it.
#[derive(Clone)]
struct Fixture {
    handler: xla::Handler,
    op: &'static str,
    args: Vec<Arr>,
    rets: Vec<Arr>,
    attrs: Vec<(&'static str, Attr)>,
}

fn padded(a: &Arr) -> HostBuf {
    let n = a.dims.iter().map(|&d| d.max(0) as usize).product::<usize>();
    let mut bytes = a.bytes.clone();
    bytes.resize(bytes.len().max(n * 8), 0);
    HostBuf::from_bytes(&bytes)
}

impl Fixture {
    /// batch 2, seqlen 40, heads 4, headdim 3, dstate 5, groups 2, chunk 32, every option.
    fn problem() -> SsdProblem {
        let case = SsdCase { groups: 2, chunk_size: 32, ..SsdCase::new(2, 40, 4, 3, 5).all_optional() };
        SsdProblem::random(&case, true)
    }

    fn fwd() -> Fixture {
        Fixture::fwd_of(&Fixture::problem())
    }

    /// The forward at a shape the tensor-core kernels take (bf16, headdim 64, dstate 64, chunk 64).
    fn tensor_core_fwd() -> Fixture {
        let case = SsdCase { dtype: Dt::BF16, ..SsdCase::new(1, 70, 2, 64, 64) };
        Fixture::fwd_of(&SsdProblem::random(&case, false))
    }

    fn fwd_of(p: &SsdProblem) -> Fixture {
        Fixture {
            handler: xla_ssm_ssd_fwd_cpu,
            op: "ssd_fwd",
            args: p.operands(),
            rets: p.fwd_results(true),
            attrs: p.fwd_attrs(true),
        }
    }

    fn bwd() -> Fixture {
        let p = Fixture::problem();
        let cs = vec![0f32; p.case.chunk_len()];
        Fixture {
            handler: xla_ssm_ssd_bwd_cpu,
            op: "ssd_bwd",
            args: p.bwd_operands(&cs),
            rets: p.bwd_results(),
            attrs: p.bwd_attrs(),
        }
    }

    fn arg(&mut self, name: &str) -> &mut Arr {
        self.args.iter_mut().find(|a| a.name == name).unwrap_or_else(|| panic!("no operand {name}"))
    }

    fn ret(&mut self, name: &str) -> &mut Arr {
        self.rets.iter_mut().find(|a| a.name == name).unwrap_or_else(|| panic!("no result {name}"))
    }

    fn attr(&mut self, name: &'static str, value: Option<Attr>) -> &mut Fixture {
        self.attrs.retain(|(n, _)| *n != name);
        if let Some(v) = value {
            self.attrs.push((name, v));
        }
        self
    }

    fn run(&self) -> Result<(), (i32, String)> {
        let mut hargs: Vec<HostBuf> = self.args.iter().map(padded).collect();
        let mut hrets: Vec<HostBuf> = self.rets.iter().map(padded).collect();
        let bufs = |list: &[Arr], hs: &mut [HostBuf]| -> Vec<xla::Buf> {
            list.iter()
                .zip(hs.iter_mut())
                .map(|(a, h)| xla::Buf { dtype: a.dtype, dims: a.dims.clone(), data: h.ptr() })
                .collect()
        };
        let (ab, rb) = (bufs(&self.args, &mut hargs), bufs(&self.rets, &mut hrets));
        let mut frame = xla::Frame::new(&ab, &rb, &self.attrs, std::ptr::null_mut());
        let result = xla::call(self.handler, &mut frame);
        if result.is_err() {
            // Nothing was written: validation comes before any work.
            for (r, h) in self.rets.iter().zip(&hrets) {
                assert!(h.bytes()[..r.bytes.len()] == r.bytes[..], "result {} written by a failed call", r.name);
            }
        }
        result
    }

    fn expect_invalid(&self, needles: &[&str]) {
        expect_invalid(self.run(), self.op, needles);
    }
}

fn expect_invalid(result: Result<(), (i32, String)>, op: &str, needles: &[&str]) {
    match result {
        Ok(()) => panic!("expected INVALID_ARGUMENT mentioning {needles:?}, got success"),
        Err((code, msg)) => {
            assert_eq!(code, xla::ERR_INVALID_ARGUMENT, "code of {msg:?}");
            assert!(msg.starts_with(op), "message does not name the op: {msg:?}");
            for n in needles {
                assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
            }
        }
    }
}

fn f32_attr(v: f32) -> Option<Attr> {
    Some(Attr::Scalar(xla::F32, v.to_le_bytes().to_vec()))
}

fn i64_attr(v: i64) -> Option<Attr> {
    Some(Attr::Scalar(xla::S64, v.to_le_bytes().to_vec()))
}

#[test]
fn valid_fixtures_pass() {
    Fixture::fwd().run().unwrap();
    Fixture::bwd().run().unwrap();
}

/// Errors both calls share: inputs, attributes.
#[test]
fn error_inputs_and_attributes() {
    for base in [Fixture::fwd(), Fixture::bwd()] {
        let mut f = base.clone();
        f.arg("x").dims = vec![2, 40, 12];
        f.expect_invalid(&["`x`", "rank 4", "(2, 40, 12)"]);
        let mut f = base.clone();
        f.arg("x").dtype = xla::F64;
        f.expect_invalid(&["`x`", "f64"]);
        let mut f = base.clone();
        f.arg("dt").dims = vec![2, 40, 3];
        f.expect_invalid(&["`dt`", "(2, 40, 4)", "(2, 40, 3)", "[batch, seqlen, heads]"]);
        let mut f = base.clone();
        f.arg("dt").dtype = xla::BF16;
        f.expect_invalid(&["`dt`", "f32", "bf16"]);
        let mut f = base.clone();
        f.arg("A").dims = vec![4, 5];
        f.expect_invalid(&["`A`", "(4,)", "(4, 5)"]);
        let mut f = base.clone();
        f.arg("B").dims = vec![2, 40, 3, 5];
        f.expect_invalid(&["`B`", "groups (= 3)", "heads (= 4)"]);
        let mut f = base.clone();
        f.arg("B").dims = vec![2, 41, 2, 5];
        f.expect_invalid(&["`B`", "(2, 40, groups, dstate)", "(2, 41, 2, 5)"]);
        let mut f = base.clone();
        f.arg("B").dims = vec![2, 40, 2, 257];
        f.arg("C").dims = vec![2, 40, 2, 257];
        f.expect_invalid(&["`B`", "dstate", "257"]);
        let mut f = base.clone();
        f.arg("C").dims = vec![2, 40, 2, 4];
        f.expect_invalid(&["`C`", "(2, 40, 2, 5)", "(2, 40, 2, 4)"]);
        let mut f = base.clone();
        f.arg("D").dims = vec![4, 2];
        f.expect_invalid(&["`D`", "(4,)", "(4, 3)", "(4, 2)"]);
        let mut f = base.clone();
        f.arg("z").dims = vec![2, 40, 4, 2];
        f.expect_invalid(&["`z`", "(2, 40, 4, 3)"]);
        let mut f = base.clone();
        f.arg("dt_bias").dtype = xla::BF16;
        f.expect_invalid(&["`dt_bias`", "f32", "bf16"]);
        let mut f = base.clone();
        f.arg("initial_states").dims = vec![2, 4, 3, 6];
        f.expect_invalid(&["`initial_states`", "(2, 4, 3, 5)", "(2, 4, 3, 6)"]);
        for bad in [0, 48, 512, -64] {
            let mut f = base.clone();
            f.attr("chunk_size", i64_attr(bad));
            f.expect_invalid(&["`chunk_size`", "32, 64, 128 or 256", &bad.to_string()]);
        }
        for (lo, hi) in [(0.5, 0.1), (f32::NAN, 1.0), (0.0, f32::NAN), (f32::INFINITY, f32::INFINITY)] {
            let mut f = base.clone();
            f.attr("dt_min", f32_attr(lo)).attr("dt_max", f32_attr(hi));
            f.expect_invalid(&["`dt_min`", "`dt_max`"]);
        }
        let mut f = base.clone();
        f.attr("dt_min", Some(Attr::Bool(true)));
        f.expect_invalid(&["`dt_min`", "f32"]);
        let mut f = base.clone();
        f.attr("has_z", None);
        f.expect_invalid(&["`has_z`", "missing"]);
        let mut f = base.clone();
        f.attr("has_d", Some(Attr::Bool(false)));
        f.expect_invalid(&["operands", "got"]);
        let mut f = base.clone();
        f.args.pop();
        f.expect_invalid(&["operands", "got"]);
        let mut f = base.clone();
        f.rets.remove(1);
        f.expect_invalid(&["results", "got"]);
    }
}

#[test]
fn error_forward_results() {
    let mut f = Fixture::fwd();
    f.ret("y").dtype = xla::BF16;
    f.expect_invalid(&["result `y`", "bf16"]);
    let mut f = Fixture::fwd();
    f.ret("final_states").dims = vec![2, 4, 3];
    f.expect_invalid(&["`final_states`", "(2, 4, 3, 5)"]);
    let mut f = Fixture::fwd();
    f.ret("chunk_states").dims = vec![2, 4, 3, 1, 5];
    f.expect_invalid(&["`chunk_states`", "(2, 4, 3, 2, 5)", "[batch, heads, headdim, n_chunks, dstate]"]);
    let mut f = Fixture::fwd();
    f.ret("chunk_states").dtype = xla::BF16;
    f.expect_invalid(&["result `chunk_states`", "expected dtype f32", "got bf16", "xla_ssm_ssd_chunk_states_dtype"]);
    // Where the tensor-core kernels run they are in T, not f32.
    let mut f = Fixture::tensor_core_fwd();
    f.ret("chunk_states").dtype = xla::F32;
    f.expect_invalid(&["result `chunk_states`", "expected dtype bf16", "tensor-core", "got f32"]);
    // save_chunk_states asks for the third result.
    let mut f = Fixture::fwd();
    f.rets.pop();
    f.expect_invalid(&["3 or 4 results", "y, final_states, chunk_states", "got 2"]);
}

#[test]
fn error_backward_operands_and_gradients() {
    let mut f = Fixture::bwd();
    f.arg("chunk_states").dims = vec![2, 4, 3, 1, 5];
    f.expect_invalid(&["operand `chunk_states`", "(2, 4, 3, 2, 5)"]);
    let mut f = Fixture::bwd();
    f.arg("chunk_states").dtype = xla::F16;
    f.expect_invalid(&["operand `chunk_states`", "expected dtype f32", "got f16"]);
    let mut f = Fixture::bwd();
    f.attr("chunk_size", i64_attr(64));
    f.expect_invalid(&["operand `chunk_states`", "(2, 4, 3, 1, 5)"]);
    let mut f = Fixture::bwd();
    f.arg("dy").dtype = xla::F16;
    f.expect_invalid(&["`dy`", "f16"]);
    let mut f = Fixture::bwd();
    f.arg("dfinal_states").dims = vec![2, 4, 3, 4];
    f.expect_invalid(&["`dfinal_states`", "(2, 4, 3, 5)"]);
    let mut f = Fixture::bwd();
    f.attr("has_dfinal_states", Some(Attr::Bool(false)));
    f.expect_invalid(&["operands", "got"]);
    for (name, dims, needle) in [
        ("dx", vec![2, 40, 4, 2], "(2, 40, 4, 3)"),
        ("ddt", vec![2, 40, 3], "(2, 40, 4)"),
        ("dA", vec![3], "(4,)"),
        ("dB", vec![2, 40, 1, 5], "(2, 40, 2, 5)"),
        ("dC", vec![2, 40, 2, 4], "(2, 40, 2, 5)"),
        ("dD", vec![4, 3], "(4,)"),
        ("dz", vec![2, 40, 4, 1], "(2, 40, 4, 3)"),
        ("ddt_bias", vec![5], "(4,)"),
        ("dinitial_states", vec![2, 4, 3, 4], "(2, 4, 3, 5)"),
    ] {
        let mut f = Fixture::bwd();
        f.ret(name).dims = dims;
        f.expect_invalid(&[&format!("result `{name}`"), needle]);
    }
    let mut f = Fixture::bwd();
    f.ret("ddt").dtype = xla::F16;
    f.expect_invalid(&["result `ddt`", "f16"]);
    let mut f = Fixture::bwd();
    f.ret("dA").dtype = xla::BF16;
    f.expect_invalid(&["result `dA`", "bf16"]);
}

/// The CUDA handlers refuse a call without the workspace they need, before touching the device (so
/// this runs without one too).
#[cfg(feature = "cuda")]
#[test]
fn cuda_handlers_require_workspace() {
    let need = |fwd: bool| {
        let f = if fwd { xla_ssm_ssd_fwd_workspace_bytes } else { xla_ssm_ssd_bwd_workspace_bytes };
        f(2, 40, 4, 3, 5, 2, 32, XLA_SSM_F32)
    };
    for (mut f, handler, bytes) in [
        (Fixture::fwd(), xla_ssm::xla::handlers::xla_ssm_ssd_fwd_cuda as xla::Handler, need(true)),
        (Fixture::bwd(), xla_ssm::xla::handlers::xla_ssm_ssd_bwd_cuda, need(false)),
    ] {
        assert!(bytes > 0);
        f.handler = handler;
        f.expect_invalid(&["`workspace`", &bytes.to_string(), "got 0"]);
        f.rets.push(Arr {
            name: "workspace",
            dtype: xla::U8,
            dims: vec![bytes - 1],
            bytes: vec![0; bytes as usize - 1],
        });
        f.expect_invalid(&["`workspace`", &bytes.to_string(), &(bytes - 1).to_string()]);
    }
}

fn last_error() -> String {
    // SAFETY: the library's last error is a NUL-terminated string that lives until the next call.
    unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned()
}

/// The workspace sizes grow with the shape and the element size, and refuse what the call would.
#[test]
fn workspace_bytes() {
    let f = |b, l, dt| xla_ssm_ssd_bwd_workspace_bytes(b, l, 8, 64, 128, 1, 256, dt);
    assert!(f(2, 1000, XLA_SSM_F32) > f(2, 1000, XLA_SSM_BF16));
    assert!(f(2, 1000, XLA_SSM_BF16) > f(1, 1000, XLA_SSM_BF16));
    assert!(f(2, 1000, XLA_SSM_BF16) > xla_ssm_ssd_fwd_workspace_bytes(2, 1000, 8, 64, 128, 1, 256, XLA_SSM_BF16));
    assert_eq!(f(2, 1000, 7), -1, "unknown dtype");
    assert!(last_error().contains("dtype"), "{}", last_error());
    assert_eq!(xla_ssm_ssd_bwd_workspace_bytes(2, 10, 8, 4, 4, 3, 32, XLA_SSM_F32), -1, "groups not dividing heads");
    assert!(last_error().contains("groups"), "{}", last_error());
    assert_eq!(xla_ssm_ssd_fwd_workspace_bytes(-1, 10, 8, 4, 4, 1, 32, XLA_SSM_F32), -1);
    assert!(last_error().contains("non-negative"), "{}", last_error());
    // Heads of 128 and 192 on the tensor-core path, as 64-wide split heads (plan::SplitHeads): the
    // figures the Elixir binding's port is checked against (bindings/elixir/test/spec_test.exs), as
    // are those below.
    type Sizer = extern "C" fn(i64, i64, i64, i64, i64, i64, i64, i32) -> i64;
    let wide = |f: Sizer, [b, l, h, p, n, g, q]: [i64; 7]| f(b, l, h, p, n, g, q, XLA_SSM_BF16);
    let (fwd, bwd): (Sizer, Sizer) = (xla_ssm_ssd_fwd_workspace_bytes, xla_ssm_ssd_bwd_workspace_bytes);
    // dt per split head (8 x 2048 x 64 bf16), A, D and dt_bias (256 bytes each), the slack.
    assert_eq!(wide(fwd, [8, 2048, 32, 128, 128, 1, 256]), 8 * 2048 * 64 * 2 + 3 * 256 + 256);
    assert_eq!(wide(bwd, [8, 2048, 32, 128, 128, 1, 256]), 310_515_456);
    assert_eq!(wide(fwd, [1, 16384, 32, 128, 128, 1, 256]), 27_267_072);
    assert_eq!(wide(fwd, [2, 333, 3, 192, 64, 3, 64]), 1_487_976);
    assert_eq!(wide(bwd, [2, 333, 3, 192, 64, 3, 64]), 3_831_296);
    // Small dstates widened (plan::PadState): to 64, and with heads of 128.
    assert_eq!(wide(fwd, [8, 2048, 64, 64, 16, 1, 256]), 54_526_208);
    assert_eq!(wide(bwd, [8, 2048, 64, 64, 16, 1, 256]), 482_480_384);
    assert_eq!(wide(fwd, [3, 130, 3, 128, 32, 3, 64]), 1_927_568);
    assert_eq!(wide(bwd, [3, 130, 3, 128, 32, 3, 64]), 3_735_552);
    assert_eq!(wide(bwd, [1, 1087, 16, 64, 100, 4, 128]), 28_467_968);
    // A state of two halves (plan::StateHalves): 128 heads' x, z and y (3 x 268_435_456), dt
    // (4_194_304), A, D, dt_bias (512 + 32_768 + 512), the initial and final states (2 x 33_554_432),
    // the chunk states (134_217_728), the slack (256).
    assert_eq!(wide(fwd, [8, 2048, 64, 64, 256, 1, 256]), 1_010_861_312);
}

/// The C API's chunk_states dtype: the inputs' dtype exactly where the tensor-core kernels run (the
/// rule the tests' `chunk_states_dt` states), whatever batch, seqlen, heads and groups are.
#[test]
fn chunk_states_dtype() {
    for dtype in [Dt::F32, Dt::BF16, Dt::F16] {
        for headdim in [16, 31, 32, 48, 64, 80, 128, 192] {
            for dstate in [1, 16, 64, 100, 128, 129, 256] {
                for chunk_size in [32, 64, 128, 256] {
                    let case = SsdCase { dtype, chunk_size, ..SsdCase::new(1, 1, 1, headdim, dstate) };
                    let got =
                        xla_ssm_ssd_chunk_states_dtype(headdim as i64, dstate as i64, chunk_size as i64, dtype.capi());
                    assert_eq!(got, case.chunk_states_dt().capi(), "{case:?}");
                }
            }
        }
    }
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(64, 128, 256, XLA_SSM_BF16), XLA_SSM_BF16);
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(64, 128, 32, XLA_SSM_BF16), XLA_SSM_F32, "half a tile");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(128, 128, 256, XLA_SSM_BF16), XLA_SSM_BF16, "two heads of 64 a head");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(96, 128, 256, XLA_SSM_BF16), XLA_SSM_BF16, "widened to 128");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(32, 128, 256, XLA_SSM_BF16), XLA_SSM_BF16, "widened to 64");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(31, 128, 256, XLA_SSM_BF16), XLA_SSM_F32, "narrower than 32");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(64, 16, 256, XLA_SSM_BF16), XLA_SSM_BF16, "a state widened to 64");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(64, 256, 256, XLA_SSM_BF16), XLA_SSM_BF16, "two halves of 128");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(64, 200, 64, XLA_SSM_F16), XLA_SSM_F16, "widened to two halves");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(64, 257, 256, XLA_SSM_BF16), XLA_SSM_F32, "wider than 256");
    assert_eq!(xla_ssm_ssd_chunk_states_dtype(64, 128, 256, 7), -1, "unknown dtype");
}

// ---------------------------------------------------------------------------------------------
// The C API: the same results as the handlers, bit for bit, and its errors.

#[test]
fn c_api_host_matches_handlers() {
    let small = |dtype, d, dt_limit| SsdCase {
        dtype,
        d,
        dt_limit,
        groups: 2,
        chunk_size: 32,
        ..SsdCase::new(2, 70, 4, 6, 8).all_optional()
    };
    // The last has chunk_states in T (the tensor-core shapes' rule).
    let cases = [
        small(Dt::F32, DForm::PerHead, (0.0, f32::INFINITY)),
        small(Dt::BF16, DForm::PerChannel, CLAMP),
        SsdCase { dtype: Dt::F16, d: DForm::PerHead, ..SsdCase::new(1, 70, 2, 64, 64).all_optional() },
    ];
    for case in cases {
        let (dtype, d, limit) = (case.dtype, case.d, case.dt_limit);
        let cs_dt = case.chunk_states_dt();
        let p = SsdProblem::random(&case, true);
        let want_fwd = p.run_fwd_cpu(true).unwrap();
        let cs = want_fwd.chunk_states.clone().unwrap();
        let want = p.run_bwd_cpu(&cs).unwrap();

        // Host copies in the dtype's encoding.
        let mut bufs: Vec<HostBuf> = p.bwd_operands(&cs).iter().map(|a| HostBuf::from_bytes(&a.bytes)).collect();
        let names: Vec<&str> = p.bwd_operands(&cs).iter().map(|a| a.name).collect();
        let mut at = |n: &str| bufs[names.iter().position(|m| *m == n).unwrap()].ptr();
        let (x, dt, a, b, c, dd, z, bias, h0, csp, dy, dfinal) = (
            at("x"),
            at("dt"),
            at("A"),
            at("B"),
            at("C"),
            at("D"),
            at("z"),
            at("dt_bias"),
            at("initial_states"),
            at("chunk_states"),
            at("dy"),
            at("dfinal_states"),
        );
        let mut y = HostBuf::from_bytes(&dtype.nans(case.x_len()));
        let mut fin = vec![f32::NAN; case.state_len()];
        let mut cs_out = HostBuf::from_bytes(&cs_dt.nans(case.chunk_len()));
        let code = dtype.capi();
        let [batch, seqlen, heads, headdim, dstate, groups, chunk_size] = case.capi_sizes();
        let fwd_args = XlaSsmSsdFwdArgs {
            batch,
            seqlen,
            heads,
            headdim,
            dstate,
            groups,
            chunk_size,
            dtype: code,
            d_per_channel: d == DForm::PerChannel,
            dt_softplus: true,
            dt_min: limit.0,
            dt_max: limit.1,
            x,
            dt,
            a: a as *const f32,
            b,
            c,
            d: dd as *const f32,
            z,
            dt_bias: bias as *const f32,
            initial_states: h0 as *const f32,
            y: y.ptr(),
            final_states: fin.as_mut_ptr(),
            chunk_states: cs_out.ptr(),
            chunk_states_dtype: cs_dt.capi(),
            workspace: std::ptr::null_mut(),
            workspace_bytes: 0,
            cu_seqlens: std::ptr::null(),
            num_seqs: 0,
        };
        // SAFETY: every pointer addresses an array of the size the struct describes.
        assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&fwd_args) }, XLA_SSM_OK);
        assert_eq!(dtype.decode(y.bytes()), want_fwd.y);
        assert_eq!(fin, want_fwd.final_states);
        assert_eq!(cs_dt.decode(cs_out.bytes()), cs);

        let mut dx = HostBuf::from_bytes(&dtype.nans(case.x_len()));
        let mut ddt = HostBuf::from_bytes(&dtype.nans(case.dt_len()));
        let mut db = HostBuf::from_bytes(&dtype.nans(case.bc_len()));
        let mut dc = HostBuf::from_bytes(&dtype.nans(case.bc_len()));
        let mut dzb = HostBuf::from_bytes(&dtype.nans(case.x_len()));
        let (mut da, mut ddv) = (vec![f32::NAN; case.heads], vec![f32::NAN; case.d_len()]);
        let (mut dbias, mut dh0) = (vec![f32::NAN; case.heads], vec![f32::NAN; case.state_len()]);
        let bwd_args = XlaSsmSsdBwdArgs {
            batch,
            seqlen,
            heads,
            headdim,
            dstate,
            groups,
            chunk_size,
            dtype: code,
            d_per_channel: d == DForm::PerChannel,
            dt_softplus: true,
            dt_min: limit.0,
            dt_max: limit.1,
            x,
            dt,
            a: a as *const f32,
            b,
            c,
            d: dd as *const f32,
            z,
            dt_bias: bias as *const f32,
            initial_states: h0 as *const f32,
            chunk_states: csp as *const c_void,
            chunk_states_dtype: cs_dt.capi(),
            dy,
            dfinal_states: dfinal as *const f32,
            dx: dx.ptr(),
            ddt: ddt.ptr(),
            da: da.as_mut_ptr(),
            db: db.ptr(),
            dc: dc.ptr(),
            dd: ddv.as_mut_ptr(),
            dz: dzb.ptr(),
            ddt_bias: dbias.as_mut_ptr(),
            dinitial_states: dh0.as_mut_ptr(),
            workspace: std::ptr::null_mut(),
            workspace_bytes: 0,
            cu_seqlens: std::ptr::null(),
            num_seqs: 0,
        };
        // SAFETY: as above.
        assert_eq!(unsafe { xla_ssm_ssd_bwd_host(&bwd_args) }, XLA_SSM_OK);
        let got = Grads {
            dx: dtype.decode(dx.bytes()),
            ddt: dtype.decode(ddt.bytes()),
            da,
            db: dtype.decode(db.bytes()),
            dc: dtype.decode(dc.bytes()),
            dd: Some(ddv),
            dz: Some(dtype.decode(dzb.bytes())),
            ddt_bias: Some(dbias),
            dh0: Some(dh0),
        };
        assert!(got.bits() == want.bits(), "C API backward differs from the handler: {case:?}");

        // Errors come back as a status and a message naming the op and the field.
        let mut bad = XlaSsmSsdFwdArgs { chunk_size: 100, ..fwd_args };
        // SAFETY: as above (refused before any access).
        assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&bad) }, XLA_SSM_INVALID_ARGUMENT);
        let msg = last_error();
        assert!(msg.starts_with("ssd_fwd") && msg.contains("`chunk_size`") && msg.contains("100"), "{msg}");
        bad = XlaSsmSsdFwdArgs { dtype: 9, ..fwd_args };
        assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&bad) }, XLA_SSM_INVALID_ARGUMENT);
        bad = XlaSsmSsdFwdArgs { y: std::ptr::null_mut(), ..fwd_args };
        assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&bad) }, XLA_SSM_INVALID_ARGUMENT);
        let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
        assert!(msg.contains("`y`") && msg.contains("null"), "{msg}");
        // A chunk_states buffer of another dtype than the rule's is refused, in both directions,
        // and an unknown code is named; without chunk_states the forward ignores the field.
        let other = if cs_dt == Dt::F32 { Dt::BF16 } else { Dt::F32 };
        bad = XlaSsmSsdFwdArgs { chunk_states_dtype: other.capi(), ..fwd_args };
        assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&bad) }, XLA_SSM_INVALID_ARGUMENT);
        let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
        let want = format!("expected dtype {}", if cs_dt == Dt::F32 { "f32" } else { "f16" });
        assert!(msg.starts_with("ssd_fwd") && msg.contains("`chunk_states`") && msg.contains(&want), "{msg}");
        let bad_bwd = XlaSsmSsdBwdArgs { chunk_states_dtype: other.capi(), ..bwd_args };
        assert_eq!(unsafe { xla_ssm_ssd_bwd_host(&bad_bwd) }, XLA_SSM_INVALID_ARGUMENT);
        let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
        assert!(msg.starts_with("ssd_bwd") && msg.contains("`chunk_states`") && msg.contains(&want), "{msg}");
        bad = XlaSsmSsdFwdArgs { chunk_states_dtype: 9, ..fwd_args };
        assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&bad) }, XLA_SSM_INVALID_ARGUMENT);
        let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
        assert!(msg.contains("`chunk_states_dtype`") && msg.contains("unknown dtype code 9"), "{msg}");
        bad = XlaSsmSsdFwdArgs { chunk_states: std::ptr::null_mut(), chunk_states_dtype: 9, ..fwd_args };
        assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&bad) }, XLA_SSM_OK);
        let bad_bwd = XlaSsmSsdBwdArgs { dd: std::ptr::null_mut(), ..bwd_args };
        assert_eq!(unsafe { xla_ssm_ssd_bwd_host(&bad_bwd) }, XLA_SSM_INVALID_ARGUMENT);
        let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
        assert!(msg.contains("`dD`") && msg.contains("missing"), "{msg}");
        assert_eq!(unsafe { xla_ssm_ssd_fwd_host(std::ptr::null()) }, XLA_SSM_INVALID_ARGUMENT);
    }
}
