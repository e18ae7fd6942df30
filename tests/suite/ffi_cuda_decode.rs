//! The decode-time CUDA targets through their exported handlers (real call frames, device buffers,
//! a real CUstream) and the C API, against the references of tests/suite/decode_common; in place and
//! copied; replayed from a CUDA graph. `#[ignore]`d: they need a device (scripts/gpu-run.sh).
#![cfg(feature = "cuda")]

use crate::common::cuda::{gpu, synchronize, DevBuf, Stream};
use crate::common::xla::{self, Buf, Frame, Handler};
use crate::common::Dt;
use crate::decode_common::*;
use cudarc::driver::{result, sys};
use xla_ssm::xla::handlers as h;

/// A call's buffers on the device: operands, then results (an aliased result is its operand's buffer).
struct DevCall {
    args: Vec<DevBuf>,
    rets: Vec<Option<DevBuf>>,
    aliases: Vec<Option<usize>>,
    arg_bufs: Vec<Buf>,
    ret_bufs: Vec<Buf>,
}

impl DevCall {
    fn new(call: &Call) -> DevCall {
        let args: Vec<DevBuf> = call.args.iter().map(|a| DevBuf::upload(&a.bytes)).collect();
        let rets: Vec<Option<DevBuf>> =
            call.rets.iter().map(|(a, alias)| alias.is_none().then(|| DevBuf::upload(&a.bytes))).collect();
        let arg_bufs = call
            .args
            .iter()
            .zip(&args)
            .map(|(a, d)| Buf { dtype: a.dtype, dims: a.dims.clone(), data: d.data() })
            .collect();
        let ret_bufs = call
            .rets
            .iter()
            .zip(&rets)
            .map(|((a, alias), d)| Buf {
                dtype: a.dtype,
                dims: a.dims.clone(),
                data: alias.map_or_else(|| d.as_ref().unwrap().data(), |i| args[i].data()),
            })
            .collect();
        result::ctx::synchronize().expect("cuCtxSynchronize");
        DevCall { args, rets, aliases: call.rets.iter().map(|(_, a)| *a).collect(), arg_bufs, ret_bufs }
    }

    fn results(&self) -> Vec<Vec<u8>> {
        self.rets
            .iter()
            .zip(&self.aliases)
            .map(|(d, a)| a.map_or_else(|| d.as_ref().unwrap().download(), |i| self.args[i].download()))
            .collect()
    }
}

pub(crate) fn run(handler: Handler, call: &Call, stream: &Stream) -> Result<Vec<Vec<u8>>, (i32, String)> {
    let dev = DevCall::new(call);
    let mut frame = Frame::new(&dev.arg_bufs, &dev.ret_bufs, &call.attrs, stream.ptr());
    xla::call(handler, &mut frame)?;
    synchronize(stream.ptr());
    Ok(dev.results())
}

fn run_ok(what: &str, handler: Handler, call: &Call, wants: &[Want], case: &dyn std::fmt::Debug, stream: &Stream) {
    let results =
        run(handler, call, stream).unwrap_or_else(|(c, m)| panic!("{what}: handler failed ({c}): {m}\ncase: {case:?}"));
    check(what, case, &results, wants);
}

