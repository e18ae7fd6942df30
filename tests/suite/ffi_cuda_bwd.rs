//! The backward pass on the GPU: the CUDA forward's checkpoints against the reference states, and
//! the CUDA backward (`xla_ssm_selective_scan_bwd_cuda`, real call frames, device buffers, a real
//! CUstream; and the C API `xla_ssm_selective_scan_bwd_cuda_launch`) against the CPU target over a
//! matrix of shapes, and against the f64 reference on the small ones; run twice, bitwise equal.
//! `#[ignore]`d: they need a device (scripts/gpu-run.sh runs them).
#![cfg(feature = "cuda")]

use crate::common::cuda::*;
use crate::common::xla::{self, Buf, Frame};
use crate::common::*;
use cudarc::driver::result;
use std::ffi::c_void;
use xla_ssm::capi::{
    xla_ssm_last_error, xla_ssm_selective_scan_bwd_cuda_launch, xla_ssm_selective_scan_bwd_workspace_bytes,
    xla_ssm_selective_scan_fwd_cuda_launch, xla_ssm_selective_scan_fwd_workspace_bytes, XlaSsmSelectiveScanBwdArgs,
    XlaSsmSelectiveScanFwdArgs, XLA_SSM_OK,
};
use xla_ssm::xla::handlers::{xla_ssm_selective_scan_bwd_cuda, xla_ssm_selective_scan_fwd_cuda};

/// Device copies of operands and (poisoned) results.
struct DeviceCall {
    args: Vec<(Operand, DevBuf)>,
    rets: Vec<(Operand, DevBuf)>,
}

impl DeviceCall {
    fn new(args: Vec<Operand>, rets: Vec<Operand>) -> DeviceCall {
        let own = |ops: Vec<Operand>| -> Vec<(Operand, DevBuf)> {
            ops.into_iter()
                .map(|o| {
                    let buf = DevBuf::upload(&o.bytes);
                    (o, buf)
                })
                .collect()
        };
        let call = DeviceCall { args: own(args), rets: own(rets) };
        // The synchronous copies are complete before any stream (non-blocking ones too) reads them.
        result::ctx::synchronize().expect("cuCtxSynchronize");
        call
    }

    fn bufs(list: &[(Operand, DevBuf)]) -> Vec<Buf> {
        list.iter().map(|(o, d)| Buf { dtype: o.dtype, dims: o.dims.clone(), data: d.data() }).collect()
    }

