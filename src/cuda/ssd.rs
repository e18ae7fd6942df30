//! The CUDA target. [`fwd`] and [`bwd`] pick a path: the tensor-core kernels ([`super::ssd_mma`])
//! where they apply (bf16/f16, headdim at least 32, dstate 1 to 256, chunks of whole 64-step tiles;
//! a head not a multiple of 64 is widened to one, a head wider than 64 runs as heads of 64, a state
//! narrower than the kernels' 64 or 128 is widened, and one wider than 128 runs as two halves of
//! 128, `plan::mma_shape`), else the generic one: expand the per-head operands to channels
//! (kernels/ssd_glue.cu), run the selective scan's CUDA kernels, and (backward) sum its per-channel
//! gradients back to heads. Scratch comes from the workspace result ([`crate::ops::ssd::plan`]).
//!
//! Packed sequences (`cu_seqlens`): the tensor-core forward cuts its tiles at the boundaries and
//! resets the state between them (kernels/ssd_fwd_common.cuh, `Windows`); its states have a row per
//! sequence. The tensor-core backward takes a packed call without initial states or final-state
//! cotangents (a training step's): a decay of 2^-512 at each sequence's first step stops everything
//! at the boundary (kernels/ssd_mma.cuh, `boundary_cut`), as the zero state the forward restarts from
//! does. With states, the generic path runs: the selective scan resets the state at the boundaries;
//! where chunk_states are in T (the tensor-core shapes) its f32 checkpoints pass through an f32 copy
//! in the workspace, widened before the backward, as on the CPU.

use super::ssd_mma;
use super::{launch, LaunchConfig};
use crate::error::{Error, Result};
use crate::ops::ssd::plan::{self, Layout};
use crate::ops::ssd::{
    scan_bwd, scan_fwd, Gather, GlueParams, HalvedState, PaddedHeads, PaddedState, Scratch, SplitHeadsParams, Ssd,
    SsdBwd, SsdBwdParams, SsdParams,
};
use crate::ops::Records;
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
    let shape = p.shape(ssd.dtype());
    if !plan::mma_applies(&shape) {
        return generic_fwd(ssd, stream);
    }
    if !ssd_mma::aligned(p) {
        return Err(Error::invalid(format!(
            "{}: the CUDA target takes x, B, C and y 16-byte aligned, z 4-byte aligned, the states \
             8-byte aligned (XLA's buffers always are)",
            ssd.op()
        )));
    }
    // Part records exist only where the kernels run the call as it is (validation): no widened
    // state, no split heads, no scratch.
    match ssd.records() {
        Records::Only(records) => return ssd_mma::part_records(ssd, &shape, records, stream),
        Records::Given(records) => return ssd_mma::fwd_given(ssd, &shape, records, stream),
        Records::Made => {}
    }
    let (ws, sizer) = if p.packed() {
        (plan::MmaWorkspace::packed(&shape, p.num_seqs), "xla_ssm_ssd_packed_fwd_workspace_bytes")
    } else {
        (plan::MmaWorkspace::new(&shape, false), "xla_ssm_ssd_fwd_workspace_bytes")
    };
    let base = workspace_at("ssd_fwd", p, ws.bytes, sizer)?;
    let at = |offset: i64| base.wrapping_add(offset as usize);
    let (mut run, dtype, call) = (*ssd, ssd.dtype(), ssd.as_bwd());
    let pad = (ws.pad.dstate != p.dstate).then(|| PaddedState::carve(&call, &ws.pad, base));
    if let Some(pad) = &pad {
        widen(&call.params(), pad, dtype, false, stream)?;
        run = run.pad_state(pad);
    }
    let whole = run.as_bwd();
    let halved = (ws.halves.halves > 1).then(|| HalvedState::carve(&whole, &ws.halves, at(ws.halves_at)));
    if let Some(halved) = &halved {
        halve(&whole.params(), halved, dtype, false, stream)?;
        run = run.halve_state(halved);
    }
    let before_heads = run.as_bwd();
    let padded = (ws.heads.headdim != p.headdim).then(|| PaddedHeads::carve(&before_heads, &ws.heads, at(ws.heads_at)));
    if let Some(padded) = &padded {
        widen_heads(&before_heads.params(), padded, dtype, false, stream)?;
        run = run.pad_heads(padded);
    }
    if ws.split.ways > 1 {
        let split = SplitHeadsParams::carve(&run.as_bwd(), &ws.split, at(ws.split_at), false);
        split_heads("expand", &split, dtype, stream)?;
        run = run.split_heads(&split);
    }
    ssd_mma::fwd(&run, &plan::mma_shape(&shape), at(ws.kernels_at), ws.kernels_bytes, stream)?;
    if let Some(padded) = &padded {
        narrow_heads(&before_heads.params(), padded, dtype, false, stream)?;
    }
    if let Some(halved) = &halved {
        join_halves(&whole.params(), halved, dtype, false, stream)?;
    }
    match &pad {
        Some(pad) => narrow(&call.params(), pad, dtype, false, stream),
        None => Ok(()),
    }
}

