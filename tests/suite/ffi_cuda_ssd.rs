//! The SSD CUDA targets (`xla_ssm_ssd_fwd_cuda`, `xla_ssm_ssd_bwd_cuda`: real call frames, device
//! buffers, a real CUstream; and the C API's `*_cuda_launch`) against the f64 references of
//! tests/suite/ssd_common and the CPU targets, over the matrix of the CPU tests plus training-sized shapes;
//! reruns bitwise equal. `#[ignore]`d: they need a device (scripts/gpu-run.sh runs them).
#![cfg(feature = "cuda")]

use crate::common::cuda::*;
use crate::common::xla::{self, Attr, Buf, Frame};
use crate::common::{assert_close, Dt, Errors, Tol};
use crate::ssd_common::*;
use cudarc::driver::result;
use std::ffi::c_void;
use xla_ssm::capi::*;
use xla_ssm::xla::handlers::{xla_ssm_ssd_bwd_cuda, xla_ssm_ssd_fwd_cuda};

/// Runs a handler on device copies of `args` and `rets` on `stream`; the results' bytes.
fn run_device(
    handler: xla::Handler,
    args: &[Arr],
    rets: &[Arr],
    attrs: &[(&str, Attr)],
    stream: *mut c_void,
) -> Result<Vec<Vec<u8>>, (i32, String)> {
    let dargs: Vec<DevBuf> = args.iter().map(|a| DevBuf::upload(&a.bytes)).collect();
    let drets: Vec<DevBuf> = rets.iter().map(|a| DevBuf::upload(&a.bytes)).collect();
    // The synchronous copies are complete before any stream (non-blocking ones too) reads them.
    result::ctx::synchronize().expect("cuCtxSynchronize");
    let bufs = |list: &[Arr], ds: &[DevBuf]| -> Vec<Buf> {
        list.iter().zip(ds).map(|(a, d)| Buf { dtype: a.dtype, dims: a.dims.clone(), data: d.data() }).collect()
    };
    let mut frame = Frame::new(&bufs(args, &dargs), &bufs(rets, &drets), attrs, stream);
    let outcome = xla::call(handler, &mut frame);
    synchronize(stream);
    outcome?;
    Ok(drets.iter().map(DevBuf::download).collect())
}

fn workspace(name: &'static str, bytes: i64) -> Arr {
    Arr { name, dtype: xla::U8, dims: vec![bytes], bytes: vec![0xff; bytes as usize] }
}

fn fwd_bytes(c: &SsdCase) -> i64 {
    let [b, l, h, p, n, g, q] =
        [c.batch, c.seqlen, c.heads, c.headdim, c.dstate, c.groups, c.chunk_size].map(|v| v as i64);
    xla_ssm_ssd_fwd_workspace_bytes(b, l, h, p, n, g, q, c.dtype.capi())
}

fn bwd_bytes(c: &SsdCase) -> i64 {
    let [b, l, h, p, n, g, q] =
        [c.batch, c.seqlen, c.heads, c.headdim, c.dstate, c.groups, c.chunk_size].map(|v| v as i64);
    xla_ssm_ssd_bwd_workspace_bytes(b, l, h, p, n, g, q, c.dtype.capi())
}

/// Workspace sizes of a problem: the packed functions' for a packed one.
fn problem_bytes(p: &SsdProblem, backward: bool) -> i64 {
    let Some(cu) = &p.cu else { return if backward { bwd_bytes(&p.case) } else { fwd_bytes(&p.case) } };
    let c = &p.case;
    let [l, s, h, d, n, g, q] =
        [c.seqlen, cu.len() - 1, c.heads, c.headdim, c.dstate, c.groups, c.chunk_size].map(|v| v as i64);
    let f = if backward { xla_ssm_ssd_packed_bwd_workspace_bytes } else { xla_ssm_ssd_packed_fwd_workspace_bytes };
    f(l, s, h, d, n, g, q, c.dtype.capi())
}

/// The CUDA forward (saving chunk states), with a workspace of the size asked for, poisoned.
fn gpu_fwd(p: &SsdProblem, stream: *mut c_void) -> Result<FwdOut, (i32, String)> {
    let mut rets = p.fwd_results(true);
    rets.push(workspace("workspace", problem_bytes(p, false)));
    let out = run_device(xla_ssm_ssd_fwd_cuda, &p.operands(), &rets, &p.fwd_attrs(true), stream)?;
    Ok(FwdOut::decode(&p.case, &out))
}

