//! `ssd_fwd` / `ssd_bwd`: Mamba-2's chunked SSD scan and its backward pass (docs/ssd.md has the ABI
//! and the math).
//!
//! [`validate_fwd`] / [`validate_bwd`] check every operand (the message names it, what was expected
//! and what came) and produce [`SsdParams`] / [`SsdBwdParams`], the structs the kernels read
//! (kernels/params.h is generated from them); [`run_fwd`] / [`run_bwd`] run them. The XLA handlers and the C API share both.
//!
//! The generic path (both platforms) runs SSD as a selective scan over dim = heads * headdim
//! channels in the channel-last layout: x, B, C, z, y, the states and their gradients already have
//! the layouts of the scan's u, B, C, z, out and states (channel h * headdim + p reads group
//! h / (heads / groups), as the scan's dim_per_group = (heads / groups) * headdim says), and
//! chunk_states are its checkpoints with checkpoint_len = chunk_size (f32; where
//! [`plan::chunk_states_dtype`] says T, the targets convert: the CPU always, CUDA for packed
//! calls). Only dt (broadcast over headdim into the scan's delta) and the per-head A, D and dt_bias
//! are expanded to channels, in scratch ([`Scratch`]), and the scan's per-channel gradients of those
//! summed back to heads.
//!
//! Packed sequences (`cu_seqlens`) pass through to the scan unchanged: its per-sequence states
//! (num_seqs, dim, dstate) are SSD's (num_seqs, heads, headdim, dstate), its reset rule is SSD's,
//! and its checkpoints keep the meaning of chunk_states (the state entering step c * chunk_size,
//! before a boundary there resets it). On CUDA packed calls always take this path (the tensor-core
//! kernels do not reset the state at boundaries).

use super::buffers::{check_buffers, Named};
use super::selective_scan;
use super::{check_elements, expect, expect_dtype, expect_nonnull, fmt_dims, Platform, Records, Tensor};
use crate::error::{Error, Result};
use crate::DType;
use std::ffi::c_void;

pub mod plan;
pub mod records;

pub use records::{validate_part_records, PartRecordsArgs};

/// The chunk sizes the op takes (the layout of `chunk_states`; a whole number of the selective
/// scan's 32-step tiles, at most the CUDA backward's longest checkpoint spacing).
pub const CHUNK_SIZES: [i64; 4] = [32, 64, 128, 256];
/// Largest dstate (the selective scan's).
pub const MAX_DSTATE: i64 = selective_scan::MAX_DSTATE;

/// Kernel parameters of the forward; generated into kernels/params.h. All arrays dense row-major; T is
/// the element type of x, dt, B, C, z, y (and of dx, ddt, dB, dC, dz). Absent optional operands and
/// results are null.
/// cbindgen:field-names=[x, dt, A, B, C, D, z, dt_bias, initial_states, y, final_states, chunk_states, workspace, workspace_bytes, batch, seqlen, heads, headdim, dstate, groups, chunk_size, dt_min, dt_max, dt_softplus, D_per_channel, cu_seqlens, num_seqs]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SsdParams {
    /// (batch, seqlen, heads, headdim) T.
    pub x: *const c_void,
    /// (batch, seqlen, heads) T.
    pub dt: *const c_void,
    /// (heads).
    pub a: *const f32,
    /// (batch, seqlen, groups, dstate) T.
    pub b: *const c_void,
    /// (batch, seqlen, groups, dstate) T.
    pub c: *const c_void,
    /// (heads) or (heads, headdim).
    pub d: *const f32,
    /// (batch, seqlen, heads, headdim) T.
    pub z: *const c_void,
    /// (heads).
    pub dt_bias: *const f32,
    /// (batch, heads, headdim, dstate); (num_seqs, heads, headdim, dstate) with packed sequences.
    pub initial_states: *const f32,
    /// (batch, seqlen, heads, headdim) T.
    pub y: *mut c_void,
    /// Like initial_states.
    pub final_states: *mut f32,
    /// (batch, heads, headdim, n_chunks, dstate): the state entering each chunk (chunk 0: the initial
    /// state), of [`plan::chunk_states_dtype`] (T in the tensor-core kernels, f32 in the generic
    /// path). Written by the forward when non-null; read by the backward.
    pub chunk_states: *mut c_void,
    /// Scratch from the host (size: the launcher's workspace function); contents undefined afterwards.
    pub workspace: *mut c_void,
    pub workspace_bytes: i64,
    pub batch: i64,
    pub seqlen: i64,
    pub heads: i64,
    pub headdim: i64,
    pub dstate: i64,
    pub groups: i64,
    pub chunk_size: i64,
    /// dt is clamped to `[dt_min, dt_max]` (always). -inf and +inf never clamp; 0 and +inf (the default)
    /// only zero negative dt, so after softplus they do nothing.
    pub dt_min: f32,
    pub dt_max: f32,
    pub dt_softplus: i32,
    /// D is (heads, headdim) rather than (heads).
    pub d_per_channel: i32,
    /// Packed sequences (docs/ssd.md): null, or int32 (num_seqs + 1) boundaries along seqlen of a
    /// batch-1 input; the state resets at each one, and the states are per sequence.
    pub cu_seqlens: *const i32,
    pub num_seqs: i64,
}

/// Kernel parameters of the backward; generated into kernels/params.h. The forward's (y and
/// final_states null, chunk_states read, the backward's workspace), the cotangents and the gradients
/// (null where the primal is absent). dx, ddt, dB, dC, dz are T; dA, dD (shaped like D), ddt_bias,
/// dinitial_states are f32.
/// cbindgen:field-names=[fwd, dy, dfinal_states, dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SsdBwdParams {
    pub fwd: SsdParams,
    pub dy: *const c_void,
    pub dfinal_states: *const f32,
    pub dx: *mut c_void,
    pub ddt: *mut c_void,
    pub da: *mut f32,
    pub db: *mut c_void,
    pub dc: *mut c_void,
    pub dd: *mut f32,
    pub dz: *mut c_void,
    pub ddt_bias: *mut f32,
    pub dinitial_states: *mut f32,
}

/// Parameters of the generic CUDA path's glue kernels (kernels/ssd_glue.cu), which expand per-head
/// operands to the selective scan's channels and fold its gradients back; generated into
/// kernels/params.h as `SsdGlueParams`. The arrays live in the workspace (`Scratch`).
/// cbindgen:field-names=[q, delta, A, D, dt_bias, ddelta, dA, dD, ddelta_bias, ddt_f32, transformed, _reserved, chunk_states_f32]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct GlueParams {
    /// The SSD call (forward: `q.fwd` only).
    pub q: SsdBwdParams,
    /// (batch, seqlen, heads * headdim) T: the scan's delta.
    pub delta: *mut c_void,
    /// (heads * headdim, dstate): A[h] for each channel and state.
    pub a: *mut f32,
    /// (heads * headdim): D[h] per channel, or null (absent, or already per channel).
    pub d: *mut f32,
    /// (heads * headdim): dt_bias[h] per channel, or null (not passed to the scan).
    pub dt_bias: *mut f32,
    /// Backward: (batch, seqlen, heads * headdim) T, the scan's gradient of delta.
    pub ddelta: *const c_void,
    /// Backward: (heads * headdim, dstate), the scan's gradient of its A.
    pub da: *const f32,
    /// Backward: (heads * headdim) when D is per head.
    pub dd: *const f32,
    /// Backward: (heads * headdim), when the scan had the bias (not transformed).
    pub ddelta_bias: *const f32,
    /// Backward: (batch, seqlen, heads) ddt before rounding, for ddt_bias when transformed; or null.
    pub ddt_f32: *mut f32,
    /// delta holds the final dt (bias, softplus and clamp applied; rounded to T) instead of the raw dt.
    pub transformed: i32,
    pub _reserved: i32,
    /// Where chunk_states are in T (packed calls at the tensor-core shapes): the scan's f32
    /// checkpoints, (batch, dim, n_chunks, dstate), rounded into chunk_states after the forward and
    /// widened from them before the backward; else null.
    pub chunk_states_f32: *mut f32,
}

