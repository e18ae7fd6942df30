//! Bitwise determinism of the CUDA targets: every op family, called through its exported handler
//! (real call frames, device buffers, a real CUstream), gives the same bytes in every result over
//! 10 runs on the same inputs; so do the same calls on two streams at once, and from 4 threads
//! spread over the devices. The kernels sum in a fixed order (no atomics), so nothing may differ.
//!
//! Each run starts from fresh copies of the operands (an in-place result overwrites its operand)
//! and fills the results with another byte pattern (NaN, 0x00, 0x7f, ...), so that an element a
//! kernel leaves unwritten, or a workspace byte it reads before writing, shows as a difference.
//! Workspaces are scratch: passed, never compared. `#[ignore]`d: they need a device
//! (scripts/gpu-run.sh runs them).
#![cfg(feature = "cuda")]

use crate::common::cuda::*;
use crate::common::xla::{self, Attr, Buf, Frame, Handler};
use crate::common::{BwdProblem, Case, Dt, Layout, Operand, Problem};
use crate::decode_common::{self as dc, Call, ConvCase, SsuCase, Want};
use crate::ssd_common::{self as sc, DForm, SsdCase, SsdProblem, CLAMP};
use cudarc::driver::result;
use xla_ssm::capi::{
    xla_ssm_selective_scan_bwd_workspace_bytes, xla_ssm_selective_scan_fwd_workspace_bytes,
    xla_ssm_ssd_bwd_workspace_bytes, xla_ssm_ssd_fwd_workspace_bytes,
};
use xla_ssm::ops::ssd::plan;
use xla_ssm::xla::handlers as h;

const RUNS: usize = 10;

/// One call of a CUDA handler, described on the host.
struct Job {
    what: String,
    handler: Handler,
    call: Call,
    /// The results' names, in result order.
    names: Vec<&'static str>,
}

