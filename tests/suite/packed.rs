//! Packed sequences (`cu_seqlens`) in the selective scan, through the C API: a packed call's
//! outputs, final states and every gradient equal those of one unpacked call per sequence, over
//! random boundaries (empty and length-1 sequences, boundaries off every chunk, piece and checkpoint
//! grid), both layouts, time-varying and time-invariant B/C, with and without initial states and
//! final-state cotangents. On the host here; `cuda_matches_host` compares the CUDA target with it.

#[cfg(feature = "cuda")]
use crate::common::cuda::{gpu, synchronize, DevBuf};
use crate::common::Rng;
#[cfg(feature = "cuda")]
use std::cell::RefCell;
use std::ffi::c_void;

/// Where a call's arrays live: host memory (the vectors themselves), or device copies.
struct Device {
    cuda: bool,
    #[cfg(feature = "cuda")]
    bufs: RefCell<Vec<DevBuf>>,
}

impl Device {
    fn new(cuda: bool) -> Device {
        Device {
            cuda,
            #[cfg(feature = "cuda")]
            bufs: RefCell::new(Vec::new()),
        }
    }

    fn bytes(&self, host: *const c_void, bytes: &[u8]) -> *mut c_void {
        if !self.cuda {
            return host as *mut c_void;
        }
        #[cfg(feature = "cuda")]
        {
            let buf = DevBuf::upload(bytes);
            let ptr = buf.data();
            self.bufs.borrow_mut().push(buf);
            ptr
        }
        #[cfg(not(feature = "cuda"))]
        unreachable!("a CUDA call in a build without CUDA ({} bytes)", bytes.len())
    }

    fn f32s(&self, v: &[f32]) -> *mut c_void {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.bytes(v.as_ptr().cast(), &bytes)
    }

    /// An output array: the device copy, or `v` itself on the host.
    fn out(&self, v: &mut [f32]) -> *mut c_void {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        if !self.cuda {
            return v.as_mut_ptr().cast();
        }
        self.bytes(std::ptr::null(), &bytes)
    }

    fn i32s(&self, v: &[i32]) -> *mut c_void {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.bytes(v.as_ptr().cast(), &bytes)
    }

    /// `bytes` of device scratch (null on the host or when 0).
    fn scratch(&self, bytes: i64) -> *mut c_void {
        if !self.cuda || bytes <= 0 {
            return std::ptr::null_mut();
        }
        self.bytes(std::ptr::null(), &vec![0xa5; bytes as usize])
    }

    /// Copies the device array at `ptr` back into `v` (on the host `ptr` is `v` already).
    fn get(&self, ptr: *mut f32, v: &mut [f32]) {
        #[cfg(feature = "cuda")]
        if self.cuda && !v.is_empty() {
            self.download(ptr, v);
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (ptr, v);
    }

    #[cfg(feature = "cuda")]
    fn download(&self, ptr: *mut f32, v: &mut [f32]) {
        synchronize(std::ptr::null_mut());
        let bufs = self.bufs.borrow();
        let buf = bufs.iter().find(|b| b.data() == ptr.cast()).expect("a buffer of this call");
        for (o, c) in v.iter_mut().zip(buf.download().chunks_exact(4)) {
            *o = f32::from_le_bytes(c.try_into().unwrap());
        }
    }
}
use xla_ssm::capi::*;

/// One packed problem, f32, batch 1.
struct Packed {
    dim: usize,
    dstate: usize,
    groups: usize,
    bld: bool,
    cu: Vec<i32>,
    u: Vec<f32>,
    delta: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    d: Vec<f32>,
    z: Vec<f32>,
    bias: Vec<f32>,
    h0: Option<Vec<f32>>,
    dout: Vec<f32>,
    dfinal: Option<Vec<f32>>,
}

/// Results of a forward and a backward.
#[derive(Default)]
struct Results {
    out: Vec<f32>,
    last: Vec<f32>,
    du: Vec<f32>,
    ddelta: Vec<f32>,
    dz: Vec<f32>,
    da: Vec<f32>,
    db: Vec<f32>,
    dc: Vec<f32>,
    dd: Vec<f32>,
    dbias: Vec<f32>,
    dh0: Vec<f32>,
}

const CHECKPOINT_LEN: i64 = 32;

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32 * scale).collect()
}