    fn run(
        &self,
        handler: xla::Handler,
        attrs: &[(&'static str, xla::Attr)],
        stream: *mut c_void,
    ) -> Result<(), (i32, String)> {
        let (args, rets) = (Self::bufs(&self.args), Self::bufs(&self.rets));
        let mut frame = Frame::new(&args, &rets, attrs, stream);
        let result = xla::call(handler, &mut frame);
        synchronize(stream);
        result
    }

    fn ret(&self, name: &str) -> &DevBuf {
        &self.rets.iter().find(|(o, _)| o.name == name).unwrap().1
    }

    fn arg(&self, name: &str) -> *mut c_void {
        self.args.iter().find(|(o, _)| o.name == name).map_or(std::ptr::null_mut(), |(_, d)| d.data())
    }

    /// The backward's gradients (results other than the workspace), as f32.
    fn grads(&self, bp: &BwdProblem) -> Grads<f32> {
        let bytes: Vec<(&str, i32, Vec<u8>)> = self
            .rets
            .iter()
            .filter(|(o, _)| o.name != "workspace")
            .map(|(o, d)| (o.name, o.dtype, d.download()))
            .collect();
        let rets: Vec<(&str, i32, &[u8])> = bytes.iter().map(|(n, t, b)| (*n, *t, &b[..])).collect();
        bp.decode_grads(&rets)
    }
}

fn u8_operand(name: &'static str, bytes: i64, fill: u8) -> Operand {
    Operand { name, dtype: xla::U8, dims: vec![bytes], bytes: vec![fill; bytes as usize] }
}

/// The CUDA forward with checkpoints (and the forward's split workspace when `split` and the shape
/// has one): the checkpoints.
fn gpu_checkpoints(bp: &BwdProblem, split: bool, stream: *mut c_void) -> Vec<f32> {
    let c = bp.case();
    let mut rets = bp.poisoned_fwd_results();
    let ws = xla_ssm_selective_scan_fwd_workspace_bytes(c.batch as i64, c.dim as i64, c.seqlen as i64, c.dstate as i64);
    if split && ws > 0 {
        rets.push(u8_operand("workspace", ws, 0xff));
    }
    let call = DeviceCall::new(bp.p.operands(), rets);
    call.run(xla_ssm_selective_scan_fwd_cuda, &bp.fwd_attrs(), stream)
        .unwrap_or_else(|(code, msg)| panic!("CUDA forward failed ({code}): {msg}\ncase: {c:?}"));
    Dt::F32.decode(&call.ret("checkpoints").download())
}

fn bwd_workspace_bytes(c: &Case) -> i64 {
    xla_ssm_selective_scan_bwd_workspace_bytes(
        c.batch as i64,
        c.dim as i64,
        c.seqlen as i64,
        c.dstate as i64,
        c.groups as i64,
    )
}

/// The CUDA backward with these checkpoints and a workspace poisoned with 0xff bytes.
fn gpu_bwd(bp: &BwdProblem, checkpoints: &[f32], stream: *mut c_void) -> Result<Grads<f32>, (i32, String)> {
    let mut rets = bp.poisoned_grads();
    rets.push(u8_operand("workspace", bwd_workspace_bytes(bp.case()), 0xff));
    let call = DeviceCall::new(bp.bwd_operands(checkpoints), rets);
    call.run(xla_ssm_selective_scan_bwd_cuda, &bp.bwd_attrs(), stream)?;
    Ok(call.grads(bp))
}

/// Twice the tolerance of a gradient against the reference: both targets err.
fn check_against_cpu(bp: &BwdProblem, cpu: &Grads<f32>, gpu: &Grads<f32>) -> Errors {
    let c = bp.case();
    let f64s = |v: &Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let opt = |v: &Option<Vec<f32>>| v.as_ref().map(f64s);
    let want = Grads {
        du: f64s(&cpu.du),
        ddelta: f64s(&cpu.ddelta),
        da: f64s(&cpu.da),
        db: f64s(&cpu.db),
        dc: f64s(&cpu.dc),
        dd: opt(&cpu.dd),
        dz: opt(&cpu.dz),
        ddelta_bias: opt(&cpu.ddelta_bias),
        dinitial_state: opt(&cpu.dinitial_state),
    };
    let double = |t: Tol| Tol { rel_l2: 2.0 * t.rel_l2, rel_max: 2.0 * t.rel_max };
    let mut worst = Errors { rel_l2: 0.0, rel_max: 0.0 };
    let mut check = |name: &str, got: &[f32], want: &[f64], dtype: Dt| {
        let e = assert_close(&format!("{name} (CUDA vs CPU)"), c, got, want, double(grad_tol(dtype)));
        worst = Errors { rel_l2: worst.rel_l2.max(e.rel_l2), rel_max: worst.rel_max.max(e.rel_max) };
    };
    check("du", &gpu.du, &want.du, c.dtype);
    check("ddelta", &gpu.ddelta, &want.ddelta, c.dtype);
    check("dA", &gpu.da, &want.da, Dt::F32);
    check("dB", &gpu.db, &want.db, c.bc_dtype);
    check("dC", &gpu.dc, &want.dc, c.bc_dtype);
    for (name, got, want, dtype) in [
        ("dD", &gpu.dd, &want.dd, Dt::F32),
        ("dz", &gpu.dz, &want.dz, c.dtype),
        ("ddelta_bias", &gpu.ddelta_bias, &want.ddelta_bias, Dt::F32),
        ("dinitial_state", &gpu.dinitial_state, &want.dinitial_state, Dt::F32),
    ] {
        match (got, want) {
            (Some(g), Some(w)) => check(name, g, w, dtype),
            (None, None) => {}
            _ => panic!("{name}: present in one target only; case {c:?}"),
        }
    }
    worst
}

/// The CUDA forward's checkpoints (checked against the reference states when `exact`, else against
/// the CPU forward's), then the CUDA backward against the CPU backward on the same checkpoints (and
/// against the reference when `exact`), run twice with identical bits.
fn roundtrip(bp: &BwdProblem, exact: bool, stream: *mut c_void) -> Errors {
    let c = bp.case();
    let checkpoints = gpu_checkpoints(bp, true, stream);
    if exact {
        assert_close("checkpoints (CUDA)", c, &checkpoints, &bp.reference_checkpoints(), Tol::F32);
    } else {
        let (_, _, cpu) = bp.run_fwd_cpu().unwrap();
        let cpu: Vec<f64> = cpu.iter().map(|&x| x as f64).collect();
        assert_close("checkpoints (CUDA vs CPU)", c, &checkpoints, &cpu, Tol { rel_l2: 1e-4, rel_max: 2e-4 });
    }
    let gpu = gpu_bwd(bp, &checkpoints, stream)
        .unwrap_or_else(|(code, msg)| panic!("CUDA backward failed ({code}): {msg}\ncase: {c:?}"));
    let again = gpu_bwd(bp, &checkpoints, stream).unwrap();
    assert!(gpu.bits() == again.bits(), "two runs of the CUDA backward differ; case {c:?}");
    let cpu = bp.run_bwd_cpu(&checkpoints).unwrap();
    if exact {
        check_grads(bp, &bp.reference(), &gpu);
    }
    check_against_cpu(bp, &cpu, &gpu)
}

fn roundtrip_all(what: &str, cases: &[(Case, usize, bool)], exact: bool) {
    let stream = Stream::new();
    let mut worst = Errors { rel_l2: 0.0, rel_max: 0.0 };
    for (case, len, dfinal) in cases {
        let e = roundtrip(&BwdProblem::random(case, *len, *dfinal), exact, stream.ptr());
        worst = Errors { rel_l2: worst.rel_l2.max(e.rel_l2), rel_max: worst.rel_max.max(e.rel_max) };
    }
    println!(
        "{what}: {} cases ok; worst CUDA vs CPU gradient rel L2 / max errors: {:.1e} / {:.1e}",
        cases.len(),
        worst.rel_l2,
        worst.rel_max
    );
}

const LAYOUTS: [Layout; 2] = [Layout::Bdl, Layout::Bld];
const DTYPES: [(Dt, Dt); 5] =
    [(Dt::F32, Dt::F32), (Dt::BF16, Dt::BF16), (Dt::BF16, Dt::F32), (Dt::F16, Dt::F16), (Dt::F16, Dt::F32)];

/// Small cases of every kind: odd seqlens, seqlen below checkpoint_len, groups narrower and wider
/// than a block, time-invariant B/C, dstate 1..256, partial channel tiles, every optional operand
/// and dtype, checkpoint_len 32..256; seqlens and channel counts that take the kernel's 16-byte
/// vector staging and ones that take its element-wise staging.
fn matrix() -> Vec<(Case, usize, bool)> {
    let mut cases = Vec::new();
    let mut i = 0usize;
    for seqlen in [1, 7, 32, 33, 100, 129, 300] {
        for layout in LAYOUTS {
            for (dim, dstate, groups) in [
                (72, 3, 2),
                (200, 16, 1),
                (130, 16, 0),
                (64, 64, 4),
                (40, 256, 2),
                (256, 16, 2),
                (8, 16, 8),
                // The forward's tiled kernel at 16 and 32 threads per channel writes the checkpoints.
                (64, 128, 2),
                (32, 256, 2),
            ] {
                i += 1;
                let (dtype, bc_dtype) = DTYPES[i % DTYPES.len()];
                let case = Case {
                    layout,
                    groups,
                    dtype,
                    bc_dtype,
                    has_d: i.is_multiple_of(2),
                    has_z: i.is_multiple_of(3),
                    has_delta_bias: i % 4 < 2,
                    has_initial_state: i % 5 < 3,
                    softplus: !i.is_multiple_of(7),
                    seed: i as u64,
                    ..Case::new(2, dim, seqlen, dstate)
                };
                cases.push((case, [32, 64, 96, 128, 256][i % 5], !i.is_multiple_of(3)));
            }
        }
    }
    for bits in 0u32..32 {
        let on = |k: u32| bits & (1 << k) != 0;
        let case = Case {
            layout: LAYOUTS[(bits.count_ones() % 2) as usize],
            groups: [1, 0][(bits % 2) as usize],
            has_d: on(0),
            has_z: on(1),
            has_delta_bias: on(2),
            has_initial_state: on(3),
            softplus: on(4),
            seed: bits as u64,
            ..Case::new(2, 136, 70, 16)
        };
        cases.push((case, 32, bits % 3 == 0));
    }
    cases
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn roundtrip_matrix() {
    gpu();
    roundtrip_all("bwd matrix", &matrix(), true);
}

/// The matrix with the forward's tiled kernel at one thread a channel wherever dstate <= 16 (the
/// library takes it on large grids only), so that its checkpoints are checked too.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn matrix_forward_tiled1() {
    gpu();
    rerun_with_env("XLA_SSM_FWD_KERNEL", "tiled1", module_path!(), &["roundtrip_matrix", "misaligned_checkpoints"]);
}

/// Checkpoints one float past a 16-byte boundary (the C API takes any f32 address): the forward
/// stores them element by element instead of as 16-byte rows, with the same bits.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn misaligned_checkpoints() {
    gpu();
    let stream = Stream::new();
    for case in [
        Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 136, 100, 16).all_optional() },
        Case { layout: Layout::Bld, ..Case::new(1, 64, 96, 32).all_optional() },
    ] {
        let bp = BwdProblem::random(&case, 32, true);
        let want = gpu_checkpoints(&bp, false, stream.ptr());
        let call = DeviceCall::new(bp.p.operands(), bp.poisoned_fwd_results());
        let shifted = DevBuf::upload(&Dt::F32.nans(want.len() + 1));
        let args = XlaSsmSelectiveScanFwdArgs {
            checkpoint_len: bp.checkpoint_len as i64,
            // SAFETY: one float into a buffer of one float more than the checkpoints.
            checkpoints: unsafe { shifted.data().cast::<f32>().add(1) },
            ..case.fwd_capi_args(
                |name| call.arg(name),
                call.ret("out").data(),
                call.ret("final_state").data() as *mut f32,
            )
        };
        // SAFETY: device buffers of the described sizes, on this context.
        let status = unsafe { xla_ssm_selective_scan_fwd_cuda_launch(&args, stream.ptr()) };
        assert_eq!(status, XLA_SSM_OK, "{case:?}");
        synchronize(stream.ptr());
        let got = Dt::F32.decode(&shifted.download()[4..]);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "checkpoints differ; case {case:?}");
    }
}