/// A launch of the tensor-core forward (kernels/ssd_fwd.cu): the call's parameters and the sequence
/// split, whose records are in `p.workspace`; generated into kernels/params.h as `SsdMmaParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FwdMmaParams {
    pub p: SsdParams,
    pub split: plan::MmaFwdSplit,
    /// Non-zero: `ssd_fwd_tile_scalars` parked the scalars of every full 64-step tile in y's rows,
    /// where the wgmma kernel reads them (unpacked calls; the other kernels form their own).
    pub scalars_in_y: i32,
}

/// CUDA's `float2`, which the kernels read as one 8-byte load (not in kernels/params.h: CUDA has it).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default)]
pub struct Float2 {
    pub x: f32,
    pub y: f32,
}

/// A launch of the tensor-core backward (kernels/ssd_bwd.cu): the call's parameters and its views of
/// the workspace ([`plan::mma_bwd_layout`]); generated into kernels/params.h as `SsdBwdMmaParams`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BwdMmaParams {
    pub q: SsdBwdParams,
    /// (batch, seqlen, heads, headdim) T, with z: y before the gate, then dy through the gate.
    pub gated: *mut c_void,
    /// (n_parts, batch * heads, scratch slots, headdim * dstate) T: recomputed states.
    pub scratch: *mut c_void,
    /// (n_parts, batch, heads).
    pub da_part: *mut f32,
    /// (n_parts, batch, heads).
    pub dbias_part: *mut f32,
    /// (n_parts, batch, heads, headdim).
    pub dd_part: *mut f32,
    /// Sequence split (few batch x heads): parts of `chunks_per_part` chunks. Parts 1..n_parts-1 are
    /// each cut in `records_per_part` pieces of whole tiles (the last ones shorter or empty), and
    /// record r (part r / records_per_part + 1, piece r % records_per_part) is the gradient entering
    /// its piece from the piece's own steps and their total decay (log2):
    /// `[n_records][batch * heads][headdim * dstate]`, then `[n_records][batch * heads]`,
    /// n_records = (n_parts - 1) * records_per_part.
    pub records: *mut f32,
    pub chunks_per_part: i64,
    pub n_parts: i64,
    pub records_per_part: i64,
    /// Per (batch * heads, chunk), headdim x dstate in T, row-major: the state entering the chunk...
    pub s_chunk: *mut c_void,
    /// ...and the gradient of the state leaving it (the main kernel writes them; bc_sums reads them).
    pub ds_chunk: *mut c_void,
    /// (batch * heads, n_chunks * chunk_size): {cum, dt} from the chunk's start (chunk_scalars).
    pub scal: *mut Float2,
    /// (batch * n_chunks * groups, msum_split, tile pairs, tile, tile): M over head ranges.
    pub msum: *mut f32,
    /// Head ranges of a group that head_msum sums apart (1..heads per group).
    pub msum_split: i64,
    /// The per-head path (partials): (batch, seqlen, heads, dstate) T each, summed by reduce_bc.
    pub db_part: *mut c_void,
    pub dc_part: *mut c_void,
}

/// The tensor-core path's view of a call whose heads are wider than 64 ([`plan::mma_shape`]): its
/// per-head operands repeated for each head's split heads before the kernels (`expand`), and the
/// kernels' gradients of them summed back to heads after (`fold`), by kernels/ssd_glue.cu;
/// generated into kernels/params.h as `SsdSplitHeadsParams`. The arrays live in the workspace
/// ([`plan::SplitHeads`]); each is null where the call has no such operand or gradient.
/// cbindgen:field-names=[q, ways, dt, A, D, dt_bias, ddt, dA, dD, ddt_bias]
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SplitHeadsParams {
    /// The caller's call (forward: `q.fwd` only).
    pub q: SsdBwdParams,
    /// Split heads per head: headdim / 64.
    pub ways: i64,
    /// (batch, seqlen, heads * ways) T.
    pub dt: *mut c_void,
    /// (heads * ways) f32 each; D only where it is per head (a (heads, headdim) D already has the
    /// split heads' layout).
    pub a: *mut f32,
    pub d: *mut f32,
    pub dt_bias: *mut f32,
    /// Backward: the kernels' gradients of the four above, the same shapes.
    pub ddt: *mut c_void,
    pub da: *mut f32,
    pub dd: *mut f32,
    pub ddt_bias: *mut f32,
}

impl SplitHeadsParams {
    /// The arrays of `layout` in the workspace at `base` (its aligned start), for `bwd` (forward: no
    /// gradients).
    pub fn carve(bwd: &SsdBwd, layout: &plan::SplitHeads, base: *mut u8, backward: bool) -> SplitHeadsParams {
        let q = &bwd.params;
        let p = &q.fwd;
        let at = |on: bool, offset: i64| if on { base.wrapping_add(offset as usize) } else { std::ptr::null_mut() };
        let d_per_head = !p.d.is_null() && p.d_per_channel == 0;
        SplitHeadsParams {
            q: *q,
            ways: layout.ways,
            dt: at(true, layout.dt) as *mut c_void,
            a: at(true, layout.a) as *mut f32,
            d: at(d_per_head, layout.d) as *mut f32,
            dt_bias: at(!p.dt_bias.is_null(), layout.dt_bias) as *mut f32,
            ddt: at(backward && !q.ddt.is_null(), layout.ddt) as *mut c_void,
            da: at(backward && !q.da.is_null(), layout.da) as *mut f32,
            dd: at(backward && d_per_head && !q.dd.is_null(), layout.dd) as *mut f32,
            ddt_bias: at(backward && !q.ddt_bias.is_null(), layout.ddt_bias) as *mut f32,
        }
    }
}

/// A strided copy (kernels/ssd_glue.cu, `gather`): element (i0, i1, i2, i3) of `dst`, rows of
/// `dst_cols` elements (at least dims[3]) after `dims`' first three, is the element of `src` at
/// sum(i_k * strides[k]), plus, where `second` is not 0, the one `second` elements past it (the sum
/// of two halves, in f32, rounded once). Elements past dims[3] in a row, and where `zero_from` is not
/// 0 those with i1 >= zero_from, are zero. Moves arrays to and from the calls of [`plan::PadState`],
/// [`plan::StateHalves`] and [`plan::PadHeads`]; generated into kernels/params.h as `SsdGather`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Gather {
    pub src: *const c_void,
    pub dst: *mut c_void,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
    pub second: i64,
    pub zero_from: i64,
    pub dst_cols: i64,
}

/// Where a stage keeps its copy of an array: `offset` bytes past the workspace's aligned start
/// `base`, or null where the caller has no such array.
fn in_workspace(callers: *const c_void, base: *mut u8, offset: i64) -> *mut c_void {
    if callers.is_null() {
        std::ptr::null_mut()
    } else {
        base.wrapping_add(offset as usize) as *mut c_void
    }
}

/// A [`plan::Copies`] in a workspace: where the tensor-core kernels read and write a stage's copies
/// of the call's per-channel arrays (null where the call has no such array).
#[derive(Debug, Clone, Copy)]
pub struct CopiesAt {
    pub x: *mut c_void,
    pub z: *mut c_void,
    pub y: *mut c_void,
    pub dy: *mut c_void,
    pub dx: *mut c_void,
    pub dz: *mut c_void,
    pub d: *mut f32,
    pub dd: *mut f32,
    pub initial_states: *mut f32,
    pub final_states: *mut f32,
    pub dinitial_states: *mut f32,
    pub dfinal_states: *mut f32,
    pub chunk_states: *mut c_void,
}