/// The backward on `stream`.
pub fn bwd(bwd: &SsdBwd, stream: *mut c_void) -> Result<()> {
    let p = &bwd.params().fwd;
    let shape = p.shape(bwd.dtype());
    let q = bwd.params();
    let with_states = !p.initial_states.is_null() || !q.dfinal_states.is_null();
    if !plan::mma_applies(&shape) || (p.packed() && with_states) {
        return generic_bwd(bwd, stream);
    }
    if !ssd_mma::bwd_aligned(&q) {
        return Err(Error::invalid(
            "ssd_bwd: the CUDA target takes x, B, C, dy and dx 16-byte aligned, z and dz 4-byte aligned, the \
             states 8-byte aligned (XLA's buffers always are)",
        ));
    }
    let ws = plan::MmaWorkspace::new(&shape, true);
    let sizer = if p.packed() { "xla_ssm_ssd_packed_bwd_workspace_bytes" } else { "xla_ssm_ssd_bwd_workspace_bytes" };
    let base = workspace_at("ssd_bwd", p, ws.bytes, sizer)?;
    let at = |offset: i64| base.wrapping_add(offset as usize);
    let (mut run, dtype) = (*bwd, bwd.dtype());
    let pad = (ws.pad.dstate != p.dstate).then(|| PaddedState::carve(bwd, &ws.pad, base));
    if let Some(pad) = &pad {
        widen(&bwd.params(), pad, dtype, true, stream)?;
        run = run.pad_state(pad);
    }
    let whole = run;
    let halved = (ws.halves.halves > 1).then(|| HalvedState::carve(&whole, &ws.halves, at(ws.halves_at)));
    if let Some(halved) = &halved {
        halve(&whole.params(), halved, dtype, true, stream)?;
        run = run.halve_state(halved);
    }
    let before_heads = run;
    let padded = (ws.heads.headdim != p.headdim).then(|| PaddedHeads::carve(&before_heads, &ws.heads, at(ws.heads_at)));
    if let Some(padded) = &padded {
        widen_heads(&before_heads.params(), padded, dtype, true, stream)?;
        run = run.pad_heads(padded);
    }
    let split = (ws.split.ways > 1).then(|| SplitHeadsParams::carve(&run, &ws.split, at(ws.split_at), true));
    if let Some(split) = &split {
        split_heads("expand", split, dtype, stream)?;
        run = run.split_heads(split);
    }
    ssd_mma::bwd(&run, &plan::mma_shape(&shape), at(ws.kernels_at), stream)?;
    if let Some(split) = &split {
        split_heads("fold", split, dtype, stream)?;
    }
    if let Some(padded) = &padded {
        narrow_heads(&before_heads.params(), padded, dtype, true, stream)?;
    }
    if let Some(halved) = &halved {
        join_halves(&whole.params(), halved, dtype, true, stream)?;
    }
    match &pad {
        Some(pad) => narrow(&bwd.params(), pad, dtype, true, stream),
        None => Ok(()),
    }
}

