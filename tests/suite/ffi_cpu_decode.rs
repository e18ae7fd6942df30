//! The decode-time CPU targets (`selective_state_update`, `causal_conv1d_{fwd,bwd,update}`,
//! `mamba_decode_step`) through their exported handlers with call frames of the fake XLA runtime,
//! against references written from the math (tests/suite/decode_common); in-place (aliased) and copied
//! states; error paths; the C API.

use crate::common::xla::{self, Attr, Buf, Frame, Handler};
use crate::common::{Dt, HostBuf, Tol};
use crate::decode_common::*;
use std::ffi::c_void;
use xla_ssm::xla::handlers as h;

/// Runs `call` through `handler` on host buffers; returns the results' bytes (an aliased result is
/// its operand's buffer after the call).
pub(crate) fn run(handler: Handler, call: &Call) -> Result<Vec<Vec<u8>>, (i32, String)> {
    let mut args: Vec<HostBuf> = call.args.iter().map(|a| HostBuf::from_bytes(&a.bytes)).collect();
    let mut rets: Vec<HostBuf> = call.rets.iter().map(|(a, _)| HostBuf::from_bytes(&a.bytes)).collect();
    let arg_bufs: Vec<Buf> = call
        .args
        .iter()
        .zip(args.iter_mut())
        .map(|(a, h)| Buf { dtype: a.dtype, dims: a.dims.clone(), data: h.ptr() })
        .collect();
    let ret_bufs: Vec<Buf> = call
        .rets
        .iter()
        .zip(rets.iter_mut())
        .map(|((a, alias), h)| Buf {
            dtype: a.dtype,
            dims: a.dims.clone(),
            data: alias.map_or_else(|| h.ptr(), |i| arg_bufs[i].data),
        })
        .collect();
    let mut frame = Frame::new(&arg_bufs, &ret_bufs, &call.attrs, std::ptr::null_mut());
    xla::call(handler, &mut frame)?;
    Ok(call
        .rets
        .iter()
        .zip(&rets)
        .map(|((_, alias), h)| alias.map_or_else(|| h.bytes().to_vec(), |i| args[i].bytes().to_vec()))
        .collect())
}

fn run_ok(what: &str, handler: Handler, call: &Call, wants: &[Want], case: &dyn std::fmt::Debug) {
    let results =
        run(handler, call).unwrap_or_else(|(c, m)| panic!("{what}: handler failed ({c}): {m}\ncase: {case:?}"));
    check(what, case, &results, wants);
}

