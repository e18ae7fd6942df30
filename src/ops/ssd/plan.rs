//! The workspace of the CUDA paths (the generic one's [`Layout`], the tensor-core one's
//! [`MmaWorkspace`]): which scratch arrays each holds, where, and how many bytes a host passes. Not
//! behind the `cuda` feature: hosts size the workspace (C API, JAX) without it.
//! Sizes depend on the shape and the element size only (every optional array is reserved), so a
//! host can size the workspace before it knows the flags or the device; packed calls (`cu_seqlens`)
//! have sizes of their own (`packed_*_workspace_bytes`): their states have a row per sequence, and
//! their backward takes the generic path when it has states, so its size covers both paths.

use super::n_chunks;
use crate::ops::selective_scan;
use crate::DType;

/// Alignment of each scratch array, and the slack the total keeps for an unaligned workspace.
pub const ALIGN: i64 = 256;

/// What the workspace depends on.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shape {
    pub batch: i64,
    pub seqlen: i64,
    pub heads: i64,
    pub headdim: i64,
    pub dstate: i64,
    pub groups: i64,
    pub chunk_size: i64,
    /// Bytes per element of x (2 or 4).
    pub elem_bytes: i64,
}

impl Shape {
    fn dim(&self) -> i64 {
        self.heads * self.headdim
    }
}

/// Byte offsets of the scratch arrays from the workspace's first `ALIGN`-aligned byte (backward-only
/// ones 0 in a forward layout), and `bytes`, the least workspace a host passes (0 when every array
/// is empty).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Layout {
    /// (batch, seqlen, dim) T.
    pub delta: i64,
    /// (dim, dstate) f32.
    pub a: i64,
    /// (dim) f32.
    pub d: i64,
    /// (dim) f32.
    pub dt_bias: i64,
    /// (batch, seqlen, dim) T.
    pub ddelta: i64,
    /// (dim, dstate) f32.
    pub da: i64,
    /// (dim) f32.
    pub dd: i64,
    /// (dim) f32.
    pub ddelta_bias: i64,
    /// (batch, seqlen, heads) f32.
    pub ddt_f32: i64,
    /// The selective scan's workspace, `scan_bytes` long.
    pub scan: i64,
    pub scan_bytes: i64,
    /// (batch, dim, n_chunks, dstate) f32: the scan's checkpoints where chunk_states are in T
    /// (packed backwards at the tensor-core shapes); empty elsewhere.
    pub chunk_states_f32: i64,
    pub bytes: i64,
}

/// Hands out aligned byte ranges one after another.
#[derive(Default)]
struct Carver {
    next: i64,
}

impl Carver {
    fn take(&mut self, bytes: i64) -> i64 {
        let at = self.next;
        self.next += (bytes.max(0) + ALIGN - 1) / ALIGN * ALIGN;
        at
    }

    /// The workspace a host passes: the arrays plus the slack for aligning its start; none when
    /// every array is empty.
    fn total(&self) -> i64 {
        if self.next == 0 {
            0
        } else {
            self.next + ALIGN
        }
    }
}

/// Bytes of the f32 copy of chunk_states the generic path needs where they are in T (where the
/// tensor-core kernels apply: only packed backwards take the generic path there), else 0.
fn chunk_states_f32_bytes(s: &Shape) -> i64 {
    if mma_applies(s) {
        s.batch * s.dim() * n_chunks(s.seqlen, s.chunk_size) * s.dstate * 4
    } else {
        0
    }
}

/// The forward's scratch: delta, A, D and dt_bias per channel, then the scan's optional workspace
/// (its sequence split). A packed call's too, at batch 1 (the generic path reads chunk_states in
/// f32 only: packed forwards at the tensor-core shapes take [`MmaWorkspace::packed`]).
pub fn fwd_layout(s: &Shape) -> Layout {
    let (dim, rows) = (s.dim(), s.batch * s.seqlen);
    let mut c = Carver::default();
    let delta = c.take(rows * dim * s.elem_bytes);
    let a = c.take(dim * s.dstate * 4);
    let d = c.take(dim * 4);
    let dt_bias = c.take(dim * 4);
    let scan_bytes = selective_scan::workspace_bytes(s.batch, dim, s.seqlen, s.dstate);
    let scan = c.take(scan_bytes);
    Layout { delta, a, d, dt_bias, scan, scan_bytes, bytes: c.total(), ..Layout::default() }
}

/// The backward's scratch: the forward's per-channel inputs, the scan's per-channel gradients of
/// them, ddt in f32 (for ddt_bias), then the scan backward's workspace.
pub fn bwd_layout(s: &Shape) -> Layout {
    generic_bwd_layout(s, 0)
}

/// The backward's scratch for a packed call on the generic path (one with states): [`bwd_layout`]
/// plus chunk_states widened to f32 where they are in T.
pub fn packed_bwd_layout(s: &Shape) -> Layout {
    generic_bwd_layout(s, chunk_states_f32_bytes(s))
}

fn generic_bwd_layout(s: &Shape, chunk_states_f32_bytes: i64) -> Layout {
    let (dim, rows) = (s.dim(), s.batch * s.seqlen);
    let mut c = Carver::default();
    let delta = c.take(rows * dim * s.elem_bytes);
    let a = c.take(dim * s.dstate * 4);
    let d = c.take(dim * 4);
    let dt_bias = c.take(dim * 4);
    let ddelta = c.take(rows * dim * s.elem_bytes);
    let da = c.take(dim * s.dstate * 4);
    let dd = c.take(dim * 4);
    let ddelta_bias = c.take(dim * 4);
    let ddt_f32 = c.take(rows * s.heads * 4);
    let scan_bytes = selective_scan::bwd_workspace_bytes(s.batch, dim, s.seqlen, s.dstate, s.groups);
    let scan = c.take(scan_bytes);
    let chunk_states_f32 = c.take(chunk_states_f32_bytes);
    Layout {
        delta,
        a,
        d,
        dt_bias,
        ddelta,
        da,
        dd,
        ddelta_bias,
        ddt_f32,
        scan,
        scan_bytes,
        chunk_states_f32,
        bytes: c.total(),
    }
}

/// Sizes a shape can be asked about: non-negative, groups dividing heads (else: no workspace, and
/// the call itself is refused).
fn sane(s: &Shape) -> Option<Shape> {
    let all = [s.batch, s.seqlen, s.heads, s.headdim, s.dstate, s.groups, s.chunk_size, s.elem_bytes];
    if all.iter().any(|&v| v < 0) || s.groups == 0 || s.heads % s.groups != 0 {
        return None;
    }
    Some(*s)
}

/// Bytes of workspace the CUDA forward needs: the tensor-core path's where it applies
/// ([`MmaWorkspace`]; it needs 16-byte aligned x, B and C), else the generic path's.
pub fn fwd_workspace_bytes(s: &Shape) -> i64 {
    sane(s).map_or(0, |s| if mma_applies(&s) { MmaWorkspace::new(&s, false).bytes } else { fwd_layout(&s).bytes })
}

/// Bytes of workspace the CUDA backward needs: the tensor-core path's where it applies (with or
/// without z), else the generic path's, which is far larger (its selective scan's per-channel scratch).
pub fn bwd_workspace_bytes(s: &Shape) -> i64 {
    sane(s).map_or(0, |s| if mma_applies(&s) { MmaWorkspace::new(&s, true).bytes } else { bwd_layout(&s).bytes })
}

/// Bytes of workspace the CUDA forward needs for a packed call (batch 1) of `num_seqs` sequences:
/// the tensor-core path's where it applies (its widened states have a row per sequence), else the
/// generic path's at batch 1.
pub fn packed_fwd_workspace_bytes(s: &Shape, num_seqs: i64) -> i64 {
    sane(s).map_or(0, |s| {
        if mma_applies(&s) {
            MmaWorkspace::packed(&s, num_seqs.max(0)).bytes
        } else {
            fwd_layout(&s).bytes
        }
    })
}

