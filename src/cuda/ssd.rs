//! The CUDA target. [`fwd`] and [`bwd`] pick a path: the tensor-core kernels ([`super::ssd_mma`])
//! where they apply (bf16/f16, headdim a multiple of 64, dstate 64 or 128, chunks of whole 64-step
//! tiles; a head wider than 64 runs as heads of 64, `plan::mma_shape`), else
//! the generic one: expand the per-head operands to channels
//! (kernels/ssd_glue.cu), run the selective scan's CUDA kernels, and (backward) sum its per-channel
//! gradients back to heads. Scratch comes from the workspace result ([`crate::ops::ssd::plan`]).
//!
//! Packed sequences (`cu_seqlens`) take the generic path at every shape: the selective scan resets
//! the state at the boundaries, while the tensor-core kernels have no boundaries (their chunked
//! products would need the decay mask cut at each one). Where chunk_states are in T (the
//! tensor-core shapes) the scan's f32 checkpoints pass through an f32 copy in the workspace,
//! rounded after the forward and widened before the backward, as on the CPU.

use super::ssd_mma;
use super::{launch, LaunchConfig};
use crate::error::{Error, Result};
use crate::ops::ssd::plan::{self, Layout};
use crate::ops::ssd::{
    scan_bwd, scan_fwd, GlueParams, Scratch, SplitHeadsParams, Ssd, SsdBwd, SsdBwdParams, SsdParams,
};
use crate::ops::{selective_scan, Platform};
use crate::DType;
use std::ffi::c_void;

use super::kernels::{self, SSD_GLUE as MODULE};
/// `kGlueThreads` of the kernels.
const THREADS: u32 = 256;
/// Grid-stride loops: enough blocks to fill an H100 a few times over.
const MAX_BLOCKS: u64 = 8192;

/// The forward on `stream`: the first path that takes the call.
pub fn fwd(ssd: &Ssd, stream: *mut c_void) -> Result<()> {
    let p = &ssd.params();
    let shape = shape(p, ssd.dtype());
    if p.packed() || !plan::mma_applies(&shape) {
        return generic_fwd(ssd, stream);
    }
    if !ssd_mma::aligned(p) {
        return Err(Error::invalid(
            "ssd_fwd: the CUDA target takes x, B and C 16-byte aligned, z and y 4-byte aligned, the states \
             8-byte aligned (XLA's buffers always are)",
        ));
    }
    let base = workspace_at("ssd_fwd", p, plan::fwd_workspace_bytes(&shape), "xla_ssm_ssd_fwd_workspace_bytes")?;
    let (mma_shape, layout) = (plan::mma_shape(&shape), plan::SplitHeads::new(&shape, false));
    let kernels_at = base.wrapping_add(layout.bytes as usize);
    let kernels_bytes = plan::mma_fwd_bytes(&mma_shape);
    if layout.ways == 1 {
        return ssd_mma::fwd(ssd, &mma_shape, kernels_at, kernels_bytes, stream);
    }
    let split = SplitHeadsParams::carve(&ssd.as_bwd(), &layout, base, false);
    split_heads("expand", &split, ssd.dtype(), stream)?;
    ssd_mma::fwd(&ssd.split_heads(&split), &mma_shape, kernels_at, kernels_bytes, stream)
}

/// The backward on `stream`.
pub fn bwd(bwd: &SsdBwd, stream: *mut c_void) -> Result<()> {
    let p = &bwd.params().fwd;
    let shape = shape(p, bwd.dtype());
    if p.packed() || !plan::mma_applies(&shape) {
        return generic_bwd(bwd, stream);
    }
    if !ssd_mma::bwd_aligned(&bwd.params()) {
        return Err(Error::invalid(
            "ssd_bwd: the CUDA target takes x, B, C and dy 16-byte aligned, z, y, dx and dz 4-byte aligned, the \
             states 8-byte aligned (XLA's buffers always are)",
        ));
    }
    let base = workspace_at("ssd_bwd", p, plan::bwd_workspace_bytes(&shape), "xla_ssm_ssd_bwd_workspace_bytes")?;
    let (mma_shape, layout) = (plan::mma_shape(&shape), plan::SplitHeads::new(&shape, true));
    let kernels_at = base.wrapping_add(layout.bytes as usize);
    if layout.ways == 1 {
        return ssd_mma::bwd(bwd, &mma_shape, kernels_at, stream);
    }
    let split = SplitHeadsParams::carve(bwd, &layout, base, true);
    split_heads("expand", &split, bwd.dtype(), stream)?;
    ssd_mma::bwd(&bwd.split_heads(&split), &mma_shape, kernels_at, stream)?;
    split_heads("fold", &split, bwd.dtype(), stream)
}

