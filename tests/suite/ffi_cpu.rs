//! Round trips through the exported CPU handler `xla_ssm_selective_scan_fwd_cpu` with real XLA FFI
//! call frames (built by the fake runtime in common/xla.rs), compared with the f64 reference; the
//! error paths (each an INVALID_ARGUMENT naming the operand, what was expected and what came); the
//! metadata handshake; and frames the handlers must refuse without crashing.

use crate::common::xla::{self, Attr, Buf, Frame};
use crate::common::*;
use std::ffi::c_void;
use xla_ssm::xla::handlers::{
    xla_ssm_selective_scan_fwd_cpu as cpu_handler, xla_ssm_selective_scan_fwd_cuda as cuda_handler,
};

fn roundtrip(case: &Case) -> (Errors, Errors) {
    let p = Problem::random(case);
    let r = p.reference();
    let (out, state) =
        run_cpu(&p).unwrap_or_else(|(code, msg)| panic!("handler failed ({code}): {msg}\ncase: {case:?}"));
    check_outputs(&p, &r, &out, &state)
}

fn roundtrip_all(what: &str, cases: &[Case]) {
    let mut worst = Worst::default();
    for case in cases {
        let (o, s) = roundtrip(case);
        worst.add(case, o, s);
    }
    println!("{}", worst.summary(what));
}

const LAYOUTS: [Layout; 2] = [Layout::Bdl, Layout::Bld];

#[test]
fn odd_seqlens_layouts_groups_dstates() {
    let mut cases = Vec::new();
    let mut i = 0u64;
    for seqlen in [1, 7, 33, 127, 300] {
        for layout in LAYOUTS {
            for (dstate, groups) in [(1, 1), (3, 2), (16, 4), (64, 0)] {
                i += 1;
                cases.push(Case {
                    layout,
                    groups,
                    has_d: i.is_multiple_of(2),
                    has_z: i.is_multiple_of(3),
                    has_delta_bias: i % 4 < 2,
                    has_initial_state: i % 5 < 3,
                    softplus: !i.is_multiple_of(7),
                    seed: i,
                    ..Case::new(2, 8, seqlen, dstate)
                });
            }
        }
    }
    roundtrip_all("odd_seqlens_layouts_groups_dstates", &cases);
}

#[test]
fn dstates_up_to_256() {
    let mut cases = Vec::new();
    for dstate in [1, 2, 3, 7, 8, 9, 16, 31, 64, 100, 255, 256] {
        for layout in LAYOUTS {
            cases.push(Case { layout, groups: 2, seed: dstate as u64, ..Case::new(2, 4, 21, dstate).all_optional() });
        }
    }
    roundtrip_all("dstates_up_to_256", &cases);
}

#[test]
fn every_combination_of_optional_operands() {
    let mut cases = Vec::new();
    for bits in 0u32..32 {
        let on = |k: u32| bits & (1 << k) != 0;
        cases.push(Case {
            layout: LAYOUTS[(bits.count_ones() % 2) as usize],
            groups: [1, 2, 0][(bits % 3) as usize],
            has_d: on(0),
            has_z: on(1),
            has_delta_bias: on(2),
            has_initial_state: on(3),
            softplus: on(4),
            seed: bits as u64,
            ..Case::new(2, 4, 17, 5)
        });
    }
    roundtrip_all("every_combination_of_optional_operands", &cases);
}

#[test]
fn dtypes() {
    let mut cases = Vec::new();
    for dtype in [Dt::F32, Dt::BF16, Dt::F16] {
        let bc_dtypes: &[Dt] = if dtype == Dt::F32 { &[Dt::F32] } else { &[Dt::F32, dtype] };
        for &bc_dtype in bc_dtypes {
            for layout in LAYOUTS {
                for groups in [1, 4, 0] {
                    for all in [false, true] {
                        let base =
                            Case { dtype, bc_dtype, layout, groups, seed: groups as u64, ..Case::new(2, 8, 45, 16) };
                        cases.push(if all { base.all_optional() } else { base });
                    }
                }
            }
        }
    }
    roundtrip_all("dtypes", &cases);
}

