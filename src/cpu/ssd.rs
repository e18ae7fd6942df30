//! SSD (`ssd_fwd` / `ssd_bwd`) on the CPU: the generic path of [`crate::ops::ssd`] (a selective scan
//! over heads * headdim channels) with its scratch in plain vectors, the CPU selective scan forward
//! and backward, and the reductions back to heads in sequential, fixed order. chunk_states in the
//! inputs' dtype ([`crate::ops::ssd::plan::chunk_states_dtype`]) pass through an f32 copy: the
//! scan's checkpoints are f32.

use super::elems::{typed, ElemVec, Elems, ElemsOut, Io};
use super::math::softplus_std;
use super::{selective_scan, selective_scan_bwd};
use crate::error::Result;
use crate::ops::ssd::{plan, scan_bwd, scan_fwd, Scratch, Ssd, SsdBwd, SsdParams};
use crate::ops::Records;
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

/// dt after bias, softplus and clamp (ssd_dt in kernels/ssd.cuh), and whether the clamp let it
/// through.
fn ssd_dt(p: &SsdParams, raw: f32, bias: f32) -> (f32, bool) {
    let v = raw + bias;
    let v = if p.dt_softplus != 0 { softplus_std(v) } else { v };
    (v.max(p.dt_min).min(p.dt_max), v >= p.dt_min && v <= p.dt_max)
}

/// dt of every (b, l, h) row, as f32.
fn dt_rows(ssd: &Ssd) -> Vec<f32> {
    let p = &ssd.params();
    let rows = p.rows().max(0) as usize;
    let mut dt = vec![0f32; rows];
    // SAFETY: validated host array of `rows` elements of the inputs' dtype.
    unsafe { Elems::new(ssd.dtype(), p.dt, rows) }.load(0, 1, &mut dt);
    dt
}

/// dt_bias of head `h` (0 without one).
fn bias(ssd: &Ssd, h: usize) -> f32 {
    // SAFETY: validated: dt_bias holds `heads` f32 when present.
    if ssd.present().dt_bias {
        unsafe { *ssd.params().dt_bias.add(h) }
    } else {
        0.0
    }
}

/// The per-channel inputs of the scan, owned.
struct Expanded {
    /// In the inputs' dtype, as the scan reads delta.
    delta: ElemVec,
    a: Vec<f32>,
    d: Vec<f32>,
    dt_bias: Vec<f32>,
}

/// dt broadcast over headdim (transformed when the scan cannot apply the clamp), A, and D and
/// dt_bias where the scan reads them per channel.
fn expand(ssd: &Ssd) -> Expanded {
    let p = &ssd.params();
    let (hd, heads) = (p.headdim as usize, p.heads as usize);
    // SAFETY: validated host array of this size.
    let a = unsafe { slice(p.a, p.heads) };
    let mut dt = dt_rows(ssd);
    if ssd.transformed() {
        for (row, v) in dt.iter_mut().enumerate() {
            *v = ssd_dt(p, *v, bias(ssd, row % heads)).0;
        }
    }
    // Raw dt goes through f32 and back unchanged (f32 holds every bf16 and f16 value).
    let mut delta = ElemVec::zeros(ssd.dtype(), dt.len() * hd);
    typed!(ElemVec, &mut delta, delta => broadcast(&dt, hd, delta));
    let per_channel = |f: &dyn Fn(usize) -> f32| (0..heads * hd).map(|i| f(i / hd)).collect::<Vec<f32>>();
    let a_exp = (0..heads * hd).flat_map(|i| std::iter::repeat_n(a[i / hd], p.dstate as usize)).collect();
    // SAFETY: validated: D holds `heads` f32 when it is expanded.
    let d = if ssd.expands_d() { per_channel(&|h| unsafe { *p.d.add(h) }) } else { Vec::new() };
    let dt_bias = if ssd.scan_gets_bias() { per_channel(&|h| bias(ssd, h)) } else { Vec::new() };
    Expanded { delta, a: a_exp, d, dt_bias }
}

/// dst = each value of `src` repeated `hd` times, rounded to E.
fn broadcast<E: Io>(src: &[f32], hd: usize, dst: &mut [E]) {
    if hd > 0 {
        for (out, &v) in dst.chunks_exact_mut(hd).zip(src) {
            out.fill(E::store(v));
        }
    }
}

fn or_null(v: &mut [f32]) -> *mut f32 {
    if v.is_empty() {
        std::ptr::null_mut()
    } else {
        v.as_mut_ptr()
    }
}