impl Packed {
    #[allow(clippy::too_many_arguments)]
    fn new(
        seed: u64,
        dim: usize,
        dstate: usize,
        groups: usize,
        bld: bool,
        lens: &[usize],
        h0: bool,
        dfinal: bool,
    ) -> Packed {
        let mut rng = Rng::new(seed);
        let mut cu = vec![0i32];
        for &l in lens {
            cu.push(cu.last().unwrap() + l as i32);
        }
        let (t, seqs) = (*cu.last().unwrap() as usize, lens.len());
        let bc = if groups == 0 { dim * dstate } else { groups * dstate * t };
        Packed {
            dim,
            dstate,
            groups,
            bld,
            u: random(&mut rng, dim * t, 1.0),
            delta: random(&mut rng, dim * t, 0.5),
            a: (0..dim * dstate).map(|_| -(0.2 + rng.uniform() as f32 * 2.0)).collect(),
            b: random(&mut rng, bc, 1.0),
            c: random(&mut rng, bc, 1.0),
            d: random(&mut rng, dim, 1.0),
            z: random(&mut rng, dim * t, 1.0),
            bias: random(&mut rng, dim, 0.3),
            h0: h0.then(|| random(&mut rng, seqs * dim * dstate, 1.0)),
            dout: random(&mut rng, dim * t, 1.0),
            dfinal: dfinal.then(|| random(&mut rng, seqs * dim * dstate, 1.0)),
            cu,
        }
    }

    fn seqlen(&self) -> usize {
        *self.cu.last().unwrap() as usize
    }

    /// Index of (channel d, step l) in a (1, dim, t) / (1, t, dim) array of `t` steps.
    fn x(&self, t: usize, d: usize, l: usize) -> usize {
        if self.bld {
            l * self.dim + d
        } else {
            d * t + l
        }
    }

    /// Index of (group g, state n, step l) of time-varying B/C over `t` steps.
    fn bc(&self, t: usize, g: usize, n: usize, l: usize) -> usize {
        if self.bld {
            (l * self.groups + g) * self.dstate + n
        } else {
            (g * self.dstate + n) * t + l
        }
    }

    /// Steps l0..l0 + len of a per-step array (`x` or B/C form), as a (1, .., len) array.
    fn slice(&self, v: &[f32], l0: usize, len: usize, bc: bool) -> Vec<f32> {
        let t = self.seqlen();
        let mut o = vec![0f32; if bc { self.groups * self.dstate * len } else { self.dim * len }];
        for l in 0..len {
            if bc {
                for g in 0..self.groups {
                    for n in 0..self.dstate {
                        o[self.bc(len, g, n, l)] = v[self.bc(t, g, n, l0 + l)];
                    }
                }
            } else {
                for d in 0..self.dim {
                    o[self.x(len, d, l)] = v[self.x(t, d, l0 + l)];
                }
            }
        }
        o
    }

    /// Writes a (1, .., len) array back at steps l0.. of `v`.
    fn unslice(&self, v: &mut [f32], part: &[f32], l0: usize, len: usize, bc: bool) {
        let t = self.seqlen();
        for l in 0..len {
            if bc {
                for g in 0..self.groups {
                    for n in 0..self.dstate {
                        v[self.bc(t, g, n, l0 + l)] = part[self.bc(len, g, n, l)];
                    }
                }
            } else {
                for d in 0..self.dim {
                    v[self.x(t, d, l0 + l)] = part[self.x(len, d, l)];
                }
            }
        }
    }