#[test]
fn groups_including_one_per_channel() {
    let mut cases = Vec::new();
    for groups in [0, 1, 2, 4, 8] {
        for layout in LAYOUTS {
            cases.push(Case { groups, layout, ..Case::new(3, 8, 19, 6).all_optional() });
        }
    }
    roundtrip_all("groups_including_one_per_channel", &cases);
}

/// Small dt (Mamba's dt_min is 1e-3), where softplus must keep f32 accuracy.
#[test]
fn small_dt() {
    let mut cases = Vec::new();
    for (layout, groups, softplus) in [(Layout::Bdl, 1, true), (Layout::Bld, 0, true), (Layout::Bdl, 2, false)] {
        let base = Case { layout, groups, softplus, dt_range: (1e-4, 1e-2), ..Case::new(2, 8, 100, 16) };
        cases.push(base.clone());
        cases.push(base.all_optional());
    }
    roundtrip_all("small_dt", &cases);
}

/// dt ~ 1e-4 everywhere (f32): softplus(x) for x ~ -9 must keep f32 accuracy.
#[test]
fn tiny_dt_f32() {
    let mut cases = Vec::new();
    for layout in LAYOUTS {
        for softplus in [true, false] {
            cases.push(Case { layout, softplus, dt_range: (1e-4, 2e-4), ..Case::new(2, 8, 64, 16) });
        }
    }
    roundtrip_all("tiny_dt_f32", &cases);
}

/// Long scans with small dt: decays close to 1, so a state remembers thousands of steps and any
/// bias in exp(dt * A) near 0 accumulates over the whole sequence instead of averaging out.
#[test]
fn long_sequence_small_dt() {
    let mut cases = Vec::new();
    for (layout, softplus, dtype) in
        [(Layout::Bdl, true, Dt::F32), (Layout::Bld, false, Dt::F32), (Layout::Bdl, true, Dt::BF16)]
    {
        let base =
            Case { layout, softplus, dtype, bc_dtype: dtype, dt_range: (1e-4, 1e-3), ..Case::new(1, 4, 4096, 16) };
        cases.push(base.clone());
        cases.push(Case { groups: 0, ..base.all_optional() });
    }
    roundtrip_all("long_sequence_small_dt", &cases);
}

/// Big enough for the CPU implementation to split channels over threads.
#[test]
fn threaded_size() {
    roundtrip_all(
        "threaded_size",
        &[
            Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 64, 300, 16).all_optional() },
            Case { layout: Layout::Bld, groups: 4, ..Case::new(3, 40, 257, 16).all_optional() },
        ],
    );
}

/// seqlen 0: nothing to scan, and the final state is h0 (bit for bit), or 0.
#[test]
fn seqlen_zero() {
    for layout in LAYOUTS {
        for groups in [0, 1, 2] {
            for has_h0 in [false, true] {
                let case = Case {
                    layout,
                    groups,
                    has_initial_state: has_h0,
                    has_d: true,
                    has_z: true,
                    ..Case::new(2, 4, 0, 8)
                };
                let p = Problem::random(&case);
                let (out, state) = run_cpu(&p).unwrap();
                assert!(out.is_empty());
                let want = p.initial_state.clone().unwrap_or_else(|| vec![0.0; case.state_len()]);
                assert_eq!(
                    state.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{case:?}"
                );
            }
        }
    }
}

/// Zero batch or dim: valid, nothing to do.
#[test]
fn zero_batch_or_dim() {
    for (batch, dim) in [(0, 4), (2, 0), (0, 0)] {
        for layout in LAYOUTS {
            for groups in [0, 1] {
                let case = Case { layout, groups, ..Case::new(batch, dim, 9, 4).all_optional() };
                let p = Problem::random(&case);
                let (out, state) = run_cpu(&p).unwrap_or_else(|e| panic!("{e:?}\n{case:?}"));
                assert!(out.is_empty() && state.is_empty());
            }
        }
    }
}

/// dstate 0 (a zero-sized dimension): out = D u silu(z), no state.
#[test]
fn dstate_zero() {
    for layout in LAYOUTS {
        let case = Case { layout, ..Case::new(2, 4, 9, 0).all_optional() };
        let p = Problem::random(&case);
        let r = p.reference();
        let (out, state) = run_cpu(&p).unwrap_or_else(|e| panic!("{e:?}"));
        assert!(state.is_empty());
        assert_close("out", &case, &out, &r.out, Tol::F32);
    }
}