/// Bytes of workspace the CUDA backward needs for a packed call (batch 1): the generic path's (with
/// states), and where the tensor-core kernels apply, enough for theirs too (without).
pub fn packed_bwd_workspace_bytes(s: &Shape) -> i64 {
    sane(s).map_or(0, |s| {
        let generic = packed_bwd_layout(&s).bytes;
        if mma_applies(&s) {
            generic.max(MmaWorkspace::new(&s, true).bytes)
        } else {
            generic
        }
    })
}

/// Steps per tile of the tensor-core forward (kernels/ssd_fwd.cu).
pub const MMA_TILE: i64 = 64;
/// The tensor-core kernels' headdim (`kP`): a head of a multiple of it runs as that many heads.
pub const MMA_HEADDIM: i64 = 64;
/// Blocks the split aims for: two per SM of a 132-SM H100.
const MMA_WAVE_BLOCKS: i64 = 264;

/// The tensor-core kernels' dstates (template instances); a smaller dstate runs as the next one up.
pub const MMA_DSTATES: [i64; 2] = [64, 128];
/// The largest dstate the tensor-core path takes: a state wider than the largest instance runs as
/// two halves of it ([`StateHalves`]).
pub const MMA_MAX_DSTATE: i64 = 256;

/// The narrowest head the tensor-core path widens ([`PadHeads`]): up to half of what it computes
/// is zeros, where the generic path runs 4-10x slower.
pub const MMA_MIN_HEADDIM: i64 = 32;

/// Whether the tensor-core kernels take a call of this shape: 2-byte elements (bf16, f16),
/// headdim at least 32, dstate 1 to 256, chunks of whole tiles (its chunk states are written per
/// tile). Depends on nothing else (not on batch, seqlen, heads or groups, which sharding splits).
pub fn mma_applies(s: &Shape) -> bool {
    s.elem_bytes == 2
        && mma_headdim(s.headdim).is_some()
        && mma_dstate(s.dstate).is_some()
        && s.chunk_size % MMA_TILE == 0
        && s.chunk_size <= MMA_MAX_CHUNK
}

/// The width the tensor-core path widens a call's heads to ([`PadHeads`]): the next multiple of 64
/// from 32 channels.
pub fn mma_headdim(headdim: i64) -> Option<i64> {
    (headdim >= MMA_MIN_HEADDIM).then(|| (headdim + MMA_HEADDIM - 1) / MMA_HEADDIM * MMA_HEADDIM)
}

/// The width the tensor-core path widens a call's state to ([`PadState`]): the smallest instance that
/// holds it, else two of the largest (run as [`StateHalves`]).
pub fn mma_dstate(dstate: i64) -> Option<i64> {
    MMA_DSTATES.into_iter().chain([MMA_MAX_DSTATE]).find(|&n| dstate >= 1 && dstate <= n)
}

/// The largest instance, of which MMA_MAX_DSTATE is two.
const MMA_LARGEST_DSTATE: i64 = MMA_DSTATES[MMA_DSTATES.len() - 1];
const _: () = assert!(MMA_MAX_DSTATE == 2 * MMA_LARGEST_DSTATE);

/// Halves of the widened state the kernels run apart: 2 past the largest instance, else 1.
pub fn state_halves(dstate: i64) -> i64 {
    mma_dstate(dstate).map_or(1, |n| (n / MMA_LARGEST_DSTATE).max(1))
}

/// The shape the tensor-core kernels run: the state widened to the kernels' dstate ([`PadState`]),
/// a state of two halves as twice the groups and heads ([`StateHalves`]), heads widened to a
/// multiple of 64 channels ([`PadHeads`]), and each head as `headdim / 64` heads of 64 channels
/// ([`SplitHeads`]). A head's channels are independent given its dt, A, B and C, and x, z, y, the
/// states and their gradients keep their bytes ((heads, headdim) = (heads * ways, 64)); only the
/// per-head operands are repeated. A state widened with zero columns of B and C stays zero there and
/// adds nothing to y; channels widened with zero x stay zero and add nothing to the gradients.
pub fn mma_shape(s: &Shape) -> Shape {
    let headdim = mma_headdim(s.headdim).unwrap_or(s.headdim);
    let ways = (headdim / MMA_HEADDIM).max(1);
    let halves = state_halves(s.dstate);
    let dstate = mma_dstate(s.dstate).unwrap_or(s.dstate) / halves;
    let (heads, groups) = (s.heads * halves * ways, s.groups * halves);
    Shape { heads, groups, headdim: headdim.min(MMA_HEADDIM), dstate, ..*s }
}

/// The call [`PadHeads`] sees: its state widened ([`PadState`]) and halved ([`StateHalves`]).
fn state_stage(s: &Shape) -> Shape {
    let halves = state_halves(s.dstate);
    let dstate = mma_dstate(s.dstate).unwrap_or(s.dstate) / halves;
    Shape { heads: s.heads * halves, groups: s.groups * halves, dstate, ..*s }
}

/// The tensor-core path's workspace: [`PadState`]'s arrays, then [`StateHalves`]' (at
/// `halves_at`), then [`PadHeads`]' (at `heads_at`), then [`SplitHeads`]' (at `split_at`), then the
/// kernels' (at `kernels_at`: the forward's split records, or [`mma_bwd_layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmaWorkspace {
    pub pad: PadState,
    pub halves: StateHalves,
    pub halves_at: i64,
    pub heads: PadHeads,
    pub heads_at: i64,
    pub split: SplitHeads,
    pub split_at: i64,
    pub kernels_at: i64,
    /// The kernels' bytes from `kernels_at` (the forward takes as many records as fit).
    pub kernels_bytes: i64,
    /// What a host passes (with the slack for an unaligned start), 0 when every array is empty.
    pub bytes: i64,
}

impl MmaWorkspace {
    pub fn new(s: &Shape, backward: bool) -> MmaWorkspace {
        MmaWorkspace::with_state_rows(s, s.batch, backward)
    }

    /// A packed forward's (batch 1, a state row per sequence).
    pub fn packed(s: &Shape, num_seqs: i64) -> MmaWorkspace {
        MmaWorkspace::with_state_rows(s, num_seqs, false)
    }

    fn with_state_rows(s: &Shape, state_rows: i64, backward: bool) -> MmaWorkspace {
        let pad = PadState::new(s, state_rows, backward);
        let halves = StateHalves::new(s, state_rows, backward);
        // The later stages see the call the earlier ones made.
        let stage = state_stage(s);
        let heads = PadHeads::new(&stage, state_rows, backward);
        let split = SplitHeads::new(&Shape { headdim: heads.headdim, ..stage }, backward);
        let halves_at = pad.bytes;
        let heads_at = halves_at + halves.bytes;
        let split_at = heads_at + heads.bytes;
        let kernels_at = split_at + split.bytes;
        let m = mma_shape(s);
        let kernels = if backward { mma_bwd_layout(&m).bytes } else { mma_fwd_bytes(&m) };
        let bytes = match (kernels_at, kernels) {
            (0, _) => kernels,
            (arrays, 0) => arrays + ALIGN,
            (arrays, kernels) => arrays + kernels,
        };
        MmaWorkspace {
            pad,
            halves,
            halves_at,
            heads,
            heads_at,
            split,
            split_at,
            kernels_at,
            kernels_bytes: kernels,
            bytes,
        }
    }
}