fn ssu_cases() -> Vec<SsuCase> {
    let mut cases = Vec::new();
    let mut seed = 0;
    for (dtype, others) in [
        (Dt::F32, vec![(Dt::F32, Dt::F32)]),
        (Dt::BF16, vec![(Dt::BF16, Dt::F32), (Dt::F32, Dt::BF16)]),
        (Dt::F16, vec![(Dt::F16, Dt::F16), (Dt::F32, Dt::F32)]),
    ] {
        for (bc_dtype, state_dtype) in others {
            for (batch, dim, dstate, groups) in
                [(1, 4, 16, 1), (3, 6, 5, 2), (2, 8, 64, 4), (2, 3, 1, 1), (1, 2, 256, 2)]
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
    }
    cases
}

#[test]
fn state_update_matches_reference() {
    for k in ssu_cases() {
        for alias in [true, false] {
            let i = ssu_inputs(&k);
            run_ok(
                "selective_state_update",
                h::xla_ssm_selective_state_update_cpu,
                &ssu_call(&k, &i, alias),
                &ssu_wants(&k, &i),
                &k,
            );
        }
    }
}

#[test]
fn state_update_pool_with_indices() {
    for (batch, slots) in [(5, 8), (6, 6), (4, 2)] {
        for alias in [true, false] {
            let k = SsuCase { pool: Some(slots), seed: batch as u64, ..SsuCase::new(batch, 6, 16, 2) };
            let i = ssu_inputs(&k);
            run_ok(
                "state update (pool)",
                h::xla_ssm_selective_state_update_cpu,
                &ssu_call(&k, &i, alias),
                &ssu_wants(&k, &i),
                &k,
            );
        }
    }
}

#[test]
fn state_update_out_of_range_index_is_an_error() {
    let k = SsuCase { pool: Some(4), ..SsuCase::new(3, 4, 8, 1) };
    let mut i = ssu_inputs(&k);
    i.indices = Some(vec![0, 4, 1]);
    let (code, msg) = run(h::xla_ssm_selective_state_update_cpu, &ssu_call(&k, &i, true)).unwrap_err();
    assert_eq!(code, xla::ERR_INVALID_ARGUMENT);
    assert!(msg.contains("state_batch_indices") && msg.contains("got 4 at index 1"), "{msg}");
}

#[test]
fn state_update_zero_sizes() {
    for (batch, dim, dstate) in [(0, 4, 16), (2, 0, 16), (2, 4, 0)] {
        let k = SsuCase::new(batch, dim, dstate, 1);
        let i = ssu_inputs(&k);
        run_ok("zero sizes", h::xla_ssm_selective_state_update_cpu, &ssu_call(&k, &i, true), &ssu_wants(&k, &i), &k);
    }
}

#[test]
fn state_update_errors_name_operand_expected_and_got() {
    let k = SsuCase::new(2, 4, 8, 2);
    let i = ssu_inputs(&k);
    let expect_err = |call: &Call, needles: &[&str]| {
        let (code, msg) = run(h::xla_ssm_selective_state_update_cpu, call).unwrap_err();
        assert_eq!(code, xla::ERR_INVALID_ARGUMENT, "{msg}");
        assert!(msg.starts_with("selective_state_update"), "{msg}");
        for n in needles {
            assert!(msg.contains(n), "{msg} lacks {n}");
        }
    };
    let mut c = ssu_call(&k, &i, true);
    c.args[2].dims = vec![2, 5];
    expect_err(&c, &["`dt`", "(2, 4)", "(2, 5)"]);
    let mut c = ssu_call(&k, &i, true);
    c.args[4].dims = vec![2, 3, 8];
    expect_err(&c, &["`B`", "groups (= 3)"]);
    let mut c = ssu_call(&k, &i, true);
    c.args[0].dtype = xla::F64;
    expect_err(&c, &["`state`", "f64"]);
    let mut c = ssu_call(&k, &i, true);
    c.args.pop();
    expect_err(&c, &["expected", "operands"]);
    let mut c = ssu_call(&k, &i, true);
    c.attrs.retain(|(n, _)| *n != "dt_softplus");
    expect_err(&c, &["dt_softplus", "missing"]);
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
                let seqlen = [1, 3, 17, 40][seed as usize % 4];
                cases.push(ConvCase {
                    dtype,
                    wdtype,
                    bld,
                    has_bias: seed % 2 == 0,
                    has_init: seed % 3 != 1,
                    silu: seed % 5 != 0,
                    seed,
                    ..ConvCase::new(2, 5, seqlen, width)
                });
            }
        }
    }
    cases
}

#[test]
fn conv1d_fwd_matches_reference() {
    for k in conv_cases() {
        let (call, wants) = conv_fwd_call(&k, &conv_inputs(&k));
        run_ok("causal_conv1d_fwd", h::xla_ssm_causal_conv1d_fwd_cpu, &call, &wants, &k);
    }
}

#[test]
fn conv1d_bwd_matches_reference() {
    for k in conv_cases() {
        let (call, wants) = conv_bwd_call(&k, &conv_inputs(&k));
        run_ok("causal_conv1d_bwd", h::xla_ssm_causal_conv1d_bwd_cpu, &call, &wants, &k);
    }
}

#[test]
fn conv1d_update_matches_reference() {
    for k in conv_cases() {
        let i = conv_inputs(&k);
        for (pool, alias) in [(None, true), (None, false), (Some(4), true)] {
            let (call, wants) = conv_update_call(&k, &i, pool, false, alias);
            run_ok("causal_conv1d_update", h::xla_ssm_causal_conv1d_update_cpu, &call, &wants, &k);
        }
        if k.seqlen == 1 {
            let (call, wants) = conv_update_call(&k, &i, None, true, true);
            run_ok("causal_conv1d_update (rank 2)", h::xla_ssm_causal_conv1d_update_cpu, &call, &wants, &k);
        }
    }
}

#[test]
fn conv1d_zero_sizes_and_errors() {
    for (b, d, l) in [(0, 3, 4), (2, 0, 4), (2, 3, 0)] {
        let k = ConvCase::new(b, d, l, 3);
        let i = conv_inputs(&k);
        let (call, wants) = conv_fwd_call(&k, &i);
        run_ok("fwd zero", h::xla_ssm_causal_conv1d_fwd_cpu, &call, &wants, &k);
        let (call, wants) = conv_bwd_call(&k, &i);
        run_ok("bwd zero", h::xla_ssm_causal_conv1d_bwd_cpu, &call, &wants, &k);
    }
    let k = ConvCase::new(2, 3, 4, 4);
    let i = conv_inputs(&k);
    let (mut call, _) = conv_fwd_call(&k, &i);
    call.args[1].dims = vec![3, 5];
    call.args[1].bytes = Dt::F32.encode(&[0.0; 15]);
    let (code, msg) = run(h::xla_ssm_causal_conv1d_fwd_cpu, &call).unwrap_err();
    assert_eq!(code, xla::ERR_INVALID_ARGUMENT);
    assert!(
        msg.contains("causal_conv1d_fwd: operand `weight`") && msg.contains("(3, 5)") && msg.contains("2..=4"),
        "{msg}"
    );
    let (mut call, _) = conv_fwd_call(&k, &i);
    call.attrs.retain(|(n, _)| *n != "layout");
    call.attrs.push(("layout", Attr::Str("lbd".into())));
    let (_, msg) = run(h::xla_ssm_causal_conv1d_fwd_cpu, &call).unwrap_err();
    assert!(msg.contains("`layout`") && msg.contains("lbd"), "{msg}");
}

