//! Round trips on the GPU through the exported CUDA handler `xla_ssm_selective_scan_fwd_cuda` (real
//! call frames, device buffers, a real CUstream) and the C API `xla_ssm_selective_scan_fwd_cuda_launch`,
//! compared with the f64 reference. `#[ignore]`d: they need a device (scripts/gpu-run.sh runs them).
//!
//! The library picks between two kernels (`tiled`, `lanes`; see src/cuda/selective_scan.rs);
//! `matrix_forced_tiled` / `matrix_forced_lanes` / `matrix_forced_tiled1` rerun the round-trip tests
//! in a child process with `XLA_SSM_FWD_KERNEL` set, so that every kernel (and the tiled one at one
//! thread a channel) sees every case it supports.
#![cfg(feature = "cuda")]

use crate::common::cuda::*;
use crate::common::xla::{self, Buf, Frame};
use crate::common::*;
use cudarc::driver::{result, sys};
use std::ffi::c_void;
use xla_ssm::xla::handlers::xla_ssm_selective_scan_fwd_cuda as cuda_handler;

/// Device copies of a problem's operands and (NaN-poisoned) results.
struct DeviceCall {
    args: Vec<(Operand, DevBuf)>,
    rets: Vec<(Operand, DevBuf)>,
}

impl DeviceCall {
    fn new(p: &Problem) -> DeviceCall {
        let own = |o: Operand| {
            let buf = DevBuf::upload(&o.bytes);
            (o, buf)
        };
        let call = DeviceCall {
            args: p.operands().into_iter().map(own).collect(),
            rets: p.poisoned_results().into_iter().map(own).collect(),
        };
        // The synchronous copies are complete before any stream (non-blocking ones too) reads them.
        result::ctx::synchronize().expect("cuCtxSynchronize");
        call
    }

    fn arg_bufs(&self) -> Vec<Buf> {
        self.args.iter().map(|(o, d)| Buf { dtype: o.dtype, dims: o.dims.clone(), data: d.data() }).collect()
    }

    fn ret_bufs(&self) -> Vec<Buf> {
        self.rets.iter().map(|(o, d)| Buf { dtype: o.dtype, dims: o.dims.clone(), data: d.data() }).collect()
    }

    fn poison(&self) {
        for (o, d) in &self.rets {
            d.overwrite(&o.bytes);
        }
        result::ctx::synchronize().expect("cuCtxSynchronize");
    }

    fn outputs(&self, case: &Case) -> (Vec<f32>, Vec<f32>) {
        (case.dtype.decode(&self.rets[0].1.download()), Dt::F32.decode(&self.rets[1].1.download()))
    }

    /// The C API's argument struct for this call.
    fn capi_args(&self, p: &Problem) -> xla_ssm::capi::XlaSsmSelectiveScanFwdArgs {
        let find =
            |name: &str| self.args.iter().find(|(o, _)| o.name == name).map_or(std::ptr::null_mut(), |(_, d)| d.data());
        p.case.fwd_capi_args(find, self.rets[0].1.data(), self.rets[1].1.data() as *mut f32)
    }
}

/// Runs `p` through the CUDA handler on `stream` (null: the legacy default stream).
fn run_gpu(p: &Problem, stream: *mut c_void) -> Result<(Vec<f32>, Vec<f32>), (i32, String)> {
    let call = DeviceCall::new(p);
    let (args, rets) = (call.arg_bufs(), call.ret_bufs());
    let mut frame = Frame::new(&args, &rets, &p.attrs(), stream);
    xla::call(cuda_handler, &mut frame)?;
    synchronize(stream);
    Ok(call.outputs(&p.case))
}

fn roundtrip(case: &Case, stream: *mut c_void) -> (Errors, Errors) {
    let p = Problem::random(case);
    let r = p.reference();
    let (out, state) =
        run_gpu(&p, stream).unwrap_or_else(|(code, msg)| panic!("handler failed ({code}): {msg}\ncase: {case:?}"));
    check_outputs(&p, &r, &out, &state)
}

fn roundtrip_all(what: &str, cases: &[Case]) {
    let stream = Stream::new();
    let mut worst = Worst::default();
    for case in cases {
        let (o, s) = roundtrip(case, stream.ptr());
        worst.add(case, o, s);
    }
    let kernel = std::env::var("XLA_SSM_FWD_KERNEL").unwrap_or_else(|_| "auto".into());
    println!("{} (kernel choice: {kernel})", worst.summary(what));
}