/// Where a call whose dstate is not one of [`MMA_DSTATES`] keeps its state-sized arrays widened to
/// the kernels' dstate with zero columns (kernels/ssd_glue.cu, `gather`), at the workspace's start:
/// B and C, the initial and final states and chunk_states; in the backward also dB, dC and the
/// states' gradients. All empty (bytes 0) at the kernels' dstates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PadState {
    /// The kernels' dstate.
    pub dstate: i64,
    /// (batch, seqlen, groups, dstate) T each.
    pub b: i64,
    pub c: i64,
    /// (state rows, heads, headdim, dstate) f32 each: batch rows, or a row per packed sequence.
    pub initial_states: i64,
    pub final_states: i64,
    /// (batch, heads, headdim, n_chunks, dstate) T.
    pub chunk_states: i64,
    /// Backward: like B, C, initial_states and final_states.
    pub db: i64,
    pub dc: i64,
    pub dinitial_states: i64,
    pub dfinal_states: i64,
    /// The arrays' extent, a multiple of ALIGN.
    pub bytes: i64,
}

impl PadState {
    pub fn new(s: &Shape, state_rows: i64, backward: bool) -> PadState {
        let dstate = mma_dstate(s.dstate).unwrap_or(s.dstate);
        if dstate == s.dstate {
            return PadState { dstate, ..PadState::default() };
        }
        let bc = s.batch * s.seqlen * s.groups * dstate * s.elem_bytes;
        let states = state_rows * s.heads * s.headdim * dstate * 4;
        let chunks = s.batch * s.heads * s.headdim * n_chunks(s.seqlen, s.chunk_size) * dstate * s.elem_bytes;
        let backward_only = |bytes: i64| if backward { bytes } else { 0 };
        let mut c = Carver::default();
        let (b, cc) = (c.take(bc), c.take(bc));
        let (initial_states, final_states, chunk_states) = (c.take(states), c.take(states), c.take(chunks));
        let (db, dc) = (c.take(backward_only(bc)), c.take(backward_only(bc)));
        let (dinitial_states, dfinal_states) = (c.take(backward_only(states)), c.take(backward_only(states)));
        PadState {
            dstate,
            b,
            c: cc,
            initial_states,
            final_states,
            chunk_states,
            db,
            dc,
            dinitial_states,
            dfinal_states,
            bytes: c.next,
        }
    }
}

/// A stage's copies of the call's per-channel arrays for the call it makes (`s`: that call's heads,
/// headdim and dstate), one after another from a [`Carver`]. Empty where the pass has no such array.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copies {
    /// (batch, seqlen, heads, headdim) T each: x and z, then y (forward) or dy, dx and dz (backward).
    pub x: i64,
    pub z: i64,
    pub y: i64,
    pub dy: i64,
    pub dx: i64,
    pub dz: i64,
    /// (heads, headdim) f32: D (either of its shapes); backward also its gradient.
    pub d: i64,
    pub dd: i64,
    /// (state rows, heads, headdim, dstate) f32 each: the initial states, then the final states
    /// (forward) or the states' gradients (backward).
    pub initial_states: i64,
    pub final_states: i64,
    pub dinitial_states: i64,
    pub dfinal_states: i64,
    /// (batch, heads, headdim, n_chunks, dstate) T.
    pub chunk_states: i64,
}

/// `bytes` in the pass that has the array, else 0.
fn in_pass(bytes: i64, backward: bool, wanted_backward: bool) -> i64 {
    if backward == wanted_backward {
        bytes
    } else {
        0
    }
}

impl Copies {
    fn carve(c: &mut Carver, s: &Shape, state_rows: i64, backward: bool) -> Copies {
        let (fwd_only, bwd_only) = (|b: i64| in_pass(b, backward, false), |b: i64| in_pass(b, backward, true));
        let per_step = s.batch * s.seqlen * s.heads * s.headdim * s.elem_bytes;
        let d = s.heads * s.headdim * 4;
        let states = state_rows * s.heads * s.headdim * s.dstate * 4;
        let chunks = s.batch * s.heads * s.headdim * n_chunks(s.seqlen, s.chunk_size) * s.dstate * s.elem_bytes;
        let (x, z, y) = (c.take(per_step), c.take(per_step), c.take(fwd_only(per_step)));
        let (dy, dx, dz) = (c.take(bwd_only(per_step)), c.take(bwd_only(per_step)), c.take(bwd_only(per_step)));
        let (d, dd) = (c.take(d), c.take(bwd_only(d)));
        let (initial_states, final_states) = (c.take(states), c.take(fwd_only(states)));
        let (dinitial_states, dfinal_states) = (c.take(bwd_only(states)), c.take(bwd_only(states)));
        let chunk_states = c.take(chunks);
        Copies {
            x,
            z,
            y,
            dy,
            dx,
            dz,
            d,
            dd,
            initial_states,
            final_states,
            dinitial_states,
            dfinal_states,
            chunk_states,
        }
    }
}

/// Where a call whose widened state is two halves of the kernels' largest dstate keeps the arrays of
/// the call the kernels run instead (kernels/ssd_glue.cu, `gather`; offsets from
/// [`MmaWorkspace`]'s `halves_at`). The state's columns split as n = half * 128 + m, so B and C
/// (batch, seqlen, groups, 2 * 128) are already (batch, seqlen, 2 * groups, 128): group 2g + k is
/// half k of group g. Its heads are those of group g again, head (2g + k) * E + j for head g * E + j
/// (E heads a group): x, z, dt and dy are repeated per half, and A, D and dt_bias (D in the first half
/// only, zero in the second, so that D x is added once). y, dx, dz, ddt, dA and ddt_bias are sums over
/// the halves, dD the first half's, and the states move their half from the last axis to the head's.
/// All empty (bytes 0) where the state is not halved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateHalves {
    /// 2, or 1 where nothing is halved.
    pub halves: i64,
    /// At 2 * heads and dstate 128.
    pub copies: Copies,
    /// (batch, seqlen, 2 * heads) T: dt; backward also ddt.
    pub dt: i64,
    pub ddt: i64,
    /// (2 * heads) f32: A and dt_bias; backward also their gradients.
    pub a: i64,
    pub dt_bias: i64,
    pub da: i64,
    pub ddt_bias: i64,
    /// The arrays' extent, a multiple of ALIGN.
    pub bytes: i64,
}

impl StateHalves {
    pub fn new(s: &Shape, state_rows: i64, backward: bool) -> StateHalves {
        let halves = state_halves(s.dstate);
        if halves == 1 {
            return StateHalves { halves, ..StateHalves::default() };
        }
        let heads = s.heads * halves;
        let bwd_only = |b: i64| in_pass(b, backward, true);
        let mut c = Carver::default();
        let copies = Copies::carve(&mut c, &Shape { heads, dstate: MMA_LARGEST_DSTATE, ..*s }, state_rows, backward);
        let (dt_bytes, per_head) = (s.batch * s.seqlen * heads * s.elem_bytes, heads * 4);
        let (dt, ddt) = (c.take(dt_bytes), c.take(bwd_only(dt_bytes)));
        let (a, dt_bias) = (c.take(per_head), c.take(per_head));
        let (da, ddt_bias) = (c.take(bwd_only(per_head)), c.take(bwd_only(per_head)));
        StateHalves { halves, copies, dt, ddt, a, dt_bias, da, ddt_bias, bytes: c.next }
    }
}

/// Where a call whose headdim is not a multiple of 64 keeps the arrays with a head's channels
/// widened to [`mma_headdim`] with zeros (kernels/ssd_glue.cu, `gather`; offsets from
/// [`MmaWorkspace`]'s `heads_at`), for the call [`StateHalves`] made: x, z, y and their gradients,
/// a (heads, headdim) D and its gradient, the states and chunk_states. The added channels' x is
/// zero, so their state, y and share of every sum stay zero; y, dx, dz, dD and the states are
/// narrowed back. All empty (bytes 0) where headdim is a multiple of 64.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PadHeads {
    /// The widened headdim.
    pub headdim: i64,
    /// At the widened headdim (D only where it is per channel).
    pub copies: Copies,
    /// The arrays' extent, a multiple of ALIGN.
    pub bytes: i64,
}