impl Job {
    /// `rets`: (name, result, the operand it is in place of). A result named "workspace" is scratch.
    fn new(
        what: String,
        handler: Handler,
        args: Vec<dc::Arr>,
        rets: Vec<(&'static str, dc::Arr, Option<usize>)>,
        attrs: Vec<(&'static str, Attr)>,
    ) -> Job {
        let names = rets.iter().map(|(n, _, _)| *n).collect();
        let rets = rets.into_iter().map(|(_, a, alias)| (a, alias)).collect();
        Job { what, handler, call: Call { args, rets, attrs }, names }
    }

    /// A decode-time call, its results named by the references' wants.
    fn decode(what: String, handler: Handler, call: Call, wants: &[Want]) -> Job {
        let mut names = vec![""; call.rets.len()];
        for w in wants {
            names[w.ret] = w.name;
        }
        assert!(names.iter().all(|n| !n.is_empty()), "{what}: a result without a name");
        Job { what, handler, call, names }
    }
}

fn arr(o: Operand) -> dc::Arr {
    dc::Arr { dtype: o.dtype, dims: o.dims, bytes: o.bytes }
}

fn ssd_arr(a: sc::Arr) -> dc::Arr {
    dc::Arr { dtype: a.dtype, dims: a.dims, bytes: a.bytes }
}

fn named(ops: Vec<Operand>) -> Vec<(&'static str, dc::Arr, Option<usize>)> {
    ops.into_iter().map(|o| (o.name, arr(o), None)).collect()
}

fn ssd_named(arrs: Vec<sc::Arr>) -> Vec<(&'static str, dc::Arr, Option<usize>)> {
    arrs.into_iter().map(|a| (a.name, ssd_arr(a), None)).collect()
}

fn workspace(bytes: i64) -> (&'static str, dc::Arr, Option<usize>) {
    ("workspace", dc::Arr { dtype: xla::U8, dims: vec![bytes], bytes: vec![0xff; bytes as usize] }, None)
}

/// Byte patterns of the results before runs after the first (which keeps the calls' own poison).
const FILLS: [u8; 4] = [0x00, 0x7f, 0xa5, 0xff];

fn fill(a: &dc::Arr, run: usize) -> Vec<u8> {
    if run == 0 {
        a.bytes.clone()
    } else {
        vec![FILLS[(run - 1) % FILLS.len()]; a.bytes.len()]
    }
}

/// A job's buffers in the current context: fresh copies of its operands, and its results (an
/// in-place result is its operand's buffer) filled for `run`.
struct Launch<'a> {
    job: &'a Job,
    args: Vec<DevBuf>,
    rets: Vec<Option<DevBuf>>,
}

impl<'a> Launch<'a> {
    fn new(job: &'a Job, run: usize) -> Launch<'a> {
        let args = job.call.args.iter().map(|a| DevBuf::upload(&a.bytes)).collect();
        let rets =
            job.call.rets.iter().map(|(a, alias)| alias.is_none().then(|| DevBuf::upload(&fill(a, run)))).collect();
        // The synchronous copies are complete before any stream (non-blocking ones too) reads them.
        result::ctx::synchronize().expect("cuCtxSynchronize");
        Launch { job, args, rets }
    }

    fn ret_ptr(&self, k: usize) -> *mut std::ffi::c_void {
        match self.job.call.rets[k].1 {
            Some(operand) => self.args[operand].data(),
            None => self.rets[k].as_ref().unwrap().data(),
        }
    }

    /// Calls the handler, which enqueues the work on `stream`; nothing waits for it.
    fn enqueue(&self, stream: &Stream) {
        let call = &self.job.call;
        let args: Vec<Buf> = call
            .args
            .iter()
            .zip(&self.args)
            .map(|(a, d)| Buf { dtype: a.dtype, dims: a.dims.clone(), data: d.data() })
            .collect();
        let rets: Vec<Buf> = call
            .rets
            .iter()
            .enumerate()
            .map(|(k, (a, _))| Buf { dtype: a.dtype, dims: a.dims.clone(), data: self.ret_ptr(k) })
            .collect();
        let mut frame = Frame::new(&args, &rets, &call.attrs, stream.ptr());
        xla::call(self.job.handler, &mut frame)
            .unwrap_or_else(|(code, msg)| panic!("{}: handler failed ({code}): {msg}", self.job.what));
    }

    /// Every result's bytes but the workspace's (once the stream has finished).
    fn results(&self) -> Vec<Vec<u8>> {
        (0..self.rets.len())
            .filter(|&k| self.job.names[k] != "workspace")
            .map(|k| match self.job.call.rets[k].1 {
                Some(operand) => self.args[operand].download(),
                None => self.rets[k].as_ref().unwrap().download(),
            })
            .collect()
    }
}

/// One run of `job` on `stream` in the current context, waited for: its results.
fn run_once(job: &Job, run: usize, stream: &Stream) -> Vec<Vec<u8>> {
    let launch = Launch::new(job, run);
    launch.enqueue(stream);
    synchronize(stream.ptr());
    launch.results()
}

/// Panics unless `got` has `want`'s bytes in every result, naming the first result that differs.
fn assert_same(job: &Job, want: &[Vec<u8>], got: &[Vec<u8>], when: &str) {
    let names: Vec<&str> = job.names.iter().copied().filter(|n| *n != "workspace").collect();
    assert_eq!(want.len(), got.len());
    for ((w, g), name) in want.iter().zip(got).zip(names) {
        if w != g {
            let differ = w.iter().zip(g).filter(|(a, b)| a != b).count();
            let first = w.iter().zip(g).position(|(a, b)| a != b).unwrap_or(0);
            panic!("{}: `{name}` differs {when}: {differ} of {} bytes, the first at byte {first}", job.what, w.len());
        }
    }
}

/// Runs each job [`RUNS`] times on one stream: every run's results are the first's, byte for byte.
fn repeat(family: &str, jobs: &[Job]) {
    let stream = Stream::new();
    for job in jobs {
        let first = run_once(job, 0, &stream);
        for run in 1..RUNS {
            let got = run_once(job, run, &stream);
            assert_same(job, &first, &got, &format!("between runs 1 and {}", run + 1));
        }
    }
    println!("{family}: {} calls, {RUNS} runs each, bitwise equal", jobs.len());
}

// ---------------------------------------------------------------------------------------------
// The calls of each op family: realistic but small shapes, the kernels' main paths.

fn scan_fwd_workspace(c: &Case) -> i64 {
    xla_ssm_selective_scan_fwd_workspace_bytes(c.batch as i64, c.dim as i64, c.seqlen as i64, c.dstate as i64)
}

/// The forward with checkpoints (what the backward needs), with the split's workspace when `split`.
fn scan_fwd_checkpoints_job(bp: &BwdProblem, split: bool) -> Job {
    let c = bp.case();
    let mut rets = named(bp.poisoned_fwd_results());
    if split {
        let bytes = scan_fwd_workspace(c);
        assert!(bytes > 0, "the forward should split the sequence: {c:?}");
        rets.push(workspace(bytes));
    }
    let what = format!("selective_scan_fwd (checkpoints every {}, split {split}) {c:?}", bp.checkpoint_len);
    Job::new(
        what,
        h::xla_ssm_selective_scan_fwd_cuda,
        bp.p.operands().into_iter().map(arr).collect(),
        rets,
        bp.fwd_attrs(),
    )
}

/// The forward scan: with a sequence split (small batch x dim, long sequences, a workspace passed;
/// a chunk-local pass then the final one) and without (no workspace; a grid of many tiles; the
/// lanes kernel, which takes a seqlen of no whole 16-byte rows).
fn scan_fwd_jobs() -> Vec<Job> {
    let split = Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 256, 4096, 16).all_optional() };
    let mut jobs = vec![
        scan_fwd_checkpoints_job(&BwdProblem::random(&split, 128, false), true),
        scan_fwd_checkpoints_job(&BwdProblem::random(&split, 128, false), false),
    ];
    let wide = Case { layout: Layout::Bld, ..Case::new(2, 128, 2048, 64).all_optional() };
    let many_tiles =
        Case { dtype: Dt::F16, bc_dtype: Dt::F32, groups: 2, ..Case::new(4, 1024, 512, 16).all_optional() };
    let lanes = Case { groups: 0, ..Case::new(2, 200, 999, 32).all_optional() };
    for (case, split) in [(wide, true), (many_tiles, false), (lanes, false)] {
        let p = Problem::random(&case);
        let mut rets = named(p.poisoned_results());
        if split {
            let bytes = scan_fwd_workspace(&case);
            assert!(bytes > 0, "the forward should split the sequence: {case:?}");
            rets.push(workspace(bytes));
        }
        let what = format!("selective_scan_fwd (split {split}) {case:?}");
        jobs.push(Job::new(
            what,
            h::xla_ssm_selective_scan_fwd_cuda,
            p.operands().into_iter().map(arr).collect(),
            rets,
            p.attrs(),
        ));
    }
    jobs
}