#[test]
fn conv1d_bwd_is_deterministic() {
    let k = ConvCase::new(3, 4, 50, 4);
    let (call, _) = conv_bwd_call(&k, &conv_inputs(&k));
    let a = run(h::xla_ssm_causal_conv1d_bwd_cpu, &call).unwrap();
    let b = run(h::xla_ssm_causal_conv1d_bwd_cpu, &call).unwrap();
    assert_eq!(a, b);
}

#[test]
fn decode_step_matches_reference() {
    let mut seed = 0;
    for k in ssu_cases().into_iter().step_by(2) {
        for width in 2..=4 {
            seed += 1;
            let wdtype = if seed % 2 == 0 { Dt::F32 } else { k.dtype };
            let alias = seed % 3 != 0;
            let (call, wants) = decode_call(&k, width, wdtype, seed % 4 != 0, alias);
            run_ok("mamba_decode_step", h::xla_ssm_mamba_decode_step_cpu, &call, &wants, &(&k, width));
        }
    }
    let k = SsuCase { pool: Some(7), ..SsuCase::new(5, 6, 16, 2) };
    let (call, wants) = decode_call(&k, 4, Dt::F32, true, true);
    run_ok("mamba_decode_step (pool)", h::xla_ssm_mamba_decode_step_cpu, &call, &wants, &k);
}

#[test]
fn decode_step_errors() {
    let k = SsuCase::new(2, 4, 8, 1);
    let (mut call, _) = decode_call(&k, 4, Dt::F32, true, true);
    call.args[3].dims = vec![2, 4, 9];
    let (code, msg) = run(h::xla_ssm_mamba_decode_step_cpu, &call).unwrap_err();
    assert_eq!(code, xla::ERR_INVALID_ARGUMENT);
    assert!(msg.starts_with("mamba_decode_step: operand `ssm_state`") && msg.contains("(2, 4, 9)"), "{msg}");
    let (mut call, _) = decode_call(&k, 4, Dt::F32, true, true);
    call.args[2].dims = vec![4, 6];
    call.args[2].bytes = Dt::F32.encode(&[0.0; 24]);
    let (_, msg) = run(h::xla_ssm_mamba_decode_step_cpu, &call).unwrap_err();
    assert!(msg.starts_with("mamba_decode_step: operand `conv_weight`"), "{msg}");
}

#[test]
fn metadata_says_command_buffer_compatible_on_cuda() {
    let cuda: [Handler; 5] = [
        h::xla_ssm_selective_state_update_cuda,
        h::xla_ssm_causal_conv1d_fwd_cuda,
        h::xla_ssm_causal_conv1d_bwd_cuda,
        h::xla_ssm_causal_conv1d_update_cuda,
        h::xla_ssm_mamba_decode_step_cuda,
    ];
    for handler in cuda {
        let m = xla::call_metadata(handler, xla::METADATA_STRUCT_SIZE, false).unwrap();
        assert_eq!(m.traits, 1);
    }
    let m = xla::call_metadata(h::xla_ssm_selective_state_update_cpu, xla::METADATA_STRUCT_SIZE, false).unwrap();
    assert_eq!(m.traits, 0);
}

// ---------------------------------------------------------------------------------------------
// C API

fn capi_args(k: &SsuCase, i: &SsuInputs, bufs: &mut [HostBuf]) -> xla_ssm::capi::XlaSsmStateUpdateArgs {
    let p = |j: usize, bufs: &mut [HostBuf]| bufs[j].ptr();
    xla_ssm::capi::XlaSsmStateUpdateArgs {
        batch: k.batch as i64,
        dim: k.dim as i64,
        dstate: k.dstate as i64,
        groups: k.groups as i64,
        n_slots: i.slots as i64,
        dtype: k.dtype.capi(),
        bc_dtype: k.bc_dtype.capi(),
        state_dtype: k.state_dtype.capi(),
        dt_softplus: k.softplus,
        state: p(0, bufs),
        x: p(1, bufs),
        dt: p(2, bufs),
        a: p(3, bufs) as *const f32,
        b: p(4, bufs),
        c: p(5, bufs),
        d: if k.has_d { p(6, bufs) as *const f32 } else { std::ptr::null() },
        z: if k.has_z { p(7, bufs) } else { std::ptr::null() },
        dt_bias: if k.has_bias { p(8, bufs) as *const f32 } else { std::ptr::null() },
        state_batch_indices: if i.indices.is_some() { p(9, bufs) as *const i32 } else { std::ptr::null() },
        out: p(10, bufs),
    }
}