impl PadHeads {
    /// For `s` as [`PadState`] and [`StateHalves`] leave it.
    pub fn new(s: &Shape, state_rows: i64, backward: bool) -> PadHeads {
        let headdim = mma_headdim(s.headdim).unwrap_or(s.headdim);
        if headdim == s.headdim {
            return PadHeads { headdim, ..PadHeads::default() };
        }
        let mut c = Carver::default();
        let copies = Copies::carve(&mut c, &Shape { headdim, ..*s }, state_rows, backward);
        PadHeads { headdim, copies, bytes: c.next }
    }
}

/// Where a call whose heads are wider than 64 keeps its per-head operands repeated for the split
/// heads of [`mma_shape`] (kernels/ssd_glue.cu), at [`MmaWorkspace`]'s `split_at` (offsets from
/// there). All empty (bytes 0) for headdim 64.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SplitHeads {
    /// Split heads per head: headdim / 64.
    pub ways: i64,
    /// (batch, seqlen, heads * ways) T: dt per split head.
    pub dt: i64,
    /// (heads * ways) f32 each: A, D (per head) and dt_bias per split head.
    pub a: i64,
    pub d: i64,
    pub dt_bias: i64,
    /// Backward: (batch, seqlen, heads * ways) T and (heads * ways) f32 each: the kernels' gradients
    /// of the split heads' dt, A, D and dt_bias, which the fold sums over each head's split heads.
    pub ddt: i64,
    pub da: i64,
    pub dd: i64,
    pub ddt_bias: i64,
    /// The arrays' extent, a multiple of ALIGN.
    pub bytes: i64,
}

impl SplitHeads {
    pub fn new(s: &Shape, backward: bool) -> SplitHeads {
        let ways = (s.headdim / MMA_HEADDIM).max(1);
        if ways == 1 {
            return SplitHeads { ways, ..SplitHeads::default() };
        }
        let per_step = s.batch * s.seqlen * s.heads * ways * s.elem_bytes;
        let per_head = s.heads * ways * 4;
        let backward_only = |bytes: i64| if backward { bytes } else { 0 };
        let mut c = Carver::default();
        let (dt, a, d, dt_bias) = (c.take(per_step), c.take(per_head), c.take(per_head), c.take(per_head));
        let (ddt, da) = (c.take(backward_only(per_step)), c.take(backward_only(per_head)));
        let (dd, ddt_bias) = (c.take(backward_only(per_head)), c.take(backward_only(per_head)));
        SplitHeads { ways, dt, a, d, dt_bias, ddt, da, dd, ddt_bias, bytes: c.next }
    }
}

/// The element type of `chunk_states` (both targets, forward and backward): `dtype` (T) where the
/// tensor-core kernels run, which save the states in T (half the bytes of f32 to write and keep,
/// ~20 us of the forward at the main shape; as mma operands they are rounded to T anyway), else
/// f32 (the selective scan's checkpoints). A function of these values alone, so that a forward's
/// residuals suit either target and every sharding.
pub fn chunk_states_dtype(dtype: DType, headdim: i64, dstate: i64, chunk_size: i64) -> DType {
    let s = Shape { headdim, dstate, chunk_size, elem_bytes: dtype.size_bytes(), ..Shape::default() };
    if mma_applies(&s) {
        dtype
    } else {
        DType::F32
    }
}

/// The largest chunk the backward's head sums take (kernels/ssd_bwd_sums.cuh: `kMsumTasks`, and its
/// 2 * chunk_size-thread blocks).
const MMA_MAX_CHUNK: i64 = 256;
/// head_msum sums a group's heads in up to this many ranges, each a block (two give about a block
/// per SM at the main shape; with a head or so per group a second range would only add workspace).
const MSUM_MAX_SPLIT: i64 = 2;

/// The tensor-core forward's sequence split; generated into kernels/params.h as `FwdSplit`. The main
/// kernel scans `n_parts` parts of `tiles_per_part` tiles; its first pass scans every part but the last
/// in `records_per_part` pieces, each recording its end state from zero and its decay.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaFwdSplit {
    pub tiles_per_part: i64,
    pub n_parts: i64,
    pub records_per_part: i64,
}

impl MmaFwdSplit {
    pub fn records(&self) -> i64 {
        (self.n_parts - 1) * self.records_per_part
    }
}

/// The split of a part-records call and of the forward given its records (docs/ssd.md, "Part
/// records"): the forward's parts, one record each, whatever the workspace and the GPU (the records'
/// size depends on the shape alone).
pub fn part_records_split(s: &Shape) -> MmaFwdSplit {
    MmaFwdSplit { records_per_part: 1, ..mma_fwd_split(s, i64::MAX, Pieces::OneWave) }
}

/// f32s of the records of a part-records call: a (headdim x dstate) state and a decay per part and
/// (batch, head). Where the tensor-core kernels run the call as it is (headdim 64, dstate 64 or
/// 128: no split heads, no widened state); 0 elsewhere, where the call is refused.
pub fn part_records_floats(s: &Shape) -> i64 {
    let native = mma_applies(s) && s.headdim == MMA_HEADDIM && MMA_DSTATES.contains(&s.dstate);
    if !native {
        return 0;
    }
    part_records_split(s).n_parts * s.batch * s.heads * (s.headdim * s.dstate + 1)
}

/// Bytes of one record of the forward's split: a headdim x dstate state and a decay per (batch, head),
/// f32.
pub fn mma_fwd_record_bytes(s: &Shape) -> i64 {
    s.batch * s.heads * (s.headdim * s.dstate + 1) * 4
}

/// The forward's split where at most `max_records` records fit: as many parts as one wave of blocks
/// holds (a second, partial wave would cost a whole one), at most one per tile, fewer where their
/// records would not fit; its first pass's pieces by `pieces`.
pub fn mma_fwd_split(s: &Shape, max_records: i64, pieces: Pieces) -> MmaFwdSplit {
    let bh = s.batch * s.heads;
    let n_tiles = (s.seqlen + MMA_TILE - 1) / MMA_TILE;
    let planned = if bh == 0 { 1 } else { (MMA_WAVE_BLOCKS / bh).min(n_tiles).max(1) };
    let planned = planned.min(max_records.max(0).saturating_add(1));
    let tiles_per_part = ((n_tiles + planned - 1) / planned).max(1);
    let n_parts = ((n_tiles + tiles_per_part - 1) / tiles_per_part).max(1);
    let fitting = if n_parts > 1 { max_records / (n_parts - 1) } else { 1 };
    let records_per_part = local_records_per_part(bh, n_parts, tiles_per_part, pieces).min(fitting).max(1);
    MmaFwdSplit { tiles_per_part, n_parts, records_per_part }
}

/// Most pieces per part in a first pass: each is a record the main kernel's later parts fold in one
/// after another.
const MAX_LOCAL_RECORDS: i64 = 4;
/// What a first-pass block costs besides its tiles (its start, the records' fold, its store), in
/// tiles: fitted to first-pass timings on an H200 (1 to 8 pieces a part at 1x16384, 2x8192 and
/// 1x4096).
const LOCAL_BLOCK_TILES: i64 = 4;

/// How a first pass cuts each part into pieces, one block and one record each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pieces {
    /// The count that finishes in the fewest tile-times, waves x (tiles of a piece +
    /// LOCAL_BLOCK_TILES), the fewest on a tie: for first passes that walk their tiles as a
    /// recurrence (mma.sync), where a block's tiles are most of the cost.
    FewestTileTimes,
    /// The most that still fit one wave: for the forward's first pass on wgmma (sm_90a, dstate
    /// 128), one long product, which more pieces shorten by less than they cost the main kernel,
    /// whose later parts each read every record before them before their first tile (1 x 16384 x 64
    /// heads, H100: 1 piece a part 291 us, 4 pieces 306; 2 x 8192: 2 pieces 266, 1 piece 276).
    OneWave,
}