/// Training-sized shapes, against the CPU target (the f64 reference would take too long).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn large_cases() {
    gpu();
    let mut cases = Vec::new();
    for (dtype, bc_dtype) in [(Dt::BF16, Dt::BF16), (Dt::F32, Dt::F32)] {
        for layout in LAYOUTS {
            let base = Case { dtype, bc_dtype, layout, ..Case::new(2, 1024, 2048, 16).all_optional() };
            cases.push((base.clone(), 128, true));
            cases.push((Case { groups: 0, ..base.clone() }, 256, false));
            cases.push((Case { groups: 4, batch: 1, seqlen: 1000, ..base }, 64, true));
        }
    }
    cases.push((Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 256, 4096, 64).all_optional() }, 512, true));
    // The JAX package's checkpoint_len (32) with 2-byte inputs: the backward copies its next tile ahead.
    cases.push((Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 1024, 2048, 16).all_optional() }, 32, true));
    roundtrip_all("bwd large", &cases, false);
}

/// More than 65535 channels (state-spaces/mamba #505), against the CPU target.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn channels_past_65535() {
    gpu();
    let case = Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 100_000, 64, 16).all_optional() };
    roundtrip_all(
        "bwd 100k channels",
        &[(case.clone(), 32, true), (Case { layout: Layout::Bld, ..case }, 64, false)],
        false,
    );
}