/// The call's state-sized inputs widened into `pad` (zero columns): B, C and the initial states, and
/// in the backward the forward's chunk states and dfinal_states.
fn widen(q: &SsdBwdParams, pad: &PaddedState, dtype: DType, backward: bool, stream: *mut c_void) -> Result<()> {
    let p = &q.fwd;
    let (n, to, f32_) = (p.dstate, pad.dstate, DType::F32);
    let (bc_rows, state_rows, chunk_rows) = rows(p);
    copy_rows(p.b, pad.b, bc_rows, n, to, dtype, stream)?;
    copy_rows(p.c, pad.c, bc_rows, n, to, dtype, stream)?;
    copy_rows(p.initial_states.cast(), pad.initial_states.cast(), state_rows, n, to, f32_, stream)?;
    if backward {
        copy_rows(p.chunk_states, pad.chunk_states, chunk_rows, n, to, dtype, stream)?;
        copy_rows(q.dfinal_states.cast(), pad.dfinal_states.cast(), state_rows, n, to, f32_, stream)?;
    }
    Ok(())
}

/// The kernels' state-sized results narrowed from `pad` into the call's: the final and chunk states,
/// or in the backward dB, dC and dinitial_states.
fn narrow(q: &SsdBwdParams, pad: &PaddedState, dtype: DType, backward: bool, stream: *mut c_void) -> Result<()> {
    let p = &q.fwd;
    let (n, from, f32_) = (p.dstate, pad.dstate, DType::F32);
    let (bc_rows, state_rows, chunk_rows) = rows(p);
    if backward {
        copy_rows(pad.db, q.db, bc_rows, from, n, dtype, stream)?;
        copy_rows(pad.dc, q.dc, bc_rows, from, n, dtype, stream)?;
        copy_rows(pad.dinitial_states.cast(), q.dinitial_states.cast(), state_rows, from, n, f32_, stream)
    } else {
        copy_rows(pad.final_states.cast(), p.final_states.cast(), state_rows, from, n, f32_, stream)?;
        copy_rows(pad.chunk_states, p.chunk_states, chunk_rows, from, n, dtype, stream)
    }
}

/// Rows of dstate elements in B and C, in the initial and final states and their gradients (a row
/// per sequence when packed), and in chunk_states.
fn rows(p: &SsdParams) -> (i64, i64, i64) {
    let per_state = p.heads * p.headdim;
    (p.batch * p.seqlen * p.groups, p.state_rows() * per_state, p.batch * per_state * p.n_chunks())
}

/// `rows` rows of `from` elements of `dtype` at `src` into rows of `to` at `dst`: the first min(from,
/// to) of each row, zeros past `from` (a `gather`); nothing where either is null.
fn copy_rows(
    src: *const c_void,
    dst: *mut c_void,
    rows: i64,
    from: i64,
    to: i64,
    dtype: DType,
    stream: *mut c_void,
) -> Result<()> {
    let g = moved(src, dst, ([rows, 1, 1, from.min(to)], [from, 0, 0, 1]));
    gather(Gather { dst_cols: to, ..g }, dtype, stream)
}

/// The sizes the halves' moves index by (plan::StateHalves): rows of (batch, seqlen, group), E heads a
/// group, headdim, state rows, chunks, and the half's dstate.
struct HalfSizes {
    step_rows: i64,
    groups: i64,
    e: i64,
    p: i64,
    state_rows: i64,
    batch: i64,
    n_chunks: i64,
    n: i64,
}

impl HalfSizes {
    fn of(p: &SsdParams) -> HalfSizes {
        HalfSizes {
            step_rows: p.batch * p.seqlen * p.groups,
            groups: p.groups,
            e: p.heads / p.groups,
            p: p.headdim,
            state_rows: p.state_rows(),
            batch: p.batch,
            n_chunks: p.n_chunks(),
            n: p.dstate / 2,
        }
    }
}