impl Pieces {
    /// The forward's rule on a GPU of compute capability `cc` (its sm_90a code takes the wgmma first
    /// pass at dstate 128).
    pub fn forward(s: &Shape, cc: (i32, i32)) -> Self {
        if s.dstate == 128 && cc == (9, 0) {
            Pieces::OneWave
        } else {
            Pieces::FewestTileTimes
        }
    }
}

/// Pieces per part of a first pass (the forward's and the backward's): the first pass of 1 x 16384 x
/// 64 heads has 192 blocks of 64 tiles, three quarters of a wave of the 264 the GPU holds; more
/// pieces fill the GPU with shorter blocks.
fn local_records_per_part(bh: i64, n_parts: i64, tiles_per_part: i64, pieces: Pieces) -> i64 {
    if n_parts <= 1 {
        return 1;
    }
    let blocks = bh * (n_parts - 1);
    let counts = 1..=tiles_per_part.min(MAX_LOCAL_RECORDS);
    match pieces {
        Pieces::OneWave => counts.rev().find(|&r| blocks * r <= MMA_WAVE_BLOCKS).unwrap_or(1),
        Pieces::FewestTileTimes => counts
            .min_by_key(|&r| {
                let waves = (blocks * r + MMA_WAVE_BLOCKS - 1) / MMA_WAVE_BLOCKS;
                waves * ((tiles_per_part + r - 1) / r + LOCAL_BLOCK_TILES)
            })
            .unwrap_or(1),
    }
}

/// The tensor-core forward's workspace: the split's records, for whichever rule the GPU takes.
pub fn mma_fwd_bytes(s: &Shape) -> i64 {
    let records = [Pieces::FewestTileTimes, Pieces::OneWave]
        .into_iter()
        .map(|pieces| mma_fwd_split(s, i64::MAX, pieces).records())
        .max()
        .unwrap_or(0)
        * mma_fwd_record_bytes(s);
    if records == 0 {
        0
    } else {
        records + ALIGN
    }
}

/// Whether the tensor-core backward forms dB and dC summed over a group's heads a chunk at a time
/// (head_msum, bc_sums) rather than per head (partials summed by reduce_bc). The head sums pay per
/// (batch, chunk, group) unit, so they win only with many heads per group, units enough to fill the
/// GPU (two head_msum blocks each, 132 SMs), dstate 128 and 256-step chunks (measured on the H100
/// over groups 1-64 and batches 1-16).
pub fn mma_bwd_head_sums(s: &Shape) -> bool {
    let n_chunks = (s.seqlen + s.chunk_size - 1) / s.chunk_size;
    s.dstate == 128 && s.chunk_size == 256 && s.heads / s.groups >= 32 && s.batch * n_chunks * s.groups >= 64
}

/// Where the tensor-core backward's arrays lie in its workspace (byte offsets from the aligned start)
/// and how it splits the sequence. The arrays of the dB/dC path not taken are empty.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MmaBwdLayout {
    /// Parts of whole chunks (one wave of blocks), `chunks_per_part` chunks each.
    pub n_parts: i64,
    pub chunks_per_part: i64,
    /// `mma_bwd_head_sums`: the head-sum path (s_chunk .. msum) or the per-head one (db_part, dc_part).
    pub head_sums: bool,
    /// (batch, seqlen, heads, headdim) in the inputs' (2-byte) type: with z, y before the gate, then
    /// the gradient of y before the gate.
    pub gated: i64,
    /// (batch * heads, n_chunks, headdim, dstate) each, 2-byte type: the state entering each chunk
    /// and the gradient of the state leaving it; adjacent, `chunk_state_bytes` each.
    pub s_chunk: i64,
    pub ds_chunk: i64,
    pub chunk_state_bytes: i64,
    /// (batch * heads, n_chunks * chunk_size) f32 pairs: each step's {cum, dt} from its chunk's start.
    pub scal: i64,
    /// (batch * n_chunks * groups, msum_split, tile pairs, 64, 64) f32: M summed over head ranges.
    pub msum: i64,
    /// The head ranges of a group that head_msum sums apart: at most MSUM_MAX_SPLIT, at most the
    /// group's heads.
    pub msum_split: i64,
    /// (batch, seqlen, heads, dstate) each, 2-byte type: per-head dB and dC, `part_bytes` each, the
    /// second right after the first (but for alignment).
    pub db_part: i64,
    pub dc_part: i64,
    pub part_bytes: i64,
    /// (n_parts, batch * heads, tiles per chunk - 3, headdim * dstate) 2-byte type: the recomputed
    /// states the kernel keeps in neither registers nor shared memory (one slot at chunk_size 256).
    pub scratch: i64,
    /// (n_parts, batch, heads) f32 each, and (n_parts, batch, heads, headdim) f32.
    pub da_part: i64,
    pub dbias_part: i64,
    pub dd_part: i64,
    /// The first pass cuts each of parts 1.. in this many pieces, a record each (as the forward's:
    /// `local_records_per_part`).
    pub records_per_part: i64,
    /// ((n_parts - 1) * records_per_part, batch * heads, headdim * dstate + 1) f32: the later parts'
    /// pieces' gradients and decays.
    pub records: i64,
    pub bytes: i64,
}

