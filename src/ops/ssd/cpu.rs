//! The CPU target: the generic path (mod.rs) with its scratch in plain vectors, the selective
//! scan's CPU forward and backward, and the reductions back to heads in sequential, fixed order.
//! chunk_states in T ([`super::plan::chunk_states_dtype`]) pass through an f32 copy: the scan's
//! checkpoints are f32.

use super::{scan_bwd, scan_fwd, Scratch, Ssd, SsdBwd, SsdParams};
use crate::dtype::Element;
use crate::error::Result;
use crate::ops::{selective_scan, Platform};
use crate::with_element_type;
use crate::DType;
use std::ffi::c_void;

/// `n` elements at `p` (validation made them host arrays of at least that many; none when n = 0,
/// where p may be null).
unsafe fn slice<'a, E>(p: *const E, n: i64) -> &'a [E] {
    if n <= 0 {
        &[]
    } else {
        std::slice::from_raw_parts(p, n as usize)
    }
}

unsafe fn slice_mut<'a, E>(p: *mut E, n: i64) -> &'a mut [E] {
    if n <= 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(p, n as usize)
    }
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// dt after bias, softplus and clamp (ssd_dt in kernels/ssd.cuh), and whether the clamp let it
/// through.
fn ssd_dt(p: &SsdParams, raw: f32, bias: f32) -> (f32, bool) {
    let v = raw + bias;
    let v = if p.dt_softplus != 0 { softplus(v) } else { v };
    (v.max(p.dt_min).min(p.dt_max), v >= p.dt_min && v <= p.dt_max)
}

/// The per-channel inputs of the scan, owned.
struct Expanded<T> {
    delta: Vec<T>,
    a: Vec<f32>,
    d: Vec<f32>,
    dt_bias: Vec<f32>,
}

/// dt broadcast over headdim (transformed when the scan cannot apply the clamp), A, and D and
/// dt_bias where the scan reads them per channel.
fn expand<T: Element>(ssd: &Ssd) -> Expanded<T> {
    let p = &ssd.params;
    let (hd, heads) = (p.headdim as usize, p.heads as usize);
    // SAFETY: validated host arrays of these sizes.
    let (dt, a) = unsafe { (slice(p.dt as *const T, p.rows()), slice(p.a, p.heads)) };
    let bias = |h: usize| if ssd.present.dt_bias { unsafe { *p.dt_bias.add(h) } } else { 0.0 };
    let transformed = ssd.transformed();
    let mut delta = Vec::with_capacity(dt.len() * hd);
    for (row, &v) in dt.iter().enumerate() {
        let v = if transformed { T::from_f32(ssd_dt(p, v.to_f32(), bias(row % heads)).0) } else { v };
        delta.extend(std::iter::repeat_n(v, hd));
    }
    let per_channel = |f: &dyn Fn(usize) -> f32| (0..heads * hd).map(|i| f(i / hd)).collect::<Vec<f32>>();
    let a_exp = (0..heads * hd).flat_map(|i| std::iter::repeat_n(a[i / hd], p.dstate as usize)).collect();
    let d = if ssd.expands_d() { per_channel(&|h| unsafe { *p.d.add(h) }) } else { Vec::new() };
    let dt_bias = if ssd.scan_gets_bias() { per_channel(&bias) } else { Vec::new() };
    Expanded { delta, a: a_exp, d, dt_bias }
}

fn or_null(v: &mut [f32]) -> *mut f32 {
    if v.is_empty() {
        std::ptr::null_mut()
    } else {
        v.as_mut_ptr()
    }
}

pub(super) fn fwd(ssd: &Ssd) -> Result<()> {
    with_element_type!(ssd.dtype, T => fwd_typed::<T>(ssd))
}

fn fwd_typed<T: Element>(ssd: &Ssd) -> Result<()> {
    let mut e = expand::<T>(ssd);
    let scratch = Scratch {
        delta: e.delta.as_mut_ptr() as *mut c_void,
        a: e.a.as_mut_ptr(),
        d: or_null(&mut e.d),
        dt_bias: or_null(&mut e.dt_bias),
        ddelta: std::ptr::null_mut(),
        da: std::ptr::null_mut(),
        dd: std::ptr::null_mut(),
        ddelta_bias: std::ptr::null_mut(),
        scan_workspace: std::ptr::null_mut(),
        scan_workspace_bytes: 0,
    };
    let in_t = ssd.save_chunk_states && ssd.chunk_states_dtype() != DType::F32;
    let len = ssd.params.chunk_states_len();
    let mut checkpoints = vec![0f32; if in_t { len as usize } else { 0 }];
    let mut run = *ssd;
    if in_t {
        run.params.chunk_states = checkpoints.as_mut_ptr() as *mut c_void;
    }
    selective_scan::run_fwd(&scan_fwd(&run, &scratch)?, Platform::Cpu)?;
    if in_t {
        // SAFETY: validated: chunk_states holds `len` elements of T.
        let out = unsafe { slice_mut(ssd.params.chunk_states as *mut T, len) };
        for (o, &v) in out.iter_mut().zip(&checkpoints) {
            *o = T::from_f32(v);
        }
    }
    Ok(())
}

