//! Sizes where the official kernels fail, on the GPU: more than 2^31 and 2^32 elements (32-bit
//! offsets, state-spaces/mamba #880) over a sequence of 1,048,576 steps with long-memory decays
//! (#686, #503). Each whole-sequence call (with the workspace that lets it split the sequence) is
//! checked against the same problem run in pieces of 2^30 elements at most, chained through their
//! final and initial states: the pieces need no 64-bit offsets, so a wrapped offset in the whole
//! call shows as a difference. More than 65535 channels (#505) and decode batches past the grid are
//! in tests/suite/ffi_cuda*.rs. `#[ignore]`d: they need a device with 40 GB free
//! (scripts/gpu-run.sh runs them).
#![cfg(feature = "cuda")]

use crate::common::cuda::{gpu, synchronize, Stream};
use crate::common::{Dt, Rng};
use cudarc::driver::{result, sys};
use std::ffi::c_void;
use xla_ssm::capi::*;

/// A device allocation of `len` bytes, freed on drop.
struct Dev {
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl Dev {
    fn alloc(len: usize) -> Dev {
        // SAFETY: a plain allocation (at least one byte, so never null).
        let ptr = unsafe { result::malloc_sync(len.max(1)) }.expect("cuMemAlloc");
        Dev { ptr, len }
    }

    /// `len` bytes repeating `pattern` (uploaded once, then doubled on the device).
    fn filled(len: usize, pattern: &[u8]) -> Dev {
        let d = Dev::alloc(len);
        let first = pattern.len().min(len);
        // SAFETY: `first` <= len bytes into the allocation, then device copies within it, each
        // from its filled prefix into the bytes after it.
        unsafe {
            result::memcpy_htod_sync(d.ptr, &pattern[..first]).expect("cuMemcpyHtoD");
            let mut filled = first;
            while filled < len {
                let n = filled.min(len - filled);
                result::memcpy_dtod_sync(d.ptr + filled as u64, d.ptr, n).expect("cuMemcpyDtoD");
                filled += n;
            }
        }
        d
    }

    fn at(&self, byte: usize) -> *mut c_void {
        assert!(byte <= self.len);
        (self.ptr + byte as u64) as *mut c_void
    }

    fn download(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `len` bytes were allocated.
        unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr) }.expect("cuMemcpyDtoH");
        out
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc`, freed once.
        unsafe { result::free_sync(self.ptr) }.expect("cuMemFree");
    }
}

fn last_error() -> String {
    // SAFETY: a NUL-terminated string owned by the library.
    unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned()
}

/// Random values in [lo, hi) of `dtype`, `n` of them, as bytes.
fn random(dtype: Dt, n: usize, lo: f64, hi: f64, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    dtype.encode(&(0..n).map(|_| rng.range(lo, hi) as f32).collect::<Vec<_>>())
}

/// Whole and pieced outputs agree: no NaN, relative L2 error and largest error within `tol` of
/// the output's scale, compared in blocks (the outputs are several GB).
fn assert_agree(what: &str, dtype: Dt, whole: &[u8], pieces: &[u8], tol: f64) {
    assert_eq!(whole.len(), pieces.len());
    let block = 1 << 24;
    let (mut diff2, mut ref2, mut max_diff, mut max_ref) = (0f64, 0f64, 0f64, 0f64);
    for (a, b) in whole.chunks(block).zip(pieces.chunks(block)) {
        for (x, y) in dtype.decode(a).into_iter().zip(dtype.decode(b)) {
            assert!(x.is_finite() && y.is_finite(), "{what}: a non-finite output ({x} vs {y})");
            let d = (x - y).abs() as f64;
            diff2 += d * d;
            ref2 += (y as f64) * (y as f64);
            max_diff = max_diff.max(d);
            max_ref = max_ref.max(y.abs() as f64);
        }
    }
    let (rel_l2, rel_max) = ((diff2 / ref2.max(1e-30)).sqrt(), max_diff / max_ref.max(1e-30));
    println!("{what}: whole vs pieces rel L2 {rel_l2:.1e}, max {rel_max:.1e} (|out| up to {max_ref:.2})");
    assert!(ref2 > 0.0, "{what}: the output is all zeros");
    assert!(rel_l2 <= tol && rel_max <= 8.0 * tol, "{what}: rel L2 {rel_l2:.1e}, max {rel_max:.1e} > {tol:.0e}");
}

/// The selective scan forward over (1, seqlen, dim) channel-last with one group: long-memory
/// decays (A in [-0.05, -0.01], delta ~ softplus(-4..-2)), whole and in `pieces` chained pieces.
fn scan_whole_vs_pieces(dtype: Dt, dim: usize, seqlen: usize, pieces: usize) {
    gpu();
    let dstate = 16usize;
    let x_len = dim * seqlen;
    let bc_len = seqlen * dstate;
    let stream = Stream::new();
    let u = Dev::filled(x_len * dtype.size(), &random(dtype, 1 << 22, -1.0, 1.0, 1));
    let delta = Dev::filled(x_len * dtype.size(), &random(dtype, (1 << 22) + 7, -4.0, -2.0, 2));
    let b = Dev::filled(bc_len * dtype.size(), &random(dtype, (1 << 20) + 3, -1.0, 1.0, 3));
    let c = Dev::filled(bc_len * dtype.size(), &random(dtype, (1 << 20) + 5, -1.0, 1.0, 4));
    let a = Dev::filled(dim * dstate * 4, &random(Dt::F32, dim * dstate, -0.05, -0.01, 5));
    let d = Dev::filled(dim * 4, &random(Dt::F32, dim, 0.5, 1.5, 6));
    let out_whole = Dev::alloc(x_len * dtype.size());
    let out_pieces = Dev::alloc(x_len * dtype.size());
    let state_bytes = dim * dstate * 4;
    let states: Vec<Dev> = (0..=pieces).map(|_| Dev::alloc(state_bytes)).collect();

    let args = |l0: usize, len: usize, out: &Dev, h0: Option<&Dev>, h1: &Dev| XlaSsmSelectiveScanFwdArgs {
        cu_seqlens: std::ptr::null(),
        num_seqs: 0,
        batch: 1,
        dim: dim as i64,
        seqlen: len as i64,
        dstate: dstate as i64,
        groups: 1,
        dtype: dtype.capi(),
        bc_dtype: dtype.capi(),
        layout: XLA_SSM_LAYOUT_BLD,
        delta_softplus: true,
        u: u.at(l0 * dim * dtype.size()),
        delta: delta.at(l0 * dim * dtype.size()),
        a: a.at(0) as *const f32,
        b: b.at(l0 * dstate * dtype.size()),
        c: c.at(l0 * dstate * dtype.size()),
        d: d.at(0) as *const f32,
        z: std::ptr::null(),
        delta_bias: std::ptr::null(),
        initial_state: h0.map_or(std::ptr::null(), |h| h.at(0) as *const f32),
        out: out.at(l0 * dim * dtype.size()),
        final_state: h1.at(0) as *mut f32,
        workspace: std::ptr::null_mut(),
        workspace_bytes: 0,
        checkpoint_len: 0,
        checkpoints: std::ptr::null_mut(),
    };
    let launch = |a: &XlaSsmSelectiveScanFwdArgs| {
        // SAFETY: device buffers of the sizes `a` describes (offsets within them), in the current
        // context; the stream is live.
        let status = unsafe { xla_ssm_selective_scan_fwd_cuda_launch(a, stream.ptr()) };
        assert_eq!(status, XLA_SSM_OK, "{}", last_error());
    };

    // The whole sequence, with the workspace that lets the kernel split it.
    let ws_bytes = xla_ssm_selective_scan_fwd_workspace_bytes(1, dim as i64, seqlen as i64, dstate as i64);
    assert!(ws_bytes >= 0, "{}", last_error());
    let ws = Dev::alloc(ws_bytes as usize);
    let mut whole = args(0, seqlen, &out_whole, None, &states[0]);
    (whole.workspace, whole.workspace_bytes) = (ws.at(0), ws_bytes);
    launch(&whole);
    // The pieces, each starting from the one before's final state.
    let step = seqlen / pieces;
    for k in 0..pieces {
        let h0 = (k > 0).then(|| &states[k]);
        launch(&args(k * step, step, &out_pieces, h0, &states[k + 1]));
    }
    synchronize(stream.ptr());

    let what = format!("selective_scan_fwd {dtype:?} (1, {seqlen}, {dim}): {} elements", x_len);
    let tol = if dtype == Dt::F32 { 1e-4 } else { 2e-2 };
    assert_agree(&what, dtype, &out_whole.download(), &out_pieces.download(), tol);
    let (h_whole, h_pieces) = (Dt::F32.decode(&states[0].download()), Dt::F32.decode(&states[pieces].download()));
    let scale = h_pieces.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = h_whole.iter().zip(&h_pieces).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(scale > 0.0 && worst <= 1e-3 * scale, "{what}: final states differ by {worst} (scale {scale})");
}

/// 2^32 elements: bf16, 4096 channels over 1,048,576 steps, against 4 pieces of 2^30.
#[test]
#[ignore = "needs a CUDA device with 40 GB free (scripts/gpu-run.sh runs the ignored tests)"]
fn selective_scan_past_2_pow_32_elements() {
    scan_whole_vs_pieces(Dt::BF16, 4096, 1 << 20, 4);
}

/// 2^31 elements: f32, 2048 channels over 1,048,576 steps, against 2 pieces of 2^30.
#[test]
#[ignore = "needs a CUDA device with 40 GB free (scripts/gpu-run.sh runs the ignored tests)"]
fn selective_scan_past_2_pow_31_elements() {
    scan_whole_vs_pieces(Dt::F32, 2048, 1 << 20, 2);
}

/// SSD forward past 2^31 elements: x (1, 524288, 64, 64) bf16, dstate 128, against 2 pieces.
#[test]
#[ignore = "needs a CUDA device with 40 GB free (scripts/gpu-run.sh runs the ignored tests)"]
fn ssd_past_2_pow_31_elements() {
    gpu();
    let dtype = Dt::BF16;
    let (seqlen, heads, headdim, dstate, chunk) = (1usize << 19, 64usize, 64usize, 128usize, 256i64);
    let x_len = seqlen * heads * headdim;
    let stream = Stream::new();
    let x = Dev::filled(x_len * 2, &random(dtype, 1 << 22, -1.0, 1.0, 11));
    let dt = Dev::filled(seqlen * heads * 2, &random(dtype, (1 << 20) + 1, -4.0, -2.0, 12));
    let b = Dev::filled(seqlen * dstate * 2, &random(dtype, (1 << 20) + 3, -0.3, 0.3, 13));
    let c = Dev::filled(seqlen * dstate * 2, &random(dtype, (1 << 20) + 5, -0.3, 0.3, 14));
    let a = Dev::filled(heads * 4, &random(Dt::F32, heads, -0.05, -0.01, 15));
    let y_whole = Dev::alloc(x_len * 2);
    let y_pieces = Dev::alloc(x_len * 2);
    let state_bytes = heads * headdim * dstate * 4;
    let states: Vec<Dev> = (0..3).map(|_| Dev::alloc(state_bytes)).collect();

    let run = |l0: usize, len: usize, y: &Dev, h0: Option<&Dev>, h1: &Dev| {
        let ws_bytes = xla_ssm_ssd_fwd_workspace_bytes(
            1,
            len as i64,
            heads as i64,
            headdim as i64,
            dstate as i64,
            1,
            chunk,
            dtype.capi(),
        );
        assert!(ws_bytes >= 0, "{}", last_error());
        let ws = Dev::alloc(ws_bytes as usize);
        let args = XlaSsmSsdFwdArgs {
            batch: 1,
            seqlen: len as i64,
            heads: heads as i64,
            headdim: headdim as i64,
            dstate: dstate as i64,
            groups: 1,
            chunk_size: chunk,
            dtype: dtype.capi(),
            d_per_channel: false,
            dt_softplus: true,
            dt_min: 0.0,
            dt_max: f32::INFINITY,
            x: x.at(l0 * heads * headdim * 2),
            dt: dt.at(l0 * heads * 2),
            a: a.at(0) as *const f32,
            b: b.at(l0 * dstate * 2),
            c: c.at(l0 * dstate * 2),
            d: std::ptr::null(),
            z: std::ptr::null(),
            dt_bias: std::ptr::null(),
            initial_states: h0.map_or(std::ptr::null(), |h| h.at(0) as *const f32),
            y: y.at(l0 * heads * headdim * 2),
            final_states: h1.at(0) as *mut f32,
            chunk_states: std::ptr::null_mut(),
            chunk_states_dtype: XLA_SSM_F32,
            workspace: ws.at(0),
            workspace_bytes: ws_bytes,
            cu_seqlens: std::ptr::null(),
            num_seqs: 0,
        };
        // SAFETY: device buffers of the sizes `args` describes (offsets within them), in the
        // current context; the stream is live.
        let status = unsafe { xla_ssm_ssd_fwd_cuda_launch(&args, stream.ptr()) };
        assert_eq!(status, XLA_SSM_OK, "{}", last_error());
        synchronize(stream.ptr()); // before `ws` is freed
    };
    run(0, seqlen, &y_whole, None, &states[0]);
    let half = seqlen / 2;
    run(0, half, &y_pieces, None, &states[1]);
    run(half, half, &y_pieces, Some(&states[1]), &states[2]);

    let what = format!("ssd_fwd bf16 (1, {seqlen}, {heads}, {headdim}), dstate {dstate}: {x_len} elements");
    assert_agree(&what, dtype, &y_whole.download(), &y_pieces.download(), 2e-2);
    let (h_whole, h_pieces) = (Dt::F32.decode(&states[0].download()), Dt::F32.decode(&states[2].download()));
    let scale = h_pieces.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = h_whole.iter().zip(&h_pieces).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(scale > 0.0 && worst <= 1e-2 * scale, "{what}: final states differ by {worst} (scale {scale})");
}