/// A split-heads kernel (kernels/ssd_glue.cu): `expand` repeats the per-head operands for the split
/// heads, `fold` sums the split heads' gradients back to heads; a thread per (batch, step, head).
fn split_heads(kernel: &str, split: &SplitHeadsParams, dtype: DType, stream: *mut c_void) -> Result<()> {
    let p = &split.q.fwd;
    let items = if kernel == "expand" { p.rows() * split.ways } else { p.rows() };
    let config = grid_stride(items.max(p.heads * split.ways));
    // SAFETY: the parameters of a validated call (see `launch`); the arrays are the workspace's
    // (plan::SplitHeads), which `workspace_at` checked holds them.
    unsafe { launch(stream, MODULE, &kernels::ssd_glue(&format!("split_heads_{kernel}"), dtype), config, split) }
}

fn shape(p: &SsdParams, dtype: DType) -> plan::Shape {
    plan::Shape {
        batch: p.batch,
        seqlen: p.seqlen,
        heads: p.heads,
        headdim: p.headdim,
        dstate: p.dstate,
        groups: p.groups,
        chunk_size: p.chunk_size,
        elem_bytes: dtype.size_bytes(),
    }
}

/// The workspace's first `plan::ALIGN`-aligned byte, once it is known to hold `layout`.
fn workspace_base(op: &str, p: &SsdParams, layout: &Layout, sizer: &str) -> Result<*mut u8> {
    workspace_at(op, p, layout.bytes, sizer)
}

/// The workspace's first `plan::ALIGN`-aligned byte, once it is known to hold `bytes` (null for 0).
fn workspace_at(op: &str, p: &SsdParams, bytes: i64, sizer: &str) -> Result<*mut u8> {
    if bytes == 0 {
        return Ok(std::ptr::null_mut());
    }
    let given = if p.workspace.is_null() { 0 } else { p.workspace_bytes };
    if given < bytes {
        return Err(Error::invalid(format!(
            "{op}: result `workspace`: the CUDA target needs at least {bytes} bytes ({sizer}), got {given}"
        )));
    }
    let align = plan::ALIGN as usize;
    let skip = (align - p.workspace as usize % align) % align;
    // SAFETY: `skip` < ALIGN, which the layout's total keeps as slack.
    Ok(unsafe { (p.workspace as *mut u8).add(skip) })
}

/// The scratch arrays of `layout` in the workspace at `base` (null when the workspace is empty).
fn carve(ssd: &Ssd, layout: &Layout, base: *mut u8, backward: bool) -> Scratch {
    let at = |offset: i64| if base.is_null() { std::ptr::null_mut() } else { base.wrapping_add(offset as usize) };
    let when = |on: bool, offset: i64| if on { at(offset) } else { std::ptr::null_mut() };
    Scratch {
        delta: at(layout.delta) as *mut c_void,
        a: at(layout.a) as *mut f32,
        d: when(ssd.expands_d(), layout.d) as *mut f32,
        dt_bias: when(ssd.scan_gets_bias(), layout.dt_bias) as *mut f32,
        ddelta: when(backward, layout.ddelta) as *mut c_void,
        da: when(backward, layout.da) as *mut f32,
        dd: when(backward && ssd.expands_d(), layout.dd) as *mut f32,
        ddelta_bias: when(backward && ssd.scan_gets_bias(), layout.ddelta_bias) as *mut f32,
        scan_workspace: when(layout.scan_bytes > 0, layout.scan) as *mut c_void,
        scan_workspace_bytes: layout.scan_bytes,
    }
}

fn glue(q: SsdBwdParams, ssd: &Ssd, s: &Scratch, ddt_f32: *mut f32, chunk_states_f32: *mut f32) -> GlueParams {
    GlueParams {
        q,
        delta: s.delta,
        a: s.a,
        d: s.d,
        dt_bias: s.dt_bias,
        ddelta: s.ddelta,
        da: s.da,
        dd: s.dd,
        ddelta_bias: s.ddelta_bias,
        ddt_f32,
        transformed: ssd.transformed() as i32,
        _reserved: 0,
        chunk_states_f32,
    }
}

fn grid_stride(items: i64) -> LaunchConfig {
    let blocks = (items.max(0) as u64).div_ceil(THREADS as u64).min(MAX_BLOCKS);
    LaunchConfig { grid: (blocks, 1, 1), block: THREADS, shared_bytes: 0 }
}

/// The scan's per-channel inputs: A (D, dt_bias) and delta.
fn expand(g: &GlueParams, dtype: DType, stream: *mut c_void) -> Result<()> {
    let p = &g.q.fwd;
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, MODULE, kernels::SSD_GLUE_EXPAND_PARAMS, grid_stride(p.dim() * p.dstate), g) }?;
    let kernel = kernels::ssd_glue("expand_delta", dtype);
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, MODULE, &kernel, grid_stride(p.rows() * p.headdim), g) }
}

/// The generic path's layout and its workspace sizer: packed calls have their own (with the f32
/// copy of chunk_states where those are in T).
fn generic_layout(p: &SsdParams, dtype: DType, backward: bool) -> (Layout, &'static str) {
    let s = shape(p, dtype);
    match (p.packed(), backward) {
        (false, false) => (plan::fwd_layout(&s), "xla_ssm_ssd_fwd_workspace_bytes"),
        (false, true) => (plan::bwd_layout(&s), "xla_ssm_ssd_bwd_workspace_bytes"),
        (true, false) => (plan::packed_fwd_layout(&s), "xla_ssm_ssd_packed_fwd_workspace_bytes"),
        (true, true) => (plan::packed_bwd_layout(&s), "xla_ssm_ssd_packed_bwd_workspace_bytes"),
    }
}