/// The backward scan, every gradient, on checkpoints from one CUDA forward: split into parts (few
/// blocks: the per-part partial sums then the fixed-order reductions) and not (132 blocks or more);
/// time-varying and time-invariant B/C, both layouts.
fn scan_bwd_jobs() -> Vec<Job> {
    let stream = Stream::new();
    let cases = [
        (Case { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..Case::new(1, 256, 2048, 16).all_optional() }, 128, true),
        (Case { groups: 2, ..Case::new(4, 2176, 96, 16).all_optional() }, 32, true),
        (
            Case {
                layout: Layout::Bld,
                groups: 0,
                dtype: Dt::F16,
                bc_dtype: Dt::F32,
                ..Case::new(2, 128, 1000, 64).all_optional()
            },
            64,
            false,
        ),
    ];
    cases
        .into_iter()
        .map(|(case, checkpoint_len, dfinal)| {
            let bp = BwdProblem::random(&case, checkpoint_len, dfinal);
            let fwd = scan_fwd_checkpoints_job(&bp, scan_fwd_workspace(&case) > 0);
            let checkpoints = Dt::F32.decode(&run_once(&fwd, 0, &stream)[2]);
            let mut rets = named(bp.poisoned_grads());
            rets.push(workspace(xla_ssm_selective_scan_bwd_workspace_bytes(
                case.batch as i64,
                case.dim as i64,
                case.seqlen as i64,
                case.dstate as i64,
                case.groups as i64,
            )));
            let args = bp.bwd_operands(&checkpoints).into_iter().map(arr).collect();
            let what = format!("selective_scan_bwd (checkpoints every {checkpoint_len}) {case:?}");
            Job::new(what, h::xla_ssm_selective_scan_bwd_cuda, args, rets, bp.bwd_attrs())
        })
        .collect()
}

fn ssd_shape(c: &SsdCase) -> plan::Shape {
    let [batch, seqlen, heads, headdim, dstate, groups, chunk_size] = c.capi_sizes();
    plan::Shape { batch, seqlen, heads, headdim, dstate, groups, chunk_size, elem_bytes: c.dtype.size() as i64 }
}