impl CopiesAt {
    /// The copies of `layout` in the workspace at `base` (its aligned start) that `bwd` (a forward:
    /// [`Ssd::as_bwd`]) has; D and dD only where `copies_d`.
    fn carve(bwd: &SsdBwd, layout: &plan::Copies, base: *mut u8, copies_d: bool) -> CopiesAt {
        let q = &bwd.params;
        let p = &q.fwd;
        let at = |callers: *const c_void, offset: i64| in_workspace(callers, base, offset);
        let d_at = |callers: *const f32, offset: i64| {
            if copies_d {
                at(callers.cast(), offset).cast()
            } else {
                std::ptr::null_mut()
            }
        };
        CopiesAt {
            x: at(p.x, layout.x),
            z: at(p.z, layout.z),
            y: at(p.y, layout.y),
            dy: at(q.dy, layout.dy),
            dx: at(q.dx, layout.dx),
            dz: at(q.dz, layout.dz),
            d: d_at(p.d, layout.d),
            dd: d_at(q.dd, layout.dd),
            initial_states: at(p.initial_states.cast(), layout.initial_states).cast(),
            final_states: at(p.final_states.cast(), layout.final_states).cast(),
            dinitial_states: at(q.dinitial_states.cast(), layout.dinitial_states).cast(),
            dfinal_states: at(q.dfinal_states.cast(), layout.dfinal_states).cast(),
            chunk_states: at(p.chunk_states, layout.chunk_states),
        }
    }
}

/// The arrays of a [`plan::PadHeads`] in a workspace: where the tensor-core kernels read and write a
/// call's arrays with its heads widened (D only where it is per channel).
#[derive(Debug, Clone, Copy)]
pub struct PaddedHeads {
    pub headdim: i64,
    pub copies: CopiesAt,
}

impl PaddedHeads {
    /// The arrays of `layout` in the workspace at `base` (its aligned start) that `bwd` (a forward:
    /// [`Ssd::as_bwd`]) has.
    pub fn carve(bwd: &SsdBwd, layout: &plan::PadHeads, base: *mut u8) -> PaddedHeads {
        let per_channel_d = bwd.params.fwd.d_per_channel != 0;
        PaddedHeads { headdim: layout.headdim, copies: CopiesAt::carve(bwd, &layout.copies, base, per_channel_d) }
    }
}

/// The arrays of a [`plan::StateHalves`] in a workspace: where the tensor-core kernels read and write
/// a halved call's arrays (null where the call has no such array); B, C, dB and dC stay where they
/// are.
#[derive(Debug, Clone, Copy)]
pub struct HalvedState {
    pub copies: CopiesAt,
    pub dt: *mut c_void,
    pub ddt: *mut c_void,
    pub a: *mut f32,
    pub dt_bias: *mut f32,
    pub da: *mut f32,
    pub ddt_bias: *mut f32,
}

impl HalvedState {
    /// The arrays of `layout` in the workspace at `base` (its aligned start) that `bwd` (a forward:
    /// [`Ssd::as_bwd`]) has.
    pub fn carve(bwd: &SsdBwd, layout: &plan::StateHalves, base: *mut u8) -> HalvedState {
        let q = &bwd.params;
        let p = &q.fwd;
        let at = |callers: *const c_void, offset: i64| in_workspace(callers, base, offset);
        HalvedState {
            copies: CopiesAt::carve(bwd, &layout.copies, base, true),
            dt: at(p.dt, layout.dt),
            ddt: at(q.ddt, layout.ddt),
            a: at(p.a.cast(), layout.a).cast(),
            dt_bias: at(p.dt_bias.cast(), layout.dt_bias).cast(),
            da: at(q.da.cast(), layout.da).cast(),
            ddt_bias: at(q.ddt_bias.cast(), layout.ddt_bias).cast(),
        }
    }
}

/// The arrays of a [`plan::PadState`] in a workspace: where the tensor-core kernels read and write
/// the call's state-sized arrays, widened to `dstate` (null where the call has no such array).
#[derive(Debug, Clone, Copy)]
pub struct PaddedState {
    pub dstate: i64,
    pub b: *mut c_void,
    pub c: *mut c_void,
    pub initial_states: *mut f32,
    pub final_states: *mut f32,
    pub chunk_states: *mut c_void,
    pub db: *mut c_void,
    pub dc: *mut c_void,
    pub dinitial_states: *mut f32,
    pub dfinal_states: *mut f32,
}

impl PaddedState {
    /// The arrays of `layout` in the workspace at `base` (its aligned start) that `bwd` (a forward:
    /// [`Ssd::as_bwd`]) has.
    pub fn carve(bwd: &SsdBwd, layout: &plan::PadState, base: *mut u8) -> PaddedState {
        let q = &bwd.params;
        let p = &q.fwd;
        let at = |callers: *const c_void, offset: i64| in_workspace(callers, base, offset);
        PaddedState {
            dstate: layout.dstate,
            b: at(p.b, layout.b),
            c: at(p.c, layout.c),
            initial_states: at(p.initial_states.cast(), layout.initial_states).cast(),
            final_states: at(p.final_states.cast(), layout.final_states).cast(),
            chunk_states: at(p.chunk_states, layout.chunk_states),
            db: at(q.db, layout.db),
            dc: at(q.dc, layout.dc),
            dinitial_states: at(q.dinitial_states.cast(), layout.dinitial_states).cast(),
            dfinal_states: at(q.dfinal_states.cast(), layout.dfinal_states).cast(),
        }
    }
}

impl SsdBwdParams {
    /// A forward's parameters with no cotangents or gradients (what kernels shared by both passes
    /// see of a forward).
    pub fn forward_only(fwd: SsdParams) -> SsdBwdParams {
        let null = std::ptr::null_mut::<f32>();
        SsdBwdParams {
            fwd,
            dy: std::ptr::null(),
            dfinal_states: null,
            dx: std::ptr::null_mut(),
            ddt: std::ptr::null_mut(),
            da: null,
            db: std::ptr::null_mut(),
            dc: std::ptr::null_mut(),
            dd: null,
            dz: std::ptr::null_mut(),
            ddt_bias: null,
            dinitial_states: null,
        }
    }
}

impl SsdParams {
    /// Whether the call packs sequences (`cu_seqlens`).
    pub fn packed(&self) -> bool {
        !self.cu_seqlens.is_null()
    }

    /// Rows of the states: batch, or num_seqs with packed sequences.
    pub fn state_rows(&self) -> i64 {
        if self.packed() {
            self.num_seqs
        } else {
            self.batch
        }
    }

    /// The packed sequences' boundaries (num_seqs + 1), when there are some.
    ///
    /// # Safety
    /// The parameters are validated and `cu_seqlens` is host memory (the CPU platform).
    pub unsafe fn host_cu_seqlens(&self) -> Option<&[i32]> {
        // SAFETY: per the contract, num_seqs + 1 readable i32s.
        self.packed().then(|| unsafe { std::slice::from_raw_parts(self.cu_seqlens, self.num_seqs as usize + 1) })
    }

    /// Channels of the equivalent selective scan.
    pub fn dim(&self) -> i64 {
        self.heads * self.headdim
    }

    /// (b, l, h) rows of dt.
    pub fn rows(&self) -> i64 {
        self.batch * self.seqlen * self.heads
    }

    /// The call's shape, as the plan sees it (x's elements of `dtype`).
    pub fn shape(&self, dtype: DType) -> plan::Shape {
        plan::Shape {
            batch: self.batch,
            seqlen: self.seqlen,
            heads: self.heads,
            headdim: self.headdim,
            dstate: self.dstate,
            groups: self.groups,
            chunk_size: self.chunk_size,
            elem_bytes: dtype.size_bytes(),
        }
    }

    pub fn n_chunks(&self) -> i64 {
        n_chunks(self.seqlen, self.chunk_size)
    }

    /// Elements of chunk_states.
    pub fn chunk_states_len(&self) -> i64 {
        self.batch * self.dim() * self.n_chunks() * self.dstate
    }

    /// The element type of chunk_states for inputs of `dtype` ([`plan::chunk_states_dtype`]).
    pub fn chunk_states_dtype(&self, dtype: DType) -> DType {
        plan::chunk_states_dtype(dtype, self.headdim, self.dstate, self.chunk_size)
    }

