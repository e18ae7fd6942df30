//! The CUDA launches of the conv1d kernels (kernels/causal_conv1d.cu): one thread per output element
//! (fwd; bwd's dx and dinitial_states), one block per channel (bwd's dweight and dbias), one thread
//! per (batch, channel) row (update). Packed sequences: the same, batch 1, and dx's threads followed by
//! dinitial_states' (num_seqs, dim, width - 1).

use super::kernels::{self, CONV};
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
    let types = (conv.dtype(), conv.weight_dtype());
    let m = CONV;
    // Packed sequences take their own kernels, which find each step's sequence by a binary search
    // over cu_seqlens; the unpacked ones are unchanged.
    let packed = !p.cu_seqlens.is_null();
    let kernel = |k| kernels::conv(k, packed, types);
    match conv.kind() {
        // SAFETY: the parameters of a validated call (see `launch`).
        Kind::Fwd => unsafe { launch(stream, m, &kernel(kernels::Conv::Fwd), flat(p.batch * p.dim * p.seqlen), p) },
        Kind::Bwd => {
            let dx_threads = if p.cu_seqlens.is_null() {
                p.batch * p.dim * (p.seqlen + p.width - 1)
            } else {
                let dinitial = if p.dinitial_states.is_null() { 0 } else { p.num_seqs * p.dim * (p.width - 1) };
                p.dim * p.seqlen + dinitial
            };
            // SAFETY: the parameters of a validated call (see `launch`).
            unsafe { launch(stream, m, &kernel(kernels::Conv::BwdDx), flat(dx_threads), p) }?;
            let per_channel = LaunchConfig { grid: (p.dim as u64, 1, 1), block: REDUCE_THREADS, shared_bytes: 0 };
            // SAFETY: the parameters of a validated call (see `launch`).
            unsafe { launch(stream, m, &kernel(kernels::Conv::BwdDw), per_channel, p) }
        }
        Kind::Update => {
            if let Some(copy) = conv.state_copy() {
                // SAFETY: validated, distinct device buffers of that size.
                unsafe { copy_async(stream, copy.to, copy.from, copy.bytes) }?;
            }
            // SAFETY: the parameters of a validated call (see `launch`).
            unsafe { launch(stream, m, &kernels::conv(kernels::Conv::Update, false, types), flat(p.batch * p.dim), p) }
        }
    }
}