/// The halved call's inputs from the whole call's `q` (kernels/ssd_glue.cu, `gather`): x, z, dt (and
/// dy) and the per-head operands repeated per half (D zero in the second), and the states' halves
/// moved to the heads (plan::StateHalves has the layouts).
fn halve(q: &SsdBwdParams, h: &HalvedState, dtype: DType, backward: bool, stream: *mut c_void) -> Result<()> {
    let p = &q.fwd;
    let sz = HalfSizes::of(p);
    let (ep, d_inner) = (sz.e * sz.p, if p.d_per_channel != 0 { sz.e * sz.p } else { sz.e });
    let repeat = |rows: i64, inner: i64| ([rows, 2, 1, inner], [inner, 0, 0, 1]);
    for (src, dst) in [(p.x, h.copies.x), (p.z, h.copies.z)] {
        gather(moved(src, dst, repeat(sz.step_rows, ep)), dtype, stream)?;
    }
    gather(moved(p.dt, h.dt, repeat(sz.step_rows, sz.e)), dtype, stream)?;
    gather(moved(p.a.cast(), h.a.cast(), repeat(sz.groups, sz.e)), DType::F32, stream)?;
    gather(moved(p.dt_bias.cast(), h.dt_bias.cast(), repeat(sz.groups, sz.e)), DType::F32, stream)?;
    gather(
        Gather { zero_from: 1, ..moved(p.d.cast(), h.copies.d.cast(), repeat(sz.groups, d_inner)) },
        DType::F32,
        stream,
    )?;
    // A state's (o, inner, half, m) to (o, half, inner, m).
    let split = |rows: i64, inner: i64| ([rows, 2, inner, sz.n], [inner * 2 * sz.n, sz.n, 2 * sz.n, 1]);
    let states = split(sz.state_rows * sz.groups, ep);
    gather(moved(p.initial_states.cast(), h.copies.initial_states.cast(), states), DType::F32, stream)?;
    if backward {
        gather(moved(q.dy, h.copies.dy, repeat(sz.step_rows, ep)), dtype, stream)?;
        gather(moved(q.dfinal_states.cast(), h.copies.dfinal_states.cast(), states), DType::F32, stream)?;
        let chunks = split(sz.batch * sz.groups, ep * sz.n_chunks);
        gather(moved(p.chunk_states, h.copies.chunk_states, chunks), dtype, stream)?;
    }
    Ok(())
}

/// The whole call's results from the halved call's: y (dx, dz, ddt, dA, ddt_bias) summed over the
/// halves, dD the first half's, and the states' halves moved back to their last axis.
fn join_halves(q: &SsdBwdParams, h: &HalvedState, dtype: DType, backward: bool, stream: *mut c_void) -> Result<()> {
    let p = &q.fwd;
    let sz = HalfSizes::of(p);
    let (ep, d_inner) = (sz.e * sz.p, if p.d_per_channel != 0 { sz.e * sz.p } else { sz.e });
    // Half 0 of (o, half, inner) at `second` = 0, half 1 `inner` past it.
    let first = |rows: i64, inner: i64| ([rows, 1, 1, inner], [2 * inner, 0, 0, 1]);
    // A state's (o, half, inner, m) to (o, inner, half, m).
    let join = |rows: i64, inner: i64| ([rows, inner, 2, sz.n], [2 * inner * sz.n, sz.n, inner * sz.n, 1]);
    let states = join(sz.state_rows * sz.groups, ep);
    if !backward {
        gather(Gather { second: ep, ..moved(h.copies.y, p.y, first(sz.step_rows, ep)) }, dtype, stream)?;
        gather(moved(h.copies.final_states.cast(), p.final_states.cast(), states), DType::F32, stream)?;
        let chunks = join(sz.batch * sz.groups, ep * sz.n_chunks);
        return gather(moved(h.copies.chunk_states, p.chunk_states, chunks), dtype, stream);
    }
    for (src, dst) in [(h.copies.dx, q.dx), (h.copies.dz, q.dz)] {
        gather(Gather { second: ep, ..moved(src, dst, first(sz.step_rows, ep)) }, dtype, stream)?;
    }
    gather(Gather { second: sz.e, ..moved(h.ddt, q.ddt, first(sz.step_rows, sz.e)) }, dtype, stream)?;
    gather(Gather { second: sz.e, ..moved(h.da.cast(), q.da.cast(), first(sz.groups, sz.e)) }, DType::F32, stream)?;
    gather(
        Gather { second: sz.e, ..moved(h.ddt_bias.cast(), q.ddt_bias.cast(), first(sz.groups, sz.e)) },
        DType::F32,
        stream,
    )?;
    gather(moved(h.copies.dd.cast(), q.dd.cast(), first(sz.groups, d_inner)), DType::F32, stream)?;
    gather(moved(h.copies.dinitial_states.cast(), q.dinitial_states.cast(), states), DType::F32, stream)
}