fn gpu_bwd(p: &SsdProblem, chunk_states: &[f32], stream: *mut c_void) -> Result<Grads<f32>, (i32, String)> {
    let mut rets = p.bwd_results();
    rets.push(workspace("workspace", problem_bytes(p, true)));
    let out = run_device(xla_ssm_ssd_bwd_cuda, &p.bwd_operands(chunk_states), &rets, &p.bwd_attrs(), stream)?;
    Ok(Grads::decode(&rets, &out))
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Forward and backward on the GPU against the reference, the CPU target's results (within
/// twice the reference tolerance), and a second run (bitwise).
fn roundtrip(case: &SsdCase, with_dfinal: bool, stream: *mut c_void) -> (Errors, Errors) {
    let p = SsdProblem::random(case, with_dfinal);
    let got = gpu_fwd(&p, stream).unwrap_or_else(|(c, m)| panic!("CUDA forward failed ({c}): {m}\ncase: {case:?}"));
    let (ey, _) = check_fwd(case, &p.reference(), &got, case.cuda_states_tol());
    let cs = got.chunk_states.clone().expect("chunk_states");
    let grads =
        gpu_bwd(&p, &cs, stream).unwrap_or_else(|(c, m)| panic!("CUDA backward failed ({c}): {m}\ncase: {case:?}"));
    let eg = check_grads(case, &p.reference_bwd(), &grads);

    let double = |t: Tol| Tol { rel_l2: 2.0 * t.rel_l2, rel_max: 2.0 * t.rel_max };
    let cpu = p.run_fwd_cpu(true).unwrap();
    assert_close("y (CUDA vs CPU)", case, &got.y, &f64s(&cpu.y), double(case.dtype.tol()));
    let cpu_grads = p.run_bwd_cpu(&cs).unwrap();
    assert_close("ddt (CUDA vs CPU)", case, &grads.ddt, &f64s(&cpu_grads.ddt), double(grad_tol(case, "ddt")));
    assert_close("dA (CUDA vs CPU)", case, &grads.da, &f64s(&cpu_grads.da), double(grad_tol(case, "dA")));

    let again = gpu_fwd(&p, stream).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&again.y) == bits(&got.y), "two CUDA forwards differ: {case:?}");
    assert!(gpu_bwd(&p, &cs, stream).unwrap().bits() == grads.bits(), "two CUDA backwards differ: {case:?}");
    (ey, eg)
}