const LAYOUTS: [Layout; 2] = [Layout::Bdl, Layout::Bld];

/// Every kind of case, small: odd seqlens, dims that leave a partial tile of channels, dstate 1..256,
/// groups (including ones the tiled kernel takes: one group per tile of channels), both layouts, every
/// optional operand, all dtypes. Many have the contiguous axis (seqlen for "bdl", dim for "bld") a
/// multiple of 8 but not of the tile length, so the tiled kernel (which wants 16-byte rows) takes
/// them, with a partial last tile, when forced.
fn matrix() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut i = 0u64;
    for seqlen in [1, 7, 8, 33, 64, 100, 127, 136, 300] {
        for layout in LAYOUTS {
            for (dim, dstate, groups) in [
                (200, 1, 1),
                (72, 3, 2),
                (200, 16, 1),
                (130, 16, 0),
                (136, 16, 0),
                (64, 64, 4),
                (40, 256, 2),
                (256, 16, 2),
            ] {
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
                    ..Case::new(2, dim, seqlen, dstate)
                });
            }
        }
    }
    for dstate in [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 64, 100, 255, 256] {
        for layout in LAYOUTS {
            cases.push(Case { layout, seed: dstate as u64, ..Case::new(2, 136, 24, dstate).all_optional() });
        }
    }
    for bits in 0u32..32 {
        let on = |k: u32| bits & (1 << k) != 0;
        cases.push(Case {
            layout: LAYOUTS[(bits.count_ones() % 2) as usize],
            groups: [1, 0][(bits % 2) as usize],
            has_d: on(0),
            has_z: on(1),
            has_delta_bias: on(2),
            has_initial_state: on(3),
            softplus: on(4),
            seed: bits as u64,
            ..Case::new(2, 136, 40, 16)
        });
    }
    for dtype in [Dt::F32, Dt::BF16, Dt::F16] {
        let bc_dtypes: &[Dt] = if dtype == Dt::F32 { &[Dt::F32] } else { &[Dt::F32, dtype] };
        for &bc_dtype in bc_dtypes {
            for layout in LAYOUTS {
                for (groups, dstate) in [(1, 16), (0, 16), (2, 64), (1, 5)] {
                    for all in [false, true] {
                        let base = Case {
                            dtype,
                            bc_dtype,
                            layout,
                            groups,
                            seed: groups as u64,
                            ..Case::new(2, 200, 104, dstate)
                        };
                        cases.push(if all { base.all_optional() } else { base });
                    }
                }
            }
        }
    }
    // Long scans with small dt: a bias in exp(dt * A) near 0 would accumulate over the sequence.
    for (layout, groups) in [(Layout::Bdl, 1), (Layout::Bld, 0)] {
        cases.push(Case { layout, groups, dt_range: (1e-3, 1e-2), ..Case::new(1, 136, 2048, 16).all_optional() });
    }
    // Small dt (Mamba's dt_min is 1e-3), where softplus must keep f32 accuracy.
    for (layout, groups, softplus) in [(Layout::Bdl, 1, true), (Layout::Bld, 0, true), (Layout::Bdl, 1, false)] {
        let base = Case { layout, groups, softplus, dt_range: (1e-4, 1e-2), ..Case::new(2, 200, 104, 16) };
        cases.push(base.clone());
        cases.push(base.all_optional());
    }
    for (groups, dim) in [(1, 384), (3, 384), (2, 256), (4, 512), (8, 64), (64, 64)] {
        for layout in LAYOUTS {
            cases.push(Case { groups, layout, ..Case::new(2, dim, 19, 16).all_optional() });
        }
    }
    cases
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn roundtrip_matrix() {
    gpu();
    roundtrip_all("matrix", &matrix());
}

/// The tests that a forced kernel choice reruns.
const FORCED_TESTS: [&str; 8] = [
    "roundtrip_matrix",
    "tiny_dt_f32",
    "large_cases",
    "zero_sizes",
    "extreme_values",
    "legacy_default_stream",
    "cuda_graph_capture",
    "c_api_cuda_launch",
];