    /// The packed call or one unpacked call over steps l0..l0 + len with state row `s`, on the host
    /// or (`cuda`) through the CUDA target, with workspaces (so that long sequences split).
    fn run(&self, packed: bool, l0: usize, len: usize, s: usize, cuda: bool) -> Results {
        let (dim, n) = (self.dim, self.dstate);
        let rows = if packed { self.cu.len() - 1 } else { 1 };
        let state = |v: &Option<Vec<f32>>| {
            v.as_ref().map(|v| if packed { v.clone() } else { v[s * dim * n..(s + 1) * dim * n].to_vec() })
        };
        let x = |v: &[f32]| if packed { v.to_vec() } else { self.slice(v, l0, len, false) };
        let bcv = |v: &[f32]| if packed || self.groups == 0 { v.to_vec() } else { self.slice(v, l0, len, true) };
        let (u, delta, z, dout) = (x(&self.u), x(&self.delta), x(&self.z), x(&self.dout));
        let (b, c) = (bcv(&self.b), bcv(&self.c));
        let (h0, dfinal) = (state(&self.h0), state(&self.dfinal));
        let mut r = Results {
            out: vec![f32::NAN; u.len()],
            last: vec![f32::NAN; rows * dim * n],
            du: vec![f32::NAN; u.len()],
            ddelta: vec![f32::NAN; u.len()],
            dz: vec![f32::NAN; u.len()],
            da: vec![f32::NAN; dim * n],
            db: vec![f32::NAN; b.len()],
            dc: vec![f32::NAN; c.len()],
            dd: vec![f32::NAN; dim],
            dbias: vec![f32::NAN; dim],
            dh0: vec![f32::NAN; if h0.is_some() { rows * dim * n } else { 0 }],
        };
        let seqlen = if packed { self.seqlen() } else { len } as i64;
        let n_checkpoints = (seqlen + CHECKPOINT_LEN - 1) / CHECKPOINT_LEN;
        let mut checkpoints = vec![f32::NAN; (dim * n) * n_checkpoints as usize];
        let null = std::ptr::null::<f32>();
        let dev = Device::new(cuda);
        let (fwd_ws, bwd_ws) = if cuda {
            let (b, d, t, n) = (1, dim as i64, seqlen, n as i64);
            (
                xla_ssm_selective_scan_fwd_workspace_bytes(b, d, t, n),
                xla_ssm_selective_scan_bwd_workspace_bytes(b, d, t, n, self.groups as i64),
            )
        } else {
            (0, 0)
        };
        let (fwd_workspace, bwd_workspace) = (dev.scratch(fwd_ws), dev.scratch(bwd_ws));
        let (cu, num_seqs) = if packed { (self.cu.as_ptr(), rows as i64) } else { (std::ptr::null(), 0) };
        let layout = if self.bld { XLA_SSM_LAYOUT_BLD } else { XLA_SSM_LAYOUT_BDL };
        let fwd = XlaSsmSelectiveScanFwdArgs {
            batch: 1,
            dim: dim as i64,
            seqlen,
            dstate: n as i64,
            groups: self.groups as i64,
            dtype: XLA_SSM_F32,
            bc_dtype: XLA_SSM_F32,
            layout,
            delta_softplus: true,
            u: dev.f32s(&u),
            delta: dev.f32s(&delta),
            a: dev.f32s(&self.a).cast(),
            b: dev.f32s(&b),
            c: dev.f32s(&c),
            d: dev.f32s(&self.d).cast(),
            z: dev.f32s(&z),
            delta_bias: dev.f32s(&self.bias).cast(),
            initial_state: h0.as_ref().map_or(null, |v| dev.f32s(v).cast()),
            out: dev.out(&mut r.out),
            final_state: dev.out(&mut r.last).cast(),
            workspace: fwd_workspace,
            workspace_bytes: fwd_ws,
            checkpoint_len: CHECKPOINT_LEN,
            checkpoints: dev.out(&mut checkpoints).cast(),
            cu_seqlens: if packed { dev.i32s(&self.cu).cast() } else { cu },
            num_seqs,
        };
        // SAFETY: buffers of the described sizes, on the host or the device.
        let status = unsafe {
            if cuda {
                xla_ssm_selective_scan_fwd_cuda_launch(&fwd, std::ptr::null_mut())
            } else {
                xla_ssm_selective_scan_fwd_host(&fwd)
            }
        };
        assert_eq!(status, XLA_SSM_OK, "{}", crate::c_api::last_error());
        dev.get(fwd.out.cast(), &mut r.out);
        dev.get(fwd.final_state, &mut r.last);
        dev.get(fwd.checkpoints, &mut checkpoints);
        let bwd = XlaSsmSelectiveScanBwdArgs {
            batch: 1,
            dim: dim as i64,
            seqlen,
            dstate: n as i64,
            groups: self.groups as i64,
            dtype: XLA_SSM_F32,
            bc_dtype: XLA_SSM_F32,
            layout,
            delta_softplus: true,
            u: fwd.u,
            delta: fwd.delta,
            a: fwd.a,
            b: fwd.b,
            c: fwd.c,
            d: fwd.d,
            z: fwd.z,
            delta_bias: fwd.delta_bias,
            initial_state: fwd.initial_state,
            checkpoint_len: CHECKPOINT_LEN,
            checkpoints: fwd.checkpoints,
            dout: dev.f32s(&dout),
            dfinal_state: dfinal.as_ref().map_or(null, |v| dev.f32s(v).cast()),
            du: dev.out(&mut r.du),
            ddelta: dev.out(&mut r.ddelta),
            da: dev.out(&mut r.da).cast(),
            db: dev.out(&mut r.db),
            dc: dev.out(&mut r.dc),
            dd: dev.out(&mut r.dd).cast(),
            dz: dev.out(&mut r.dz),
            ddelta_bias: dev.out(&mut r.dbias).cast(),
            dinitial_state: if h0.is_some() { dev.out(&mut r.dh0).cast() } else { std::ptr::null_mut() },
            workspace: bwd_workspace,
            workspace_bytes: bwd_ws,
            cu_seqlens: fwd.cu_seqlens,
            num_seqs,
        };
        // SAFETY: as above.
        let status = unsafe {
            if cuda {
                xla_ssm_selective_scan_bwd_cuda_launch(&bwd, std::ptr::null_mut())
            } else {
                xla_ssm_selective_scan_bwd_host(&bwd)
            }
        };
        assert_eq!(status, XLA_SSM_OK, "{}", crate::c_api::last_error());
        for (ptr, v) in [
            (bwd.du.cast(), &mut r.du),
            (bwd.ddelta.cast(), &mut r.ddelta),
            (bwd.dz.cast(), &mut r.dz),
            (bwd.da, &mut r.da),
            (bwd.db.cast(), &mut r.db),
            (bwd.dc.cast(), &mut r.dc),
            (bwd.dd, &mut r.dd),
            (bwd.ddelta_bias, &mut r.dbias),
            (bwd.dinitial_state, &mut r.dh0),
        ] {
            dev.get(ptr, v);
        }
        r
    }