fn roundtrip_all(what: &str, cases: &[SsdCase]) {
    let stream = Stream::new();
    let (mut y, mut g) = (0f64, 0f64);
    for (k, case) in cases.iter().enumerate() {
        let (ey, eg) = roundtrip(case, k % 2 == 0, stream.ptr());
        y = y.max(ey.rel_l2);
        g = g.max(eg.rel_l2);
    }
    println!("{what}: {} cases ok; worst rel L2 against the reference: y {y:.1e}, gradients {g:.1e}", cases.len());
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn shapes_groups_chunks() {
    gpu();
    // The CPU tests' matrix, and two training-sized shapes.
    let cases = shape_cases(&[&SHAPES[..], &[(2, 500, 4, 64, 16, 1, 256), (1, 130, 16, 8, 128, 4, 64)]].concat());
    roundtrip_all("shapes", &cases);
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn dtypes() {
    gpu();
    let mut cases = Vec::new();
    for dtype in [Dt::F32, Dt::BF16, Dt::F16] {
        for (limit, d) in [((0.0, f32::INFINITY), DForm::PerHead), (CLAMP, DForm::PerChannel)] {
            let base = SsdCase { dtype, dt_limit: limit, groups: 2, chunk_size: 32, ..SsdCase::new(2, 77, 4, 16, 16) };
            cases.push(SsdCase { d, ..base.all_optional() });
        }
    }
    roundtrip_all("dtypes", &cases);
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn every_combination_of_optional_operands() {
    gpu();
    let mut cases = Vec::new();
    let mut k = 0;
    for d in [DForm::None, DForm::PerHead, DForm::PerChannel] {
        for mask in 0..8 {
            for (softplus, limit) in [(true, (0.0, f32::INFINITY)), (true, CLAMP), (false, NO_CLAMP), (false, CLAMP)] {
                k += 1;
                cases.push(SsdCase {
                    d,
                    has_z: mask & 1 != 0,
                    has_dt_bias: mask & 2 != 0,
                    has_initial_states: mask & 4 != 0,
                    softplus,
                    dt_limit: limit,
                    groups: 2,
                    chunk_size: 32,
                    dtype: [Dt::F32, Dt::BF16, Dt::F16][k % 3],
                    seed: k as u64,
                    ..SsdCase::new(2, 45, 4, 3, 5)
                });
            }
        }
    }
    roundtrip_all("optional operands", &cases);
}

/// Training-sized: batch 2, seqlen 1000, heads 8, headdim 64, dstate 128, in bf16 and f32.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn large_shapes() {
    gpu();
    let cases = [
        SsdCase { dtype: Dt::BF16, chunk_size: 256, groups: 1, ..SsdCase::new(2, 1000, 8, 64, 128).all_optional() },
        SsdCase {
            dtype: Dt::F32,
            chunk_size: 128,
            groups: 2,
            dt_limit: CLAMP,
            ..SsdCase::new(2, 1000, 8, 64, 128).all_optional()
        },
    ];
    roundtrip_all("large", &cases);
}

/// The tensor-core kernels (bf16/f16, headdim at least 32, dstate up to 256, chunks of whole 64-step
/// tiles): odd lengths, groups, both forms of D, the clamp, z (the backward recomputes y before the
/// gate, split as far as its records fit), the sequence splits of both passes (few batch x heads: up
/// to one part per 64-step tile forward, per chunk backward), both ways to dB and dC, heads of 128 to
/// 256 channels, heads of 32 to 96 (widened), dstates of 1 to 100 (widened), and 200 and 256 (two
/// halves).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn tensor_core_paths() {
    gpu();
    // (batch, seqlen, heads, headdim, dstate, groups, chunk_size, dtype, D form, z, clamp)
    type Row = (usize, usize, usize, usize, usize, usize, usize, Dt, DForm, bool, bool);
    let case = |seed: u64, &(b, l, h, p, n, g, q, dtype, d, z, clamp): &Row| {
        let case = SsdCase {
            groups: g,
            chunk_size: q,
            dtype,
            d,
            has_z: z,
            dt_limit: if clamp { CLAMP } else { (0.0, f32::INFINITY) },
            seed,
            ..SsdCase::new(b, l, h, p, n).all_optional()
        };
        assert!(case.tensor_cores());
        case
    };
    let heads_of_64: [Row; 10] = [
        (1, 1, 1, 64, 64, 1, 64, Dt::BF16, DForm::PerHead, false, false),
        (1, 700, 2, 64, 128, 1, 128, Dt::BF16, DForm::PerChannel, false, true),
        (2, 333, 4, 64, 64, 2, 64, Dt::F16, DForm::None, false, false),
        (1, 1000, 3, 64, 128, 3, 256, Dt::F16, DForm::PerHead, false, true),
        (3, 130, 4, 64, 128, 4, 64, Dt::BF16, DForm::PerHead, true, false),
        (2, 64, 8, 64, 64, 2, 64, Dt::BF16, DForm::PerChannel, false, false),
        (1, 700, 2, 64, 64, 1, 128, Dt::F16, DForm::PerChannel, true, true),
        // 32 heads per group and 2 x 32 (batch, chunk, group) units: dB and dC through the head sums
        // (plan::mma_bwd_head_sums); every case above takes the per-head partials.
        (2, 8100, 32, 64, 128, 1, 256, Dt::BF16, DForm::PerChannel, true, false),
        // 16 (batch, head) pairs: the forward's first pass scans each part in two pieces
        // (plan::mma_fwd_split), on the wgmma kernel and on the mma.sync one.
        (2, 1087, 8, 64, 128, 2, 64, Dt::BF16, DForm::PerHead, true, false),
        (1, 1087, 16, 64, 64, 4, 128, Dt::F16, DForm::PerChannel, false, true),
    ];
    // Heads wider than 64 run as headdim / 64 heads of 64 (plan::mma_shape), their dt, A, D and dt_bias
    // repeated and the gradients of those summed back; dstates under 64, and between 64 and 128, are
    // widened.
    let other: [Row; 10] = [
        (2, 333, 2, 128, 64, 1, 64, Dt::BF16, DForm::PerHead, false, false),
        (1, 700, 4, 128, 128, 2, 128, Dt::F16, DForm::PerChannel, true, true),
        (3, 130, 3, 192, 128, 3, 64, Dt::BF16, DForm::PerHead, true, true),
        (1, 1087, 2, 256, 64, 1, 256, Dt::F16, DForm::None, false, false),
        // 16 heads of 128 a group: 32 split heads a group, dB and dC through the head sums.
        (2, 8100, 16, 128, 128, 1, 256, Dt::BF16, DForm::PerHead, true, false),
        // dstates the kernels widen with zero columns (plan::PadState): to 64, and 100 to 128.
        (2, 333, 4, 64, 16, 2, 64, Dt::BF16, DForm::PerHead, true, false),
        (1, 700, 2, 64, 1, 1, 128, Dt::F16, DForm::PerChannel, false, true),
        (3, 130, 3, 128, 32, 3, 64, Dt::BF16, DForm::None, true, true),
        (1, 1087, 16, 64, 100, 4, 128, Dt::F16, DForm::PerHead, false, false),
        (1, 1500, 8, 64, 48, 1, 256, Dt::BF16, DForm::PerChannel, true, false),
    ];
    // dstates past 128 run as two halves of 128, as twice the groups and heads (plan::StateHalves):
    // x, z, dt, dy and the per-head operands repeated, the states' halves moved to the heads, y and
    // the gradients summed back; 200 widened to 256 first; with split heads; through the head sums
    // (2 x 17 chunks x 2 halved groups, 32 heads each).
    let halves: [Row; 6] = [
        (2, 333, 4, 64, 256, 2, 64, Dt::BF16, DForm::PerHead, true, false),
        (1, 700, 2, 64, 200, 1, 128, Dt::F16, DForm::PerChannel, false, true),
        (3, 130, 3, 128, 256, 3, 64, Dt::BF16, DForm::None, true, true),
        (1, 1087, 16, 64, 256, 4, 256, Dt::BF16, DForm::PerHead, false, false),
        (1, 1, 1, 64, 129, 1, 64, Dt::F16, DForm::PerChannel, true, false),
        (2, 4100, 32, 64, 256, 1, 256, Dt::BF16, DForm::PerChannel, true, false),
    ];
    // headdims not a multiple of 64 widened to the next with zero channels (plan::PadHeads): alone,
    // then split, with a widened state, with two halves; through the head sums (32 heads a group).
    let narrow: [Row; 6] = [
        (2, 333, 4, 32, 128, 2, 64, Dt::BF16, DForm::PerChannel, true, false),
        (1, 700, 2, 48, 64, 1, 128, Dt::F16, DForm::PerHead, false, true),
        (3, 130, 3, 96, 128, 3, 64, Dt::BF16, DForm::PerChannel, true, true),
        (2, 500, 4, 40, 16, 1, 256, Dt::F16, DForm::None, false, false),
        (1, 1087, 8, 32, 256, 2, 256, Dt::BF16, DForm::PerChannel, true, false),
        (2, 8100, 32, 32, 128, 1, 256, Dt::BF16, DForm::PerHead, false, false),
    ];
    let mut cases: Vec<SsdCase> = heads_of_64.iter().enumerate().map(|(k, r)| case(700 + k as u64, r)).collect();
    cases.extend(other.iter().enumerate().map(|(k, r)| case(800 + k as u64, r)));
    cases.extend(halves.iter().enumerate().map(|(k, r)| case(900 + k as u64, r)));
    cases.extend(narrow.iter().enumerate().map(|(k, r)| case(1000 + k as u64, r)));
    roundtrip_all("tensor cores", &cases);
}

/// Chunk 0 of packed chunk states set to zero: the state before the boundary rule at step 0 is
/// never read (the backward applies the rule there), so a kernel may leave anything there.
fn packed_chunk0_zeroed(case: &SsdCase, mut out: FwdOut) -> FwdOut {
    if let Some(cs) = out.chunk_states.as_mut() {
        for (i, v) in cs.iter_mut().enumerate() {
            if (i / case.dstate).is_multiple_of(case.n_chunks()) {
                *v = 0.0;
            }
        }
    }
    out
}

/// Packed sequences (`cu_seqlens`) on CUDA: against the references, the host's results on the same
/// chunk states, and a second run (bitwise). Generic shapes (f32 and bf16, a long stream that the
/// scans split: the selective scan resets the state at the boundaries) and tensor-core shapes (the
/// forward's windows cut at the boundaries, across the sequence split's parts and pieces; the
/// backward with states on the generic path, chunk_states in T through an f32 copy in the workspace,
/// and without on the tensor-core kernels, their decays cut at the boundaries): random
/// boundaries with empty and length-1 sequences off the chunk grid, sequences a few steps long (many
/// boundaries in a tile), split heads (headdim 128), widened heads (32, 96), widened states (dstate
/// 16, 100) and states of two halves (200, 256). A workspace one byte short of the packed size is refused.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn packed_matches_host() {
    gpu();
    let stream = Stream::new();
    let mut rng = crate::common::Rng::new(0xbacc);
    let cases = [
        // (case, total steps, longest sequence)
        (
            SsdCase {
                groups: 2,
                d: DForm::PerChannel,
                dt_limit: CLAMP,
                ..SsdCase::new(1, 0, 4, 16, 16).all_optional()
            },
            3000,
            400,
        ),
        (
            SsdCase { dtype: Dt::BF16, chunk_size: 32, has_z: false, ..SsdCase::new(1, 0, 4, 8, 16).all_optional() },
            1500,
            200,
        ),
        (SsdCase { chunk_size: 256, ..SsdCase::new(1, 0, 2, 64, 128) }, 6000, 1500),
        (SsdCase { dtype: Dt::BF16, ..SsdCase::new(1, 0, 2, 64, 64).all_optional() }, 700, 150),
        (
            SsdCase {
                dtype: Dt::F16,
                chunk_size: 256,
                groups: 2,
                dt_limit: CLAMP,
                ..SsdCase::new(1, 0, 4, 64, 128).all_optional()
            },
            2000,
            600,
        ),
        (
            SsdCase {
                dtype: Dt::BF16,
                chunk_size: 128,
                d: DForm::PerChannel,
                ..SsdCase::new(1, 0, 2, 64, 128).all_optional()
            },
            900,
            300,
        ),
        (SsdCase { dtype: Dt::BF16, groups: 2, ..SsdCase::new(1, 0, 2, 128, 16).all_optional() }, 1200, 9),
        (SsdCase { dtype: Dt::F16, chunk_size: 256, ..SsdCase::new(1, 0, 3, 64, 100).all_optional() }, 5000, 2500),
        // Without states: the tensor-core backward (its decays cut at the boundaries). Split heads,
        // many boundaries a tile; mma.sync at dstate 64 with 2 groups; a widened dstate.
        (
            SsdCase {
                dtype: Dt::BF16,
                has_initial_states: false,
                dt_limit: CLAMP,
                ..SsdCase::new(1, 0, 2, 128, 128).all_optional()
            },
            1200,
            9,
        ),
        (
            SsdCase {
                dtype: Dt::F16,
                groups: 2,
                chunk_size: 128,
                d: DForm::PerChannel,
                has_initial_states: false,
                ..SsdCase::new(1, 0, 4, 64, 64).all_optional()
            },
            3000,
            700,
        ),
        (SsdCase { dtype: Dt::BF16, chunk_size: 256, ..SsdCase::new(1, 0, 2, 64, 16) }, 2500, 300),
        // Heads of 32 widened to 64 (plan::PadHeads), with states and without.
        (SsdCase { dtype: Dt::BF16, chunk_size: 64, ..SsdCase::new(1, 0, 3, 32, 64).all_optional() }, 1000, 200),
        (
            SsdCase { dtype: Dt::F16, has_initial_states: false, ..SsdCase::new(1, 0, 2, 96, 128).all_optional() },
            1500,
            40,
        ),
        // A state of two halves (plan::StateHalves): their states a row per sequence, with states
        // (the generic backward) and without.
        (SsdCase { dtype: Dt::BF16, chunk_size: 128, ..SsdCase::new(1, 0, 2, 64, 256).all_optional() }, 1500, 300),
        (
            SsdCase {
                dtype: Dt::F16,
                groups: 2,
                has_initial_states: false,
                ..SsdCase::new(1, 0, 4, 64, 200).all_optional()
            },
            2000,
            150,
        ),
    ];
    let double = |t: Tol| Tol { rel_l2: 2.0 * t.rel_l2, rel_max: 2.0 * t.rel_max };
    for (k, (case, total, longest)) in cases.into_iter().enumerate() {
        let lens = crate::ssd_packed::lengths(&mut rng, total, longest);
        let case = SsdCase { seed: 900 + k as u64, ..case };
        // dfinal_states on every other case, but not where the tensor-core backward is meant to run.
        let tensor_core_bwd = !case.has_initial_states && case.dtype != Dt::F32;
        let p = SsdProblem::packed(&case, &lens, k % 2 == 0 && !tensor_core_bwd);
        let case = &p.case;
        let got = gpu_fwd(&p, stream.ptr()).unwrap_or_else(|(c, m)| panic!("CUDA forward failed ({c}): {m}\n{case:?}"));
        let cs = got.chunk_states.clone().expect("chunk_states");
        check_fwd(case, &p.reference(), &packed_chunk0_zeroed(case, got.clone()), case.cuda_states_tol());
        let grads =
            gpu_bwd(&p, &cs, stream.ptr()).unwrap_or_else(|(c, m)| panic!("CUDA backward failed ({c}): {m}\n{case:?}"));
        check_grads(case, &p.reference_bwd(), &grads);

        let cpu = p.run_fwd_cpu(true).unwrap();
        assert_close("packed y (CUDA vs CPU)", case, &got.y, &f64s(&cpu.y), double(case.dtype.tol()));
        let f = double(case.cuda_states_tol());
        assert_close("packed final_states (CUDA vs CPU)", case, &got.final_states, &f64s(&cpu.final_states), f);
        let cpu_grads = p.run_bwd_cpu(&cs).unwrap();
        crate::ssd_packed::compare_grads(
            "CUDA vs CPU",
            case,
            &grads,
            &cpu_grads,
            double(case.dtype.tol()),
            double(grad_tol(case, "dA")),
        );

        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&gpu_fwd(&p, stream.ptr()).unwrap().y) == bits(&got.y), "two CUDA forwards differ: {case:?}");
        assert!(gpu_bwd(&p, &cs, stream.ptr()).unwrap().bits() == grads.bits(), "two CUDA backwards differ: {case:?}");

        let mut rets = p.fwd_results(true);
        rets.push(workspace("workspace", problem_bytes(&p, false) - 1));
        let short = run_device(xla_ssm_ssd_fwd_cuda, &p.operands(), &rets, &p.fwd_attrs(true), stream.ptr());
        let (code, message) = short.expect_err("a short workspace");
        assert_eq!(code, xla::ERR_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("xla_ssm_ssd_packed_fwd_workspace_bytes"), "{message}");
    }
}