/// Reruns [`FORCED_TESTS`] in a child process with `XLA_SSM_FWD_KERNEL=kernel`.
fn forced(kernel: &str) {
    gpu();
    rerun_with_env("XLA_SSM_FWD_KERNEL", kernel, module_path!(), &FORCED_TESTS);
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn matrix_forced_tiled() {
    forced("tiled");
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn matrix_forced_lanes() {
    forced("lanes");
}

/// The tiled kernel at one thread a channel (dstate <= 16), which the library takes on large grids
/// only; forced, it also runs the sequence split's first pass.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn matrix_forced_tiled1() {
    forced("tiled1");
}

/// Larger problems (the reference runs on all cores).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn large_cases() {
    gpu();
    roundtrip_all(
        "large",
        &[
            Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 512, 1000, 16).all_optional() },
            Case { layout: Layout::Bld, ..Case::new(2, 512, 1000, 16).all_optional() },
            Case { groups: 4, ..Case::new(2, 512, 1000, 256).all_optional() },
            Case {
                dtype: Dt::F16,
                bc_dtype: Dt::F32,
                layout: Layout::Bld,
                ..Case::new(2, 512, 1000, 256).all_optional()
            },
            // Enough 64-channel tiles to fill an H100: the automatic choice takes the tiled kernel.
            Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(8, 4096, 128, 16).all_optional() },
            Case { dtype: Dt::BF16, layout: Layout::Bld, groups: 0, ..Case::new(8, 4096, 128, 16).all_optional() },
            // The tiled kernel at 4 and 8 threads per channel (dstate 17..32, 33..64), partial ones too.
            Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 512, 1000, 64).all_optional() },
            Case { layout: Layout::Bld, ..Case::new(2, 512, 1000, 32).all_optional() },
            Case { dtype: Dt::F16, bc_dtype: Dt::F16, groups: 2, ..Case::new(2, 256, 512, 40).all_optional() },
            Case { layout: Layout::Bld, groups: 0, ..Case::new(2, 192, 256, 20).all_optional() },
            // 16 and 32 threads per channel (dstate 65..128, 129..256): 32- and 16-channel tiles.
            Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 512, 1000, 128).all_optional() },
            Case { dtype: Dt::BF16, layout: Layout::Bld, groups: 4, ..Case::new(2, 256, 504, 96).all_optional() },
            Case { dtype: Dt::F16, bc_dtype: Dt::F16, groups: 0, ..Case::new(1, 80, 256, 256).all_optional() },
            // Channel-last 2-byte B/C of a dstate that is no whole number of 16-byte vectors.
            Case {
                dtype: Dt::BF16,
                bc_dtype: Dt::BF16,
                layout: Layout::Bld,
                ..Case::new(2, 256, 256, 100).all_optional()
            },
        ],
    );
}

/// More than 65535 channels (state-spaces/mamba #505: the official forward puts channels on a grid
/// axis limited to 65535), in both layouts, against the f64 reference.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn channels_past_65535() {
    gpu();
    roundtrip_all(
        "100k channels",
        &[
            Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 100_000, 64, 16).all_optional() },
            Case { layout: Layout::Bld, groups: 4, ..Case::new(1, 100_000, 37, 16) },
        ],
    );
}

/// dt ~ 1e-4 everywhere (f32): softplus(x) for x ~ -9 must keep f32 accuracy, not only its
/// absolute error (log(1 + e^x) evaluated as written loses e^x's digits to the rounding of 1 + e^x).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn tiny_dt_f32() {
    gpu();
    let mut cases = Vec::new();
    for layout in LAYOUTS {
        for softplus in [true, false] {
            cases.push(Case { layout, softplus, dt_range: (1e-4, 2e-4), ..Case::new(2, 136, 64, 16) });
            cases.push(Case { layout, softplus, dt_range: (1e-4, 2e-4), ..Case::new(2, 40, 64, 64) });
        }
    }
    roundtrip_all("tiny_dt_f32", &cases);
}