/// Host buffers for the C API, in capi_args's order (all present; unused ones ignored).
fn capi_bufs(k: &SsuCase, i: &SsuInputs) -> Vec<HostBuf> {
    let ix: Vec<u8> = i.indices.clone().unwrap_or_default().iter().flat_map(|v| v.to_le_bytes()).collect();
    [
        k.state_dtype.encode(&i.state),
        k.dtype.encode(&i.x),
        k.dtype.encode(&i.dt),
        Dt::F32.encode(&i.a),
        k.bc_dtype.encode(&i.b),
        k.bc_dtype.encode(&i.c),
        Dt::F32.encode(&i.d),
        k.dtype.encode(&i.z),
        Dt::F32.encode(&i.bias),
        ix,
        k.dtype.nans(k.batch * k.dim),
    ]
    .iter()
    .map(|b| HostBuf::from_bytes(b))
    .collect()
}

#[test]
fn c_api_state_update_and_decode_step() {
    for k in [
        SsuCase::new(2, 8, 16, 2),
        SsuCase { dtype: Dt::BF16, bc_dtype: Dt::BF16, pool: Some(5), ..SsuCase::new(4, 6, 8, 1) },
    ] {
        let i = ssu_inputs(&k);
        let mut bufs = capi_bufs(&k, &i);
        let args = capi_args(&k, &i, &mut bufs);
        // SAFETY: host buffers of the described sizes.
        let status = unsafe { xla_ssm::capi::xla_ssm_selective_state_update_host(&args) };
        assert_eq!(status, 0);
        let (out, state) = ssu_reference(&k, &i, None);
        crate::common::assert_close("capi out", &k, &k.dtype.decode(bufs[10].bytes()), &out, k.dtype.tol());
        crate::common::assert_close(
            "capi state",
            &k,
            &k.state_dtype.decode(bufs[0].bytes()),
            &state,
            k.state_dtype.tol(),
        );

        // The fused step with a zero conv state and weight (0, .., 0, 1): xc = silu(x).
        let width = 3;
        let mut bufs = capi_bufs(&k, &i);
        let mut conv_state = HostBuf::from_bytes(&k.dtype.encode(&vec![0.0; i.slots * k.dim * (width - 1)]));
        let w: Vec<f32> = (0..k.dim * width).map(|j| if j % width == width - 1 { 1.0 } else { 0.0 }).collect();
        let mut weight = HostBuf::from_bytes(&Dt::F32.encode(&w));
        let step = xla_ssm::capi::XlaSsmDecodeStepArgs {
            ssm: capi_args(&k, &i, &mut bufs),
            width: width as i64,
            conv_dtype: Dt::F32.capi(),
            conv_state: conv_state.ptr(),
            conv_weight: weight.ptr() as *const c_void,
            conv_bias: std::ptr::null(),
        };
        // SAFETY: as above.
        assert_eq!(unsafe { xla_ssm::capi::xla_ssm_mamba_decode_step_host(&step) }, 0);
        let xc: Vec<f64> = i.x.iter().map(|&x| x as f64 / (1.0 + (-(x as f64)).exp())).collect();
        let (out, state) = ssu_reference(&k, &i, Some(&xc));
        crate::common::assert_close("capi fused out", &k, &k.dtype.decode(bufs[10].bytes()), &out, k.dtype.tol());
        crate::common::assert_close(
            "capi fused state",
            &k,
            &k.state_dtype.decode(bufs[0].bytes()),
            &state,
            k.state_dtype.tol(),
        );
    }
    // Errors come back as a status and a message.
    let k = SsuCase::new(2, 4, 8, 3);
    let i = ssu_inputs(&k);
    let mut bufs = capi_bufs(&k, &i);
    let args = capi_args(&k, &i, &mut bufs);
    // SAFETY: as above.
    assert_eq!(unsafe { xla_ssm::capi::xla_ssm_selective_state_update_host(&args) }, 1);
    let msg = unsafe { std::ffi::CStr::from_ptr(xla_ssm::capi::xla_ssm_last_error()) }.to_string_lossy().into_owned();
    assert!(msg.contains("groups (= 3)"), "{msg}");
    let _ = Tol::F32;
}