/// Invalid boundaries, which the CUDA target cannot read before it runs (docs/ssd.md): negative,
/// past seqlen, decreasing, repeated. The forward (tensor-core windows, and the generic path) and the
/// backward still run to completion: every index taken from the boundaries is clamped, so nothing
/// outside the buffers is touched (compute-sanitizer's memcheck shows it, run over this test). The
/// stream stays usable: a valid call right after matches the reference.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn packed_invalid_boundaries_stay_in_bounds() {
    gpu();
    let stream = Stream::new();
    let cases = [
        SsdCase { dtype: Dt::BF16, chunk_size: 128, ..SsdCase::new(1, 0, 2, 64, 128).all_optional() },
        SsdCase { dtype: Dt::BF16, ..SsdCase::new(1, 0, 2, 64, 64).all_optional() },
        SsdCase { groups: 2, ..SsdCase::new(1, 0, 4, 16, 16).all_optional() },
    ];
    for case in cases {
        let lens = [0, 90, 1, 200, 37, 0];
        let valid = SsdProblem::packed(&case, &lens, true);
        let l = valid.case.seqlen as i32;
        for cu in [
            vec![0, -5, l + 700, 3, i32::MIN, i32::MAX, l],
            vec![l, l - 1, 64, 64, 0, 1, 0],
            vec![5, 5, 5, 5, 5, 5, 5],
            vec![0, 200, 100, 300, 50, l, l - 10],
        ] {
            let bad = SsdProblem { cu: Some(cu.clone()), ..valid.clone() };
            let got = gpu_fwd(&bad, stream.ptr()).unwrap_or_else(|(c, m)| panic!("forward, {cu:?} ({c}): {m}"));
            let cs = got.chunk_states.expect("chunk_states");
            gpu_bwd(&bad, &cs, stream.ptr()).unwrap_or_else(|(c, m)| panic!("backward, {cu:?} ({c}): {m}"));
        }
        let got = gpu_fwd(&valid, stream.ptr()).unwrap_or_else(|(c, m)| panic!("valid forward ({c}): {m}"));
        check_fwd(
            &valid.case,
            &valid.reference(),
            &packed_chunk0_zeroed(&valid.case, got),
            valid.case.cuda_states_tol(),
        );
    }
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn zero_sized_dims() {
    gpu();
    let stream = Stream::new();
    for (b, l, h, p, g) in [(0, 9, 2, 3, 1), (2, 0, 2, 3, 1), (2, 9, 0, 3, 1), (2, 9, 2, 0, 2), (2, 0, 2, 0, 1)] {
        for limit in [(0.0, f32::INFINITY), CLAMP] {
            let case =
                SsdCase { groups: g, chunk_size: 32, dt_limit: limit, ..SsdCase::new(b, l, h, p, 4).all_optional() };
            let pr = SsdProblem::random(&case, true);
            let got = gpu_fwd(&pr, stream.ptr()).unwrap();
            check_fwd(&case, &pr.reference(), &got, case.cuda_states_tol());
            let grads = gpu_bwd(&pr, got.chunk_states.as_ref().unwrap(), stream.ptr()).unwrap();
            check_grads(&case, &pr.reference_bwd(), &grads);
        }
    }
}