/// The same call twice gives the same bits (also when the work is split over threads).
#[test]
fn deterministic() {
    for case in [Case::new(2, 4, 33, 16).all_optional(), Case::new(2, 64, 300, 16).all_optional()] {
        let p = Problem::random(&case);
        let (a, b) = (run_cpu(&p).unwrap(), run_cpu(&p).unwrap());
        assert!(a.0.iter().zip(&b.0).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert!(a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}

/// Only EXECUTE does work: another stage returns success and leaves the results alone.
#[test]
fn other_stages_do_nothing() {
    let p = Problem::random(&Case::new(2, 4, 9, 4).all_optional());
    let mut call = HostCall::new(&p);
    let (args, rets) = (call.arg_bufs(), call.ret_bufs());
    let mut frame = Frame::new(&args, &rets, &p.attrs(), std::ptr::null_mut());
    frame.raw.stage = xla::STAGE_PREPARE;
    xla::call(cpu_handler, &mut frame).unwrap();
    let (out, state) = call.outputs(&p.case);
    assert!(out.iter().chain(&state).all(|x| x.is_nan()));
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// A valid call (batch 2, dim 8, seqlen 5, dstate 4, groups 1, f32, "bdl", all optional operands)
/// whose pieces a test can change before calling. Changed operands point at a large zeroed scratch
/// buffer, so that a handler that read them anyway would not crash the test.
struct Fixture {
    call: HostCall,
    scratch: HostBuf,
    args: Vec<Buf>,
    rets: Vec<Buf>,
    attrs: Vec<(&'static str, Attr)>,
}

impl Fixture {
    fn new() -> Fixture {
        Fixture::with(Case::new(2, 8, 5, 4).all_optional())
    }

    fn with(case: Case) -> Fixture {
        let p = Problem::random(&case);
        let mut call = HostCall::new(&p);
        let (args, rets) = (call.arg_bufs(), call.ret_bufs());
        Fixture { call, scratch: HostBuf::from_bytes(&vec![0u8; 1 << 20]), args, rets, attrs: p.attrs() }
    }

    fn arg(&mut self, i: usize, dtype: i32, dims: &[i64]) {
        self.args[i] = Buf { dtype, dims: dims.to_vec(), data: self.scratch.ptr() };
    }

    fn ret(&mut self, i: usize, dtype: i32, dims: &[i64]) {
        self.rets[i] = Buf { dtype, dims: dims.to_vec(), data: self.scratch.ptr() };
    }

    fn attr(&mut self, name: &'static str, value: Option<Attr>) {
        self.attrs.retain(|(n, _)| *n != name);
        if let Some(v) = value {
            self.attrs.push((name, v));
        }
    }

    fn run(&mut self) -> Result<(), (i32, String)> {
        let mut frame = Frame::new(&self.args, &self.rets, &self.attrs, std::ptr::null_mut());
        let result = xla::call(cpu_handler, &mut frame);
        if result.is_err() {
            // Nothing was written: validation comes before any work.
            let (out, state) = self.call.outputs(&Case::new(2, 8, 5, 4));
            assert!(out.iter().chain(&state).all(|x| x.is_nan()), "results written by a failed call");
        }
        result
    }

    /// Runs and asserts INVALID_ARGUMENT with a message holding every one of `needles`.
    fn expect_invalid(&mut self, needles: &[&str]) {
        match self.run() {
            Ok(()) => panic!("expected INVALID_ARGUMENT mentioning {needles:?}, got success"),
            Err((code, msg)) => {
                assert_eq!(code, xla::ERR_INVALID_ARGUMENT, "code of {msg:?}");
                assert!(msg.starts_with("selective_scan_fwd"), "message does not name the op: {msg:?}");
                for n in needles {
                    assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
                }
            }
        }
    }
}

// Operand indices with all optional operands present.
const U: usize = 0;
const DELTA: usize = 1;
const A: usize = 2;
const B: usize = 3;
const C: usize = 4;
const D: usize = 5;
const Z: usize = 6;
const DELTA_BIAS: usize = 7;
const H0: usize = 8;

#[test]
fn valid_fixture_passes() {
    Fixture::new().run().unwrap();
}

#[test]
fn error_u_rank() {
    let mut f = Fixture::new();
    f.arg(U, xla::F32, &[2, 8]);
    f.expect_invalid(&["`u`", "rank 3", "(2, 8)"]);
}

#[test]
fn error_delta_shape() {
    let mut f = Fixture::new();
    f.arg(DELTA, xla::F32, &[2, 8, 6]);
    f.expect_invalid(&["`delta`", "(2, 8, 5)", "(2, 8, 6)"]);
}

#[test]
fn error_a_dtype() {
    let mut f = Fixture::new();
    f.arg(A, xla::BF16, &[8, 4]);
    f.expect_invalid(&["`A`", "f32", "bf16"]);
}

#[test]
fn error_a_shape() {
    let mut f = Fixture::new();
    f.arg(A, xla::F32, &[7, 4]);
    f.expect_invalid(&["`A`", "(8, dstate)", "(7, 4)"]);
}

#[test]
fn error_groups_do_not_divide_dim() {
    let mut f = Fixture::new();
    f.arg(B, xla::F32, &[2, 3, 4, 5]);
    f.arg(C, xla::F32, &[2, 3, 4, 5]);
    f.expect_invalid(&["`B`", "groups (= 3)", "dim (= 8)"]);
}

#[test]
fn error_b_shape() {
    let mut f = Fixture::new();
    f.arg(B, xla::F32, &[2, 1, 4, 6]);
    f.expect_invalid(&["`B`", "(2, 1, 4, 5)", "(2, 1, 4, 6)"]);
    let mut f = Fixture::new();
    f.arg(B, xla::F32, &[2, 4, 5]);
    f.expect_invalid(&["`B`", "rank 4", "rank 2", "(2, 4, 5)"]);
}

#[test]
fn error_c_shape_differs_from_b() {
    let mut f = Fixture::new();
    f.arg(C, xla::F32, &[2, 1, 4, 6]);
    f.expect_invalid(&["`C`", "(2, 1, 4, 5)", "(2, 1, 4, 6)"]);
    // C time-invariant while B varies with time.
    let mut f = Fixture::new();
    f.arg(C, xla::F32, &[8, 4]);
    f.expect_invalid(&["`C`", "(2, 1, 4, 5)", "(8, 4)"]);
}

#[test]
fn error_c_dtype_differs_from_b() {
    let mut f = Fixture::with(Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 8, 5, 4).all_optional() });
    f.arg(C, xla::F32, &[2, 1, 4, 5]);
    f.expect_invalid(&["`C`", "bf16", "f32"]);
}

#[test]
fn error_bc_dtype_not_allowed() {
    // f32 u: B must be f32.
    let mut f = Fixture::new();
    f.arg(B, xla::BF16, &[2, 1, 4, 5]);
    f.arg(C, xla::BF16, &[2, 1, 4, 5]);
    f.expect_invalid(&["`B`", "expected dtype f32", "bf16"]);
    // bf16 u: B may be f32 or bf16, not f16.
    let mut f = Fixture::with(Case { dtype: Dt::BF16, ..Case::new(2, 8, 5, 4).all_optional() });
    f.arg(B, xla::F16, &[2, 1, 4, 5]);
    f.arg(C, xla::F16, &[2, 1, 4, 5]);
    f.expect_invalid(&["`B`", "f32 or bf16", "f16"]);
}

#[test]
fn error_dstate_too_large() {
    let mut f = Fixture::new();
    f.arg(A, xla::F32, &[8, 300]);
    f.arg(B, xla::F32, &[2, 1, 300, 5]);
    f.arg(C, xla::F32, &[2, 1, 300, 5]);
    f.arg(H0, xla::F32, &[2, 8, 300]);
    f.ret(1, xla::F32, &[2, 8, 300]);
    f.expect_invalid(&["`A`", "at most 256", "300"]);
}

#[test]
fn error_optional_operands() {
    let mut f = Fixture::new();
    f.arg(D, xla::F32, &[4]);
    f.expect_invalid(&["`D`", "(8,)", "(4,)"]);
    let mut f = Fixture::new();
    f.arg(D, xla::BF16, &[8]);
    f.expect_invalid(&["`D`", "f32", "bf16"]);
    let mut f = Fixture::new();
    f.arg(Z, xla::F16, &[2, 8, 5]);
    f.expect_invalid(&["`z`", "f32", "f16"]);
    let mut f = Fixture::new();
    f.arg(Z, xla::F32, &[2, 5, 8]);
    f.expect_invalid(&["`z`", "(2, 8, 5)", "(2, 5, 8)"]);
    let mut f = Fixture::new();
    f.arg(DELTA_BIAS, xla::F32, &[8, 1]);
    f.expect_invalid(&["`delta_bias`", "(8,)", "(8, 1)"]);
    let mut f = Fixture::new();
    f.arg(H0, xla::F32, &[2, 8, 5]);
    f.expect_invalid(&["`initial_state`", "(2, 8, 4)", "(2, 8, 5)"]);
    let mut f = Fixture::new();
    f.arg(H0, xla::BF16, &[2, 8, 4]);
    f.expect_invalid(&["`initial_state`", "f32", "bf16"]);
}

#[test]
fn error_out_dtype() {
    let mut f = Fixture::new();
    f.ret(0, xla::F16, &[2, 8, 5]);
    f.expect_invalid(&["`out`", "f32", "f16"]);
    let mut f = Fixture::with(Case { dtype: Dt::BF16, ..Case::new(2, 8, 5, 4).all_optional() });
    f.ret(0, xla::F32, &[2, 8, 5]);
    f.expect_invalid(&["`out`", "bf16", "f32"]);
}

#[test]
fn error_result_shapes() {
    let mut f = Fixture::new();
    f.ret(0, xla::F32, &[2, 5, 8]);
    f.expect_invalid(&["`out`", "(2, 8, 5)", "(2, 5, 8)"]);
    let mut f = Fixture::new();
    f.ret(1, xla::F32, &[2, 8, 3]);
    f.expect_invalid(&["`final_state`", "(2, 8, 4)", "(2, 8, 3)"]);
    let mut f = Fixture::new();
    f.ret(1, xla::BF16, &[2, 8, 4]);
    f.expect_invalid(&["`final_state`", "f32", "bf16"]);
}

#[test]
fn error_missing_attribute() {
    for name in ["layout", "delta_softplus", "has_d", "has_z", "has_delta_bias", "has_initial_state"] {
        let mut f = Fixture::new();
        f.attr(name, None);
        f.expect_invalid(&[&format!("`{name}`"), "missing"]);
    }
}

#[test]
fn error_mistyped_attributes() {
    let mut f = Fixture::new();
    f.attr("layout", Some(Attr::Bool(true)));
    f.expect_invalid(&["`layout`", "expected a string", "scalar"]);
    let mut f = Fixture::new();
    f.attr("delta_softplus", Some(Attr::Str("true".into())));
    f.expect_invalid(&["`delta_softplus`", "bool", "got a string"]);
    let mut f = Fixture::new();
    f.attr("has_z", Some(Attr::Scalar(xla::S32, 1i32.to_le_bytes().to_vec())));
    f.expect_invalid(&["`has_z`", "bool (pred)", "s32"]);
}

#[test]
fn error_bad_layout_string() {
    for bad in ["lbd", "BDL", "", "bdl "] {
        let mut f = Fixture::new();
        f.attr("layout", Some(Attr::Str(bad.into())));
        f.expect_invalid(&["`layout`", "\"bdl\" or \"bld\"", &format!("{bad:?}")]);
    }
}

#[test]
fn error_operand_count_disagrees_with_flags() {
    // has_d says D follows, but it was left out.
    let mut f = Fixture::with(Case { has_d: true, ..Case::new(2, 8, 5, 4) });
    f.args.pop();
    f.expect_invalid(&["expected 6 operands", "u, delta, A, B, C, D", "got 5"]);
    // An operand too many.
    let mut f = Fixture::with(Case::new(2, 8, 5, 4));
    f.args.push(f.args[0].clone());
    f.expect_invalid(&["expected 5 operands", "got 6"]);
    // All flags on, z missing.
    let mut f = Fixture::new();
    f.args.remove(Z);
    f.expect_invalid(&["expected 9 operands", "got 8"]);
}

#[test]
fn error_result_count() {
    let mut f = Fixture::new();
    f.rets.pop();
    f.expect_invalid(&["expected 2 or 3 results", "got 1"]);
    let mut f = Fixture::new();
    f.rets.push(f.rets[1].clone());
    f.rets.push(f.rets[1].clone());
    f.expect_invalid(&["expected 2 or 3 results", "got 4"]);
    // A third result is the (CUDA-only) workspace: the CPU accepts and ignores it.
    let mut f = Fixture::new();
    f.rets.push(Buf { dtype: xla::U8, dims: vec![64], data: f.scratch.ptr() });
    f.run().expect("a workspace result is accepted");
}

#[test]
fn error_unsupported_dtypes() {
    let mut f = Fixture::new();
    f.arg(U, xla::F64, &[2, 8, 5]);
    f.expect_invalid(&["`u`", "f32 or bf16 or f16", "f64"]);
    let mut f = Fixture::new();
    f.arg(U, xla::S32, &[2, 8, 5]);
    f.expect_invalid(&["`u`", "s32"]);
    let mut f = Fixture::new();
    f.arg(DELTA, xla::S32, &[2, 8, 5]);
    f.expect_invalid(&["`delta`", "f32", "s32"]);
    let mut f = Fixture::new();
    f.arg(B, xla::F64, &[2, 1, 4, 5]);
    f.expect_invalid(&["`B`", "f32", "f64"]);
}

#[test]
fn error_null_data() {
    let mut f = Fixture::new();
    f.args[U].data = std::ptr::null_mut();
    f.expect_invalid(&["`u`", "null"]);
    let mut f = Fixture::new();
    f.rets[1].data = std::ptr::null_mut();
    f.expect_invalid(&["`final_state`", "null"]);
}

// ---------------------------------------------------------------------------------------------
// The handshake and malformed frames.

#[test]
fn metadata_handshake() {
    for (handler, traits) in [(cpu_handler as xla::Handler, 0u32), (cuda_handler as xla::Handler, 1u32)] {
        let m = xla::call_metadata(handler, xla::METADATA_STRUCT_SIZE, false).unwrap();
        assert_eq!((m.major, m.minor), (0, 1));
        assert_eq!(m.api_version_struct_size, xla::API_VERSION_STRUCT_SIZE);
        assert_eq!(m.traits, traits);
        // API 0.1 has no state type id: a handler of 0.1 leaves the field a newer runtime has alone.
        assert_eq!(m.state_type_id, -7, "wrote the state type id");
        // An older runtime's smaller metadata struct: the same answer within its size.
        let m = xla::call_metadata(handler, xla::METADATA_STRUCT_SIZE_V1, false).unwrap();
        assert_eq!((m.major, m.minor, m.traits), (0, 1, traits));
        assert_eq!(m.state_type_id, -7, "wrote past the metadata struct's size");
        // A metadata struct too small to hold the answer is refused.
        let err = xla::call_metadata(handler, 16, true).unwrap_err();
        assert_eq!(err.0, xla::ERR_INVALID_ARGUMENT, "{err:?}");
    }
}

fn valid_frame_parts() -> (Problem, HostCall) {
    let p = Problem::random(&Case::new(2, 4, 9, 4).all_optional());
    let call = HostCall::new(&p);
    (p, call)
}

#[test]
fn call_frame_too_small() {
    for handler in [cpu_handler as xla::Handler, cuda_handler as xla::Handler] {
        let (p, mut call) = valid_frame_parts();
        let (args, rets) = (call.arg_bufs(), call.ret_bufs());
        let mut frame = Frame::new(&args, &rets, &p.attrs(), std::ptr::null_mut());
        frame.raw.struct_size = 100;
        let (code, msg) = xla::call(handler, &mut frame).unwrap_err();
        assert_eq!(code, xla::ERR_INVALID_ARGUMENT);
        assert!(msg.contains("XLA_FFI_CallFrame") && msg.contains("100"), "{msg}");
        let (out, _) = call.outputs(&p.case);
        assert!(out.iter().all(|x| x.is_nan()));
    }
}

#[test]
fn api_table_too_small_or_wrong_version() {
    let (p, mut call) = valid_frame_parts();
    let (args, rets) = (call.arg_bufs(), call.ret_bufs());
    let mut frame = Frame::new(&args, &rets, &p.attrs(), std::ptr::null_mut());
    frame.api.struct_size = 48; // up to internal_api: no function entries
    let (code, msg) = xla::call(cpu_handler, &mut frame).unwrap_err();
    assert_eq!(code, xla::ERR_INVALID_ARGUMENT);
    assert!(msg.contains("XLA_FFI_Api"), "{msg}");

    let mut frame = Frame::new(&args, &rets, &p.attrs(), std::ptr::null_mut());
    frame.api.api_version.major_version = 1;
    let (code, msg) = xla::call(cpu_handler, &mut frame).unwrap_err();
    assert_eq!(code, xla::ERR_INVALID_ARGUMENT);
    assert!(msg.contains("1.3") && msg.contains("0.1"), "{msg}");
}

#[test]
fn null_call_frame_does_not_crash() {
    // SAFETY: the handlers accept a null frame (nothing to report through, nothing done).
    unsafe {
        assert!(cpu_handler(std::ptr::null_mut()).is_null());
        assert!(cuda_handler(std::ptr::null_mut()).is_null());
    }
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> usize {
    xla_ssm::cuda::device_count()
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> usize {
    0
}

/// The CUDA handler on a machine without CUDA (or in a build without it): an error, not a crash.
#[test]
fn cuda_handler_without_cuda_returns_error() {
    if cuda_devices() > 0 {
        println!("skipped: a CUDA device is present (tests/suite/ffi_cuda.rs covers it)");
        return;
    }
    let (p, mut call) = valid_frame_parts();
    let (args, rets) = (call.arg_bufs(), call.ret_bufs());
    let mut frame = Frame::new(&args, &rets, &p.attrs(), std::ptr::null_mut::<c_void>());
    let (code, msg) = xla::call(cuda_handler, &mut frame).unwrap_err();
    let want = if cfg!(feature = "cuda") { xla::ERR_INTERNAL } else { xla::ERR_UNIMPLEMENTED };
    assert_eq!(code, want, "{msg}");
    assert!(msg.contains("CUDA") || msg.contains("cu"), "{msg}");
    println!("cuda handler without CUDA: code {code}: {msg}");
    // Validation still comes first.
    let mut bad = args.clone();
    bad[0].dims = vec![2, 4];
    let mut frame = Frame::new(&bad, &rets, &p.attrs(), std::ptr::null_mut());
    let (code, msg) = xla::call(cuda_handler, &mut frame).unwrap_err();
    assert_eq!(code, xla::ERR_INVALID_ARGUMENT, "{msg}");
}

/// XLA_FFI_Stream_Get failing: the CUDA handler passes the runtime's message on.
#[test]
fn cuda_handler_stream_get_error() {
    let (p, mut call) = valid_frame_parts();
    let (args, rets) = (call.arg_bufs(), call.ret_bufs());
    let mut frame = Frame::new(&args, &rets, &p.attrs(), std::ptr::null_mut());
    frame.ctx.fail_stream_get = true;
    let (code, msg) = xla::call(cuda_handler, &mut frame).unwrap_err();
    assert_eq!(code, xla::ERR_INTERNAL, "{msg}");
    assert!(msg.contains("no stream for you"), "{msg}");
    let (out, state) = call.outputs(&p.case);
    assert!(out.iter().chain(&state).all(|x| x.is_nan()));
}

// ---------------------------------------------------------------------------------------------
// The CPU implementation picks its instruction set once per process (`XLA_SSM_CPU_ISA` asks for
// less than the best); rerun the round trips with each.

const ISA_TESTS: [&str; 13] = [
    "odd_seqlens_layouts_groups_dstates",
    "tiny_dt_f32",
    "long_sequence_small_dt",
    "dstates_up_to_256",
    "every_combination_of_optional_operands",
    "dtypes",
    "groups_including_one_per_channel",
    "small_dt",
    "threaded_size",
    "seqlen_zero",
    "zero_batch_or_dim",
    "dstate_zero",
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
