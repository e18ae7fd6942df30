//! The CUDA launches of the conv1d kernels (kernels/causal_conv1d.cu): one thread per output element
//! (fwd; bwd's dx and dinitial_states), one block per channel (bwd's dweight and dbias), one thread
//! per (batch, channel) row (update).

use super::{copy_async, launch, LaunchConfig};
use crate::error::Result;
use crate::ops::conv1d::{Conv, Kind};
use std::ffi::c_void;

const BLOCK: u32 = 256;
/// `kReduceThreads` of the kernel.
const REDUCE_THREADS: u32 = 256;

fn flat(n: i64) -> LaunchConfig {
    LaunchConfig { grid: ((n as u64).div_ceil(BLOCK as u64), 1, 1), block: BLOCK, shared_bytes: 0 }
}

pub fn run(conv: &Conv, stream: *mut c_void) -> Result<()> {
    let p = &conv.params();
    let types = format!("{}_{}", conv.dtype().name(), conv.weight_dtype().name());
    let m = "causal_conv1d";
    match conv.kind() {
        // SAFETY: the parameters of a validated call (see `launch`).
        Kind::Fwd => unsafe {
            launch(stream, m, &format!("causal_conv1d_fwd_{types}"), flat(p.batch * p.dim * p.seqlen), p)
        },
        Kind::Bwd => {
            let padded = p.batch * p.dim * (p.seqlen + p.width - 1);
            // SAFETY: the parameters of a validated call (see `launch`).
            unsafe { launch(stream, m, &format!("causal_conv1d_bwd_dx_{types}"), flat(padded), p) }?;
            let per_channel = LaunchConfig { grid: (p.dim as u64, 1, 1), block: REDUCE_THREADS, shared_bytes: 0 };
            // SAFETY: the parameters of a validated call (see `launch`).
            unsafe { launch(stream, m, &format!("causal_conv1d_bwd_dw_{types}"), per_channel, p) }
        }
        Kind::Update => {
            if let Some(copy) = conv.state_copy() {
                // SAFETY: validated, distinct device buffers of that size.
                unsafe { copy_async(stream, copy.to, copy.from, copy.bytes) }?;
            }
            // SAFETY: the parameters of a validated call (see `launch`).
            unsafe { launch(stream, m, &format!("causal_conv1d_update_{types}"), flat(p.batch * p.dim), p) }
        }
    }
}