/// The forward with its workspace and y at `ws_offset` and `y_offset` bytes past an allocation's
/// start: y's bytes.
fn fwd_y_offset(
    case: &SsdCase,
    p: &SsdProblem,
    ws_offset: u64,
    y_offset: u64,
    stream: *mut c_void,
) -> Result<Vec<u8>, (i32, String)> {
    let bytes = fwd_bytes(case);
    let ws = DevBuf::upload(&vec![0u8; bytes as usize + 64]);
    let dargs: Vec<DevBuf> = p.operands().iter().map(|a| DevBuf::upload(&a.bytes)).collect();
    let rets = p.fwd_results(true);
    let y_len = rets[0].bytes.len();
    let y = DevBuf::upload(&vec![0u8; y_len + 64]);
    let drets: Vec<DevBuf> = rets.iter().map(|a| DevBuf::upload(&a.bytes)).collect();
    result::ctx::synchronize().unwrap();
    let mut rb: Vec<Buf> =
        rets.iter().zip(&drets).map(|(a, d)| Buf { dtype: a.dtype, dims: a.dims.clone(), data: d.data() }).collect();
    rb[0].data = (y.ptr + y_offset) as *mut c_void;
    rb.push(Buf { dtype: xla::U8, dims: vec![bytes], data: (ws.ptr + ws_offset) as *mut c_void });
    let ab: Vec<Buf> = p
        .operands()
        .iter()
        .zip(&dargs)
        .map(|(a, d)| Buf { dtype: a.dtype, dims: a.dims.clone(), data: d.data() })
        .collect();
    let mut frame = Frame::new(&ab, &rb, &p.fwd_attrs(true), stream);
    let outcome = xla::call(xla_ssm_ssd_fwd_cuda, &mut frame);
    synchronize(stream);
    outcome.map(|()| y.download()[y_offset as usize..][..y_len].to_vec())
}