    /// Whether the clamp can change no dt: then the scan's delta is the raw dt (exact) and the
    /// scan applies the bias and softplus itself. It cannot when neither limit is finite, or when
    /// softplus makes dt >= 0 >= dt_min.
    pub fn clamp_is_noop(&self) -> bool {
        self.dt_max == f32::INFINITY
            && (self.dt_min == f32::NEG_INFINITY || (self.dt_softplus != 0 && self.dt_min <= 0.0))
    }
}

/// Chunks of a sequence: ceil(seqlen / chunk_size).
pub fn n_chunks(seqlen: i64, chunk_size: i64) -> i64 {
    if chunk_size <= 0 {
        0
    } else {
        (seqlen + chunk_size - 1) / chunk_size
    }
}

/// Which optional inputs a call has (their pointers may be null when they are empty).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Present {
    pub d: bool,
    pub z: bool,
    pub dt_bias: bool,
    pub initial_states: bool,
}

/// The inputs of both calls, as the host describes them.
pub struct Inputs<'a> {
    pub x: &'a Tensor,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    /// (heads) or (heads, headdim).
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub dt_bias: Option<&'a Tensor>,
    /// (batch, heads, headdim, dstate); (num_seqs, heads, headdim, dstate) with `cu_seqlens`.
    pub initial_states: Option<&'a Tensor>,
    /// Packed sequences: int32 (num_seqs + 1) boundaries along seqlen of a batch-1 input.
    pub cu_seqlens: Option<&'a Tensor>,
    pub chunk_size: i64,
    pub dt_softplus: bool,
    pub dt_min: f32,
    pub dt_max: f32,
}

impl<'a> Inputs<'a> {
    /// The operands by name, for the checks every call's buffers get.
    fn named(&self) -> Vec<Named<'a>> {
        vec![
            ("x", Some(self.x)),
            ("dt", Some(self.dt)),
            ("A", Some(self.a)),
            ("B", Some(self.b)),
            ("C", Some(self.c)),
            ("D", self.d),
            ("z", self.z),
            ("dt_bias", self.dt_bias),
            ("initial_states", self.initial_states),
            ("cu_seqlens", self.cu_seqlens),
        ]
    }
}

/// The operands and results of one forward call.
pub struct FwdArgs<'a> {
    pub inputs: Inputs<'a>,
    pub y: &'a Tensor,
    pub final_states: &'a Tensor,
    /// Written when given (`save_chunk_states`).
    pub chunk_states: Option<&'a Tensor>,
    /// Scratch (any dtype); the CUDA target needs [`plan::fwd_workspace_bytes`] bytes.
    pub workspace: Option<&'a Tensor>,
    /// The split's first pass, made beforehand by `ssd_part_records` on the same inputs
    /// ([`records`]): the tensor-core split reads them instead of making them.
    pub part_records: Option<&'a Tensor>,
}

/// The operands and results of one backward call; each optional gradient is present exactly when
/// its primal is.
pub struct BwdArgs<'a> {
    pub inputs: Inputs<'a>,
    pub chunk_states: &'a Tensor,
    pub dy: &'a Tensor,
    pub dfinal_states: Option<&'a Tensor>,
    pub dx: &'a Tensor,
    pub ddt: &'a Tensor,
    pub da: &'a Tensor,
    pub db: &'a Tensor,
    pub dc: &'a Tensor,
    pub dd: Option<&'a Tensor>,
    pub dz: Option<&'a Tensor>,
    pub ddt_bias: Option<&'a Tensor>,
    pub dinitial_states: Option<&'a Tensor>,
    /// Scratch (any dtype); the CUDA target needs [`plan::bwd_workspace_bytes`] bytes.
    pub workspace: Option<&'a Tensor>,
}

validated! {
    /// A validated forward call.
    #[derive(Debug, Clone, Copy)]
    pub struct Ssd {
        params: SsdParams,
        /// dtype of x, dt, B, C, z and y.
        dtype: DType,
        present: Present,
        /// Whether the call writes chunk_states (its pointer may be null when they are empty).
        save_chunk_states: bool,
        /// Where the split's part records come from, or that they are all the call makes.
        records: Records,
    }
}

validated! {
    /// A validated backward call.
    #[derive(Debug, Clone, Copy)]
    pub struct SsdBwd {
        params: SsdBwdParams,
        /// dtype of x, dt, B, C, z, dy and their gradients.
        dtype: DType,
        present: Present,
        has_dfinal_states: bool,
    }
}

impl SsdBwd {
    /// The same call reading the forward's chunk states from `chunk_states` (the CPU's f32 copy of
    /// them).
    pub fn with_chunk_states(&self, chunk_states: *mut c_void) -> SsdBwd {
        let mut bwd = *self;
        bwd.params.fwd.chunk_states = chunk_states;
        bwd
    }

    /// The forward the backward with z runs first on the CUDA tensor-core path: y before the gate,
    /// into `y_pre` (same shape and dtype as y), without z, final states, chunk states or workspace.
    pub fn ungated_forward(&self, y_pre: *mut c_void) -> Ssd {
        let params = SsdParams {
            z: std::ptr::null(),
            y: y_pre,
            final_states: std::ptr::null_mut(),
            chunk_states: std::ptr::null_mut(),
            workspace: std::ptr::null_mut(),
            workspace_bytes: 0,
            ..self.params.fwd
        };
        let present = Present { z: false, ..self.present };
        Ssd { params, dtype: self.dtype, present, save_chunk_states: false, records: Records::Made }
    }
}

impl SsdBwd {
    /// This call as `split.ways` heads of headdim / ways per head, reading the split heads' operands
    /// and writing their gradients where `split` says (its `fold` then sums them to heads). The
    /// other arrays keep their bytes: (heads, headdim) rows are (heads * ways, headdim / ways) rows,
    /// which is also why a (heads, headdim) D and its gradient stay as they are.
    pub fn split_heads(&self, split: &SplitHeadsParams) -> SsdBwd {
        let q = &self.params;
        let p = &q.fwd;
        let or_callers = |split: *mut f32, callers: *mut f32| if split.is_null() { callers } else { split };
        let fwd = SsdParams {
            dt: split.dt,
            a: split.a,
            d: or_callers(split.d, p.d as *mut f32),
            dt_bias: split.dt_bias,
            heads: p.heads * split.ways,
            headdim: p.headdim / split.ways,
            ..*p
        };
        let params = SsdBwdParams {
            fwd,
            ddt: split.ddt,
            da: split.da,
            dd: or_callers(split.dd, q.dd),
            ddt_bias: split.ddt_bias,
            ..*q
        };
        SsdBwd { params, ..*self }
    }

    /// This call reading and writing its per-channel arrays where `copies` says (the caller's D and
    /// dD where `copies` has none).
    fn with_copies(&self, copies: &CopiesAt) -> SsdBwd {
        let q = &self.params;
        let p = &q.fwd;
        let or_callers = |copy: *mut f32, callers: *const f32| if copy.is_null() { callers } else { copy };
        let fwd = SsdParams {
            x: copies.x,
            z: copies.z,
            y: copies.y,
            d: or_callers(copies.d, p.d),
            initial_states: copies.initial_states,
            final_states: copies.final_states,
            chunk_states: copies.chunk_states,
            ..*p
        };
        let params = SsdBwdParams {
            fwd,
            dy: copies.dy,
            dfinal_states: copies.dfinal_states,
            dx: copies.dx,
            dd: or_callers(copies.dd, q.dd) as *mut f32,
            dz: copies.dz,
            dinitial_states: copies.dinitial_states,
            ..*q
        };
        SsdBwd { params, ..*self }
    }

