//! The CPU forward scan: channels (b, d) split over threads; per channel, one pass per state `n`
//! over the sequence, so B/C rows are read in order and the state stays in a register.

use super::{Fwd, FwdParams};
use crate::dtype::Element;
use crate::with_element_type;

/// Raw pointers are shared read-only by the workers; each writes only its own channels.
#[derive(Clone, Copy)]
struct Shared(FwdParams);
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// Below this many (channel x step x state) updates one thread is faster than spawning workers.
const PARALLEL_WORK: i64 = 1 << 16;

pub(super) fn fwd(fwd: &Fwd) {
    with_element_type!(fwd.dtype, T => {
        if fwd.bc_dtype == crate::DType::F32 {
            fwd_typed::<T, f32>(&fwd.params)
        } else {
            fwd_typed::<T, T>(&fwd.params)
        }
    })
}

fn fwd_typed<T: Element, TB: Element>(p: &FwdParams) {
    let channels = p.batch * p.dim;
    if channels == 0 {
        return;
    }
    let work = channels * p.seqlen.max(1) * p.dstate.max(1);
    let threads = if work < PARALLEL_WORK {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get() as i64).min(channels)
    };
    let shared = Shared(*p);
    if threads == 1 {
        channel_range::<T, TB>(shared, 0, channels);
        return;
    }
    let per_thread = (channels + threads - 1) / threads;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (start, end) = (t * per_thread, ((t + 1) * per_thread).min(channels));
            if start < end {
                scope.spawn(move || channel_range::<T, TB>(shared, start, end));
            }
        }
    });
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn channel_range<T: Element, TB: Element>(shared: Shared, start: i64, end: i64) {
    let p = shared.0;
    let len = p.seqlen as usize;
    let (mut dt, mut uf, mut y) = (vec![0f32; len], vec![0f32; len], vec![0f32; len]);
    for channel in start..end {
        // SAFETY: validation checked every operand's shape against these sizes and strides.
        unsafe { scan_channel::<T, TB>(&p, channel / p.dim, channel % p.dim, &mut dt, &mut uf, &mut y) };
    }
}

/// # Safety
/// `p` must come from `validate_fwd`, and (b, d) be in range.
unsafe fn scan_channel<T: Element, TB: Element>(
    p: &FwdParams,
    b: i64,
    d: i64,
    dt: &mut [f32],
    uf: &mut [f32],
    y: &mut [f32],
) {
    let x_base = b * p.x_stride_batch + d * p.x_stride_dim;
    let x_at = |l: usize| (x_base + l as i64 * p.x_stride_seq) as usize;
    let (u, delta) = (p.u as *const T, p.delta as *const T);
    let bias = if p.delta_bias.is_null() { 0.0 } else { *p.delta_bias.add(d as usize) };
    let skip = if p.d.is_null() { 0.0 } else { *p.d.add(d as usize) };
    for l in 0..dt.len() {
        let mut v = (*delta.add(x_at(l))).to_f32() + bias;
        if p.delta_softplus != 0 {
            v = softplus(v);
        }
        dt[l] = v;
        uf[l] = (*u.add(x_at(l))).to_f32();
        y[l] = skip * uf[l];
    }

    let (bm, cm) = (p.b as *const TB, p.c as *const TB);
    let bc_base = b * p.bc_stride_batch + (d / p.dim_per_group) * p.bc_stride_group;
    let state_base = ((b * p.dim + d) * p.dstate) as usize;
    for n in 0..p.dstate {
        let a = *p.a.add((d * p.dstate + n) as usize);
        let mut h = if p.initial_state.is_null() { 0.0 } else { *p.initial_state.add(state_base + n as usize) };
        let row = bc_base + n * p.bc_stride_state;
        for l in 0..dt.len() {
            let at = (row + l as i64 * p.bc_stride_seq) as usize;
            h = (dt[l] * a).exp() * h + dt[l] * (*bm.add(at)).to_f32() * uf[l];
            y[l] += (*cm.add(at)).to_f32() * h;
        }
        *p.final_state.add(state_base + n as usize) = h;
    }

    let (z, out) = (p.z as *const T, p.out as *mut T);
    for l in 0..y.len() {
        let mut v = y[l];
        if !z.is_null() {
            v *= silu((*z.add(x_at(l))).to_f32());
        }
        *out.add(x_at(l)) = T::from_f32(v);
    }
}
