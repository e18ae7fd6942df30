//! Packed sequences (`cu_seqlens`) in SSD, on the host: a packed call's y, final states and every
//! gradient equal those of one unpacked call per sequence, and the f64 references (the packed
//! recurrence, whose chunk states are the states entering each chunk before a boundary there
//! resets them), over random boundaries (empty and length-1 sequences, boundaries off the chunk
//! grid), dtypes, the tensor-core shapes (chunk_states in T), every optional operand; the refusals
//! (batch, shapes, dtype, boundary values); the C API and its packed workspace sizes. The CUDA
//! target is compared with the host in tests/suite/ffi_cuda_ssd.rs (`packed_matches_host`).

use crate::common::xla::{self, Attr};
use crate::common::{assert_close, Dt, HostBuf, Rng, Tol};
use crate::ssd_common::*;
use std::ffi::c_void;
use xla_ssm::capi::*;

fn below(rng: &mut Rng, n: usize) -> usize {
    ((rng.uniform() * n as f64) as usize).min(n - 1)
}

/// Random sequence lengths adding up to `total`, with empty and length-1 ones among them (one
/// empty sequence first or elsewhere, one last) and lengths up to `longest`.
pub fn lengths(rng: &mut Rng, total: usize, longest: usize) -> Vec<usize> {
    let mut lens = vec![0, 1];
    let mut left = total.saturating_sub(1);
    while left > 0 {
        let l = match below(rng, 5) {
            0 => 0,
            1 => 1,
            _ => 2 + below(rng, longest.max(2)),
        }
        .min(left);
        lens.push(l);
        left -= l;
    }
    lens.push(0);
    let k = lens.len();
    lens.swap(0, below(rng, k));
    lens
}

/// The packed forward (saving chunk states) and backward through the CPU handlers.
fn packed_cpu(p: &SsdProblem) -> (FwdOut, Grads<f32>) {
    let fwd = p.run_fwd_cpu(true).unwrap_or_else(|(c, m)| panic!("packed forward failed ({c}): {m}"));
    let grads = p
        .run_bwd_cpu(fwd.chunk_states.as_ref().expect("chunk_states"))
        .unwrap_or_else(|(c, m)| panic!("packed backward failed ({c}): {m}"));
    (fwd, grads)
}