/// SSD problems on the tensor-core kernels (2-byte types, headdim 64, dstate 64 or 128, chunks of
/// whole 64-step tiles): few (batch, head) pairs, whose sequences both passes split into parts (the
/// first pass's records, then the parts after them), and enough pairs for one part; and on the
/// generic kernels (f32; headdim 32).
fn ssd_problems() -> Vec<SsdProblem> {
    let tensor_cores = [
        (SsdCase { dtype: Dt::BF16, ..SsdCase::new(2, 1000, 4, 64, 128).all_optional() }, true),
        (SsdCase { dtype: Dt::BF16, groups: 2, ..SsdCase::new(2, 1087, 8, 64, 128).all_optional() }, true),
        (
            SsdCase {
                dtype: Dt::F16,
                chunk_size: 128,
                d: DForm::PerChannel,
                has_z: false,
                dt_limit: CLAMP,
                ..SsdCase::new(1, 700, 2, 64, 64).all_optional()
            },
            true,
        ),
        (SsdCase { dtype: Dt::BF16, groups: 4, ..SsdCase::new(6, 128, 48, 64, 64).all_optional() }, false),
        // Heads widened to 64 (plan::PadHeads), a state of two halves (plan::StateHalves).
        (SsdCase { dtype: Dt::BF16, chunk_size: 128, ..SsdCase::new(1, 500, 6, 32, 16).all_optional() }, true),
        (SsdCase { dtype: Dt::F16, ..SsdCase::new(2, 300, 2, 64, 256).all_optional() }, true),
    ];
    for (c, split) in &tensor_cores {
        assert!(c.tensor_cores(), "{c:?}");
        assert_eq!(plan::mma_bwd_layout(&ssd_shape(c)).n_parts > 1, *split, "{c:?}");
    }
    let generic = [
        SsdCase { groups: 2, d: DForm::PerChannel, dt_limit: CLAMP, ..SsdCase::new(2, 300, 4, 16, 32).all_optional() },
        SsdCase { dtype: Dt::BF16, chunk_size: 128, ..SsdCase::new(1, 500, 6, 16, 16).all_optional() },
    ];
    for c in &generic {
        assert!(!c.tensor_cores(), "{c:?}");
    }
    let cases = tensor_cores.iter().map(|(c, _)| c).chain(&generic);
    cases.enumerate().map(|(k, c)| SsdProblem::random(c, k % 2 == 0)).collect()
}

/// The tensor-core backward that sums dB and dC over a group's heads a chunk at a time (32 heads a
/// group, 64 (batch, chunk, group) units, 256-step chunks): another reduction path, training-sized
/// (34M elements in x), so in the repeated backward only.
fn ssd_head_sums_problem() -> SsdProblem {
    let c = SsdCase { dtype: Dt::BF16, chunk_size: 256, seed: 9, ..SsdCase::new(4, 4096, 32, 64, 128).all_optional() };
    assert!(plan::mma_bwd_head_sums(&ssd_shape(&c)), "{c:?}");
    SsdProblem::random(&c, true)
}

fn ssd_fwd_job(p: &SsdProblem) -> Job {
    let c = &p.case;
    let [b, l, hd, hp, n, g, q] = c.capi_sizes();
    let mut rets = ssd_named(p.fwd_results(true));
    rets.push(workspace(xla_ssm_ssd_fwd_workspace_bytes(b, l, hd, hp, n, g, q, c.dtype.capi())));
    let args = p.operands().into_iter().map(ssd_arr).collect();
    Job::new(format!("ssd_fwd {c:?}"), h::xla_ssm_ssd_fwd_cuda, args, rets, p.fwd_attrs(true))
}

fn ssd_fwd_jobs() -> Vec<Job> {
    ssd_problems().iter().map(ssd_fwd_job).collect()
}

/// The SSD backward, every gradient, on chunk states from one CUDA forward.
fn ssd_bwd_jobs(problems: &[SsdProblem]) -> Vec<Job> {
    let stream = Stream::new();
    problems
        .iter()
        .map(|p| {
            let c = &p.case;
            let chunk_states = c.chunk_states_dt().decode(&run_once(&ssd_fwd_job(p), 0, &stream)[2]);
            let [b, l, hd, hp, n, g, q] = c.capi_sizes();
            let mut rets = ssd_named(p.bwd_results());
            rets.push(workspace(xla_ssm_ssd_bwd_workspace_bytes(b, l, hd, hp, n, g, q, c.dtype.capi())));
            let args = p.bwd_operands(&chunk_states).into_iter().map(ssd_arr).collect();
            Job::new(format!("ssd_bwd {c:?}"), h::xla_ssm_ssd_bwd_cuda, args, rets, p.bwd_attrs())
        })
        .collect()
}