fn ssu_cases() -> Vec<SsuCase> {
    let mut cases = Vec::new();
    let mut seed = 0;
    for (dtype, bc_dtype, state_dtype) in [
        (Dt::F32, Dt::F32, Dt::F32),
        (Dt::BF16, Dt::BF16, Dt::F32),
        (Dt::BF16, Dt::F32, Dt::BF16),
        (Dt::BF16, Dt::BF16, Dt::BF16),
        (Dt::F16, Dt::F16, Dt::F16),
        (Dt::F16, Dt::F32, Dt::F32),
    ] {
        // Vectorized (dstate a multiple of the lane's vector) and scalar paths; several lanes per row.
        for (batch, dim, dstate, groups) in
            [(1, 64, 16, 1), (3, 40, 5, 2), (2, 96, 64, 4), (2, 33, 1, 1), (1, 8, 256, 2), (4, 130, 128, 2)]
        {
            seed += 1;
            cases.push(SsuCase {
                dtype,
                bc_dtype,
                state_dtype,
                has_d: seed % 2 == 0,
                has_z: seed % 3 != 0,
                has_bias: seed % 4 < 2,
                softplus: seed % 5 != 0,
                seed,
                ..SsuCase::new(batch, dim, dstate, groups)
            });
        }
    }
    cases
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn state_update_matches_reference() {
    gpu();
    let s = Stream::new();
    for k in ssu_cases() {
        for alias in [true, false] {
            let i = ssu_inputs(&k);
            run_ok(
                "selective_state_update",
                h::xla_ssm_selective_state_update_cuda,
                &ssu_call(&k, &i, alias),
                &ssu_wants(&k, &i),
                &k,
                &s,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn state_update_pool_indices_and_out_of_range_skipped() {
    gpu();
    let s = Stream::new();
    for (batch, slots) in [(5, 8), (6, 6), (40, 64)] {
        for alias in [true, false] {
            let k = SsuCase { pool: Some(slots), seed: batch as u64, ..SsuCase::new(batch, 48, 16, 2) };
            let i = ssu_inputs(&k);
            run_ok(
                "state update (pool)",
                h::xla_ssm_selective_state_update_cuda,
                &ssu_call(&k, &i, alias),
                &ssu_wants(&k, &i),
                &k,
                &s,
            );
        }
    }
    // On the GPU an index >= slots is skipped like padding (documented): same as -1.
    let k = SsuCase { pool: Some(4), ..SsuCase::new(3, 16, 16, 1) };
    let mut i = ssu_inputs(&k);
    i.indices = Some(vec![0, -1, 1]);
    let wants = ssu_wants(&k, &i);
    i.indices = Some(vec![0, 4, 1]);
    run_ok(
        "state update (index out of range)",
        h::xla_ssm_selective_state_update_cuda,
        &ssu_call(&k, &i, true),
        &wants,
        &k,
        &s,
    );
}

/// The fast kernels' grid holds at most 65535 batch rows, and each block loops over the rest: a
/// batch past that (from a pool, with padding rows), state update and fused step.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn batch_past_the_grid() {
    gpu();
    let s = Stream::new();
    let k = SsuCase { pool: Some(65549), seed: 99, ..SsuCase::new(65540, 32, 16, 1) };
    let i = ssu_inputs(&k);
    run_ok(
        "state update (batch past the grid)",
        h::xla_ssm_selective_state_update_cuda,
        &ssu_call(&k, &i, true),
        &ssu_wants(&k, &i),
        &k,
        &s,
    );
    let (call, wants) = decode_call(&k, 4, Dt::F32, true, true);
    run_ok("mamba_decode_step (batch past the grid)", h::xla_ssm_mamba_decode_step_cuda, &call, &wants, &k, &s);
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn zero_sizes() {
    gpu();
    let s = Stream::new();
    for (batch, dim, dstate) in [(0, 4, 16), (2, 0, 16), (2, 4, 0)] {
        let k = SsuCase::new(batch, dim, dstate, 1);
        let i = ssu_inputs(&k);
        run_ok(
            "zero sizes",
            h::xla_ssm_selective_state_update_cuda,
            &ssu_call(&k, &i, false),
            &ssu_wants(&k, &i),
            &k,
            &s,
        );
        let (call, wants) = decode_call(&k, 4, Dt::F32, true, true);
        run_ok("zero sizes (fused)", h::xla_ssm_mamba_decode_step_cuda, &call, &wants, &k, &s);
    }
    for (b, d, l) in [(0, 3, 4), (2, 0, 4), (2, 3, 0)] {
        let k = ConvCase::new(b, d, l, 3);
        let i = conv_inputs(&k);
        let (call, wants) = conv_fwd_call(&k, &i);
        run_ok("conv fwd zero", h::xla_ssm_causal_conv1d_fwd_cuda, &call, &wants, &k, &s);
        let (call, wants) = conv_bwd_call(&k, &i);
        run_ok("conv bwd zero", h::xla_ssm_causal_conv1d_bwd_cuda, &call, &wants, &k, &s);
    }
}

fn conv_cases() -> Vec<ConvCase> {
    let mut cases = Vec::new();
    let mut seed = 0;
    for (dtype, wdtype) in
        [(Dt::F32, Dt::F32), (Dt::BF16, Dt::BF16), (Dt::BF16, Dt::F32), (Dt::F16, Dt::F16), (Dt::F16, Dt::F32)]
    {
        for width in 2..=4 {
            for bld in [false, true] {
                seed += 1;
                let seqlen = [1, 3, 17, 300][seed as usize % 4];
                cases.push(ConvCase {
                    dtype,
                    wdtype,
                    bld,
                    has_bias: seed % 2 == 0,
                    has_init: seed % 3 != 1,
                    silu: seed % 5 != 0,
                    seed,
                    ..ConvCase::new(3, 37, seqlen, width)
                });
            }
        }
    }
    cases
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn conv1d_fwd_bwd_update_match_reference() {
    gpu();
    let s = Stream::new();
    for k in conv_cases() {
        let i = conv_inputs(&k);
        let (call, wants) = conv_fwd_call(&k, &i);
        run_ok("causal_conv1d_fwd", h::xla_ssm_causal_conv1d_fwd_cuda, &call, &wants, &k, &s);
        let (call, wants) = conv_bwd_call(&k, &i);
        run_ok("causal_conv1d_bwd", h::xla_ssm_causal_conv1d_bwd_cuda, &call, &wants, &k, &s);
        // Deterministic: a second run gives the same bits.
        let a = run(h::xla_ssm_causal_conv1d_bwd_cuda, &call, &s).unwrap();
        let b = run(h::xla_ssm_causal_conv1d_bwd_cuda, &call, &s).unwrap();
        assert_eq!(a, b, "causal_conv1d_bwd is not deterministic\ncase: {k:?}");
        for (pool, alias) in [(None, true), (None, false), (Some(5), true)] {
            let (call, wants) = conv_update_call(&k, &i, pool, false, alias);
            run_ok("causal_conv1d_update", h::xla_ssm_causal_conv1d_update_cuda, &call, &wants, &k, &s);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn decode_step_matches_reference() {
    gpu();
    let s = Stream::new();
    let mut seed = 0;
    for k in ssu_cases() {
        for width in 2..=4 {
            seed += 1;
            let wdtype = if seed % 2 == 0 { Dt::F32 } else { k.dtype };
            let (call, wants) = decode_call(&k, width, wdtype, seed % 4 != 0, seed % 3 != 0);
            run_ok("mamba_decode_step", h::xla_ssm_mamba_decode_step_cuda, &call, &wants, &(&k, width), &s);
        }
    }
    let k = SsuCase { pool: Some(70), ..SsuCase::new(50, 64, 16, 2) };
    let (call, wants) = decode_call(&k, 4, Dt::F32, true, true);
    run_ok("mamba_decode_step (pool)", h::xla_ssm_mamba_decode_step_cuda, &call, &wants, &k, &s);
}

/// The state update and the fused step captured in a CUDA graph and replayed: the graph's result
/// is that of the direct call (so the handlers' command-buffer trait holds).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn cuda_graph_replay() {
    gpu();
    let s = Stream::new();
    let k = SsuCase { dtype: Dt::BF16, bc_dtype: Dt::BF16, ..SsuCase::new(4, 256, 16, 1) };
    let (call, wants) = decode_call(&k, 4, Dt::F32, true, true);
    // A direct call first, so that the module is loaded before the capture.
    run_ok("fused (direct)", h::xla_ssm_mamba_decode_step_cuda, &call, &wants, &k, &s);
    let dev = DevCall::new(&call);
    let mut frame = Frame::new(&dev.arg_bufs, &dev.ret_bufs, &call.attrs, s.ptr());
    // SAFETY: plain capture of one handler call on a live stream; graph objects destroyed below.
    unsafe {
        assert_eq!(
            sys::cuStreamBeginCapture_v2(s.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            sys::CUresult::CUDA_SUCCESS
        );
        let r = xla::call(h::xla_ssm_mamba_decode_step_cuda, &mut frame);
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        assert_eq!(sys::cuStreamEndCapture(s.0, &mut graph), sys::CUresult::CUDA_SUCCESS);
        r.expect("handler under capture");
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        assert_eq!(sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuGraphLaunch(exec, s.0), sys::CUresult::CUDA_SUCCESS);
        synchronize(s.ptr());
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
    check("fused (graph replay)", &k, &dev.results(), &wants);
}

#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn c_api_cuda_launch() {
    gpu();
    let s = Stream::new();
    let k = SsuCase { dtype: Dt::BF16, bc_dtype: Dt::BF16, pool: Some(9), ..SsuCase::new(6, 64, 16, 2) };
    let i = ssu_inputs(&k);
    let call = ssu_call(&k, &i, true);
    let dev = DevCall::new(&call);
    let find = |name_index: usize| dev.args[name_index].data();
    // Operand order of ssu_call: state, x, dt, A, B, C, D, z, dt_bias, indices.
    let args = xla_ssm::capi::XlaSsmStateUpdateArgs {
        batch: k.batch as i64,
        dim: k.dim as i64,
        dstate: k.dstate as i64,
        groups: k.groups as i64,
        n_slots: i.slots as i64,
        dtype: k.dtype.capi(),
        bc_dtype: k.bc_dtype.capi(),
        state_dtype: k.state_dtype.capi(),
        dt_softplus: k.softplus,
        state: find(0),
        x: find(1),
        dt: find(2),
        a: find(3) as *const f32,
        b: find(4),
        c: find(5),
        d: find(6) as *const f32,
        z: find(7),
        dt_bias: find(8) as *const f32,
        state_batch_indices: find(9) as *const i32,
        out: dev.ret_bufs[0].data,
    };
    // SAFETY: device buffers of the described sizes.
    assert_eq!(unsafe { xla_ssm::capi::xla_ssm_selective_state_update_cuda_launch(&args, s.ptr()) }, 0);
    synchronize(s.ptr());
    check("C API state update", &k, &dev.results(), &ssu_wants(&k, &i));
}