/// Zero-sized dimensions do nothing but write the gradients they define (zeros, or dfinal_state
/// for dinitial_state when seqlen is 0).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn zero_sizes() {
    gpu();
    let stream = Stream::new();
    for (shape, groups) in
        [((2, 4, 0, 3), 1), ((2, 4, 0, 3), 0), ((0, 4, 9, 3), 0), ((2, 0, 9, 3), 1), ((2, 4, 9, 0), 1)]
    {
        let (batch, dim, seqlen, dstate) = shape;
        let case = Case { groups, ..Case::new(batch, dim, seqlen, dstate).all_optional() };
        let bp = BwdProblem::random(&case, 32, true);
        let checkpoints = gpu_checkpoints(&bp, false, stream.ptr());
        let gpu = gpu_bwd(&bp, &checkpoints, stream.ptr()).unwrap();
        check_grads(&bp, &bp.reference(), &gpu);
    }
}

/// Without a workspace, or with one too small, the CUDA backward refuses (INVALID_ARGUMENT naming
/// `workspace` and the bytes it needs) and writes nothing.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn workspace_required() {
    gpu();
    let stream = Stream::new();
    let bp = BwdProblem::random(&Case::new(2, 64, 100, 16).all_optional(), 32, true);
    let checkpoints = vec![0f32; bp.checkpoint_dims().iter().product::<i64>() as usize];
    let needed = bwd_workspace_bytes(bp.case());
    assert!(needed > 0);
    for workspace in [None, Some(needed - 4)] {
        let mut rets = bp.poisoned_grads();
        if let Some(bytes) = workspace {
            rets.push(u8_operand("workspace", bytes, 0));
        }
        let call = DeviceCall::new(bp.bwd_operands(&checkpoints), rets);
        let (code, msg) = call.run(xla_ssm_selective_scan_bwd_cuda, &bp.bwd_attrs(), stream.ptr()).unwrap_err();
        assert_eq!(code, xla::ERR_INVALID_ARGUMENT, "{msg}");
        assert!(msg.contains("`workspace`") && msg.contains(&needed.to_string()), "{msg}");
        let du = bp.case().dtype.decode(&call.ret("du").download());
        assert!(du.iter().all(|x| x.is_nan()), "du written by a failed call");
    }
}