/// seqlen 0: final state = h0 bit for bit (or 0); zero batch, dim or dstate: valid.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn zero_sizes() {
    gpu();
    let stream = Stream::new();
    for layout in LAYOUTS {
        for groups in [0, 1] {
            for has_h0 in [false, true] {
                let case = Case { layout, groups, has_initial_state: has_h0, ..Case::new(2, 136, 0, 16) };
                let p = Problem::random(&case);
                let (out, state) = run_gpu(&p, stream.ptr()).unwrap();
                assert!(out.is_empty());
                let want = p.initial_state.clone().unwrap_or_else(|| vec![0.0; case.state_len()]);
                assert_eq!(
                    state.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
            for (batch, dim) in [(0, 4), (2, 0), (0, 0)] {
                let case = Case { layout, groups, ..Case::new(batch, dim, 9, 4).all_optional() };
                let (out, state) =
                    run_gpu(&Problem::random(&case), stream.ptr()).unwrap_or_else(|e| panic!("{e:?}\n{case:?}"));
                assert!(out.is_empty() && state.is_empty());
            }
            let case = Case { layout, groups, ..Case::new(2, 8, 9, 0).all_optional() };
            let p = Problem::random(&case);
            let (out, state) = run_gpu(&p, stream.ptr()).unwrap_or_else(|e| panic!("{e:?}\n{case:?}"));
            assert!(state.is_empty());
            assert_close("out (dstate 0)", &case, &out, &p.reference().out, Tol::F32);
        }
    }
}

/// Extreme but finite inputs: softplus's linear branch (delta > 20), tiny dt, large |z|.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn extreme_values() {
    gpu();
    let stream = Stream::new();
    for layout in LAYOUTS {
        for (dim, dstate) in [(136, 16), (40, 64)] {
            let case = Case { layout, ..Case::new(2, dim, 40, dstate).all_optional() };
            let mut p = Problem::random(&case);
            let specials = [25.0f32, 21.0, 19.5, -12.0, 3.0];
            for (i, x) in p.delta.iter_mut().enumerate() {
                if i % 3 == 0 {
                    *x = specials[i % specials.len()];
                }
            }
            let zs = [-100.0f32, -30.0, 30.0, 100.0, 0.0];
            for (i, x) in p.z.as_mut().unwrap().iter_mut().enumerate() {
                if i % 4 == 0 {
                    *x = zs[i % zs.len()];
                }
            }
            let r = p.reference();
            let (out, state) = run_gpu(&p, stream.ptr()).unwrap();
            check_outputs(&p, &r, &out, &state);
        }
    }
}

/// The legacy default stream (null) works too: the context current on the calling thread is used.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn legacy_default_stream() {
    gpu();
    for case in [
        Case::new(2, 136, 32, 16).all_optional(),
        Case { layout: Layout::Bld, ..Case::new(2, 40, 33, 64).all_optional() },
    ] {
        roundtrip(&case, std::ptr::null_mut());
    }
}

/// A stream the test created, with other work queued ahead of the kernel on it: the handler must
/// enqueue (not run eagerly, not synchronize something else), and see the stream's earlier writes.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn non_default_stream_orders_work() {
    gpu();
    let stream = Stream::new();
    let case = Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 200, 296, 16).all_optional() };
    let p = Problem::random(&case);
    let r = p.reference();
    let call = DeviceCall::new(&p);
    // Queue on the stream: u := garbage, then u := the real values (async copies), then the scan.
    let u_bytes = &call.args[0].0.bytes;
    let garbage = vec![0x7fu8; u_bytes.len()];
    // SAFETY: copies into our own allocation, on our own stream; host buffers outlive the sync below.
    unsafe {
        result::memcpy_htod_async(call.args[0].1.ptr, &garbage, stream.0).expect("cuMemcpyHtoDAsync");
        result::memcpy_htod_async(call.args[0].1.ptr, u_bytes, stream.0).expect("cuMemcpyHtoDAsync");
    }
    let (args, rets) = (call.arg_bufs(), call.ret_bufs());
    let mut frame = Frame::new(&args, &rets, &p.attrs(), stream.ptr());
    xla::call(cuda_handler, &mut frame).unwrap();
    synchronize(stream.ptr());
    let (out, state) = call.outputs(&case);
    check_outputs(&p, &r, &out, &state);
}

/// Several threads, each with its own stream, calling at once (module cache, per-thread context).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn concurrent_threads() {
    gpu();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                gpu();
                let dstate = [16, 64, 3, 256][t as usize];
                let case =
                    Case { seed: t, layout: LAYOUTS[t as usize % 2], ..Case::new(2, 136, 77, dstate).all_optional() };
                let stream = Stream::new();
                for _ in 0..3 {
                    roundtrip(&case, stream.ptr());
                }
            });
        }
    });
}