    /// This call with its state's two halves run as twice the groups and heads
    /// ([`plan::StateHalves`]): every array but B, C, dB and dC is `halved`'s.
    pub fn halve_state(&self, halved: &HalvedState) -> SsdBwd {
        let mut bwd = self.with_copies(&halved.copies);
        let q = &mut bwd.params;
        q.fwd.dt = halved.dt;
        q.fwd.a = halved.a;
        q.fwd.dt_bias = halved.dt_bias;
        q.fwd.heads *= 2;
        q.fwd.groups *= 2;
        q.fwd.dstate /= 2;
        q.ddt = halved.ddt;
        q.da = halved.da;
        q.ddt_bias = halved.ddt_bias;
        bwd
    }

    /// This call with its heads widened to `padded.headdim` channels ([`plan::PadHeads`]): its
    /// per-channel arrays are `padded`'s (a per-head D and its gradient stay the caller's).
    pub fn pad_heads(&self, padded: &PaddedHeads) -> SsdBwd {
        let mut bwd = self.with_copies(&padded.copies);
        bwd.params.fwd.headdim = padded.headdim;
        bwd
    }

    /// This call on a state widened to `pad.dstate`: its state-sized arrays are `pad`'s.
    pub fn pad_state(&self, pad: &PaddedState) -> SsdBwd {
        let q = &self.params;
        let fwd = SsdParams {
            b: pad.b,
            c: pad.c,
            initial_states: pad.initial_states,
            final_states: pad.final_states,
            chunk_states: pad.chunk_states,
            dstate: pad.dstate,
            ..q.fwd
        };
        let params = SsdBwdParams {
            fwd,
            db: pad.db,
            dc: pad.dc,
            dinitial_states: pad.dinitial_states,
            dfinal_states: pad.dfinal_states,
            ..*q
        };
        SsdBwd { params, ..*self }
    }
}

impl Ssd {
    /// The forward as [`SsdBwd::pad_state`] views it.
    pub fn pad_state(&self, pad: &PaddedState) -> Ssd {
        Ssd { params: self.as_bwd().pad_state(pad).params.fwd, ..*self }
    }

    /// The forward as [`SsdBwd::halve_state`] views it.
    pub fn halve_state(&self, halved: &HalvedState) -> Ssd {
        Ssd { params: self.as_bwd().halve_state(halved).params.fwd, ..*self }
    }

    /// The forward as [`SsdBwd::pad_heads`] views it.
    pub fn pad_heads(&self, padded: &PaddedHeads) -> Ssd {
        Ssd { params: self.as_bwd().pad_heads(padded).params.fwd, ..*self }
    }

    /// The forward as [`SsdBwd::split_heads`] views it.
    pub fn split_heads(&self, split: &SplitHeadsParams) -> Ssd {
        Ssd { params: self.as_bwd().split_heads(split).params.fwd, ..*self }
    }

    /// The call as a backward with no cotangents or gradients (what kernels shared by both passes
    /// see of a forward).
    pub fn as_bwd(&self) -> SsdBwd {
        let params = SsdBwdParams::forward_only(self.params);
        SsdBwd { params, dtype: self.dtype, present: self.present, has_dfinal_states: false }
    }

    /// The same call writing its chunk states to `chunk_states` instead (the CPU's f32 scratch, when
    /// the caller's are in the inputs' dtype).
    pub fn with_chunk_states(&self, chunk_states: *mut c_void) -> Ssd {
        let mut ssd = *self;
        ssd.params.chunk_states = chunk_states;
        ssd
    }

    /// The element type of chunk_states ([`plan::chunk_states_dtype`]).
    pub fn chunk_states_dtype(&self) -> DType {
        self.params.chunk_states_dtype(self.dtype)
    }

    /// A part-records call as the plain forward whose final states are its end states from zero,
    /// writing y to `y` (x's shape and dtype).
    pub fn forward_of_part_records(&self, y: *mut c_void) -> Ssd {
        Ssd { params: SsdParams { y, ..self.params }, records: Records::Made, ..*self }
    }
}