/// causal_conv1d forward and backward (dweight and dbias: one block's fixed-order reduction per
/// channel), both layouts, widths 2 to 4; and the update, from a pool in place and copied.
fn conv_jobs() -> Vec<Job> {
    let mut jobs = Vec::new();
    for k in [
        ConvCase { dtype: Dt::BF16, wdtype: Dt::BF16, bld: true, ..ConvCase::new(4, 512, 1024, 4) },
        ConvCase { has_init: false, silu: false, seed: 2, ..ConvCase::new(2, 300, 777, 3) },
        ConvCase { dtype: Dt::F16, wdtype: Dt::F32, has_bias: false, seed: 3, ..ConvCase::new(3, 130, 2048, 2) },
    ] {
        let i = dc::conv_inputs(&k);
        let (call, wants) = dc::conv_fwd_call(&k, &i);
        jobs.push(Job::decode(format!("causal_conv1d_fwd {k:?}"), h::xla_ssm_causal_conv1d_fwd_cuda, call, &wants));
        let (call, wants) = dc::conv_bwd_call(&k, &i);
        jobs.push(Job::decode(format!("causal_conv1d_bwd {k:?}"), h::xla_ssm_causal_conv1d_bwd_cuda, call, &wants));
    }
    for (k, pool, alias) in [
        (ConvCase { dtype: Dt::BF16, wdtype: Dt::BF16, ..ConvCase::new(8, 512, 1, 4) }, Some(12), true),
        (ConvCase { bld: true, seed: 5, ..ConvCase::new(16, 256, 4, 3) }, None, false),
    ] {
        let i = dc::conv_inputs(&k);
        let (call, wants) = dc::conv_update_call(&k, &i, pool, k.seqlen == 1, alias);
        let what = format!("causal_conv1d_update (pool {pool:?}, in place {alias}) {k:?}");
        jobs.push(Job::decode(what, h::xla_ssm_causal_conv1d_update_cuda, call, &wants));
    }
    jobs
}

/// selective_state_update: the fast kernel from a pool of states in place, the general one (dstate
/// 5), 2-byte states copied.
fn state_update_jobs() -> Vec<Job> {
    [
        (SsuCase { dtype: Dt::BF16, bc_dtype: Dt::BF16, pool: Some(24), ..SsuCase::new(16, 1024, 128, 8) }, true),
        (
            SsuCase { dtype: Dt::F16, bc_dtype: Dt::F32, state_dtype: Dt::F16, seed: 2, ..SsuCase::new(8, 512, 16, 1) },
            false,
        ),
        (SsuCase { seed: 3, ..SsuCase::new(3, 130, 5, 2) }, false),
    ]
    .into_iter()
    .map(|(k, alias)| {
        let i = dc::ssu_inputs(&k);
        let what = format!("selective_state_update (in place {alias}) {k:?}");
        Job::decode(what, h::xla_ssm_selective_state_update_cuda, dc::ssu_call(&k, &i, alias), &dc::ssu_wants(&k, &i))
    })
    .collect()
}

/// The fused decode step (conv update, then state update): in place from a pool, and copied.
fn decode_step_jobs() -> Vec<Job> {
    [
        (
            SsuCase { dtype: Dt::BF16, bc_dtype: Dt::BF16, pool: Some(24), ..SsuCase::new(16, 1024, 128, 8) },
            4,
            Dt::F32,
            true,
            true,
        ),
        (
            SsuCase { dtype: Dt::F16, bc_dtype: Dt::F16, state_dtype: Dt::F16, seed: 2, ..SsuCase::new(8, 512, 16, 1) },
            3,
            Dt::F16,
            false,
            false,
        ),
    ]
    .into_iter()
    .map(|(k, width, wdtype, conv_bias, alias)| {
        let (call, wants) = dc::decode_call(&k, width, wdtype, conv_bias, alias);
        let what = format!("mamba_decode_step (width {width}, in place {alias}) {k:?}");
        Job::decode(what, h::xla_ssm_mamba_decode_step_cuda, call, &wants)
    })
    .collect()
}

fn all_jobs() -> Vec<Job> {
    let mut jobs = scan_fwd_jobs();
    jobs.extend(scan_bwd_jobs());
    jobs.extend(ssd_fwd_jobs());
    jobs.extend(ssd_bwd_jobs(&ssd_problems()));
    jobs.extend(conv_jobs());
    jobs.extend(state_update_jobs());
    jobs.extend(decode_step_jobs());
    jobs
}