    /// The per-sequence calls' results, put together as the packed call's.
    fn per_sequence(&self) -> Results {
        let (dim, n, t) = (self.dim, self.dstate, self.seqlen());
        let seqs = self.cu.len() - 1;
        let mut all = Results {
            out: vec![0.0; dim * t],
            last: vec![0.0; seqs * dim * n],
            du: vec![0.0; dim * t],
            ddelta: vec![0.0; dim * t],
            dz: vec![0.0; dim * t],
            da: vec![0.0; dim * n],
            db: vec![0.0; self.b.len()],
            dc: vec![0.0; self.c.len()],
            dd: vec![0.0; dim],
            dbias: vec![0.0; dim],
            dh0: vec![0.0; if self.h0.is_some() { seqs * dim * n } else { 0 }],
        };
        for s in 0..seqs {
            let (l0, len) = (self.cu[s] as usize, (self.cu[s + 1] - self.cu[s]) as usize);
            let r = self.run(false, l0, len, s, false);
            for (whole, part) in
                [(&mut all.out, &r.out), (&mut all.du, &r.du), (&mut all.ddelta, &r.ddelta), (&mut all.dz, &r.dz)]
            {
                self.unslice(whole, part, l0, len, false);
            }
            let rows = s * dim * n..(s + 1) * dim * n;
            all.last[rows.clone()].copy_from_slice(&r.last);
            if self.h0.is_some() {
                all.dh0[rows].copy_from_slice(&r.dh0);
            }
            let add = |whole: &mut Vec<f32>, part: &[f32]| whole.iter_mut().zip(part).for_each(|(w, p)| *w += p);
            add(&mut all.da, &r.da);
            add(&mut all.dd, &r.dd);
            add(&mut all.dbias, &r.dbias);
            if self.groups == 0 {
                add(&mut all.db, &r.db);
                add(&mut all.dc, &r.dc);
            } else {
                self.unslice(&mut all.db, &r.db, l0, len, true);
                self.unslice(&mut all.dc, &r.dc, l0, len, true);
            }
        }
        all
    }
}

/// Relative L2 distance of each result.
fn compare(what: &str, got: &Results, want: &Results, tol: f64) {
    let pairs = [
        ("out", &got.out, &want.out),
        ("final_state", &got.last, &want.last),
        ("du", &got.du, &want.du),
        ("ddelta", &got.ddelta, &want.ddelta),
        ("dz", &got.dz, &want.dz),
        ("dA", &got.da, &want.da),
        ("dB", &got.db, &want.db),
        ("dC", &got.dc, &want.dc),
        ("dD", &got.dd, &want.dd),
        ("ddelta_bias", &got.dbias, &want.dbias),
        ("dinitial_state", &got.dh0, &want.dh0),
    ];
    for (name, g, w) in pairs {
        assert_eq!(g.len(), w.len(), "{what}: {name} sizes");
        let num: f64 = g.iter().zip(w.iter()).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum();
        let den: f64 = w.iter().map(|b| (*b as f64).powi(2)).sum();
        let err = (num / den.max(1e-30)).sqrt();
        assert!(g.iter().all(|v| v.is_finite()) && err <= tol, "{what}: {name} relative L2 error {err:.2e}");
    }
}

fn below(rng: &mut Rng, n: usize) -> usize {
    ((rng.uniform() * n as f64) as usize).min(n - 1)
}