pub fn mma_bwd_layout(s: &Shape) -> MmaBwdLayout {
    let bh = s.batch * s.heads;
    let n_chunks = (s.seqlen + s.chunk_size - 1) / s.chunk_size;
    let wanted = if bh == 0 { 1 } else { (MMA_WAVE_BLOCKS / bh).min(n_chunks).max(1) };
    let chunks_per_part = ((n_chunks + wanted - 1) / wanted).max(1);
    let n_parts = ((n_chunks + chunks_per_part - 1) / chunks_per_part).max(1);
    let state = s.headdim * s.dstate;
    let mut c = Carver::default();
    let gated = c.take(s.batch * s.seqlen * s.heads * s.headdim * 2);
    let head_sums = mma_bwd_head_sums(s);
    let sized = |bytes: i64, used: bool| if used { bytes } else { 0 };
    let chunk_state_bytes = sized(bh * n_chunks * state * 2, head_sums);
    // Each path's two arrays are adjacent, so that with z the forward's split records can take both:
    // chunk_state_bytes is a multiple of ALIGN (state = 64 x dstate elements); part_bytes may fall
    // short of one by a pad, which the records' 2 x part_bytes then leave unused.
    let s_chunk = c.take(chunk_state_bytes);
    let ds_chunk = c.take(chunk_state_bytes);
    let scal = c.take(sized(bh * n_chunks * s.chunk_size * 8, head_sums));
    let tiles = s.chunk_size / MMA_TILE;
    let msum_split = MSUM_MAX_SPLIT.min(s.heads / s.groups).max(1);
    let msum_bytes = s.batch * n_chunks * s.groups * msum_split * tiles * (tiles + 1) / 2 * MMA_TILE * MMA_TILE * 4;
    let msum = c.take(sized(msum_bytes, head_sums));
    let part_bytes = sized(s.batch * s.seqlen * s.heads * s.dstate * 2, !head_sums);
    let db_part = c.take(part_bytes);
    let dc_part = c.take(part_bytes);
    let scratch = c.take(n_parts * bh * (tiles - 3).max(0) * state * 2);
    let da_part = c.take(n_parts * bh * 4);
    let dbias_part = c.take(n_parts * bh * 4);
    let dd_part = c.take(n_parts * bh * s.headdim * 4);
    // (The backward's first pass on wgmma is not yet measured against OneWave.)
    let records_per_part =
        local_records_per_part(bh, n_parts, chunks_per_part * s.chunk_size / MMA_TILE, Pieces::FewestTileTimes);
    let records = c.take((n_parts - 1) * records_per_part * bh * (state + 1) * 4);
    MmaBwdLayout {
        n_parts,
        chunks_per_part,
        head_sums,
        gated,
        s_chunk,
        ds_chunk,
        chunk_state_bytes,
        scal,
        msum,
        msum_split,
        db_part,
        dc_part,
        part_bytes,
        scratch,
        da_part,
        dbias_part,
        dd_part,
        records_per_part,
        records,
        bytes: c.total(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (offset, bytes) span ALIGN-aligned, ending by `end`, and no two non-empty ones overlapping.
    fn assert_aligned_and_disjoint(spans: &[(i64, i64)], end: i64) {
        for (i, &(at, len)) in spans.iter().enumerate() {
            assert_eq!(at % ALIGN, 0);
            assert!(at + len <= end, "array {i} ends past {end}");
            for &(other, other_len) in &spans[i + 1..] {
                assert!(len == 0 || other_len == 0 || at + len <= other || other + other_len <= at, "arrays overlap");
            }
        }
    }

    #[test]
    fn arrays_are_aligned_and_disjoint() {
        let s =
            Shape { batch: 2, seqlen: 33, heads: 6, headdim: 5, dstate: 7, groups: 3, chunk_size: 32, elem_bytes: 2 };
        let l = bwd_layout(&s);
        let dim = 30;
        let spans = [
            (l.delta, 2 * 33 * dim * 2),
            (l.a, dim * 7 * 4),
            (l.d, dim * 4),
            (l.dt_bias, dim * 4),
            (l.ddelta, 2 * 33 * dim * 2),
            (l.da, dim * 7 * 4),
            (l.dd, dim * 4),
            (l.ddelta_bias, dim * 4),
            (l.ddt_f32, 2 * 33 * 6 * 4),
            (l.scan, l.scan_bytes),
        ];
        for (i, &(at, len)) in spans.iter().enumerate() {
            assert_eq!(at % ALIGN, 0);
            assert!(at + len + ALIGN <= l.bytes, "array {i} ends past the workspace");
            for &(other, other_len) in &spans[i + 1..] {
                assert!(at + len <= other || other + other_len <= at, "arrays overlap");
            }
        }
        assert!(l.scan_bytes > 0);
        assert_eq!(bwd_workspace_bytes(&Shape { groups: 4, ..s }), 0, "groups must divide heads");
        // Without a batch, the per-channel A still goes through the scan (its dA is zero).
        assert!(fwd_workspace_bytes(&Shape { batch: 0, ..s }) > 0);
        assert_eq!(fwd_workspace_bytes(&Shape { heads: 0, ..s }), 0);
    }

    #[test]
    fn mma_bwd_arrays_are_aligned_and_disjoint() {
        let few = Shape {
            batch: 2,
            seqlen: 333,
            heads: 6,
            headdim: 64,
            dstate: 128,
            groups: 3,
            chunk_size: 256,
            elem_bytes: 2,
        };
        assert!(mma_applies(&few));
        assert!(!mma_applies(&Shape { chunk_size: 512, ..few }), "head_msum takes chunks up to 256");
        // 32 heads per group and 1 x 64 chunks x 2 groups units: the head sums; fewer of either, or
        // another dstate or chunk size: the per-head partials.
        let many = Shape { batch: 1, seqlen: 64 * 256 - 3, heads: 64, groups: 2, ..few };
        assert!(mma_bwd_head_sums(&many));
        for other in [
            few,
            Shape { groups: 4, ..many },
            Shape { seqlen: 31 * 256, ..many },
            Shape { dstate: 64, ..many },
            Shape { chunk_size: 128, ..many },
        ] {
            assert!(!mma_bwd_head_sums(&other), "{other:?}");
        }
        for s in [few, many] {
            let l = mma_bwd_layout(&s);
            let (bh, n_chunks, state) = (s.batch * s.heads, (s.seqlen + 255) / 256, 64 * 128);
            let (sums, parts) = if l.head_sums { (1, 0) } else { (0, 1) };
            assert_eq!(l.head_sums, mma_bwd_head_sums(&s));
            assert_eq!(l.chunk_state_bytes, sums * bh * n_chunks * state * 2);
            assert_eq!(l.part_bytes, parts * s.batch * s.seqlen * s.heads * 128 * 2);
            assert_eq!(l.msum_split, 2);
            // With z, the forward's split records go where the path's two adjacent arrays are.
            assert_eq!(l.ds_chunk, l.s_chunk + l.chunk_state_bytes);
            assert!(l.dc_part >= l.db_part + l.part_bytes && l.dc_part < l.db_part + l.part_bytes + ALIGN);
            let spans = [
                (l.gated, s.batch * s.seqlen * s.heads * 64 * 2),
                (l.s_chunk, l.chunk_state_bytes),
                (l.ds_chunk, l.chunk_state_bytes),
                (l.scal, sums * bh * n_chunks * 256 * 8),
                (l.msum, sums * s.batch * n_chunks * s.groups * l.msum_split * 10 * 64 * 64 * 4),
                (l.db_part, l.part_bytes),
                (l.dc_part, l.part_bytes),
                (l.scratch, l.n_parts * bh * state * 2),
                (l.da_part, l.n_parts * bh * 4),
                (l.dbias_part, l.n_parts * bh * 4),
                (l.dd_part, l.n_parts * bh * 64 * 4),
                (l.records, (l.n_parts - 1) * l.records_per_part * bh * (state + 1) * 4),
            ];
            // The last ALIGN bytes are the slack for an unaligned start.
            assert_aligned_and_disjoint(&spans, l.bytes - ALIGN);
        }
        // One head per group: one head range.
        assert_eq!(mma_bwd_layout(&Shape { groups: 6, ..few }).msum_split, 1);
    }

    /// The benchmarks' Mamba-2 shape (64 heads of 64, dstate 128, one group, chunk 256, bf16).
    fn mamba2(batch: i64, seqlen: i64) -> Shape {
        Shape { batch, seqlen, heads: 64, headdim: 64, dstate: 128, groups: 1, chunk_size: 256, elem_bytes: 2 }
    }

    #[test]
    fn mma_fwd_split_fills_the_gpu() {
        let shape = mamba2;
        let split =
            |tiles_per_part, n_parts, records_per_part| MmaFwdSplit { tiles_per_part, n_parts, records_per_part };
        use Pieces::{FewestTileTimes as Waves, OneWave};
        // LOCAL_BLOCK_TILES was fitted to these H200 timings.
        assert_eq!(mma_fwd_split(&shape(1, 16384), i64::MAX, Waves), split(64, 4, 4));
        assert_eq!(mma_fwd_split(&shape(2, 8192), i64::MAX, Waves), split(64, 2, 2));
        assert_eq!(mma_fwd_split(&shape(1, 4096), i64::MAX, Waves), split(16, 4, 1));
        assert_eq!(mma_fwd_split(&shape(8, 2048), i64::MAX, Waves), split(32, 1, 1));
        // OneWave follows H100 measurements: one wave of first-pass blocks.
        assert_eq!(mma_fwd_split(&shape(1, 16384), i64::MAX, OneWave), split(64, 4, 1));
        assert_eq!(mma_fwd_split(&shape(1, 32768), i64::MAX, OneWave), split(128, 4, 1));
        assert_eq!(mma_fwd_split(&shape(2, 8192), i64::MAX, OneWave), split(64, 2, 2));
        assert_eq!(mma_fwd_split(&shape(1, 4096), i64::MAX, OneWave), split(16, 4, 1));
        assert_eq!(mma_fwd_split(&Shape { heads: 16, ..shape(1, 16384) }, i64::MAX, OneWave), split(16, 16, 1));
        assert_eq!(mma_fwd_split(&Shape { heads: 8, ..shape(1, 16384) }, i64::MAX, OneWave), split(8, 32, 1));
        assert_eq!(mma_fwd_split(&Shape { heads: 4, ..shape(1, 8192) }, i64::MAX, OneWave), split(2, 64, 1));
        assert_eq!(Pieces::forward(&shape(1, 16384), (9, 0)), OneWave);
        assert_eq!(Pieces::forward(&Shape { dstate: 64, ..shape(1, 16384) }, (9, 0)), Waves);
        assert_eq!(Pieces::forward(&shape(1, 16384), (8, 0)), Waves);
        // Where fewer records fit: fewer pieces, then fewer parts; none without a workspace.
        assert_eq!(mma_fwd_split(&shape(1, 16384), 11, Waves), split(64, 4, 3));
        assert_eq!(mma_fwd_split(&shape(1, 16384), 2, Waves), split(86, 3, 1));
        assert_eq!(mma_fwd_split(&shape(1, 16384), 0, Waves), split(256, 1, 1));
        for (batch, seqlen, max) in [(1, 16384, i64::MAX), (1, 100, 7), (3, 5000, 5), (1, 1, 9), (2, 0, 3), (1, 700, 4)]
        {
            for pieces in [Waves, OneWave] {
                let s = shape(batch, seqlen);
                let sp = mma_fwd_split(&s, max, pieces);
                let n_tiles = (seqlen + MMA_TILE - 1) / MMA_TILE;
                assert!(sp.records() <= max && sp.records_per_part <= sp.tiles_per_part.max(1), "{sp:?}");
                assert!(
                    sp.n_parts * sp.tiles_per_part >= n_tiles && (sp.n_parts - 1) * sp.tiles_per_part < n_tiles.max(1)
                );
                assert!(sp.records() * mma_fwd_record_bytes(&s) <= mma_fwd_bytes(&s), "{sp:?}");
            }
        }
        let s = shape(1, 16384);
        assert_eq!(mma_fwd_bytes(&s), 12 * mma_fwd_record_bytes(&s) + ALIGN);
        assert_eq!(mma_fwd_bytes(&shape(8, 2048)), 0);
    }

    #[test]
    fn mma_bwd_split_fills_the_gpu() {
        // (n_parts, chunks_per_part, records_per_part): parts of whole chunks, one wave of them; the
        // first pass's pieces as the forward's.
        let split = |batch, seqlen| {
            let l = mma_bwd_layout(&mamba2(batch, seqlen));
            (l.n_parts, l.chunks_per_part, l.records_per_part)
        };
        assert_eq!(split(1, 16384), (4, 16, 4));
        assert_eq!(split(2, 8192), (2, 16, 2));
        assert_eq!(split(1, 4096), (4, 4, 1));
        assert_eq!(split(8, 2048), (1, 8, 1));
        // Fewer chunks than a part's pieces would want: at most one piece per tile.
        let short = Shape { heads: 1, ..mamba2(1, 3 * 256) };
        let l = mma_bwd_layout(&short);
        assert_eq!((l.n_parts, l.chunks_per_part, l.records_per_part), (3, 1, 4));
    }

    #[test]
    fn wide_heads_run_as_heads_of_64() {
        let wide = Shape { heads: 32, headdim: 128, ..mamba2(8, 2048) };
        assert!(mma_applies(&wide) && mma_applies(&Shape { headdim: 256, ..wide }));
        assert!(!mma_applies(&Shape { headdim: 31, ..wide }) && !mma_applies(&Shape { headdim: 0, ..wide }));
        let m = mma_shape(&wide);
        assert_eq!((m.heads, m.headdim, m.batch, m.groups), (64, 64, 8, 1));
        assert_eq!((mma_shape(&mamba2(8, 2048)).heads, mma_shape(&mamba2(8, 2048)).headdim), (64, 64));
        assert_eq!(SplitHeads::new(&mamba2(8, 2048), true), SplitHeads { ways: 1, ..SplitHeads::default() });

        let (fwd, bwd) = (SplitHeads::new(&wide, false), SplitHeads::new(&wide, true));
        assert_eq!((fwd.ways, bwd.ways), (2, 2));
        let (per_step, per_head) = (8 * 2048 * 64 * 2, 64 * 4);
        for (l, backward) in [(fwd, false), (bwd, true)] {
            let grads = if backward { 1 } else { 0 };
            let spans = [
                (l.dt, per_step),
                (l.a, per_head),
                (l.d, per_head),
                (l.dt_bias, per_head),
                (l.ddt, grads * per_step),
                (l.da, grads * per_head),
                (l.dd, grads * per_head),
                (l.ddt_bias, grads * per_head),
            ];
            assert_aligned_and_disjoint(&spans, l.bytes);
            assert_eq!(l.bytes % ALIGN, 0);
        }
        // The kernels' arrays follow the split heads' (no records at 8 x 2048: only the slack).
        assert_eq!(mma_fwd_bytes(&m), 0);
        assert_eq!(fwd_workspace_bytes(&wide), fwd.bytes + ALIGN);
        assert_eq!(bwd_workspace_bytes(&wide), bwd.bytes + mma_bwd_layout(&m).bytes);
        let long = Shape { batch: 1, seqlen: 16384, ..wide };
        let records = mma_fwd_bytes(&mma_shape(&long));
        assert!(records > 0);
        assert_eq!(fwd_workspace_bytes(&long), SplitHeads::new(&long, false).bytes + records);
    }

    #[test]
    fn small_states_run_widened() {
        assert_eq!([1, 16, 64, 65, 100, 128].map(mma_dstate), [64, 64, 64, 128, 128, 128].map(Some));
        assert_eq!([129, 200, 256].map(mma_dstate), [Some(256); 3]);
        assert_eq!([0, 257].map(mma_dstate), [None; 2]);
        let s = Shape { dstate: 16, ..mamba2(8, 2048) };
        assert!(mma_applies(&s) && mma_applies(&Shape { dstate: 256, ..s }));
        assert!(!mma_applies(&Shape { dstate: 257, ..s }));
        assert_eq!(mma_shape(&s).dstate, 64);
        assert_eq!(PadState::new(&mamba2(8, 2048), 8, true), PadState { dstate: 128, ..PadState::default() });

        let (fwd, bwd) = (PadState::new(&s, s.batch, false), PadState::new(&s, s.batch, true));
        let (bc, states, chunks) = (8 * 2048 * 64 * 2, 8 * 64 * 64 * 64 * 4, 8 * 64 * 64 * 8 * 64 * 2);
        for (l, backward) in [(fwd, false), (bwd, true)] {
            let grads = if backward { 1 } else { 0 };
            let spans = [
                (l.b, bc),
                (l.c, bc),
                (l.initial_states, states),
                (l.final_states, states),
                (l.chunk_states, chunks),
                (l.db, grads * bc),
                (l.dc, grads * bc),
                (l.dinitial_states, grads * states),
                (l.dfinal_states, grads * states),
            ];
            assert_aligned_and_disjoint(&spans, l.bytes);
        }
        // Widened state, then split heads, then the kernels' arrays.
        let both = Shape { heads: 32, headdim: 128, ..s };
        let ws = MmaWorkspace::new(&both, true);
        assert_eq!((ws.pad, ws.split), (PadState::new(&both, both.batch, true), SplitHeads::new(&both, true)));
        assert_eq!((ws.split_at, ws.kernels_at), (ws.pad.bytes, ws.pad.bytes + ws.split.bytes));
        assert_eq!(ws.kernels_bytes, mma_bwd_layout(&mma_shape(&both)).bytes);
        assert_eq!(ws.bytes, ws.kernels_at + ws.kernels_bytes);
        assert_eq!(bwd_workspace_bytes(&both), ws.bytes);
        assert_eq!(fwd_workspace_bytes(&both), MmaWorkspace::new(&both, false).kernels_at + ALIGN);
        // A packed forward's widened states have a row per sequence.
        let packed = Shape { batch: 1, seqlen: 3000, ..s };
        let (one, five) = (MmaWorkspace::packed(&packed, 1), MmaWorkspace::packed(&packed, 5));
        assert_eq!(one, MmaWorkspace::new(&packed, false));
        assert_eq!(five.pad, PadState::new(&packed, 5, false));
        let state_bytes = 64 * 64 * 64 * 4;
        assert_eq!(five.pad.final_states - five.pad.initial_states, 5 * state_bytes);
        assert_eq!(packed_fwd_workspace_bytes(&packed, 5), five.bytes);
    }

    #[test]
    fn wide_states_run_as_two_halves() {
        assert_eq!([1, 64, 128, 129, 256].map(state_halves), [1, 1, 1, 2, 2]);
        let s = Shape { dstate: 256, ..mamba2(8, 2048) };
        let m = mma_shape(&s);
        assert_eq!((m.heads, m.groups, m.headdim, m.dstate), (128, 2, 64, 128));
        let wide = mma_shape(&Shape { headdim: 128, dstate: 200, ..s });
        assert_eq!((wide.heads, wide.groups, wide.headdim, wide.dstate), (256, 2, 64, 128));
        assert_eq!(StateHalves::new(&mamba2(8, 2048), 8, true), StateHalves { halves: 1, ..StateHalves::default() });
        assert_eq!(part_records_floats(&s), 0, "part records only where the kernels run the call as it is");

        let per_step = 8 * 2048 * 128 * 64 * 2;
        let (dt, per_head, d) = (8 * 2048 * 128 * 2, 128 * 4, 128 * 64 * 4);
        let (states, chunks) = (8 * 128 * 64 * 128 * 4, 8 * 128 * 64 * 8 * 128 * 2);
        for backward in [false, true] {
            let l = StateHalves::new(&s, s.batch, backward);
            let (f, b) = if backward { (0, 1) } else { (1, 0) };
            let spans = [
                (l.copies.x, per_step),
                (l.copies.z, per_step),
                (l.copies.y, f * per_step),
                (l.copies.dy, b * per_step),
                (l.copies.dx, b * per_step),
                (l.copies.dz, b * per_step),
                (l.dt, dt),
                (l.ddt, b * dt),
                (l.a, per_head),
                (l.copies.d, d),
                (l.dt_bias, per_head),
                (l.da, b * per_head),
                (l.copies.dd, b * d),
                (l.ddt_bias, b * per_head),
                (l.copies.initial_states, states),
                (l.copies.final_states, f * states),
                (l.copies.dinitial_states, b * states),
                (l.copies.dfinal_states, b * states),
                (l.copies.chunk_states, chunks),
            ];
            assert_aligned_and_disjoint(&spans, l.bytes);
            assert_eq!(l.bytes, spans.iter().map(|&(_, len)| (len + ALIGN - 1) / ALIGN * ALIGN).sum::<i64>());
            // Widened state, then its halves, then the halved call's split heads, then the kernels'.
            let both = Shape { headdim: 128, dstate: 200, ..s };
            let ws = MmaWorkspace::new(&both, backward);
            let halves = StateHalves::new(&both, both.batch, backward);
            assert_eq!((ws.pad.dstate, ws.halves, ws.halves_at), (256, halves, ws.pad.bytes));
            assert_eq!(ws.split, SplitHeads::new(&Shape { heads: 128, ..both }, backward));
            assert_eq!((ws.split_at, ws.kernels_at), (ws.pad.bytes + halves.bytes, ws.split_at + ws.split.bytes));
            assert_eq!(ws.split.ways, 2);
        }
        // A packed forward's states have a row per sequence.
        let packed = Shape { batch: 1, seqlen: 3000, ..s };
        let five = MmaWorkspace::packed(&packed, 5);
        assert_eq!(five.halves, StateHalves::new(&packed, 5, false));
        assert_eq!(five.halves.copies.final_states - five.halves.copies.initial_states, 5 * 128 * 64 * 128 * 4);
    }

    #[test]
    fn narrow_heads_run_widened() {
        assert_eq!([32, 33, 48, 64, 65, 96, 128].map(mma_headdim), [64, 64, 64, 64, 128, 128, 128].map(Some));
        assert_eq!([0, 1, 16, 31].map(mma_headdim), [None; 4]);
        let s = Shape { heads: 128, headdim: 32, ..mamba2(8, 2048) };
        let m = mma_shape(&s);
        assert_eq!((m.heads, m.groups, m.headdim, m.dstate), (128, 1, 64, 128));
        let odd = mma_shape(&Shape { headdim: 96, dstate: 200, ..s });
        assert_eq!((odd.heads, odd.groups, odd.headdim, odd.dstate), (512, 2, 64, 128));
        assert_eq!(PadHeads::new(&mamba2(8, 2048), 8, true), PadHeads { headdim: 64, ..PadHeads::default() });
        assert_eq!(part_records_floats(&s), 0);

        let per_step = 8 * 2048 * 128 * 64 * 2;
        let (d, states, chunks) = (128 * 64 * 4, 8 * 128 * 64 * 128 * 4, 8 * 128 * 64 * 8 * 128 * 2);
        for backward in [false, true] {
            let l = PadHeads::new(&s, s.batch, backward);
            let (f, b) = if backward { (0, 1) } else { (1, 0) };
            let spans = [
                (l.copies.x, per_step),
                (l.copies.z, per_step),
                (l.copies.y, f * per_step),
                (l.copies.dy, b * per_step),
                (l.copies.dx, b * per_step),
                (l.copies.dz, b * per_step),
                (l.copies.d, d),
                (l.copies.dd, b * d),
                (l.copies.initial_states, states),
                (l.copies.final_states, f * states),
                (l.copies.dinitial_states, b * states),
                (l.copies.dfinal_states, b * states),
                (l.copies.chunk_states, chunks),
            ];
            assert_aligned_and_disjoint(&spans, l.bytes);
            assert_eq!(l.bytes, spans.iter().map(|&(_, len)| (len + ALIGN - 1) / ALIGN * ALIGN).sum::<i64>());
            // Widened state, halves, widened heads (of the halved call, on its widened state), split heads.
            let all = Shape { headdim: 96, dstate: 200, ..s };
            let ws = MmaWorkspace::new(&all, backward);
            let stage = Shape { heads: 256, groups: 2, dstate: 128, ..all };
            assert_eq!((ws.pad.dstate, ws.heads), (256, PadHeads::new(&stage, all.batch, backward)));
            assert_eq!(ws.split, SplitHeads::new(&Shape { headdim: 128, ..stage }, backward));
            assert_eq!((ws.heads_at, ws.split_at), (ws.halves_at + ws.halves.bytes, ws.heads_at + ws.heads.bytes));
            assert_eq!(ws.kernels_at, ws.split_at + ws.split.bytes);
        }
        // The states of a widened dstate under 128: the kernels' dstate.
        let small = PadHeads::new(&Shape { dstate: 64, ..s }, 8, false);
        assert_eq!(small.copies.final_states - small.copies.initial_states, 8 * 128 * 64 * 64 * 4);
    }

    /// The workspace functions size for the path that runs: where the tensor-core kernels apply the
    /// CUDA target never falls back to the generic path (misaligned operands are refused), so its
    /// far larger scratch is not asked for.
    #[test]
    fn workspaces_are_sized_for_the_path_that_runs() {
        let main = mamba2(8, 2048);
        assert!(mma_applies(&main));
        assert_eq!(bwd_workspace_bytes(&main), mma_bwd_layout(&main).bytes);
        assert_eq!(fwd_workspace_bytes(&main), mma_fwd_bytes(&main));
        assert!(bwd_workspace_bytes(&main) < bwd_layout(&main).bytes / 10);
        let generic = Shape { headdim: 16, ..main };
        assert!(!mma_applies(&generic));
        assert_eq!(bwd_workspace_bytes(&generic), bwd_layout(&generic).bytes);
        assert_eq!(fwd_workspace_bytes(&generic), fwd_layout(&generic).bytes);
    }
}