/// Where the scan's f32 checkpoints go when chunk_states are in T: the layout's f32 copy (null when
/// they are f32, or empty). Only packed calls reach the generic path with chunk_states in T.
fn chunk_states_f32(ssd: &Ssd, layout: &Layout, base: *mut u8, op: &str) -> Result<*mut f32> {
    let p = &ssd.params();
    if ssd.chunk_states_dtype() == DType::F32 || base.is_null() || p.chunk_states_len() == 0 {
        return Ok(std::ptr::null_mut());
    }
    if !p.packed() {
        return Err(Error::Internal(format!("{op}: chunk_states in T on the generic path of an unpacked call")));
    }
    Ok(base.wrapping_add(layout.chunk_states_f32 as usize) as *mut f32)
}

/// A glue kernel over the elements of chunk_states (rounding the f32 copy to T, or widening).
fn convert_chunk_states(g: &GlueParams, kernel: &str, dtype: DType, stream: *mut c_void) -> Result<()> {
    let config = grid_stride(g.q.fwd.chunk_states_len());
    // SAFETY: the parameters of a validated call (see `launch`); chunk_states_f32 holds
    // chunk_states_len f32 of the workspace.
    unsafe { launch(stream, MODULE, &kernels::ssd_glue(kernel, dtype), config, g) }
}

fn generic_fwd(ssd: &Ssd, stream: *mut c_void) -> Result<()> {
    let p = &ssd.params();
    let (layout, sizer) = generic_layout(p, ssd.dtype(), false);
    let base = workspace_base("ssd_fwd", p, &layout, sizer)?;
    let scratch = carve(ssd, &layout, base, false);
    let f32_copy =
        if ssd.save_chunk_states() { chunk_states_f32(ssd, &layout, base, "ssd_fwd")? } else { std::ptr::null_mut() };
    let q = SsdBwdParams::forward_only(*p);
    let g = glue(q, ssd, &scratch, std::ptr::null_mut(), f32_copy);
    expand(&g, ssd.dtype(), stream)?;
    if f32_copy.is_null() {
        return selective_scan::run_fwd(&scan_fwd(ssd, &scratch)?, Platform::Cuda { stream });
    }
    let run = ssd.with_chunk_states(f32_copy as *mut c_void);
    selective_scan::run_fwd(&scan_fwd(&run, &scratch)?, Platform::Cuda { stream })?;
    convert_chunk_states(&g, "round_chunk_states", ssd.dtype(), stream)
}

fn generic_bwd(bwd: &SsdBwd, stream: *mut c_void) -> Result<()> {
    let ssd = bwd.inputs();
    let p = &ssd.params();
    let (layout, sizer) = generic_layout(p, ssd.dtype(), true);
    let base = workspace_base("ssd_bwd", p, &layout, sizer)?;
    let scratch = carve(&ssd, &layout, base, true);
    let with_ddt_f32 = ssd.transformed() && ssd.present().dt_bias && !base.is_null();
    let ddt_f32 =
        if with_ddt_f32 { base.wrapping_add(layout.ddt_f32 as usize) as *mut f32 } else { std::ptr::null_mut() };
    let f32_copy = chunk_states_f32(&ssd, &layout, base, "ssd_bwd")?;
    let g = glue(bwd.params(), &ssd, &scratch, ddt_f32, f32_copy);
    expand(&g, ssd.dtype(), stream)?;
    if f32_copy.is_null() {
        selective_scan::run_bwd(&scan_bwd(bwd, &scratch)?, Platform::Cuda { stream })?;
    } else {
        convert_chunk_states(&g, "widen_chunk_states", ssd.dtype(), stream)?;
        let run = bwd.with_chunk_states(f32_copy as *mut c_void);
        selective_scan::run_bwd(&scan_bwd(&run, &scratch)?, Platform::Cuda { stream })?;
    }
    // ddt: a warp per (b, l, h) row, 8 rows per block.
    let rows_per_block = (THREADS / 32) as u64;
    let blocks = (p.rows().max(0) as u64).div_ceil(rows_per_block).min(MAX_BLOCKS);
    let config = LaunchConfig { grid: (blocks, 1, 1), block: THREADS, shared_bytes: 0 };
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, MODULE, &kernels::ssd_glue("reduce_ddt", ssd.dtype()), config, &g) }?;
    let per_head = LaunchConfig { grid: (p.heads as u64, 1, 1), block: THREADS, shared_bytes: 0 };
    // SAFETY: the parameters of a validated call (see `launch`).
    unsafe { launch(stream, MODULE, kernels::SSD_GLUE_REDUCE_HEADS, per_head, &g) }
}