/// Random sequence lengths adding up to about `total`, with empty and length-1 ones among them.
fn lengths(rng: &mut Rng, total: usize) -> Vec<usize> {
    let mut lens = vec![0, 1];
    let mut left = total;
    while left > 0 {
        let l = match below(rng, 4) {
            0 => 0,
            1 => 1,
            _ => 1 + below(rng, left.min(150)),
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

#[test]
fn packed_equals_per_sequence_on_the_host() {
    let mut rng = Rng::new(0x5e95);
    for (i, &(dim, dstate, groups, bld, h0, dfinal)) in [
        (5, 4, 1, false, true, true),
        (8, 16, 2, true, false, true),
        (3, 7, 0, false, true, false),
        (20, 8, 0, true, false, false),
        (9, 5, 3, true, true, true),
    ]
    .iter()
    .enumerate()
    {
        let lens = lengths(&mut rng, 200 + 37 * i);
        let p = Packed::new(100 + i as u64, dim, dstate, groups, bld, &lens, h0, dfinal);
        let what = format!("dim {dim} dstate {dstate} groups {groups} bld {bld} lens {lens:?}");
        compare(&what, &p.run(true, 0, 0, 0, false), &p.per_sequence(), 1e-5);
    }
}

#[test]
fn bad_boundaries_are_refused_on_the_host() {
    let p = Packed::new(1, 4, 4, 1, false, &[5, 7], true, true);
    for (cu, needle) in [(vec![1, 5, 12], "first"), (vec![0, 7, 5], "decrease"), (vec![0, 5, 11], "last")] {
        let bad = Packed { cu, ..Packed::new(1, 4, 4, 1, false, &[5, 7], true, true) };
        let (dim, n) = (bad.dim, bad.dstate);
        let mut out = vec![0f32; dim * 12];
        let mut last = vec![0f32; 2 * dim * n];
        let args = XlaSsmSelectiveScanFwdArgs {
            batch: 1,
            dim: dim as i64,
            seqlen: 12,
            dstate: n as i64,
            groups: 1,
            dtype: XLA_SSM_F32,
            bc_dtype: XLA_SSM_F32,
            layout: XLA_SSM_LAYOUT_BDL,
            delta_softplus: false,
            u: p.u.as_ptr().cast(),
            delta: p.delta.as_ptr().cast(),
            a: p.a.as_ptr(),
            b: p.b.as_ptr().cast(),
            c: p.c.as_ptr().cast(),
            d: std::ptr::null(),
            z: std::ptr::null(),
            delta_bias: std::ptr::null(),
            initial_state: std::ptr::null(),
            out: out.as_mut_ptr().cast(),
            final_state: last.as_mut_ptr(),
            workspace: std::ptr::null_mut(),
            workspace_bytes: 0,
            checkpoint_len: 0,
            checkpoints: std::ptr::null_mut(),
            cu_seqlens: bad.cu.as_ptr(),
            num_seqs: 2,
        };
        // SAFETY: host buffers of the described sizes.
        let status = unsafe { xla_ssm_selective_scan_fwd_host(&args) };
        let message = crate::c_api::last_error();
        assert_eq!(status, XLA_SSM_INVALID_ARGUMENT, "{message}");
        assert!(message.contains("cu_seqlens") && message.contains(needle), "{message}");
    }
}

/// The CUDA target (tiled and lanes kernels, with and without the sequence split) against the host
/// on packed problems.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn cuda_matches_host() {
    gpu();
    let mut rng = Rng::new(0xc0da);
    for (i, &(dim, dstate, groups, bld, h0, dfinal, total)) in [
        (256, 16, 1, false, true, true, 3000),
        (128, 64, 2, true, true, false, 2500),
        (192, 16, 0, true, false, true, 1200),
        (40, 7, 1, false, true, true, 700),
        (64, 32, 1, true, true, true, 5000),
    ]
    .iter()
    .enumerate()
    {
        let lens = lengths(&mut rng, total);
        let p = Packed::new(200 + i as u64, dim, dstate, groups, bld, &lens, h0, dfinal);
        let what = format!("dim {dim} dstate {dstate} groups {groups} bld {bld} total {total}");
        compare(&what, &p.run(true, 0, 0, 0, true), &p.run(true, 0, 0, 0, false), 2e-4);
    }
}

/// The same with the outputs' pass at one thread a channel (dstate <= 16), which the library takes
/// on large grids only (the benchmark's batch-1 sequences of 16384 steps at dim 4096).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device (scripts/gpu-run.sh runs the ignored tests)"]
fn cuda_matches_host_at_one_thread_a_channel() {
    crate::common::rerun_with_env("XLA_SSM_FWD_KERNEL", "tiled1", module_path!(), &["cuda_matches_host"]);
}