/// One unpacked CPU call per sequence, put together as the packed call's results: (y, final
/// states, gradients).
fn per_sequence_cpu(p: &SsdProblem) -> (Vec<f32>, Vec<f32>, Grads<f32>) {
    let c = &p.case;
    let xs = c.heads * c.headdim;
    let mut y = vec![0f32; c.x_len()];
    let mut finals = Vec::new();
    let mut parts = Vec::new();
    for (s, (l0, _)) in p.sequences().into_iter().enumerate() {
        let one = p.sequence(s);
        let fwd = one.run_fwd_cpu(true).unwrap_or_else(|(c, m)| panic!("sequence {s} forward failed ({c}): {m}"));
        y[l0 * xs..l0 * xs + fwd.y.len()].copy_from_slice(&fwd.y);
        finals.extend_from_slice(&fwd.final_states);
        let cs = fwd.chunk_states.expect("chunk_states");
        parts.push(one.run_bwd_cpu(&cs).unwrap_or_else(|(c, m)| panic!("sequence {s} backward failed ({c}): {m}")));
    }
    (y, finals, p.stitch(&parts))
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Packed against per-sequence results: f32 ones to f32 rounding (sums over sequences change
/// order), T ones to a rounding of T.
fn same(dtype: Dt) -> Tol {
    if dtype == Dt::F32 {
        Tol { rel_l2: 1e-5, rel_max: 1e-4 }
    } else {
        dtype.tol()
    }
}

pub fn compare_grads(what: &str, case: &SsdCase, got: &Grads<f32>, want: &Grads<f32>, t: Tol, f: Tol) {
    let check = |name: &str, g: &[f32], w: &[f32], tol: Tol| {
        assert_close(&format!("{what}: {name}"), case, g, &f64s(w), tol);
    };
    check("dx", &got.dx, &want.dx, t);
    check("ddt", &got.ddt, &want.ddt, t);
    check("dA", &got.da, &want.da, f);
    check("dB", &got.db, &want.db, t);
    check("dC", &got.dc, &want.dc, t);
    let opt = [
        ("dD", &got.dd, &want.dd, f),
        ("dz", &got.dz, &want.dz, t),
        ("ddt_bias", &got.ddt_bias, &want.ddt_bias, f),
        ("dinitial_states", &got.dh0, &want.dh0, f),
    ];
    for (name, g, w, tol) in opt {
        match (g, w) {
            (Some(g), Some(w)) => check(name, g, w, tol),
            (None, None) => {}
            _ => panic!("{what}: {name} present in one of the two only"),
        }
    }
}

/// Packed == per sequence == the f64 references, for one problem.
fn check_packed(p: &SsdProblem) {
    let case = &p.case;
    let what = format!("lens {:?}", p.sequences().iter().map(|s| s.1).collect::<Vec<_>>());
    let (fwd, grads) = packed_cpu(p);
    check_fwd(case, &p.reference(), &fwd, case.f32_tol());
    check_grads(case, &p.reference_bwd(), &grads);
    let (y, finals, want) = per_sequence_cpu(p);
    assert_close(&format!("{what}: y against per-sequence calls"), case, &fwd.y, &f64s(&y), same(case.dtype));
    let f = same(Dt::F32);
    let f = if case.transformed() { Tol { rel_l2: 2.0 * f.rel_l2, rel_max: 2.0 * f.rel_max } } else { f };
    assert_close(
        &format!("{what}: final_states against per-sequence calls"),
        case,
        &fwd.final_states,
        &f64s(&finals),
        f,
    );
    // Chunk states in T: the backward recomputes from states rounded at other steps than the
    // per-sequence calls' (whose chunks start at each sequence), so f32 gradients differ by T's
    // rounding.
    let fg = if case.chunk_states_dt() == Dt::F32 { f } else { grad_tol(case, "dA") };
    compare_grads(&format!("{what}, against per-sequence calls"), case, &grads, &want, same(case.dtype), fg);
}

#[test]
fn packed_equals_per_sequence_and_the_reference() {
    let mut rng = Rng::new(0x55d9);
    let cases = [
        // (case, total steps, longest sequence)
        (
            SsdCase {
                groups: 2,
                chunk_size: 32,
                d: DForm::PerChannel,
                dt_limit: CLAMP,
                ..SsdCase::new(1, 0, 4, 8, 16).all_optional()
            },
            300,
            90,
        ),
        (
            SsdCase { softplus: false, dt_limit: NO_CLAMP, dt_range: (0.01, 0.3), ..SsdCase::new(1, 0, 2, 3, 5) },
            200,
            150,
        ),
        // Tensor-core shapes: chunk_states in T on the host too.
        (SsdCase { dtype: Dt::BF16, ..SsdCase::new(1, 0, 2, 64, 64).all_optional() }, 400, 130),
        (
            SsdCase { dtype: Dt::F16, chunk_size: 128, has_z: false, ..SsdCase::new(1, 0, 2, 64, 128).all_optional() },
            350,
            200,
        ),
        (
            SsdCase {
                dtype: Dt::F16,
                groups: 4,
                chunk_size: 128,
                d: DForm::PerHead,
                has_z: true,
                ..SsdCase::new(1, 0, 4, 16, 7)
            },
            500,
            260,
        ),
        (
            SsdCase {
                groups: 3,
                chunk_size: 256,
                has_initial_states: true,
                dt_limit: CLAMP,
                ..SsdCase::new(1, 0, 3, 5, 4)
            },
            150,
            40,
        ),
    ];
    for (k, (case, total, longest)) in cases.into_iter().enumerate() {
        let lens = lengths(&mut rng, total, longest);
        let case = SsdCase { seed: 100 + k as u64, ..case };
        check_packed(&SsdProblem::packed(&case, &lens, k % 2 == 0));
    }
}

/// One sequence, sequences of one step each, empty sequences only, none at all, and boundaries on
/// the chunk grid.
#[test]
fn packed_edge_cases() {
    let base = SsdCase { chunk_size: 32, groups: 2, ..SsdCase::new(1, 0, 2, 4, 3).all_optional() };
    for lens in [vec![70], vec![1; 40], vec![0, 0, 0], vec![], vec![32, 0, 64, 32, 1, 31], vec![0, 33, 0]] {
        for with_dfinal in [true, false] {
            let p = SsdProblem::packed(&base, &lens, with_dfinal);
            check_packed(&p);
            if lens.iter().all(|&l| l == 0) {
                // Nothing ran: each final state is its initial state, each initial state's gradient
                // is its final state's cotangent (or zero).
                let (fwd, grads) = packed_cpu(&p);
                assert_eq!(&fwd.final_states, p.h0.as_ref().unwrap());
                let dh0 = grads.dh0.unwrap();
                match &p.dfinal {
                    Some(v) => assert_eq!(&dh0, v),
                    None => assert!(dh0.iter().all(|&v| v == 0.0)),
                }
            }
        }
    }
}

/// A single sequence packed is the unpacked call (its chunk 0 aside: the state before the first
/// boundary is zero).
#[test]
fn one_sequence_is_the_unpacked_call() {
    let case = SsdCase { chunk_size: 32, ..SsdCase::new(1, 100, 2, 4, 8).all_optional() };
    let packed = SsdProblem::packed(&case, &[100], true);
    let unpacked = packed.sequence(0);
    let (pf, pg) = packed_cpu(&packed);
    let uf = unpacked.run_fwd_cpu(true).unwrap();
    let ug = unpacked.run_bwd_cpu(uf.chunk_states.as_ref().unwrap()).unwrap();
    assert_eq!(pf.y, uf.y);
    assert_eq!(pf.final_states, uf.final_states);
    let state = case.heads * case.headdim * case.dstate;
    let (pcs, ucs) = (pf.chunk_states.unwrap(), uf.chunk_states.unwrap());
    let nc = case.n_chunks();
    for (i, (p, u)) in pcs.iter().zip(&ucs).enumerate() {
        let chunk = (i / case.dstate) % nc;
        assert_eq!(*p, if chunk == 0 { 0.0 } else { *u }, "chunk_states[{i}]");
    }
    assert_eq!(pcs.len(), state * nc);
    assert_eq!(pg.bits(), ug.bits(), "gradients");
}

// ------------------------------------------------------------------------------------ refusals

fn run_fwd(p: &SsdProblem, edit: impl FnOnce(&mut Vec<Arr>)) -> Result<Vec<Vec<u8>>, (i32, String)> {
    let mut args = p.operands();
    edit(&mut args);
    run_host(xla_ssm::xla::handlers::xla_ssm_ssd_fwd_cpu, &args, &p.fwd_results(true), &p.fwd_attrs(true))
}

fn refused(what: &str, r: Result<Vec<Vec<u8>>, (i32, String)>, needles: &[&str]) {
    match r {
        Ok(_) => panic!("{what}: accepted"),
        Err((code, m)) => {
            assert_eq!(code, xla::ERR_INVALID_ARGUMENT, "{what}: {m}");
            assert!(needles.iter().all(|n| m.contains(n)), "{what}: message {m:?} lacks one of {needles:?}");
        }
    }
}

fn set_cu(args: &mut [Arr], cu: &[i32]) {
    let a = args.iter_mut().find(|a| a.name == "cu_seqlens").unwrap();
    a.dims = vec![cu.len() as i64];
    a.bytes = cu.iter().flat_map(|v| v.to_le_bytes()).collect();
}

#[test]
fn packed_refusals() {
    let case = SsdCase { chunk_size: 32, ..SsdCase::new(1, 0, 2, 4, 3).all_optional() };
    let p = SsdProblem::packed(&case, &[5, 0, 7], true);

    // Boundaries the host can read: 0 first, non-decreasing, seqlen last; forward and backward.
    let cs = vec![0f32; p.case.chunk_len()];
    for (cu, needle) in [([1, 5, 5, 12], "first"), ([0, 7, 5, 12], "decrease"), ([0, 5, 5, 11], "last")] {
        refused("forward", run_fwd(&p, |a| set_cu(a, &cu)), &["cu_seqlens", needle]);
        let mut args = p.bwd_operands(&cs);
        set_cu(&mut args, &cu);
        let r = run_host(xla_ssm::xla::handlers::xla_ssm_ssd_bwd_cpu, &args, &p.bwd_results(), &p.bwd_attrs());
        refused("backward", r, &["cu_seqlens", needle]);
    }
    // Shape and dtype of the boundaries.
    refused(
        "cu_seqlens f32",
        run_fwd(&p, |a| a.iter_mut().find(|a| a.name == "cu_seqlens").unwrap().dtype = xla::F32),
        &["cu_seqlens"],
    );
    refused(
        "cu_seqlens rank 2",
        run_fwd(&p, |a| a.iter_mut().find(|a| a.name == "cu_seqlens").unwrap().dims = vec![2, 2]),
        &["cu_seqlens", "num_seqs + 1"],
    );
    // States per sequence, not per batch entry.
    refused(
        "initial_states of one row",
        run_fwd(&p, |a| {
            let h0 = a.iter_mut().find(|a| a.name == "initial_states").unwrap();
            h0.dims[0] = 1;
            h0.bytes.truncate(h0.bytes.len() / 3);
        }),
        &["initial_states", "num_seqs"],
    );
    // Packing needs batch 1.
    let case2 = SsdCase { has_initial_states: false, ..SsdCase::new(2, 12, 2, 4, 3) };
    let mut p2 = SsdProblem::random(&case2, false);
    p2.cu = Some(vec![0, 12]);
    refused("batch 2", run_fwd(&p2, |_| {}), &["cu_seqlens", "batch must be 1"]);
    // The operand without its flag is one operand too many; the flag without the operand one too few.
    let mut attrs = p.fwd_attrs(true);
    attrs.retain(|(n, _)| *n != "has_cu_seqlens");
    let r = run_host(xla_ssm::xla::handlers::xla_ssm_ssd_fwd_cpu, &p.operands(), &p.fwd_results(true), &attrs);
    assert!(r.is_err(), "cu_seqlens without has_cu_seqlens accepted");
    attrs.push(("has_cu_seqlens", Attr::Bool(false)));
    let r = run_host(xla_ssm::xla::handlers::xla_ssm_ssd_fwd_cpu, &p.operands(), &p.fwd_results(true), &attrs);
    assert!(r.is_err(), "cu_seqlens with has_cu_seqlens = false accepted");
}

// ------------------------------------------------------------------------------------- C API

/// The host C API on a packed problem gives the handlers' results; the packed workspace sizes.
#[test]
fn c_api_packed() {
    let case = SsdCase { chunk_size: 32, groups: 2, ..SsdCase::new(1, 0, 4, 3, 5).all_optional() };
    let p = SsdProblem::packed(&case, &[10, 0, 1, 40, 9], true);
    let c = &p.case;
    let (fwd, grads) = packed_cpu(&p);
    let cs = fwd.chunk_states.clone().unwrap();
    let host = |v: &[f32]| HostBuf::from_bytes(&Dt::F32.encode(v));
    let t = |v: &[f32]| HostBuf::from_bytes(&c.dtype.encode(v));
    let (mut x, mut dt, mut a, mut b, mut cc) = (t(&p.x), t(&p.dt), host(&p.a), t(&p.b), t(&p.c));
    let (mut d, mut z, mut bias, mut h0) = (
        host(p.d.as_ref().unwrap()),
        t(p.z.as_ref().unwrap()),
        host(p.dt_bias.as_ref().unwrap()),
        host(p.h0.as_ref().unwrap()),
    );
    let (mut dy, mut dfinal, mut csb) = (t(&p.dy), host(p.dfinal.as_ref().unwrap()), host(&cs));
    let cu = p.cu.clone().unwrap();
    let rows = p.state_rows();
    let mut y = vec![f32::NAN; c.x_len()];
    let mut fin = vec![f32::NAN; rows * c.heads * c.headdim * c.dstate];
    let mut cs_out = vec![f32::NAN; c.chunk_len()];
    let [batch, seqlen, heads, headdim, dstate, groups, chunk_size] = c.capi_sizes();
    let fwd_args = XlaSsmSsdFwdArgs {
        batch,
        seqlen,
        heads,
        headdim,
        dstate,
        groups,
        chunk_size,
        dtype: c.dtype.capi(),
        d_per_channel: false,
        dt_softplus: true,
        dt_min: c.dt_limit.0,
        dt_max: c.dt_limit.1,
        x: x.ptr(),
        dt: dt.ptr(),
        a: a.ptr() as *const f32,
        b: b.ptr(),
        c: cc.ptr(),
        d: d.ptr() as *const f32,
        z: z.ptr(),
        dt_bias: bias.ptr() as *const f32,
        initial_states: h0.ptr() as *const f32,
        y: y.as_mut_ptr().cast(),
        final_states: fin.as_mut_ptr(),
        chunk_states: cs_out.as_mut_ptr().cast(),
        chunk_states_dtype: XLA_SSM_F32,
        workspace: std::ptr::null_mut(),
        workspace_bytes: 0,
        cu_seqlens: cu.as_ptr(),
        num_seqs: rows as i64,
    };
    // SAFETY: every pointer addresses a host array of the size the struct describes.
    assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&fwd_args) }, XLA_SSM_OK, "{}", crate::c_api::last_error());
    assert_eq!((y, fin, cs_out), (fwd.y.clone(), fwd.final_states.clone(), cs));

    let n = |len: usize| vec![f32::NAN; len];
    let (mut dx, mut ddt, mut da, mut db, mut dc) =
        (n(c.x_len()), n(c.dt_len()), n(c.heads), n(c.bc_len()), n(c.bc_len()));
    let (mut dd, mut dz, mut dbias, mut dh0) = (n(c.heads), n(c.x_len()), n(c.heads), n(fwd.final_states.len()));
    let bwd_args = XlaSsmSsdBwdArgs {
        batch,
        seqlen,
        heads,
        headdim,
        dstate,
        groups,
        chunk_size,
        dtype: c.dtype.capi(),
        d_per_channel: false,
        dt_softplus: true,
        dt_min: c.dt_limit.0,
        dt_max: c.dt_limit.1,
        x: x.ptr(),
        dt: dt.ptr(),
        a: a.ptr() as *const f32,
        b: b.ptr(),
        c: cc.ptr(),
        d: d.ptr() as *const f32,
        z: z.ptr(),
        dt_bias: bias.ptr() as *const f32,
        initial_states: h0.ptr() as *const f32,
        chunk_states: csb.ptr() as *const c_void,
        chunk_states_dtype: XLA_SSM_F32,
        dy: dy.ptr(),
        dfinal_states: dfinal.ptr() as *const f32,
        dx: dx.as_mut_ptr().cast(),
        ddt: ddt.as_mut_ptr().cast(),
        da: da.as_mut_ptr(),
        db: db.as_mut_ptr().cast(),
        dc: dc.as_mut_ptr().cast(),
        dd: dd.as_mut_ptr(),
        dz: dz.as_mut_ptr().cast(),
        ddt_bias: dbias.as_mut_ptr(),
        dinitial_states: dh0.as_mut_ptr(),
        workspace: std::ptr::null_mut(),
        workspace_bytes: 0,
        cu_seqlens: cu.as_ptr(),
        num_seqs: rows as i64,
    };
    // SAFETY: as above.
    assert_eq!(unsafe { xla_ssm_ssd_bwd_host(&bwd_args) }, XLA_SSM_OK, "{}", crate::c_api::last_error());
    let got = Grads { dx, ddt, da, db, dc, dd: Some(dd), dz: Some(dz), ddt_bias: Some(dbias), dh0: Some(dh0) };
    assert_eq!(got.bits(), grads.bits());

    // A bad boundary through the C API: refused, nothing written.
    let bad = [0, 10, 10, 9, 60, 60];
    let mut y2 = vec![f32::NAN; c.x_len()];
    let args = XlaSsmSsdFwdArgs { cu_seqlens: bad.as_ptr(), y: y2.as_mut_ptr().cast(), ..fwd_args };
    // SAFETY: as above.
    assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&args) }, XLA_SSM_INVALID_ARGUMENT);
    assert!(crate::c_api::last_error().contains("cu_seqlens"));
    assert!(y2.iter().all(|v| v.is_nan()));
    // A negative num_seqs is refused before any array is touched.
    let args = XlaSsmSsdFwdArgs { num_seqs: -1, ..fwd_args };
    // SAFETY: as above (refused before any access).
    assert_eq!(unsafe { xla_ssm_ssd_fwd_host(&args) }, XLA_SSM_INVALID_ARGUMENT);
}