pub(crate) fn fwd(ssd: &Ssd) -> Result<()> {
    let mut e = expand(ssd);
    let scratch = Scratch {
        delta: e.delta.as_mut_ptr(),
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
    let in_t = ssd.save_chunk_states() && ssd.chunk_states_dtype() != DType::F32;
    let len = ssd.params().chunk_states_len();
    let mut checkpoints = vec![0f32; if in_t { len as usize } else { 0 }];
    let run = if in_t { ssd.with_chunk_states(checkpoints.as_mut_ptr() as *mut c_void) } else { *ssd };
    selective_scan::fwd(&scan_fwd(&run, &scratch)?);
    if in_t {
        // SAFETY: validated: chunk_states holds `len` elements of the inputs' dtype, which nothing
        // else accesses during the call.
        unsafe {
            let out = ElemsOut::new(ssd.dtype(), ssd.params().chunk_states, len as usize);
            out.store(0, 1, &checkpoints);
        }
    }
    Ok(())
}

/// `ssd_part_records` on the CPU, which has no split of its own: the end states from zero are the
/// forward's final states (its outputs, into scratch, are dropped), and the records zeros (a CPU
/// forward given them ignores them).
pub(crate) fn part_records(ssd: &Ssd) -> Result<()> {
    let Records::Only(records) = ssd.records() else { unreachable!("a part-records call") };
    let p = ssd.params();
    let floats = plan::part_records_floats(&p.shape(ssd.dtype()));
    let mut y = ElemVec::zeros(ssd.dtype(), (p.rows() * p.headdim).max(0) as usize);
    let forward = Ssd::forward_of_part_records(ssd, y.as_mut_ptr());
    fwd(&forward)?;
    // SAFETY: validated: the records result holds `floats` f32s, which nothing else accesses.
    unsafe { slice_mut(records, floats) }.fill(0.0);
    Ok(())
}

pub(crate) fn bwd(bwd: &SsdBwd) -> Result<()> {
    let ssd = bwd.inputs();
    let (p, q) = (&ssd.params(), &bwd.params());
    let dim = p.dim();
    let mut e = expand(&ssd);
    let mut ddelta = ElemVec::zeros(ssd.dtype(), e.delta.len());
    let mut da = vec![0f32; e.a.len()];
    let mut dd = vec![0f32; e.d.len()];
    let mut ddelta_bias = vec![0f32; e.dt_bias.len()];
    let scratch = Scratch {
        delta: e.delta.as_mut_ptr(),
        a: e.a.as_mut_ptr(),
        d: or_null(&mut e.d),
        dt_bias: or_null(&mut e.dt_bias),
        ddelta: ddelta.as_mut_ptr(),
        da: da.as_mut_ptr(),
        dd: or_null(&mut dd),
        ddelta_bias: or_null(&mut ddelta_bias),
        scan_workspace: std::ptr::null_mut(),
        scan_workspace_bytes: 0,
    };
    let in_t = ssd.chunk_states_dtype() != DType::F32;
    let widened: Vec<f32> = if in_t {
        let len = p.chunk_states_len().max(0) as usize;
        let mut widened = vec![0f32; len];
        // SAFETY: validated: chunk_states holds this many elements of the inputs' dtype.
        unsafe { Elems::new(ssd.dtype(), p.chunk_states as *const c_void, len) }.load(0, 1, &mut widened);
        widened
    } else {
        Vec::new()
    };
    let run = if in_t { bwd.with_chunk_states(widened.as_ptr() as *mut c_void) } else { *bwd };
    selective_scan_bwd::bwd(&scan_bwd(&run, &scratch)?);

    let (hd, heads) = (p.headdim as usize, p.heads as usize);
    let transformed = ssd.transformed();
    let dt = dt_rows(&ssd);
    // ddt: the scan's ddelta summed over headdim; through the transform when delta was transformed.
    let mut ddt = vec![0f32; dt.len()];
    let mut row_grads = vec![0f32; hd];
    let mut dbias_from_ddt = vec![0f32; if transformed && ssd.present().dt_bias { heads } else { 0 }];
    for (row, (out, &raw)) in ddt.iter_mut().zip(&dt).enumerate() {
        ddelta.view().load(row * hd, 1, &mut row_grads);
        let mut g: f32 = row_grads.iter().sum();
        if transformed {
            let h = row % heads;
            let pre = raw + bias(&ssd, h);
            let (_, passes) = ssd_dt(p, raw, bias(&ssd, h));
            let dsoftplus = if p.dt_softplus != 0 { 1.0 / (1.0 + (-pre).exp()) } else { 1.0 };
            g = if passes { g * dsoftplus } else { 0.0 };
            if let Some(acc) = dbias_from_ddt.get_mut(h) {
                *acc += g;
            }
        }
        *out = g;
    }
    // SAFETY: validated: ddt holds a row's element of the inputs' dtype per dt row; nothing else
    // accesses it during the call.
    unsafe { ElemsOut::new(ssd.dtype(), q.ddt, ddt.len()).store(0, 1, &ddt) };
    // Per-head parameters: the sums of their channels' gradients.
    let per_head = |v: &[f32], per: usize| -> Vec<f32> { v.chunks_exact(per.max(1)).map(|c| c.iter().sum()).collect() };
    // SAFETY: dA is (heads); dD (heads) when D is per head; ddt_bias (heads) when dt_bias is given.
    unsafe {
        if dim > 0 {
            slice_mut(q.da, p.heads).copy_from_slice(&per_head(&da, hd * p.dstate as usize));
            if ssd.expands_d() {
                slice_mut(q.dd, p.heads).copy_from_slice(&per_head(&dd, hd));
            }
            if ssd.present().dt_bias {
                let sums = if transformed { dbias_from_ddt } else { per_head(&ddelta_bias, hd) };
                slice_mut(q.ddt_bias, p.heads).copy_from_slice(&sums);
            }
        } else {
            // No channel: heads-sized gradients are zero (or empty).
            slice_mut(q.da, p.heads).fill(0.0);
            if ssd.expands_d() {
                slice_mut(q.dd, p.heads).fill(0.0);
            }
            if ssd.present().dt_bias {
                slice_mut(q.ddt_bias, p.heads).fill(0.0);
            }
        }
    }
    Ok(())
}