pub(super) fn bwd(bwd: &SsdBwd) -> Result<()> {
    with_element_type!(bwd.dtype, T => bwd_typed::<T>(bwd))
}

fn bwd_typed<T: Element>(bwd: &SsdBwd) -> Result<()> {
    let ssd = bwd.inputs();
    let (p, q) = (&ssd.params, &bwd.params);
    let dim = p.dim();
    let mut e = expand::<T>(&ssd);
    let mut ddelta = vec![T::from_f32(0.0); e.delta.len()];
    let mut da = vec![0f32; e.a.len()];
    let mut dd = vec![0f32; e.d.len()];
    let mut ddelta_bias = vec![0f32; e.dt_bias.len()];
    let scratch = Scratch {
        delta: e.delta.as_mut_ptr() as *mut c_void,
        a: e.a.as_mut_ptr(),
        d: or_null(&mut e.d),
        dt_bias: or_null(&mut e.dt_bias),
        ddelta: ddelta.as_mut_ptr() as *mut c_void,
        da: da.as_mut_ptr(),
        dd: or_null(&mut dd),
        ddelta_bias: or_null(&mut ddelta_bias),
        scan_workspace: std::ptr::null_mut(),
        scan_workspace_bytes: 0,
    };
    let in_t = ssd.chunk_states_dtype() != DType::F32;
    let widened: Vec<f32> = if in_t {
        // SAFETY: validated: chunk_states holds this many elements of T.
        unsafe { slice(p.chunk_states as *const T, p.chunk_states_len()) }.iter().map(|v| v.to_f32()).collect()
    } else {
        Vec::new()
    };
    let mut run = *bwd;
    if in_t {
        run.params.fwd.chunk_states = widened.as_ptr() as *mut c_void;
    }
    selective_scan::run_bwd(&scan_bwd(&run, &scratch)?, Platform::Cpu)?;

    let (hd, heads) = (p.headdim as usize, p.heads as usize);
    let transformed = ssd.transformed();
    // SAFETY: validated host arrays of these sizes.
    let (dt, ddt) = unsafe { (slice(p.dt as *const T, p.rows()), slice_mut(q.ddt as *mut T, p.rows())) };
    let bias = |h: usize| if ssd.present.dt_bias { unsafe { *p.dt_bias.add(h) } } else { 0.0 };
    // ddt: the scan's ddelta summed over headdim; through the transform when delta was transformed.
    let mut dbias_from_ddt = vec![0f32; if transformed && ssd.present.dt_bias { heads } else { 0 }];
    for (row, (out, &raw)) in ddt.iter_mut().zip(dt).enumerate() {
        let mut g: f32 = ddelta[row * hd..(row + 1) * hd].iter().map(|v| v.to_f32()).sum();
        if transformed {
            let h = row % heads;
            let pre = raw.to_f32() + bias(h);
            let (_, passes) = ssd_dt(p, raw.to_f32(), bias(h));
            let dsoftplus = if p.dt_softplus != 0 { 1.0 / (1.0 + (-pre).exp()) } else { 1.0 };
            g = if passes { g * dsoftplus } else { 0.0 };
            if let Some(acc) = dbias_from_ddt.get_mut(h) {
                *acc += g;
            }
        }
        *out = T::from_f32(g);
    }
    // Per-head parameters: the sums of their channels' gradients.
    let per_head = |v: &[f32], per: usize| -> Vec<f32> { v.chunks_exact(per.max(1)).map(|c| c.iter().sum()).collect() };
    // SAFETY: dA is (heads); dD (heads) when D is per head; ddt_bias (heads) when dt_bias is given.
    unsafe {
        if dim > 0 {
            slice_mut(q.da, p.heads).copy_from_slice(&per_head(&da, hd * p.dstate as usize));
            if ssd.expands_d() {
                slice_mut(q.dd, p.heads).copy_from_slice(&per_head(&dd, hd));
            }
            if ssd.present.dt_bias {
                let sums = if transformed { dbias_from_ddt } else { per_head(&ddelta_bias, hd) };
                slice_mut(q.ddt_bias, p.heads).copy_from_slice(&sums);
            }
        } else {
            // No channel: heads-sized gradients are zero (or empty).
            slice_mut(q.da, p.heads).fill(0.0);
            if ssd.expands_d() {
                slice_mut(q.dd, p.heads).fill(0.0);
            }
            if ssd.present.dt_bias {
                slice_mut(q.ddt_bias, p.heads).fill(0.0);
            }
        }
    }
    Ok(())
}
