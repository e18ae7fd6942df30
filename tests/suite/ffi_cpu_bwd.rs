//! The backward pass on the CPU: the f64 reference backward against finite differences of the f64
//! reference forward (which validates the reference); the forward's checkpoints against the
//! reference states; round trips through the exported handlers `xla_ssm_selective_scan_fwd_cpu`
//! (with checkpoints) and `xla_ssm_selective_scan_bwd_cpu` against the reference over many shapes;
//! determinism; and the error paths (INVALID_ARGUMENT naming the operand).

use crate::common::xla::{self, Attr, Buf, Frame};
use crate::common::*;
use xla_ssm::xla::handlers::{
    xla_ssm_selective_scan_bwd_cpu as bwd_handler, xla_ssm_selective_scan_fwd_cpu as fwd_handler,
};

// ---------------------------------------------------------------------------------------------
// The reference itself.

/// sum(dout * out) + sum(dfinal_state * final_state) of the f64 reference forward.
fn loss(bp: &BwdProblem, p: &Problem) -> f64 {
    let r = p.reference();
    let mut l: f64 = r.out.iter().zip(&bp.dout).map(|(o, g)| o * *g as f64).sum();
    if let Some(df) = &bp.dfinal_state {
        l += r.final_state.iter().zip(df).map(|(s, g)| s * *g as f64).sum::<f64>();
    }
    l
}

fn input_mut<'a>(p: &'a mut Problem, name: &str) -> Option<&'a mut Vec<f32>> {
    match name {
        "u" => Some(&mut p.u),
        "delta" => Some(&mut p.delta),
        "A" => Some(&mut p.a),
        "B" => Some(&mut p.b),
        "C" => Some(&mut p.c),
        "D" => p.d.as_mut(),
        "z" => p.z.as_mut(),
        "delta_bias" => p.delta_bias.as_mut(),
        "initial_state" => p.initial_state.as_mut(),
        _ => unreachable!(),
    }
}

fn grad<'a>(g: &'a Grads<f64>, name: &str) -> Option<&'a Vec<f64>> {
    match name {
        "u" => Some(&g.du),
        "delta" => Some(&g.ddelta),
        "A" => Some(&g.da),
        "B" => Some(&g.db),
        "C" => Some(&g.dc),
        "D" => g.dd.as_ref(),
        "z" => g.dz.as_ref(),
        "delta_bias" => g.ddelta_bias.as_ref(),
        "initial_state" => g.dinitial_state.as_ref(),
        _ => unreachable!(),
    }
}