/// A workspace that does not start on a 256-byte boundary works the same (the op aligns inside).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn misaligned_workspace() {
    gpu();
    let stream = Stream::new();
    let case = SsdCase { groups: 2, dtype: Dt::BF16, ..SsdCase::new(2, 100, 4, 16, 16).all_optional() };
    let p = SsdProblem::random(&case, true);
    let want = gpu_fwd(&p, stream.ptr()).unwrap();
    assert_eq!(case.dtype.decode(&fwd_y_offset(&case, &p, 4, 0, stream.ptr()).unwrap()), want.y);
}

/// The tensor-core kernels store y in 16-byte chunks (and park the tile scalars there): a y that is
/// not 16-byte aligned (a C caller's; XLA's always are) is an error, not a misaligned store that
/// would take the context down; the same call aligned runs.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn unaligned_y_is_an_error() {
    gpu();
    let stream = Stream::new();
    let case = SsdCase { dtype: Dt::BF16, ..SsdCase::new(2, 300, 3, 64, 128).all_optional() };
    let p = SsdProblem::random(&case, true);
    let (status, message) = fwd_y_offset(&case, &p, 0, 4, stream.ptr()).unwrap_err();
    assert_ne!(status, 0);
    assert!(message.contains("y 16-byte aligned"), "{message}");
    let want = gpu_fwd(&p, stream.ptr()).unwrap();
    assert_eq!(case.dtype.decode(&fwd_y_offset(&case, &p, 0, 0, stream.ptr()).unwrap()), want.y);
}