// ---------------------------------------------------------------------------------------------
// Repeated runs, one family a test.

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn repeat_selective_scan_fwd() {
    gpu();
    repeat("selective_scan_fwd", &scan_fwd_jobs());
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn repeat_selective_scan_bwd() {
    gpu();
    repeat("selective_scan_bwd", &scan_bwd_jobs());
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn repeat_ssd_fwd() {
    gpu();
    repeat("ssd_fwd", &ssd_fwd_jobs());
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn repeat_ssd_bwd() {
    gpu();
    let mut problems = ssd_problems();
    problems.push(ssd_head_sums_problem());
    repeat("ssd_bwd", &ssd_bwd_jobs(&problems));
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn repeat_causal_conv1d() {
    gpu();
    repeat("causal_conv1d", &conv_jobs());
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn repeat_selective_state_update() {
    gpu();
    repeat("selective_state_update", &state_update_jobs());
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn repeat_mamba_decode_step() {
    gpu();
    repeat("mamba_decode_step", &decode_step_jobs());
}

// ---------------------------------------------------------------------------------------------
// Concurrency.

/// Every call of every family on two streams at once, each call with its own buffers (workspaces
/// included), gives the single-stream results. All calls are enqueued, alternating between the
/// streams, before either is waited for, so that the two streams' kernels run side by side where
/// the GPU has room; three rounds.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn two_streams_at_once() {
    gpu();
    let jobs = all_jobs();
    let single = Stream::new();
    let want: Vec<Vec<Vec<u8>>> = jobs.iter().map(|j| run_once(j, 0, &single)).collect();
    let streams = [Stream::new(), Stream::new()];
    for round in 0..3 {
        let launches: Vec<[Launch; 2]> =
            jobs.iter().map(|j| [Launch::new(j, 2 * round + 1), Launch::new(j, 2 * round + 2)]).collect();
        for pair in &launches {
            for (launch, stream) in pair.iter().zip(&streams) {
                launch.enqueue(stream);
            }
        }
        for stream in &streams {
            synchronize(stream.ptr());
        }
        for (pair, want) in launches.iter().zip(&want) {
            for (s, launch) in pair.iter().enumerate() {
                let when = format!("on stream {} of 2 (round {}) from the single-stream run", s + 1, round + 1);
                assert_same(launch.job, want, &launch.results(), &when);
            }
        }
    }
    println!("two streams at once: {} calls, 3 rounds, bitwise equal to one stream", jobs.len());
}

const THREADS: usize = 4;

/// 4 host threads, thread t on device t % device_count, each with its own stream, all calling at
/// once: every result is bitwise that of a single-thread run. Results are compared across devices
/// of the same description (name, compute capability, SMs: what the kernel choices depend on);
/// devices of another description are compared with a run on one of their own. With one device,
/// the 4 threads share device 0 (said on stderr: no second device was tested).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn threads_over_devices() {
    gpu();
    let devices = device_count();
    let used = devices.min(THREADS);
    let descriptions: Vec<String> = (0..used).map(device_description).collect();
    eprintln!("threads_over_devices: {THREADS} threads over {used} of {devices} CUDA device(s): {descriptions:?}");
    if devices == 1 {
        eprintln!("threads_over_devices: only one CUDA device found: all {THREADS} threads run on device 0");
    }
    let jobs = all_jobs();
    // One single-thread run per kind of device, on its first device.
    let mut want: Vec<(String, Vec<Vec<Vec<u8>>>)> = Vec::new();
    for (device, description) in descriptions.iter().enumerate() {
        if want.iter().all(|(d, _)| d != description) {
            gpu_on(device);
            let stream = Stream::new();
            want.push((description.clone(), jobs.iter().map(|j| run_once(j, 0, &stream)).collect()));
        }
    }
    gpu();
    if want.len() > 1 {
        eprintln!("threads_over_devices: {} kinds of device: results compared within each kind only", want.len());
    }
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (jobs, want, descriptions) = (&jobs, &want, &descriptions);
            s.spawn(move || {
                let device = t % used;
                gpu_on(device);
                let stream = Stream::new();
                let want = &want.iter().find(|(d, _)| *d == descriptions[device]).unwrap().1;
                for (k, (job, want)) in jobs.iter().zip(want).enumerate() {
                    let got = run_once(job, t + k, &stream);
                    let when = format!("in thread {t} on device {device} from the single-thread run");
                    assert_same(job, want, &got, &when);
                }
            });
        }
    });
    println!("threads over devices: {} calls from {THREADS} threads on {used} device(s), bitwise equal", jobs.len());
}