/// Captured into a CUDA graph (what XLA's command buffers do, as the handler's traits allow) and
/// replayed: the replay computes the right answer, twice.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn cuda_graph_capture() {
    gpu();
    for case in [
        Case::new(2, 256, 64, 16).all_optional(),
        Case { layout: Layout::Bld, ..Case::new(2, 40, 65, 64).all_optional() },
    ] {
        let p = Problem::random(&case);
        let r = p.reference();
        let stream = Stream::new();
        let call = DeviceCall::new(&p);
        let (args, rets) = (call.arg_bufs(), call.ret_bufs());
        let mut frame = Frame::new(&args, &rets, &p.attrs(), stream.ptr());
        // Warm up outside the capture (module load), then capture.
        xla::call(cuda_handler, &mut frame).unwrap();
        synchronize(stream.ptr());
        call.poison();
        // SAFETY: capture on our own stream; the graph and its instance are destroyed below.
        unsafe {
            result::stream::begin_capture(stream.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .expect("cuStreamBeginCapture");
            let status = xla::call(cuda_handler, &mut frame);
            let graph = result::stream::end_capture(stream.0).expect("cuStreamEndCapture");
            status.unwrap();
            synchronize(stream.ptr());
            let (out, _) = call.outputs(&case);
            assert!(out.iter().all(|x| x.is_nan()), "the captured call ran eagerly");
            let exec = result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)).expect("cuGraphInstantiate");
            for _ in 0..2 {
                call.poison();
                result::graph::launch(exec, stream.0).expect("cuGraphLaunch");
                synchronize(stream.ptr());
                let (out, state) = call.outputs(&case);
                check_outputs(&p, &r, &out, &state);
            }
            result::graph::exec_destroy(exec).expect("cuGraphExecDestroy");
            result::graph::destroy(graph).expect("cuGraphDestroy");
        }
    }
}

/// The C API on device memory: `xla_ssm_selective_scan_fwd_cuda_launch`, on a created stream and on
/// the legacy default stream, and its errors.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn c_api_cuda_launch() {
    gpu();
    use xla_ssm::capi::*;
    assert!(xla_ssm_cuda_device_count() >= 1);
    let stream = Stream::new();
    let cases = [
        Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 200, 100, 16).all_optional() },
        Case { layout: Layout::Bld, groups: 0, ..Case::new(2, 64, 100, 64).all_optional() },
        Case { dtype: Dt::F16, groups: 2, ..Case::new(2, 256, 100, 16) },
    ];
    for (i, case) in cases.iter().enumerate() {
        let p = Problem::random(case);
        let r = p.reference();
        let call = DeviceCall::new(&p);
        let args = call.capi_args(&p);
        let s = if i == 1 { std::ptr::null_mut() } else { stream.ptr() };
        // SAFETY: device pointers of the described sizes, in the current context.
        let status = unsafe { xla_ssm_selective_scan_fwd_cuda_launch(&args, s) };
        // SAFETY: a NUL-terminated string owned by the library.
        let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
        assert_eq!(status, XLA_SSM_OK, "{msg}");
        synchronize(s);
        let (out, state) = call.outputs(case);
        check_outputs(&p, &r, &out, &state);
    }
    // Errors: validated before any launch.
    let p = Problem::random(&cases[0]);
    let call = DeviceCall::new(&p);
    let mut args = call.capi_args(&p);
    args.dtype = 7;
    // SAFETY: as above.
    let status = unsafe { xla_ssm_selective_scan_fwd_cuda_launch(&args, stream.ptr()) };
    let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned();
    assert_eq!(status, XLA_SSM_INVALID_ARGUMENT);
    assert!(msg.contains("dtype") && msg.contains('7'), "{msg}");
    // SAFETY: a null argument struct is refused.
    let status = unsafe { xla_ssm_selective_scan_fwd_cuda_launch(std::ptr::null(), stream.ptr()) };
    assert_eq!(status, XLA_SSM_INVALID_ARGUMENT);
    synchronize(stream.ptr());
    let (out, _) = call.outputs(&cases[0]);
    assert!(out.iter().all(|x| x.is_nan()), "a refused call wrote its output");
}

/// Validation errors come back from the CUDA handler as they do from the CPU one.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn cuda_handler_errors() {
    gpu();
    let stream = Stream::new();
    let p = Problem::random(&Case::new(2, 8, 5, 4).all_optional());
    let call = DeviceCall::new(&p);
    let (mut args, rets) = (call.arg_bufs(), call.ret_bufs());
    args[2].dtype = xla::BF16; // A
    let mut frame = Frame::new(&args, &rets, &p.attrs(), stream.ptr());
    let (code, msg) = xla::call(cuda_handler, &mut frame).unwrap_err();
    assert_eq!(code, xla::ERR_INVALID_ARGUMENT);
    assert!(msg.contains("`A`") && msg.contains("bf16"), "{msg}");
    synchronize(stream.ptr());
    let (out, _) = call.outputs(&p.case);
    assert!(out.iter().all(|x| x.is_nan()));
}