impl SsdBwd {
    /// The forward's view of this call (its inputs).
    pub fn inputs(&self) -> Ssd {
        Ssd {
            params: self.params.fwd,
            dtype: self.dtype,
            present: self.present,
            save_chunk_states: false,
            records: Records::Made,
        }
    }
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
const X_MEANING: &str = "[batch, seqlen, heads, headdim]";
const DT_MEANING: &str = "[batch, seqlen, heads]";
const BC_MEANING: &str = "[batch, seqlen, groups, dstate]";
const STATES_MEANING: &str = "[batch, heads, headdim, dstate]";
const PACKED_STATES_MEANING: &str = "[num_seqs, heads, headdim, dstate] (packed sequences)";
const CHUNK_STATES_MEANING: &str = "[batch, heads, headdim, n_chunks, dstate]";

fn opt_ptr(t: Option<&Tensor>) -> *const c_void {
    t.map_or(std::ptr::null(), |t| t.data as *const c_void)
}

fn opt_mut(t: Option<&Tensor>) -> *mut c_void {
    opt_ptr(t) as *mut c_void
}

fn workspace_size(t: Option<&Tensor>) -> i64 {
    t.map_or(0, |w| w.numel() * w.dtype.size_bytes())
}

/// The checked inputs: the parameters without results, and the shapes results are checked against.
struct Checked {
    params: SsdParams,
    dtype: DType,
    present: Present,
    x_dims: Vec<i64>,
    dt_dims: Vec<i64>,
    bc_dims: Vec<i64>,
    d_dims: Vec<i64>,
    state_dims: Vec<i64>,
    /// What state_dims mean (per batch entry, or per packed sequence).
    state_meaning: &'static str,
    chunk_dims: Vec<i64>,
}

fn validate_chunk_size(op: &str, chunk_size: i64) -> Result<()> {
    if !CHUNK_SIZES.contains(&chunk_size) {
        return Err(Error::invalid(format!(
            "{op}: attribute `chunk_size`: expected 32, 64, 128 or 256, got {chunk_size}"
        )));
    }
    Ok(())
}

fn validate_dt_limits(op: &str, dt_min: f32, dt_max: f32) -> Result<()> {
    // Written so that NaN fails.
    let ok = dt_min <= dt_max && dt_min < f32::INFINITY && dt_max > f32::NEG_INFINITY;
    if !ok {
        return Err(Error::invalid(format!(
            "{op}: attributes `dt_min`, `dt_max`: expected dt_min <= dt_max (not NaN, dt_min < +inf, dt_max > -inf), \
             got dt_min = {dt_min}, dt_max = {dt_max}"
        )));
    }
    Ok(())
}

/// `cu_seqlens` of a packed call: int32 (num_seqs + 1,) with x's batch 1. Returns num_seqs. (Its
/// values are checked where the host can read them: [`selective_scan::check_cu_seqlens_values`].)
fn check_cu_seqlens(op: &str, cu: &Tensor, batch: i64) -> Result<i64> {
    let what = format!("{op}: operand `cu_seqlens`");
    check_elements(&what, &cu.dims)?;
    expect_dtype(cu, &what, &[DType::S32])?;
    if cu.dims.len() != 1 || cu.dims[0] < 1 {
        return Err(Error::invalid(format!(
            "{what}: expected shape (num_seqs + 1,) [boundaries], got {}",
            fmt_dims(&cu.dims)
        )));
    }
    if batch != 1 {
        return Err(Error::invalid(format!(
            "{what}: packed sequences lie along seqlen of one batch row: x's batch must be 1, got {batch}"
        )));
    }
    Ok(cu.dims[0] - 1)
}

/// Checks every input against x's shape and dtype (the checks both calls share).
fn validate_inputs(op: &str, i: &Inputs) -> Result<Checked> {
    validate_chunk_size(op, i.chunk_size)?;
    validate_dt_limits(op, i.dt_min, i.dt_max)?;
    let x = i.x;
    check_elements(&format!("{op}: operand `x`"), &x.dims)?;
    if x.dims.len() != 4 {
        return Err(Error::invalid(format!(
            "{op}: operand `x`: expected rank 4 {X_MEANING}, got shape {}",
            fmt_dims(&x.dims)
        )));
    }
    expect_dtype(x, &format!("{op}: operand `x`"), &FLOATS)?;
    let dtype = x.dtype;
    let (batch, seqlen, heads, headdim) = (x.dims[0], x.dims[1], x.dims[2], x.dims[3]);
    let dt_dims = vec![batch, seqlen, heads];
    expect(i.dt, &format!("{op}: operand `dt`"), &dt_dims, DT_MEANING, &[dtype])?;
    expect(i.a, &format!("{op}: operand `A`"), &[heads], "[heads]", &[DType::F32])?;

    let b = i.b;
    if b.dims.len() != 4 || b.dims[0] != batch || b.dims[1] != seqlen {
        return Err(Error::invalid(format!(
            "{op}: operand `B`: expected shape ({batch}, {seqlen}, groups, dstate) {BC_MEANING}, got {}",
            fmt_dims(&b.dims)
        )));
    }
    let (groups, dstate) = (b.dims[2], b.dims[3]);
    if groups < 1 || heads % groups != 0 {
        return Err(Error::invalid(format!(
            "{op}: operand `B`: groups (= {groups}) must be at least 1 and divide heads (= {heads})"
        )));
    }
    if !(1..=MAX_DSTATE).contains(&dstate) {
        return Err(Error::invalid(format!("{op}: operand `B`: dstate must be in [1, {MAX_DSTATE}], got {dstate}")));
    }
    let bc_dims = vec![batch, seqlen, groups, dstate];
    expect(b, &format!("{op}: operand `B`"), &bc_dims, BC_MEANING, &[dtype])?;
    expect(i.c, &format!("{op}: operand `C` (must match B)"), &bc_dims, BC_MEANING, &[dtype])?;

    let d_dims = match i.d {
        None => vec![heads],
        Some(d) => {
            let dims = if d.dims.len() == 2 { vec![heads, headdim] } else { vec![heads] };
            if d.dims != dims {
                return Err(Error::invalid(format!(
                    "{op}: operand `D`: expected shape ({heads},) [heads] or ({heads}, {headdim}) [heads, headdim], got {}",
                    fmt_dims(&d.dims)
                )));
            }
            expect_dtype(d, &format!("{op}: operand `D`"), &[DType::F32])?;
            dims
        }
    };
    if let Some(z) = i.z {
        expect(z, &format!("{op}: operand `z`"), &x.dims, X_MEANING, &[dtype])?;
    }
    if let Some(bias) = i.dt_bias {
        expect(bias, &format!("{op}: operand `dt_bias`"), &[heads], "[heads]", &[DType::F32])?;
    }
    let (state_rows, state_meaning, num_seqs) = match i.cu_seqlens {
        None => (batch, STATES_MEANING, 0),
        Some(cu) => {
            let num_seqs = check_cu_seqlens(op, cu, batch)?;
            (num_seqs, PACKED_STATES_MEANING, num_seqs)
        }
    };
    let state_dims = vec![state_rows, heads, headdim, dstate];
    if let Some(h0) = i.initial_states {
        expect(h0, &format!("{op}: operand `initial_states`"), &state_dims, state_meaning, &[DType::F32])?;
    }
    let named: [(Option<&Tensor>, &str); 10] = [
        (Some(x), "x"),
        (Some(i.dt), "dt"),
        (Some(i.a), "A"),
        (Some(b), "B"),
        (Some(i.c), "C"),
        (i.d, "D"),
        (i.z, "z"),
        (i.dt_bias, "dt_bias"),
        (i.initial_states, "initial_states"),
        (i.cu_seqlens, "cu_seqlens"),
    ];
    expect_nonnull_all(op, "operand", &named)?;

    let params = SsdParams {
        x: x.data,
        dt: i.dt.data,
        a: i.a.data as *const f32,
        b: b.data,
        c: i.c.data,
        d: opt_ptr(i.d) as *const f32,
        z: opt_ptr(i.z),
        dt_bias: opt_ptr(i.dt_bias) as *const f32,
        initial_states: opt_ptr(i.initial_states) as *const f32,
        y: std::ptr::null_mut(),
        final_states: std::ptr::null_mut(),
        chunk_states: std::ptr::null_mut(),
        workspace: std::ptr::null_mut(),
        workspace_bytes: 0,
        batch,
        seqlen,
        heads,
        headdim,
        dstate,
        groups,
        chunk_size: i.chunk_size,
        dt_min: i.dt_min,
        dt_max: i.dt_max,
        dt_softplus: i.dt_softplus as i32,
        d_per_channel: (d_dims.len() == 2) as i32,
        cu_seqlens: opt_ptr(i.cu_seqlens) as *const i32,
        num_seqs,
    };
    let present = Present {
        d: i.d.is_some(),
        z: i.z.is_some(),
        dt_bias: i.dt_bias.is_some(),
        initial_states: i.initial_states.is_some(),
    };
    let chunk_dims = vec![batch, heads, headdim, n_chunks(seqlen, i.chunk_size), dstate];
    Ok(Checked {
        params,
        dtype,
        present,
        x_dims: x.dims.clone(),
        dt_dims,
        bc_dims,
        d_dims,
        state_dims,
        state_meaning,
        chunk_dims,
    })
}

/// Each named tensor that is present has data (or is empty).
fn expect_nonnull_all(op: &str, kind: &str, named: &[(Option<&Tensor>, &str)]) -> Result<()> {
    for (t, name) in named {
        if let Some(t) = t {
            expect_nonnull(t, &format!("{op}: {kind} `{name}`"))?;
        }
    }
    Ok(())
}

/// chunk_states' shape, and the dtype [`plan::chunk_states_dtype`] names (the message says why).
fn expect_chunk_states(op: &str, kind: &str, t: &Tensor, k: &Checked) -> Result<()> {
    let want = k.params.chunk_states_dtype(k.dtype);
    if t.dtype == want || t.dims != k.chunk_dims {
        return expect(t, &format!("{op}: {kind} `chunk_states`"), &k.chunk_dims, CHUNK_STATES_MEANING, &[want]);
    }
    let why = if want == DType::F32 {
        "f32 unless the tensor-core kernels run"
    } else {
        "the inputs' dtype where the tensor-core kernels run (bf16/f16, headdim at least 32, \
         dstate 1 to 256, chunk_size 64, 128 or 256)"
    };
    Err(Error::invalid(format!(
        "{op}: {kind} `chunk_states`: expected dtype {} ({why}; xla_ssm_ssd_chunk_states_dtype), got {}",
        want.name(),
        t.dtype.name()
    )))
}

/// Checks a forward call: the inputs, then y, final_states and chunk_states.
pub fn validate_fwd(args: &FwdArgs) -> Result<Ssd> {
    let op = "ssd_fwd";
    let k = validate_inputs(op, &args.inputs)?;
    expect(args.y, &format!("{op}: result `y`"), &k.x_dims, X_MEANING, &[k.dtype])?;
    let what = format!("{op}: result `final_states`");
    expect(args.final_states, &what, &k.state_dims, k.state_meaning, &[DType::F32])?;
    if let Some(t) = args.chunk_states {
        expect_chunk_states(op, "result", t, &k)?;
    }
    let results = [(Some(args.y), "y"), (Some(args.final_states), "final_states"), (args.chunk_states, "chunk_states")];
    expect_nonnull_all(op, "result", &results)?;
    let results = [
        ("y", Some(args.y)),
        ("final_states", Some(args.final_states)),
        ("chunk_states", args.chunk_states),
        ("workspace", args.workspace),
    ];
    check_buffers(op, &args.inputs.named(), &results)?;
    let records = match args.part_records {
        None => Records::Made,
        Some(t) => records::check_records_operand(op, t, &k.params, k.dtype, &results)?,
    };
    let params = SsdParams {
        y: args.y.data,
        final_states: args.final_states.data as *mut f32,
        chunk_states: opt_mut(args.chunk_states),
        workspace: opt_mut(args.workspace),
        workspace_bytes: workspace_size(args.workspace),
        ..k.params
    };
    let save_chunk_states = args.chunk_states.is_some();
    Ok(Ssd { params, dtype: k.dtype, present: k.present, save_chunk_states, records })
}

/// Checks a backward call: the inputs, chunk_states, the cotangents and every gradient (shape and
/// dtype of its primal).
pub fn validate_bwd(args: &BwdArgs) -> Result<SsdBwd> {
    let op = "ssd_bwd";
    let k = validate_inputs(op, &args.inputs)?;
    let i = &args.inputs;
    let f32_ = DType::F32;
    expect_chunk_states(op, "operand", args.chunk_states, &k)?;
    expect(args.dy, &format!("{op}: operand `dy`"), &k.x_dims, X_MEANING, &[k.dtype])?;
    if let Some(t) = args.dfinal_states {
        expect(t, &format!("{op}: operand `dfinal_states`"), &k.state_dims, k.state_meaning, &[f32_])?;
    }
    expect(args.dx, &format!("{op}: result `dx`"), &k.x_dims, X_MEANING, &[k.dtype])?;
    expect(args.ddt, &format!("{op}: result `ddt`"), &k.dt_dims, DT_MEANING, &[k.dtype])?;
    expect(args.da, &format!("{op}: result `dA`"), &[k.params.heads], "[heads]", &[f32_])?;
    expect(args.db, &format!("{op}: result `dB`"), &k.bc_dims, BC_MEANING, &[k.dtype])?;
    expect(args.dc, &format!("{op}: result `dC`"), &k.bc_dims, BC_MEANING, &[k.dtype])?;
    let d_meaning = if k.d_dims.len() == 2 { "[heads, headdim]" } else { "[heads]" };
    // (primal, gradient, their names, the gradient's shape, its meaning, dtype)
    type OptionalGrad<'t> = (Option<&'t Tensor>, Option<&'t Tensor>, &'t str, &'t str, &'t [i64], &'t str, DType);
    let heads = [k.params.heads];
    let optional: [OptionalGrad; 4] = [
        (i.d, args.dd, "D", "dD", &k.d_dims, d_meaning, f32_),
        (i.z, args.dz, "z", "dz", &k.x_dims, X_MEANING, k.dtype),
        (i.dt_bias, args.ddt_bias, "dt_bias", "ddt_bias", &heads, "[heads]", f32_),
        (
            i.initial_states,
            args.dinitial_states,
            "initial_states",
            "dinitial_states",
            &k.state_dims,
            k.state_meaning,
            f32_,
        ),
    ];
    for (primal, grad, primal_name, name, dims, meaning, dtype) in optional {
        match (primal, grad) {
            (Some(_), Some(t)) => expect(t, &format!("{op}: result `{name}`"), dims, meaning, &[dtype])?,
            (None, None) => {}
            (Some(_), None) => {
                return Err(Error::invalid(format!(
                    "{op}: result `{name}`: missing, but operand `{primal_name}` is given (its gradient is required)"
                )))
            }
            (None, Some(_)) => {
                return Err(Error::invalid(format!("{op}: result `{name}`: given, but operand `{primal_name}` is not")))
            }
        }
    }
    expect_nonnull_all(
        op,
        "operand",
        &[(Some(args.chunk_states), "chunk_states"), (Some(args.dy), "dy"), (args.dfinal_states, "dfinal_states")],
    )?;
    expect_nonnull_all(
        op,
        "result",
        &[
            (Some(args.dx), "dx"),
            (Some(args.ddt), "ddt"),
            (Some(args.da), "dA"),
            (Some(args.db), "dB"),
            (Some(args.dc), "dC"),
            (args.dd, "dD"),
            (args.dz, "dz"),
            (args.ddt_bias, "ddt_bias"),
            (args.dinitial_states, "dinitial_states"),
        ],
    )?;
    let mut operands = i.named();
    operands.extend([
        ("chunk_states", Some(args.chunk_states)),
        ("dy", Some(args.dy)),
        ("dfinal_states", args.dfinal_states),
    ]);
    let results = [
        ("dx", Some(args.dx)),
        ("ddt", Some(args.ddt)),
        ("dA", Some(args.da)),
        ("dB", Some(args.db)),
        ("dC", Some(args.dc)),
        ("dD", args.dd),
        ("dz", args.dz),
        ("ddt_bias", args.ddt_bias),
        ("dinitial_states", args.dinitial_states),
        ("workspace", args.workspace),
    ];
    check_buffers(op, &operands, &results)?;
    let params = SsdBwdParams {
        fwd: SsdParams {
            chunk_states: args.chunk_states.data,
            workspace: opt_mut(args.workspace),
            workspace_bytes: workspace_size(args.workspace),
            ..k.params
        },
        dy: args.dy.data,
        dfinal_states: opt_ptr(args.dfinal_states) as *const f32,
        dx: args.dx.data,
        ddt: args.ddt.data,
        da: args.da.data as *mut f32,
        db: args.db.data,
        dc: args.dc.data,
        dd: opt_mut(args.dd) as *mut f32,
        dz: opt_mut(args.dz),
        ddt_bias: opt_mut(args.ddt_bias) as *mut f32,
        dinitial_states: opt_mut(args.dinitial_states) as *mut f32,
    };
    Ok(SsdBwd { params, dtype: k.dtype, present: k.present, has_dfinal_states: args.dfinal_states.is_some() })
}

/// Runs a validated forward call.
pub fn run_fwd(ssd: &Ssd, platform: Platform) -> Result<()> {
    match platform {
        Platform::Cpu => {
            // SAFETY: validated, and on the CPU platform every buffer is host memory.
            if let Some(cu) = unsafe { ssd.params.host_cu_seqlens() } {
                selective_scan::check_cu_seqlens_values("ssd_fwd", cu, ssd.params.seqlen)?;
            }
            // Given records are the forward's own first pass: the CPU, which has none, ignores them.
            match ssd.records {
                Records::Only(_) => crate::cpu::ssd::part_records(ssd),
                Records::Made | Records::Given(_) => crate::cpu::ssd::fwd(ssd),
            }
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => crate::cuda::ssd::fwd(ssd, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(no_cuda(ssd.op())),
    }
}

/// Runs a validated backward call.
pub fn run_bwd(bwd: &SsdBwd, platform: Platform) -> Result<()> {
    match platform {
        Platform::Cpu => {
            // SAFETY: validated, and on the CPU platform every buffer is host memory.
            if let Some(cu) = unsafe { bwd.params.fwd.host_cu_seqlens() } {
                selective_scan::check_cu_seqlens_values("ssd_bwd", cu, bwd.params.fwd.seqlen)?;
            }
            crate::cpu::ssd::bwd(bwd)
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => crate::cuda::ssd::bwd(bwd, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(no_cuda("ssd_bwd")),
    }
}

#[cfg(not(feature = "cuda"))]
fn no_cuda(op: &str) -> Error {
    Error::Unimplemented(format!("{op}: this build of xla-ssm has no CUDA support (built without the `cuda` feature)"))
}

// ------------------------------------------------------------------------------ generic path

/// Per-channel arrays of the generic path, in the platform's memory. `d` and `dt_bias` are null
/// when the scan reads the caller's D (per channel) / gets no bias; the gradients only in the
/// backward.
pub(crate) struct Scratch {
    /// (batch, seqlen, dim) of dtype T: the raw dt, or the transformed dt ([`Ssd::transformed`]).
    pub delta: *mut c_void,
    /// (dim, dstate) f32.
    pub a: *mut f32,
    /// (dim) f32.
    pub d: *mut f32,
    /// (dim) f32.
    pub dt_bias: *mut f32,
    /// Backward: like delta.
    pub ddelta: *mut c_void,
    /// Backward: (dim, dstate) f32.
    pub da: *mut f32,
    /// Backward: (dim) f32, when `d` is given.
    pub dd: *mut f32,
    /// Backward: (dim) f32, when `dt_bias` is given.
    pub ddelta_bias: *mut f32,
    /// The selective scan's own workspace (CUDA).
    pub scan_workspace: *mut c_void,
    pub scan_workspace_bytes: i64,
}

impl Ssd {
    /// Whether the scan's delta is dt after bias, softplus and clamp (rounded to T) rather than the
    /// raw dt: when a clamp could change it, since the scan has no clamp.
    pub fn transformed(&self) -> bool {
        !self.params.clamp_is_noop()
    }

    /// Whether D is expanded from (heads) to channels (else the caller's (heads, headdim) D is the
    /// scan's D as it is).
    pub fn expands_d(&self) -> bool {
        self.present.d && self.params.d_per_channel == 0
    }

    /// Whether the scan gets dt_bias (expanded to channels): when delta is the raw dt.
    pub fn scan_gets_bias(&self) -> bool {
        self.present.dt_bias && !self.transformed()
    }
}

/// Tensors describing an SSD call as a selective scan, over the SSD operands and the scratch.
struct ScanView {
    u: Tensor,
    delta: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    d: Option<Tensor>,
    z: Option<Tensor>,
    delta_bias: Option<Tensor>,
    initial_state: Option<Tensor>,
    cu_seqlens: Option<Tensor>,
    softplus: bool,
    x_dims: Vec<i64>,
    state_dims: Vec<i64>,
    per_channel: Vec<i64>,
}

fn tensor(dtype: DType, dims: &[i64], data: *const c_void) -> Tensor {
    Tensor { dtype, dims: dims.to_vec(), data: data as *mut c_void }
}

impl ScanView {
    fn new(ssd: &Ssd, s: &Scratch) -> ScanView {
        let p = &ssd.params;
        let (t, f32_) = (ssd.dtype, DType::F32);
        let dim = p.dim();
        let x_dims = vec![p.batch, p.seqlen, dim];
        let bc_dims = [p.batch, p.seqlen, p.groups, p.dstate];
        // Packed: one state row per sequence, as in the scan.
        let state_dims = vec![p.state_rows(), dim, p.dstate];
        let per_channel = vec![dim];
        let d_data = if ssd.expands_d() { s.d as *const c_void } else { p.d as *const c_void };
        ScanView {
            u: tensor(t, &x_dims, p.x),
            delta: tensor(t, &x_dims, s.delta),
            a: tensor(f32_, &[dim, p.dstate], s.a as *const c_void),
            b: tensor(t, &bc_dims, p.b),
            c: tensor(t, &bc_dims, p.c),
            d: ssd.present.d.then(|| tensor(f32_, &per_channel, d_data)),
            z: ssd.present.z.then(|| tensor(t, &x_dims, p.z)),
            delta_bias: ssd.scan_gets_bias().then(|| tensor(f32_, &per_channel, s.dt_bias as *const c_void)),
            initial_state: ssd
                .present
                .initial_states
                .then(|| tensor(f32_, &state_dims, p.initial_states as *const c_void)),
            cu_seqlens: p.packed().then(|| tensor(DType::S32, &[p.num_seqs + 1], p.cu_seqlens as *const c_void)),
            softplus: p.dt_softplus != 0 && !ssd.transformed(),
            x_dims,
            state_dims,
            per_channel,
        }
    }

    fn inputs(&self) -> selective_scan::Inputs<'_> {
        selective_scan::Inputs {
            u: &self.u,
            delta: &self.delta,
            a: &self.a,
            b: &self.b,
            c: &self.c,
            d: self.d.as_ref(),
            z: self.z.as_ref(),
            delta_bias: self.delta_bias.as_ref(),
            initial_state: self.initial_state.as_ref(),
            cu_seqlens: self.cu_seqlens.as_ref(),
            delta_softplus: self.softplus,
            layout: selective_scan::Layout::ChannelLast,
        }
    }
}

/// A byte workspace tensor.
fn byte_tensor(data: *mut c_void, bytes: i64) -> Tensor {
    Tensor { dtype: DType::U8, dims: vec![bytes.max(0)], data }
}

/// The scan rejecting what SSD validation accepted is a bug of this module.
fn internal(op: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| Error::Internal(format!("{op}: the generic path built an invalid selective scan: {}", e.message()))
}

/// The selective scan forward of a validated SSD forward, over this scratch.
pub(crate) fn scan_fwd(ssd: &Ssd, s: &Scratch) -> Result<selective_scan::Fwd> {
    let p = &ssd.params;
    let v = ScanView::new(ssd, s);
    let out = tensor(ssd.dtype, &v.x_dims, p.y);
    let final_state = tensor(DType::F32, &v.state_dims, p.final_states as *const c_void);
    let save = ssd.save_chunk_states;
    let checkpoint_len = if save { p.chunk_size } else { 0 };
    let checkpoints = tensor(DType::F32, &[p.batch, p.dim(), p.n_chunks(), p.dstate], p.chunk_states);
    let workspace = byte_tensor(s.scan_workspace, s.scan_workspace_bytes);
    selective_scan::validate_fwd(&selective_scan::FwdArgs {
        inputs: v.inputs(),
        out: &out,
        final_state: &final_state,
        checkpoints: save.then_some(&checkpoints),
        checkpoint_len,
        workspace: (!s.scan_workspace.is_null()).then_some(&workspace),
        chunk_records: None,
    })
    .map_err(internal("ssd_fwd"))
}

/// The selective scan backward of a validated SSD backward, over this scratch: its gradients of
/// delta, A, D (when expanded) and delta_bias land in the scratch, the others in the SSD results.
pub(crate) fn scan_bwd(bwd: &SsdBwd, s: &Scratch) -> Result<selective_scan::Bwd> {
    let ssd = bwd.inputs();
    let (p, q) = (&ssd.params, &bwd.params);
    let v = ScanView::new(&ssd, s);
    let (t, f32_) = (ssd.dtype, DType::F32);
    let dim = p.dim();
    let checkpoints = tensor(f32_, &[p.batch, dim, p.n_chunks(), p.dstate], p.chunk_states);
    let dout = tensor(t, &v.x_dims, q.dy);
    let dfinal_state = tensor(f32_, &v.state_dims, q.dfinal_states as *const c_void);
    let du = tensor(t, &v.x_dims, q.dx);
    let ddelta = tensor(t, &v.x_dims, s.ddelta);
    let da = tensor(f32_, &[dim, p.dstate], s.da as *const c_void);
    let db = tensor(t, &v.b.dims, q.db);
    let dc = tensor(t, &v.b.dims, q.dc);
    let dd_data = if ssd.expands_d() { s.dd as *const c_void } else { q.dd as *const c_void };
    let dd = tensor(f32_, &v.per_channel, dd_data);
    let dz = tensor(t, &v.x_dims, q.dz);
    let ddelta_bias = tensor(f32_, &v.per_channel, s.ddelta_bias as *const c_void);
    let dinitial_state = tensor(f32_, &v.state_dims, q.dinitial_states as *const c_void);
    let workspace = byte_tensor(s.scan_workspace, s.scan_workspace_bytes);
    selective_scan::validate_bwd(&selective_scan::BwdArgs {
        inputs: v.inputs(),
        checkpoints: &checkpoints,
        checkpoint_len: p.chunk_size,
        dout: &dout,
        dfinal_state: bwd.has_dfinal_states.then_some(&dfinal_state),
        du: &du,
        ddelta: &ddelta,
        da: &da,
        db: &db,
        dc: &dc,
        dd: ssd.present.d.then_some(&dd),
        dz: ssd.present.z.then_some(&dz),
        ddelta_bias: v.delta_bias.is_some().then_some(&ddelta_bias),
        dinitial_state: ssd.present.initial_states.then_some(&dinitial_state),
        workspace: (!s.scan_workspace.is_null()).then_some(&workspace),
    })
    .map_err(internal("ssd_bwd"))
}