/// The call's per-channel arrays widened into `padded`'s rows of `padded.headdim` channels (zeros
/// past the call's headdim): x, z, a per-channel D and the initial states, and in the backward dy,
/// dfinal_states and the forward's chunk states.
fn widen_heads(
    q: &SsdBwdParams,
    padded: &PaddedHeads,
    dtype: DType,
    backward: bool,
    stream: *mut c_void,
) -> Result<()> {
    let (p, c, f32_) = (&q.fwd, &padded.copies, DType::F32);
    let [step, state, chunk] = head_rows(p);
    // Rows of `unit` elements a channel, `headdim` channels to `padded.headdim`.
    let widen = |src: *const c_void, dst: *mut c_void, (rows, unit): (i64, i64), dtype: DType| {
        copy_rows(src, dst, rows, p.headdim * unit, padded.headdim * unit, dtype, stream)
    };
    widen(p.x, c.x, step, dtype)?;
    widen(p.z, c.z, step, dtype)?;
    widen(p.d.cast(), c.d.cast(), (p.heads, 1), f32_)?;
    widen(p.initial_states.cast(), c.initial_states.cast(), state, f32_)?;
    if backward {
        widen(q.dy, c.dy, step, dtype)?;
        widen(q.dfinal_states.cast(), c.dfinal_states.cast(), state, f32_)?;
        widen(p.chunk_states, c.chunk_states, chunk, dtype)?;
    }
    Ok(())
}

/// The call's results narrowed from `padded`'s: y, the final states and chunk states, or in the
/// backward dx, dz, a per-channel dD and dinitial_states.
fn narrow_heads(
    q: &SsdBwdParams,
    padded: &PaddedHeads,
    dtype: DType,
    backward: bool,
    stream: *mut c_void,
) -> Result<()> {
    let (p, c, f32_) = (&q.fwd, &padded.copies, DType::F32);
    let [step, state, chunk] = head_rows(p);
    let narrow = |src: *mut c_void, dst: *mut c_void, (rows, unit): (i64, i64), dtype: DType| {
        copy_rows(src, dst, rows, padded.headdim * unit, p.headdim * unit, dtype, stream)
    };
    if !backward {
        narrow(c.y, p.y, step, dtype)?;
        narrow(c.final_states.cast(), p.final_states.cast(), state, f32_)?;
        return narrow(c.chunk_states, p.chunk_states, chunk, dtype);
    }
    narrow(c.dx, q.dx, step, dtype)?;
    narrow(c.dz, q.dz, step, dtype)?;
    narrow(c.dd.cast(), q.dd.cast(), (p.heads, 1), f32_)?;
    narrow(c.dinitial_states.cast(), q.dinitial_states.cast(), state, f32_)
}