/// The C API's device entry point gives the XLA handler's bits.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn c_api_cuda_launch() {
    gpu();
    let stream = Stream::new();
    for case in [
        Case::new(2, 136, 100, 16).all_optional(),
        Case { groups: 0, layout: Layout::Bld, dtype: Dt::BF16, bc_dtype: Dt::F32, ..Case::new(2, 64, 77, 5) },
    ] {
        let bp = BwdProblem::random(&case, 64, case.has_d);
        let checkpoints = gpu_checkpoints(&bp, false, stream.ptr());
        let want = gpu_bwd(&bp, &checkpoints, stream.ptr()).unwrap();
        let mut rets = bp.poisoned_grads();
        let bytes = bwd_workspace_bytes(&case);
        rets.push(u8_operand("workspace", bytes, 0xff));
        let call = DeviceCall::new(bp.bwd_operands(&checkpoints), rets);
        let grad =
            |name: &str| call.rets.iter().find(|(o, _)| o.name == name).map_or(std::ptr::null_mut(), |(_, d)| d.data());
        let args = XlaSsmSelectiveScanBwdArgs {
            cu_seqlens: std::ptr::null(),
            num_seqs: 0,
            batch: case.batch as i64,
            dim: case.dim as i64,
            seqlen: case.seqlen as i64,
            dstate: case.dstate as i64,
            groups: case.groups as i64,
            dtype: case.dtype.capi(),
            bc_dtype: case.bc_dtype.capi(),
            layout: case.layout.capi(),
            delta_softplus: case.softplus,
            u: call.arg("u"),
            delta: call.arg("delta"),
            a: call.arg("A") as *const f32,
            b: call.arg("B"),
            c: call.arg("C"),
            d: call.arg("D") as *const f32,
            z: call.arg("z"),
            delta_bias: call.arg("delta_bias") as *const f32,
            initial_state: call.arg("initial_state") as *const f32,
            checkpoint_len: bp.checkpoint_len as i64,
            checkpoints: call.arg("checkpoints") as *const f32,
            dout: call.arg("dout"),
            dfinal_state: call.arg("dfinal_state") as *const f32,
            du: grad("du"),
            ddelta: grad("ddelta"),
            da: grad("dA") as *mut f32,
            db: grad("dB"),
            dc: grad("dC"),
            dd: grad("dD") as *mut f32,
            dz: grad("dz"),
            ddelta_bias: grad("ddelta_bias") as *mut f32,
            dinitial_state: grad("dinitial_state") as *mut f32,
            workspace: grad("workspace"),
            workspace_bytes: bytes,
        };
        // SAFETY: device buffers of the described sizes, on this context.
        let status = unsafe { xla_ssm_selective_scan_bwd_cuda_launch(&args, stream.ptr()) };
        // SAFETY: a NUL-terminated string owned by the library.
        let err = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
        assert_eq!(status, XLA_SSM_OK, "{err}");
        synchronize(stream.ptr());
        let got = call.grads(&bp);
        assert!(got.bits() == want.bits(), "C API and XLA handler differ; case {case:?}");
    }
}