/// Central differences (steps as the f32 inputs can hold them, divided by exactly what was taken).
#[test]
fn reference_matches_finite_differences() {
    let base = Case::new(2, 4, 6, 3).all_optional();
    let cases = [
        base.clone(),
        Case { layout: Layout::Bld, groups: 2, softplus: false, ..base.clone() },
        Case { groups: 0, has_z: false, ..base.clone() },
        Case { groups: 4, has_d: false, has_delta_bias: false, layout: Layout::Bld, ..base.clone() },
        Case { seqlen: 1, has_initial_state: false, ..base.clone() },
    ];
    for (i, case) in cases.iter().enumerate() {
        let bp = BwdProblem::random(case, 32, i % 2 == 0);
        let want = bp.reference();
        for (name, _) in GRAD_NAMES {
            let Some(analytic) = grad(&want, name) else {
                continue;
            };
            let len = analytic.len();
            let mut numeric = vec![0f64; len];
            for (k, num) in numeric.iter_mut().enumerate() {
                let mut p = bp.p.clone();
                let x = input_mut(&mut p, name).unwrap()[k];
                let step = 1e-3 * x.abs().max(1.0);
                let (plus, minus) = (x + step, x - step);
                input_mut(&mut p, name).unwrap()[k] = plus;
                let lp = loss(&bp, &p);
                input_mut(&mut p, name).unwrap()[k] = minus;
                let lm = loss(&bp, &p);
                *num = (lp - lm) / (plus as f64 - minus as f64);
            }
            let as_f32: Vec<f32> = numeric.iter().map(|&x| x as f32).collect();
            // Central differences are exact to O(step^2): about 1e-6 of the gradient here.
            assert_close(
                &format!("d{name} (finite differences)"),
                case,
                &as_f32,
                analytic,
                Tol { rel_l2: 2e-5, rel_max: 5e-5 },
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Checkpoints.

/// The forward's checkpoints are the reference states entering steps 0, L, 2L, ...; its other
/// results are unchanged by asking for them.
#[test]
fn forward_checkpoints_are_the_states() {
    let mut worst = Worst::default();
    for (i, (shape, len)) in [
        ((2, 8, 100, 16), 32),
        ((1, 20, 31, 5), 32),
        ((2, 4, 200, 3), 96),
        ((1, 3, 64, 64), 64),
        ((2, 17, 130, 1), 128),
    ]
    .into_iter()
    .enumerate()
    {
        let (batch, dim, seqlen, dstate) = shape;
        for layout in [Layout::Bdl, Layout::Bld] {
            let dtype = [Dt::F32, Dt::BF16, Dt::F16][i % 3];
            let case = Case { layout, dtype, groups: [1, 0, 2, 1, 0][i], ..Case::new(batch, dim, seqlen, dstate) };
            let case = if i % 2 == 0 { case.all_optional() } else { case };
            let bp = BwdProblem::random(&case, len, false);
            let (out, state, checkpoints) = bp.run_fwd_cpu().unwrap();
            let want = bp.reference_checkpoints();
            assert_close("checkpoints", &case, &checkpoints, &want, Tol::F32);
            let (o, s) = check_outputs(&bp.p, &bp.p.reference(), &out, &state);
            worst.add(&case, o, s);
            // Without checkpoints: the same bits.
            let (plain_out, plain_state) = run_cpu(&bp.p).unwrap();
            assert!(plain_out.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()), "{case:?}");
            assert!(plain_state.iter().zip(&state).all(|(a, b)| a.to_bits() == b.to_bits()), "{case:?}");
        }
    }
    println!("{}", worst.summary("forward with checkpoints"));
}

/// seqlen 0: no checkpoints (an empty result) and the initial state as the final state.
#[test]
fn forward_checkpoints_seqlen_zero() {
    let bp = BwdProblem::random(&Case::new(2, 4, 0, 3).all_optional(), 32, false);
    let (out, state, checkpoints) = bp.run_fwd_cpu().unwrap();
    assert!(out.is_empty() && checkpoints.is_empty());
    assert_eq!(state, *bp.p.initial_state.as_ref().unwrap());
}

// ---------------------------------------------------------------------------------------------
// Round trips.

fn roundtrip(bp: &BwdProblem) -> Errors {
    let got =
        bp.run_cpu().unwrap_or_else(|(code, msg)| panic!("handler failed ({code}): {msg}\ncase: {:?}", bp.case()));
    check_grads(bp, &bp.reference(), &got)
}

/// Every case of `cases` (with its checkpoint_len and whether dfinal_state is given).
fn roundtrip_all(what: &str, cases: &[(Case, usize, bool)]) {
    let mut worst = Errors { rel_l2: 0.0, rel_max: 0.0 };
    for (case, len, dfinal) in cases {
        let e = roundtrip(&BwdProblem::random(case, *len, *dfinal));
        if std::env::var_os("XLA_SSM_TEST_VERBOSE").is_some() {
            println!(
                "  worst gradient rel L2 / max: {:.1e} / {:.1e}: {case:?} checkpoint_len {len}",
                e.rel_l2, e.rel_max
            );
        }
        worst = Errors { rel_l2: worst.rel_l2.max(e.rel_l2), rel_max: worst.rel_max.max(e.rel_max) };
    }
    println!(
        "{what}: {} cases ok; worst gradient rel L2 / max errors: {:.1e} / {:.1e}",
        cases.len(),
        worst.rel_l2,
        worst.rel_max
    );
}

const DTYPES: [(Dt, Dt); 5] =
    [(Dt::F32, Dt::F32), (Dt::BF16, Dt::BF16), (Dt::BF16, Dt::F32), (Dt::F16, Dt::F16), (Dt::F16, Dt::F32)];

/// Shapes (odd seqlens, seqlen below checkpoint_len, narrow and wide groups, time-invariant B/C,
/// dstate 1..64, channels that do not fill a SIMD block) x both layouts x checkpoint_len
/// 32 / 64 / 96 / 128, with dtypes, optional operands, dfinal_state and softplus varied across them.
#[test]
fn shapes_layouts_groups_checkpoints() {
    let shapes: [(usize, usize, usize, usize, usize); 10] = [
        // (batch, dim, seqlen, dstate, groups)
        (2, 8, 100, 16, 1),
        (1, 4, 7, 3, 1),
        (2, 16, 200, 5, 2),
        (1, 8, 77, 16, 4),
        (2, 40, 65, 7, 0),
        (1, 32, 129, 64, 1),
        (2, 24, 33, 1, 2),
        (1, 64, 96, 33, 4),
        (3, 20, 50, 2, 0),
        (1, 2, 160, 16, 2),
    ];
    let mut cases = Vec::new();
    for (i, &(batch, dim, seqlen, dstate, groups)) in shapes.iter().enumerate() {
        for (j, layout) in [Layout::Bdl, Layout::Bld].into_iter().enumerate() {
            let k = 2 * i + j;
            let (dtype, bc_dtype) = DTYPES[k % DTYPES.len()];
            let mask = k * 7 + 3;
            let case = Case {
                groups,
                dtype,
                bc_dtype,
                layout,
                has_d: mask & 1 != 0,
                has_z: mask & 2 != 0,
                has_delta_bias: mask & 4 != 0,
                has_initial_state: mask & 8 != 0,
                softplus: k % 3 != 1,
                seed: k as u64,
                ..Case::new(batch, dim, seqlen, dstate)
            };
            cases.push((case, [32, 64, 96, 128][k % 4], k % 3 != 0));
        }
    }
    roundtrip_all("bwd shapes", &cases);
}

/// Every combination of optional operands, with and without dfinal_state.
#[test]
fn every_combination_of_optional_operands() {
    let mut cases = Vec::new();
    for mask in 0..16 {
        for dfinal in [false, true] {
            let case = Case {
                has_d: mask & 1 != 0,
                has_z: mask & 2 != 0,
                has_delta_bias: mask & 4 != 0,
                has_initial_state: mask & 8 != 0,
                groups: [1, 0, 2][mask % 3],
                seed: mask as u64,
                ..Case::new(2, 12, 45, 6)
            };
            cases.push((case, 32, dfinal));
        }
    }
    roundtrip_all("bwd optional operands", &cases);
}

/// Each dtype pair in each layout, with everything on.
#[test]
fn dtypes() {
    let mut cases = Vec::new();
    for (dtype, bc_dtype) in DTYPES {
        for layout in [Layout::Bdl, Layout::Bld] {
            for groups in [0, 1, 2] {
                let case = Case { dtype, bc_dtype, layout, groups, ..Case::new(2, 16, 70, 16).all_optional() };
                cases.push((case, 64, true));
            }
        }
    }
    roundtrip_all("bwd dtypes", &cases);
}

/// Large enough for several threads and several units per span; long checkpoints (sub-checkpoints).
#[test]
fn threaded_size_and_long_checkpoints() {
    let cases = [
        (Case::new(2, 64, 300, 16).all_optional(), 64, true),
        (Case { groups: 0, ..Case::new(1, 128, 257, 16).all_optional() }, 256, true),
        (Case { layout: Layout::Bld, groups: 4, ..Case::new(2, 64, 200, 32).all_optional() }, 160, false),
    ];
    roundtrip_all("bwd threaded", &cases);
}

/// Zero-sized dimensions: seqlen 0 gives dinitial_state = dfinal_state and zero dA, dD, ...;
/// batch 0 zero parameter gradients; dim 0 and dstate 0 empty or state-free results.
#[test]
fn zero_sized_dims() {
    for (shape, groups) in
        [((2, 4, 0, 3), 1), ((2, 4, 0, 3), 0), ((0, 4, 9, 3), 0), ((2, 0, 9, 3), 1), ((2, 4, 9, 0), 1)]
    {
        let (batch, dim, seqlen, dstate) = shape;
        let case = Case { groups, ..Case::new(batch, dim, seqlen, dstate).all_optional() };
        let bp = BwdProblem::random(&case, 32, true);
        let got = bp.run_cpu().unwrap();
        let want = bp.reference();
        // The reference is exact here (zeros, dfinal_state itself, or short sums).
        check_grads(&bp, &want, &got);
        if seqlen == 0 {
            assert_eq!(got.dinitial_state.as_ref().unwrap(), bp.dfinal_state.as_ref().unwrap());
            assert!(got.da.iter().chain(got.dd.as_ref().unwrap()).all(|&x| x == 0.0));
        }
    }
}

/// The same call twice gives the same bits (threads take units in whatever order they come).
#[test]
fn deterministic() {
    for (case, len) in [
        (Case::new(2, 64, 300, 16).all_optional(), 64),
        (Case { groups: 0, layout: Layout::Bld, ..Case::new(2, 80, 400, 16).all_optional() }, 96),
    ] {
        let bp = BwdProblem::random(&case, len, true);
        let (_, _, checkpoints) = bp.run_fwd_cpu().unwrap();
        let (a, b) = (bp.run_bwd_cpu(&checkpoints).unwrap(), bp.run_bwd_cpu(&checkpoints).unwrap());
        assert!(a.bits() == b.bits(), "{case:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// A valid backward call (batch 2, dim 8, seqlen 40, dstate 4, groups 1, f32, "bdl", all optional
/// operands, dfinal_state, checkpoint_len 32) whose pieces a test can change. Changed operands point
/// at a zeroed scratch buffer, so that a handler that read them anyway would not crash the test.
struct Fixture {
    _args: Vec<HostBuf>,
    rets: Vec<(&'static str, i32, HostBuf)>,
    scratch: HostBuf,
    args: Vec<Buf>,
    ret_bufs: Vec<Buf>,
    attrs: Vec<(&'static str, Attr)>,
}

impl Fixture {
    fn new() -> Fixture {
        let bp = BwdProblem::random(&Case::new(2, 8, 40, 4).all_optional(), 32, true);
        let checkpoints = vec![0f32; bp.checkpoint_dims().iter().product::<i64>() as usize];
        let ops = bp.bwd_operands(&checkpoints);
        let mut args_mem: Vec<HostBuf> = ops.iter().map(|o| HostBuf::from_bytes(&o.bytes)).collect();
        let args = ops
            .iter()
            .zip(args_mem.iter_mut())
            .map(|(o, h)| Buf { dtype: o.dtype, dims: o.dims.clone(), data: h.ptr() })
            .collect();
        let mut rets: Vec<(&'static str, i32, HostBuf)> =
            bp.poisoned_grads().into_iter().map(|o| (o.name, o.dtype, HostBuf::from_bytes(&o.bytes))).collect();
        let ret_bufs = bp
            .poisoned_grads()
            .iter()
            .zip(rets.iter_mut())
            .map(|(o, (_, _, h))| Buf { dtype: o.dtype, dims: o.dims.clone(), data: h.ptr() })
            .collect();
        Fixture {
            _args: args_mem,
            rets,
            scratch: HostBuf::from_bytes(&vec![0u8; 1 << 20]),
            args,
            ret_bufs,
            attrs: bp.bwd_attrs(),
        }
    }

    fn arg(&mut self, i: usize, dtype: i32, dims: &[i64]) {
        self.args[i] = Buf { dtype, dims: dims.to_vec(), data: self.scratch.ptr() };
    }

    fn ret(&mut self, i: usize, dtype: i32, dims: &[i64]) {
        self.ret_bufs[i] = Buf { dtype, dims: dims.to_vec(), data: self.scratch.ptr() };
    }

    fn attr(&mut self, name: &'static str, value: Option<Attr>) {
        self.attrs.retain(|(n, _)| *n != name);
        if let Some(v) = value {
            self.attrs.push((name, v));
        }
    }

    fn run(&mut self) -> Result<(), (i32, String)> {
        let mut frame = Frame::new(&self.args, &self.ret_bufs, &self.attrs, std::ptr::null_mut());
        let result = xla::call(bwd_handler, &mut frame);
        if result.is_err() {
            // Nothing was written: validation comes before any work.
            for (name, dtype, h) in &self.rets {
                let dt = [Dt::F32, Dt::BF16, Dt::F16].into_iter().find(|d| d.xla() == *dtype).unwrap();
                assert!(dt.decode(h.bytes()).iter().all(|x| x.is_nan()), "result {name} written by a failed call");
            }
        }
        result
    }

    fn expect_invalid(&mut self, needles: &[&str]) {
        expect_invalid(self.run(), "selective_scan_bwd", needles);
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

// Operand and result indices of the fixture.
const A: usize = 2;
const CHECKPOINTS: usize = 9;
const DOUT: usize = 10;
const DFINAL: usize = 11;
const DU: usize = 0;
const DDELTA: usize = 1;
const DA: usize = 2;
const DB: usize = 3;
const DD: usize = 5;
const DZ: usize = 6;
const DH0: usize = 8;

fn scalar_i64(v: i64) -> Option<Attr> {
    Some(Attr::Scalar(xla::S64, v.to_le_bytes().to_vec()))
}

#[test]
fn valid_fixture_passes() {
    Fixture::new().run().unwrap();
}

#[test]
fn error_checkpoint_len() {
    for (value, needle) in [(48, "48"), (0, "got 0"), (-32, "-32")] {
        let mut f = Fixture::new();
        f.attr("checkpoint_len", scalar_i64(value));
        f.expect_invalid(&["`checkpoint_len`", "positive multiple of 32", needle]);
    }
    let mut f = Fixture::new();
    f.attr("checkpoint_len", None);
    f.expect_invalid(&["`checkpoint_len`", "missing"]);
    let mut f = Fixture::new();
    f.attr("checkpoint_len", Some(Attr::Bool(true)));
    f.expect_invalid(&["`checkpoint_len`", "integer"]);
    // An i32 scalar is an integer too.
    let mut f = Fixture::new();
    f.attr("checkpoint_len", Some(Attr::Scalar(xla::S32, 32i32.to_le_bytes().to_vec())));
    f.run().unwrap();
}

#[test]
fn error_checkpoints_shape() {
    let mut f = Fixture::new();
    // seqlen 40, checkpoint_len 32: two checkpoints, not one.
    f.arg(CHECKPOINTS, xla::F32, &[2, 8, 1, 4]);
    f.expect_invalid(&["`checkpoints`", "(2, 8, 2, 4)", "(2, 8, 1, 4)"]);
    let mut f = Fixture::new();
    f.arg(CHECKPOINTS, xla::BF16, &[2, 8, 2, 4]);
    f.expect_invalid(&["`checkpoints`", "f32", "bf16"]);
    // checkpoint_len 64 wants one checkpoint.
    let mut f = Fixture::new();
    f.attr("checkpoint_len", scalar_i64(64));
    f.expect_invalid(&["`checkpoints`", "(2, 8, 1, 4)", "(2, 8, 2, 4)"]);
}

#[test]
fn error_missing_checkpoints_or_operand_count() {
    let mut f = Fixture::new();
    f.args.remove(CHECKPOINTS);
    f.expect_invalid(&["expected 12 operands", "checkpoints", "got 11"]);
    let mut f = Fixture::new();
    f.attr("has_dfinal_state", Some(Attr::Bool(false)));
    f.expect_invalid(&["expected 11 operands", "got 12"]);
    let mut f = Fixture::new();
    f.attr("has_dfinal_state", None);
    f.expect_invalid(&["`has_dfinal_state`", "missing"]);
}

#[test]
fn error_result_count() {
    let mut f = Fixture::new();
    f.ret_bufs.pop();
    f.expect_invalid(&["expected 9 or 10 results", "dinitial_state", "got 8"]);
    let mut f = Fixture::new();
    f.attr("has_z", Some(Attr::Bool(false)));
    f.expect_invalid(&["operands"]);
}

#[test]
fn error_cotangents() {
    let mut f = Fixture::new();
    f.arg(DOUT, xla::F32, &[2, 8, 39]);
    f.expect_invalid(&["`dout`", "(2, 8, 40)", "(2, 8, 39)"]);
    let mut f = Fixture::new();
    f.arg(DOUT, xla::BF16, &[2, 8, 40]);
    f.expect_invalid(&["`dout`", "f32", "bf16"]);
    let mut f = Fixture::new();
    f.arg(DFINAL, xla::F32, &[2, 8, 5]);
    f.expect_invalid(&["`dfinal_state`", "(2, 8, 4)", "(2, 8, 5)"]);
}

#[test]
fn error_gradient_shapes_and_dtypes() {
    let cases: [(usize, i32, &[i64], &[&str]); 8] = [
        (DU, xla::F32, &[2, 40, 8], &["`du`", "(2, 8, 40)", "(2, 40, 8)"]),
        (DDELTA, xla::BF16, &[2, 8, 40], &["`ddelta`", "f32", "bf16"]),
        (DA, xla::BF16, &[8, 4], &["`dA`", "f32", "bf16"]),
        (DA, xla::F32, &[8, 5], &["`dA`", "(8, 4)", "(8, 5)"]),
        (DB, xla::F16, &[2, 1, 4, 40], &["`dB`", "f32", "f16"]),
        (DD, xla::F32, &[9], &["`dD`", "(8,)", "(9,)"]),
        (DZ, xla::F16, &[2, 8, 40], &["`dz`", "f32", "f16"]),
        (DH0, xla::F32, &[2, 8], &["`dinitial_state`", "(2, 8, 4)", "(2, 8)"]),
    ];
    for (i, dtype, dims, needles) in cases {
        let mut f = Fixture::new();
        f.ret(i, dtype, dims);
        f.expect_invalid(needles);
    }
}

#[test]
fn error_inputs_as_in_the_forward() {
    let mut f = Fixture::new();
    f.arg(A, xla::F32, &[8, 300]);
    f.expect_invalid(&["`A`", "dstate must be at most 256"]);
    let mut f = Fixture::new();
    f.attr("layout", Some(Attr::Str("ldb".into())));
    f.expect_invalid(&["`layout`", "\"ldb\""]);
}

/// The CUDA handler refuses a call without the workspace it needs, before touching the device (so
/// this runs without one too).
#[cfg(feature = "cuda")]
#[test]
fn cuda_handler_requires_workspace() {
    let f = Fixture::new();
    let mut frame = Frame::new(&f.args, &f.ret_bufs, &f.attrs, std::ptr::null_mut());
    let result = xla::call(xla_ssm::xla::handlers::xla_ssm_selective_scan_bwd_cuda, &mut frame);
    let needed = xla_ssm::capi::xla_ssm_selective_scan_bwd_workspace_bytes(2, 8, 40, 4, 1);
    expect_invalid(result, "selective_scan_bwd", &["`workspace`", &needed.to_string()]);
}

/// The forward: a bad checkpoint_len, or checkpoints missing / of the wrong shape.
#[test]
fn error_forward_checkpoints() {
    let bp = BwdProblem::random(&Case::new(2, 8, 40, 4), 32, false);
    let run = |attrs: &[(&'static str, Attr)], rets: Vec<Operand>| {
        let mut call = HostCall { args: Vec::new(), rets: Vec::new() };
        call.args =
            bp.p.operands()
                .into_iter()
                .map(|o| {
                    let h = HostBuf::from_bytes(&o.bytes);
                    (o, h)
                })
                .collect();
        call.rets = rets
            .into_iter()
            .map(|o| {
                let h = HostBuf::from_bytes(&o.bytes);
                (o, h)
            })
            .collect();
        let (args, rets) = (call.arg_bufs(), call.ret_bufs());
        let mut frame = Frame::new(&args, &rets, attrs, std::ptr::null_mut());
        xla::call(fwd_handler, &mut frame)
    };
    let with_len = |v: i64| {
        let mut attrs = bp.p.attrs();
        attrs.push(("checkpoint_len", Attr::Scalar(xla::S64, v.to_le_bytes().to_vec())));
        attrs
    };
    let op = "selective_scan_fwd";
    expect_invalid(run(&with_len(40), bp.poisoned_fwd_results()), op, &["`checkpoint_len`", "multiple of 32", "40"]);
    expect_invalid(run(&with_len(-32), bp.poisoned_fwd_results()), op, &["`checkpoint_len`", "-32"]);
    expect_invalid(
        run(&with_len(32), bp.p.poisoned_results()),
        op,
        &["expected 3 or 4 results", "checkpoints", "got 2"],
    );
    let mut bad = bp.poisoned_fwd_results();
    bad[2].dims = vec![2, 8, 1, 4];
    expect_invalid(run(&with_len(32), bad), op, &["`checkpoints`", "(2, 8, 2, 4)", "(2, 8, 1, 4)"]);
    // checkpoint_len 0 is "none", as when the attribute is absent.
    run(&with_len(0), bp.p.poisoned_results()).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Instruction sets: the round trips again with AVX2 (8 lanes) and without SIMD extensions.

const ISA_TESTS: [&str; 4] = [
    "shapes_layouts_groups_checkpoints",
    "every_combination_of_optional_operands",
    "threaded_size_and_long_checkpoints",
    "deterministic",
];

#[test]
fn roundtrips_with_isa_avx2() {
    rerun_with_env("XLA_SSM_CPU_ISA", "avx2", module_path!(), &ISA_TESTS);
}

#[test]
fn roundtrips_with_isa_portable() {
    rerun_with_env("XLA_SSM_CPU_ISA", "portable", module_path!(), &ISA_TESTS);
}