/// (rows, elements a channel) of the per-channel arrays: x, z, y and their gradients; the states;
/// chunk_states. A head's channels are the outer axis of each row.
fn head_rows(p: &SsdParams) -> [(i64, i64); 3] {
    [(p.rows(), 1), (p.state_rows() * p.heads, p.dstate), (p.batch * p.heads, p.n_chunks() * p.dstate)]
}

/// A plain strided copy of `(dims, strides)` from `src` into dense `dst` ([`Gather`]).
fn moved(src: *const c_void, dst: *mut c_void, (dims, strides): ([i64; 4], [i64; 4])) -> Gather {
    Gather { src, dst, dims, strides, second: 0, zero_from: 0, dst_cols: 0 }
}

/// One `gather` (kernels/ssd_glue.cu); nothing where either array is null.
fn gather(g: Gather, dtype: DType, stream: *mut c_void) -> Result<()> {
    let rows = g.dims[0] * g.dims[1] * g.dims[2];
    if g.src.is_null() || g.dst.is_null() || rows * g.dims[3].max(g.dst_cols) == 0 {
        return Ok(());
    }
    let warps_per_block = (THREADS / 32) as u64;
    let blocks = (rows as u64).div_ceil(warps_per_block).min(MAX_BLOCKS);
    let config = LaunchConfig { grid: (blocks, 1, 1), block: THREADS, shared_bytes: 0 };
    // SAFETY: `src` holds every element the strides reach and `dst` the rows of max(dst_cols,
    // dims[3]) elements: the call's validated arrays and the workspace's (plan::PadState,
    // plan::StateHalves, plan::PadHeads), which `workspace_at` checked holds them; the callers'
    // sizes are those arrays' shapes.
    unsafe { launch(stream, MODULE, &kernels::ssd_glue("gather", dtype), config, &g) }
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

/// The generic path's layout and its workspace sizer: packed calls have their own sizers (the
/// backward's layout with the f32 copy of chunk_states where those are in T).
fn generic_layout(p: &SsdParams, dtype: DType, backward: bool) -> (Layout, &'static str) {
    let s = p.shape(dtype);
    match (p.packed(), backward) {
        (false, false) => (plan::fwd_layout(&s), "xla_ssm_ssd_fwd_workspace_bytes"),
        (false, true) => (plan::bwd_layout(&s), "xla_ssm_ssd_bwd_workspace_bytes"),
        (true, false) => (plan::fwd_layout(&s), "xla_ssm_ssd_packed_fwd_workspace_bytes"),
        (true, true) => (plan::packed_bwd_layout(&s), "xla_ssm_ssd_packed_bwd_workspace_bytes"),
    }
}

/// Where the scan's f32 checkpoints come from when chunk_states are in T: the layout's f32 copy (null
/// when they are f32, or empty). Only packed backwards reach the generic path with chunk_states in T.
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

/// chunk_states (in T) widened into the f32 copy.
fn widen_chunk_states(g: &GlueParams, dtype: DType, stream: *mut c_void) -> Result<()> {
    let config = grid_stride(g.q.fwd.chunk_states_len());
    // SAFETY: the parameters of a validated call (see `launch`); chunk_states_f32 holds
    // chunk_states_len f32 of the workspace.
    unsafe { launch(stream, MODULE, &kernels::ssd_glue("widen_chunk_states", dtype), config, g) }
}

fn generic_fwd(ssd: &Ssd, stream: *mut c_void) -> Result<()> {
    let p = &ssd.params();
    let (layout, sizer) = generic_layout(p, ssd.dtype(), false);
    let base = workspace_base("ssd_fwd", p, &layout, sizer)?;
    let scratch = carve(ssd, &layout, base, false);
    let q = SsdBwdParams::forward_only(*p);
    let g = glue(q, ssd, &scratch, std::ptr::null_mut(), std::ptr::null_mut());
    expand(&g, ssd.dtype(), stream)?;
    selective_scan::run_fwd(&scan_fwd(ssd, &scratch)?, Platform::Cuda { stream })
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
        widen_chunk_states(&g, ssd.dtype(), stream)?;
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