/// Time-varying B/C that are not 16-byte aligned (one element in): the tiled kernel stages them element
/// by element ("varying") instead of as 16-byte vectors.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn misaligned_bc() {
    gpu();
    let stream = Stream::new();
    for case in [
        Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(2, 128, 200, 16).all_optional() },
        Case { dtype: Dt::BF16, ..Case::new(2, 64, 96, 64).all_optional() },
        Case { dtype: Dt::F16, bc_dtype: Dt::F16, ..Case::new(1, 64, 160, 130).all_optional() },
        Case { layout: Layout::Bld, dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 64, 96, 136).all_optional() },
    ] {
        let p = Problem::random(&case);
        let r = p.reference();
        let call = DeviceCall::new(&p);
        let elem = case.bc_dtype.encode(&[0.0]).len();
        let shifted = |values: &[f32]| {
            let mut bytes = vec![0u8; elem];
            bytes.extend(case.bc_dtype.encode(values));
            DevBuf::upload(&bytes)
        };
        let (b, c) = (shifted(&p.b), shifted(&p.c));
        let mut args = call.capi_args(&p);
        // SAFETY: one element into buffers of one element more than B and C.
        unsafe {
            args.b = b.data().cast::<u8>().add(elem).cast();
            args.c = c.data().cast::<u8>().add(elem).cast();
        }
        // SAFETY: device pointers of the described sizes, in the current context.
        let status = unsafe { xla_ssm::capi::xla_ssm_selective_scan_fwd_cuda_launch(&args, stream.ptr()) };
        assert_eq!(status, xla_ssm::capi::XLA_SSM_OK, "{case:?}");
        synchronize(stream.ptr());
        let (out, state) = call.outputs(&case);
        check_outputs(&p, &r, &out, &state);
    }
}

/// Small batch x dim with long sequences: given a workspace (a third result, or the C API's field),
/// the tiled kernel splits the sequence into chunks (a chunk-local pass, then the final pass).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn split_sequence() {
    gpu();
    let stream = Stream::new();
    let cases = [
        Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 200, 1000, 16).all_optional() },
        Case { layout: Layout::Bld, ..Case::new(2, 136, 2048, 16).all_optional() },
        Case { groups: 0, has_initial_state: true, ..Case::new(1, 128, 4096, 16) },
        Case {
            dtype: Dt::F16,
            bc_dtype: Dt::F32,
            dt_range: (1e-4, 1e-2),
            ..Case::new(1, 64, 777 * 8, 8).all_optional()
        },
        Case { softplus: false, ..Case::new(1, 256, 160, 4).all_optional() },
        // Records of 33, 65, 129 and 257 floats (4 to 32 threads per channel; 32- and 16-channel tiles).
        Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 128, 1024, 64).all_optional() },
        Case { layout: Layout::Bld, ..Case::new(1, 192, 800, 24).all_optional() },
        Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 96, 640, 128).all_optional() },
        Case { layout: Layout::Bld, groups: 2, ..Case::new(1, 64, 512, 200).all_optional() },
    ];
    for case in &cases {
        let c = case;
        let bytes = xla_ssm::capi::xla_ssm_selective_scan_fwd_workspace_bytes(
            c.batch as i64,
            c.dim as i64,
            c.seqlen as i64,
            c.dstate as i64,
        );
        assert!(bytes > 0, "case should split: {case:?}");
        let p = Problem::random(case);
        let r = p.reference();
        let workspace = DevBuf::upload(&vec![0xffu8; bytes as usize]);
        // Through the XLA handler, the workspace as a third (u8) result.
        let call = DeviceCall::new(&p);
        let mut rets = call.ret_bufs();
        rets.push(Buf { dtype: xla::U8, dims: vec![bytes], data: workspace.data() });
        let mut frame = Frame::new(&call.arg_bufs(), &rets, &p.attrs(), stream.ptr());
        xla::call(cuda_handler, &mut frame).unwrap_or_else(|(code, msg)| panic!("handler failed ({code}): {msg}"));
        synchronize(stream.ptr());
        let (out, state) = call.outputs(case);
        check_outputs(&p, &r, &out, &state);
        // Through the C API.
        call.poison();
        let mut args = call.capi_args(&p);
        args.workspace = workspace.data();
        args.workspace_bytes = bytes;
        // SAFETY: device pointers of the described sizes, in the current context.
        let status = unsafe { xla_ssm::capi::xla_ssm_selective_scan_fwd_cuda_launch(&args, stream.ptr()) };
        assert_eq!(status, xla_ssm::capi::XLA_SSM_OK);
        synchronize(stream.ptr());
        let (out, state) = call.outputs(case);
        check_outputs(&p, &r, &out, &state);
    }
}