#[test]
fn packed_workspace_sizes() {
    let (bf16, f32_) = (Dt::BF16.capi(), Dt::F32.capi());
    // Outside the tensor-core shapes, the generic path's: at batch 1, the unpacked sizes...
    for (l, h, p, n, g, q, t) in
        [(1000, 4, 16, 16, 2, 64, f32_), (513, 2, 64, 64, 1, 64, f32_), (300, 8, 16, 64, 2, 128, bf16)]
    {
        assert_eq!(
            xla_ssm_ssd_packed_fwd_workspace_bytes(l, 7, h, p, n, g, q, t),
            xla_ssm_ssd_fwd_workspace_bytes(1, l, h, p, n, g, q, t)
        );
        assert_eq!(
            xla_ssm_ssd_packed_bwd_workspace_bytes(l, 7, h, p, n, g, q, t),
            xla_ssm_ssd_bwd_workspace_bytes(1, l, h, p, n, g, q, t)
        );
    }
    // ...and at them: the forward's the tensor-core path's (as unpacked at a kernel dstate; a widened
    // state has a row per sequence), the backward's the larger of the generic path's plus an f32 copy
    // of chunk_states (calls with states) and the tensor-core path's (without).
    let (l, h, q) = (1000i64, 4i64, 128i64);
    let f32_states = h * 64 * ((l + q - 1) / q) * 128 * 4;
    let fwd = xla_ssm_ssd_packed_fwd_workspace_bytes(l, 3, h, 64, 128, 1, q, bf16);
    assert_eq!(fwd, xla_ssm_ssd_fwd_workspace_bytes(1, l, h, 64, 128, 1, q, bf16));
    let widened = |seqs| xla_ssm_ssd_packed_fwd_workspace_bytes(l, seqs, h, 64, 100, 1, q, bf16);
    assert_eq!(widened(1), xla_ssm_ssd_fwd_workspace_bytes(1, l, h, 64, 100, 1, q, bf16));
    assert_eq!(widened(3) - widened(1), 2 * 2 * h * 64 * 128 * 4, "initial and final states, 2 more rows");
    let bwd = xla_ssm_ssd_packed_bwd_workspace_bytes(l, 3, h, 64, 128, 1, q, bf16);
    assert!(bwd >= f32_states, "{bwd} {f32_states}");
    assert!(bwd >= xla_ssm_ssd_bwd_workspace_bytes(1, l, h, 64, 128, 1, q, bf16));
    // Refused as a call would be.
    assert_eq!(xla_ssm_ssd_packed_fwd_workspace_bytes(l, -1, h, 64, 128, 1, q, bf16), -1);
    assert!(crate::c_api::last_error().contains("non-negative"));
    assert_eq!(xla_ssm_ssd_packed_bwd_workspace_bytes(l, 3, h, 64, 128, 1, 100, bf16), -1);
}
