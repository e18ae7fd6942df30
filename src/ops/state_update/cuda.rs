//! The CUDA launch of the state update (kernels/selective_state_update.cu): `lanes` threads per
//! (batch, channel) row, each holding 16 bytes of the state (4 f32 or 8 half states) per pass, the
//! row's output summed over the lanes by warp shuffles; on small problems whose rows are one vector
//! per lane, the fast kernel, which issues all of a row's loads first. One launch; a copy before it only when XLA
//! did not alias the state.

use super::{state_bytes, Update, UpdateParams};
use crate::cuda::{copy_async, launch, LaunchConfig};
use crate::error::Result;
use crate::ops::args::Alias;
use crate::DType;
use once_cell::sync::Lazy;
use std::ffi::c_void;

/// Threads per block; `XLA_SSM_DECODE_BLOCK` overrides it (64..=1024, for tuning).
static BLOCK: Lazy<u32> = Lazy::new(|| {
    std::env::var("XLA_SSM_DECODE_BLOCK")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|b: &u32| (64..=1024).contains(b) && b.is_power_of_two())
        .unwrap_or(128)
});

/// Largest block of the fast kernels (`kFastBlock`).
const FAST_BLOCK: u32 = 256;
/// Rows (batch x dim) below which the fast kernel is used. Measured on the H100 (BENCHMARKS.md): it
/// wins on small batches (2.3 vs 2.9 us at 1 x 4096 x 16), while on large ones the general kernel
/// was faster than every fast variant tried (85 us at 256 x 5120 x 16 vs 108 us with 4 rows per thread).
const FAST_ROWS_BELOW: i64 = 1 << 16;

/// Sets `lanes` and `vectorized` and returns the launch shape for `p` and the kernel name's suffix:
/// "" (the general kernel: any dstate, several passes per lane) or "_r1" (the fast kernel: vectorized,
/// one 16-byte vector of the state per lane, all loads issued first).
pub(crate) fn geometry(p: &mut UpdateParams, state_dtype: DType) -> (LaunchConfig, &'static str) {
    let per_lane = 16 / state_dtype.size_bytes();
    let chunks = (p.dstate + per_lane - 1) / per_lane;
    p.lanes = (chunks.max(1) as u64).next_power_of_two().min(32) as i32;
    let aligned =
        [p.state as *const c_void, p.a as *const c_void, p.b, p.c].iter().all(|&ptr| (ptr as usize).is_multiple_of(16));
    p.vectorized = (aligned && p.dstate % per_lane == 0) as i32;
    let rows = (p.batch * p.dim) as u64;
    if p.vectorized != 0 && p.dstate == p.lanes as i64 * per_lane && p.batch * p.dim < FAST_ROWS_BELOW {
        let block = (*BLOCK).min(FAST_BLOCK);
        let rows_per_block = (block / p.lanes as u32) as u64;
        let config = LaunchConfig { grid: (rows.div_ceil(rows_per_block), 1, 1), block, shared_bytes: 0 };
        return (config, "_r1");
    }
    let rows_per_block = (*BLOCK / p.lanes as u32) as u64;
    (LaunchConfig { grid: (rows.div_ceil(rows_per_block), 1, 1), block: *BLOCK, shared_bytes: 0 }, "")
}

pub(crate) fn type_suffix(types: &[DType]) -> String {
    types.iter().map(|t| t.name()).collect::<Vec<_>>().join("_")
}

pub(super) fn update(u: &Update, stream: *mut c_void) -> Result<()> {
    if u.alias == Alias::Copy {
        copy_async(stream, u.params.state, u.state_in, state_bytes(&u.params, u.state_dtype))?;
    }
    let mut p = u.params;
    if p.batch * p.dim == 0 {
        return Ok(());
    }
    let (config, form) = geometry(&mut p, u.state_dtype);
    let kernel = format!("selective_state_update_{}{form}", type_suffix(&[u.dtype, u.bc_dtype, u.state_dtype]));
    launch(stream, "selective_state_update", &kernel, config, &p)
}