/// The C API's CUDA entry points give the handlers' bits, on the generic path (f32 chunk states)
/// and on the tensor-core one (chunk states in T).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn c_api_cuda_launch_matches_handlers() {
    gpu();
    let stream = Stream::new();
    let generic = SsdCase {
        groups: 2,
        d: DForm::PerChannel,
        dt_limit: CLAMP,
        dtype: Dt::BF16,
        ..SsdCase::new(2, 90, 4, 8, 16).all_optional()
    };
    let tensor_cores = SsdCase { dtype: Dt::BF16, ..SsdCase::new(1, 130, 2, 64, 64).all_optional() };
    for case in [generic, tensor_cores] {
        c_api_cuda_case(&case, &stream);
    }
}

fn c_api_cuda_case(case: &SsdCase, stream: &Stream) {
    let p = SsdProblem::random(case, true);
    let want_fwd = gpu_fwd(&p, stream.ptr()).unwrap();
    let cs = want_fwd.chunk_states.clone().unwrap();
    let want = gpu_bwd(&p, &cs, stream.ptr()).unwrap();

    let ops = p.bwd_operands(&cs);
    let dev: Vec<DevBuf> = ops.iter().map(|a| DevBuf::upload(&a.bytes)).collect();
    let at = |n: &str| dev[ops.iter().position(|a| a.name == n).unwrap()].data();
    let t = case.dtype;
    let y = DevBuf::upload(&t.nans(case.x_len()));
    let fin = DevBuf::upload(&Dt::F32.nans(case.state_len()));
    let cs_dt = case.chunk_states_dt();
    let cs_out = DevBuf::upload(&cs_dt.nans(case.chunk_len()));
    let wsf = DevBuf::upload(&vec![0xffu8; fwd_bytes(case) as usize]);
    result::ctx::synchronize().unwrap();
    let [batch, seqlen, heads, headdim, dstate, groups, chunk_size] = case.capi_sizes();
    let fwd_args = XlaSsmSsdFwdArgs {
        batch,
        seqlen,
        heads,
        headdim,
        dstate,
        groups,
        chunk_size,
        dtype: t.capi(),
        d_per_channel: case.d == DForm::PerChannel,
        dt_softplus: case.softplus,
        dt_min: case.dt_limit.0,
        dt_max: case.dt_limit.1,
        x: at("x"),
        dt: at("dt"),
        a: at("A") as *const f32,
        b: at("B"),
        c: at("C"),
        d: at("D") as *const f32,
        z: at("z"),
        dt_bias: at("dt_bias") as *const f32,
        initial_states: at("initial_states") as *const f32,
        y: y.data(),
        final_states: fin.data() as *mut f32,
        chunk_states: cs_out.data(),
        chunk_states_dtype: cs_dt.capi(),
        workspace: wsf.data(),
        workspace_bytes: wsf.len as i64,
        cu_seqlens: std::ptr::null(),
        num_seqs: 0,
    };
    // SAFETY: device arrays of the sizes the struct describes.
    assert_eq!(unsafe { xla_ssm_ssd_fwd_cuda_launch(&fwd_args, stream.ptr()) }, XLA_SSM_OK);
    synchronize(stream.ptr());
    assert_eq!(t.decode(&y.download()), want_fwd.y);
    assert_eq!(cs_dt.decode(&cs_out.download()), cs, "{case:?}");

    let grads: Vec<(Arr, DevBuf)> = p
        .bwd_results()
        .into_iter()
        .map(|a| {
            let d = DevBuf::upload(&a.bytes);
            (a, d)
        })
        .collect();
    let g = |n: &str| grads.iter().find(|(a, _)| a.name == n).unwrap().1.data();
    let wsb = DevBuf::upload(&vec![0xffu8; bwd_bytes(case) as usize]);
    result::ctx::synchronize().unwrap();
    let bwd_args = XlaSsmSsdBwdArgs {
        batch,
        seqlen,
        heads,
        headdim,
        dstate,
        groups,
        chunk_size,
        dtype: t.capi(),
        d_per_channel: case.d == DForm::PerChannel,
        dt_softplus: case.softplus,
        dt_min: case.dt_limit.0,
        dt_max: case.dt_limit.1,
        x: at("x"),
        dt: at("dt"),
        a: at("A") as *const f32,
        b: at("B"),
        c: at("C"),
        d: at("D") as *const f32,
        z: at("z"),
        dt_bias: at("dt_bias") as *const f32,
        initial_states: at("initial_states") as *const f32,
        chunk_states: at("chunk_states"),
        chunk_states_dtype: cs_dt.capi(),
        dy: at("dy"),
        dfinal_states: at("dfinal_states") as *const f32,
        dx: g("dx"),
        ddt: g("ddt"),
        da: g("dA") as *mut f32,
        db: g("dB"),
        dc: g("dC"),
        dd: g("dD") as *mut f32,
        dz: g("dz"),
        ddt_bias: g("ddt_bias") as *mut f32,
        dinitial_states: g("dinitial_states") as *mut f32,
        workspace: wsb.data(),
        workspace_bytes: wsb.len as i64,
        cu_seqlens: std::ptr::null(),
        num_seqs: 0,
    };
    // SAFETY: as above.
    assert_eq!(unsafe { xla_ssm_ssd_bwd_cuda_launch(&bwd_args, stream.ptr()) }, XLA_SSM_OK);
    synchronize(stream.ptr());
    let rets: Vec<Arr> = grads.iter().map(|(a, _)| a.clone()).collect();
    let out: Vec<Vec<u8>> = grads.iter().map(|(_, d)| d.download()).collect();
    assert!(Grads::decode(&rets, &out).bits() == want.bits(), "C API backward differs from the handler: {case:?}");

    // Too small a workspace, or chunk_states declared in another dtype: refused, nothing launched.
    let small = XlaSsmSsdBwdArgs { workspace_bytes: wsb.len as i64 - 1, ..bwd_args };
    assert_eq!(unsafe { xla_ssm_ssd_bwd_cuda_launch(&small, stream.ptr()) }, XLA_SSM_INVALID_ARGUMENT);
    let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
    assert!(msg.starts_with("ssd_bwd") && msg.contains("`workspace`"), "{msg}");
    let other = if cs_dt == Dt::F32 { t } else { Dt::F32 };
    let wrong = XlaSsmSsdFwdArgs { chunk_states_dtype: other.capi(), ..fwd_args };
    assert_eq!(unsafe { xla_ssm_ssd_fwd_cuda_launch(&wrong, stream.ptr()) }, XLA_SSM_INVALID_ARGUMENT);
    let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
    assert!(msg.starts_with("ssd_fwd") && msg.contains("`chunk_states`"), "{msg}");
}
