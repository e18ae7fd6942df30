//! `selective_scan_fwd`: Mamba-1's selective scan, forward (docs/selective_scan_fwd.md has the ABI).
//!
//! [`validate_fwd`] turns operand descriptions into [`FwdParams`] (pointers, sizes and element
//! strides: the one struct that the CPU loop and the CUDA kernel both read, so that both layouts and
//! both forms of B/C are a matter of strides), and [`run_fwd`] runs it on a platform.

use super::{expect, expect_dtype, expect_nonnull, Platform, Tensor};
use crate::error::{Error, Result};
use crate::xla::frame::Frame;
use crate::DType;
use std::ffi::c_void;

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;

/// Largest supported state size (the CUDA kernel spreads it over at most 32 lanes of 8 states).
pub const MAX_DSTATE: i64 = 256;

/// The layout of u, delta, z and out (and of time-varying B and C).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// (batch, dim, seqlen); B, C: (batch, groups, dstate, seqlen).
    ChannelFirst,
    /// (batch, seqlen, dim); B, C: (batch, seqlen, groups, dstate).
    ChannelLast,
}

impl Layout {
    pub fn parse(s: &str) -> Result<Layout> {
        match s {
            "bdl" => Ok(Layout::ChannelFirst),
            "bld" => Ok(Layout::ChannelLast),
            other => Err(Error::invalid(format!(
                "selective_scan_fwd: attribute `layout`: expected \"bdl\" or \"bld\", got {other:?}"
            ))),
        }
    }
}

/// The operands of one forward call, as the host describes them.
pub struct FwdArgs<'a> {
    pub u: &'a Tensor,
    pub delta: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub delta_bias: Option<&'a Tensor>,
    pub initial_state: Option<&'a Tensor>,
    pub out: &'a Tensor,
    pub final_state: &'a Tensor,
    /// Scratch for the CUDA kernel's sequence split (see [`workspace_bytes`]); any dtype, contents
    /// undefined afterwards. Without it (or when it is too small) the scan runs unsplit.
    pub workspace: Option<&'a Tensor>,
    pub delta_softplus: bool,
    pub layout: Layout,
}

/// Kernel parameters, passed by value to the CUDA kernel: mirrored field for field by
/// `SelectiveScanFwdParams` in `kernels/selective_scan_fwd.cu`. Absent optional operands are null.
/// Strides are in elements. Channel `d` reads B/C at
/// `b * bc_stride_batch + (d / dim_per_group) * bc_stride_group + n * bc_stride_state + l * bc_stride_seq`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct FwdParams {
    pub u: *const c_void,
    pub delta: *const c_void,
    pub a: *const f32,
    pub b: *const c_void,
    pub c: *const c_void,
    pub d: *const f32,
    pub z: *const c_void,
    pub delta_bias: *const f32,
    pub initial_state: *const f32,
    pub out: *mut c_void,
    pub final_state: *mut f32,
    pub batch: i64,
    pub dim: i64,
    pub seqlen: i64,
    pub dstate: i64,
    pub dim_per_group: i64,
    pub x_stride_batch: i64,
    pub x_stride_dim: i64,
    pub x_stride_seq: i64,
    pub bc_stride_batch: i64,
    pub bc_stride_group: i64,
    pub bc_stride_state: i64,
    pub bc_stride_seq: i64,
    pub delta_softplus: i32,
    pub _reserved: i32,
    /// Sequence split (CUDA tiled kernel): per-chunk records, [n_chunks - 1][batch][dim][dstate + 1] f32.
    pub workspace: *mut f32,
    pub chunk_len: i64,
    pub n_chunks: i64,
}

// The CUDA mirror asserts the same size.
const _: () = assert!(std::mem::size_of::<FwdParams>() == 11 * 8 + 12 * 8 + 8 + 3 * 8);

/// A validated forward call.
#[derive(Debug, Clone, Copy)]
pub struct Fwd {
    pub params: FwdParams,
    /// dtype of u, delta, z and out.
    pub dtype: DType,
    /// dtype of B and C.
    pub bc_dtype: DType,
    /// B and C are (batch, groups, dstate, seqlen)-like rather than (dim, dstate).
    pub bc_time_varying: bool,
    /// Size of the workspace the host passed (0: none).
    pub workspace_bytes: i64,
}

/// Channels per block of the CUDA `tiled` kernel (`kTileChannels`).
pub const TILE_CHANNELS: i64 = 128;
/// Largest dstate of the CUDA `tiled` kernel (`kTiledStates`), the only one that splits.
pub const TILED_MAX_DSTATE: i64 = 16;
/// f32s per (chunk, batch, channel) record of the split: end state, then sum of dt (`kChunkRecord`).
const SPLIT_RECORD_FLOATS: i64 = TILED_MAX_DSTATE + 1;
/// Blocks the split aims for: two per multiprocessor of an H100 (132).
pub const SPLIT_TARGET_BLOCKS: i64 = 264;
/// Shortest chunk worth a block of its own.
pub const SPLIT_MIN_CHUNK: i64 = 64;

/// Chunks of the CUDA kernel's sequence split: (chunk_len, n_chunks). A small batch x dim leaves the
/// GPU idle, so the sequence is cut into chunks scanned in parallel: a first pass records each
/// chunk's end state from zero, a second carries the true states in and writes the output. Only
/// when there are fewer than [`SPLIT_TARGET_BLOCKS`] / 2 tiles of channels; depends on the shape
/// alone, so that a host can size the workspace before it knows the device.
pub fn split_plan(batch: i64, dim: i64, seqlen: i64) -> (i64, i64) {
    let tiles = batch * ((dim + TILE_CHANNELS - 1) / TILE_CHANNELS);
    if tiles == 0 || 2 * tiles >= SPLIT_TARGET_BLOCKS || seqlen < 2 * SPLIT_MIN_CHUNK {
        return (seqlen, 1);
    }
    let chunks = ((SPLIT_TARGET_BLOCKS + tiles - 1) / tiles).min(seqlen / SPLIT_MIN_CHUNK);
    // A whole number of tile steps (32 for 2-byte types, 16 for f32).
    let chunk_len = ((seqlen + chunks - 1) / chunks + 31) / 32 * 32;
    (chunk_len, (seqlen + chunk_len - 1) / chunk_len)
}

/// Bytes of workspace that let the CUDA forward scan split the sequence (0: it never splits).
pub fn workspace_bytes(batch: i64, dim: i64, seqlen: i64, dstate: i64) -> i64 {
    let (_, n_chunks) = split_plan(batch, dim, seqlen);
    if n_chunks <= 1 || dstate > TILED_MAX_DSTATE {
        return 0;
    }
    (n_chunks - 1) * batch * dim * SPLIT_RECORD_FLOATS * 4
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn opt_ptr(t: Option<&Tensor>) -> *const c_void {
    t.map_or(std::ptr::null(), |t| t.data as *const c_void)
}

/// Checks every operand against u's shape and dtype; the message names the operand, what was
/// expected and what came.
pub fn validate_fwd(args: &FwdArgs) -> Result<Fwd> {
    let op = "selective_scan_fwd";
    let x_meaning = match args.layout {
        Layout::ChannelFirst => "[batch, dim, seqlen]",
        Layout::ChannelLast => "[batch, seqlen, dim]",
    };
    let u = args.u;
    if u.dims.len() != 3 || u.dims.iter().any(|&x| x < 0) {
        return Err(Error::invalid(format!(
            "{op}: operand `u`: expected rank 3 {x_meaning}, got shape {}",
            super::fmt_dims(&u.dims)
        )));
    }
    expect_dtype(u, &format!("{op}: operand `u`"), &FLOATS)?;
    let dtype = u.dtype;
    let (batch, dim, seqlen) = match args.layout {
        Layout::ChannelFirst => (u.dims[0], u.dims[1], u.dims[2]),
        Layout::ChannelLast => (u.dims[0], u.dims[2], u.dims[1]),
    };
    expect(args.delta, &format!("{op}: operand `delta`"), &u.dims, x_meaning, &[dtype])?;
    if let Some(z) = args.z {
        expect(z, &format!("{op}: operand `z`"), &u.dims, x_meaning, &[dtype])?;
    }

    let a = args.a;
    if a.dims.len() != 2 || a.dims[0] != dim || a.dims[1] < 0 {
        return Err(Error::invalid(format!(
            "{op}: operand `A`: expected shape ({dim}, dstate) [dim, dstate], got {}",
            super::fmt_dims(&a.dims)
        )));
    }
    expect_dtype(a, &format!("{op}: operand `A`"), &[DType::F32])?;
    let dstate = a.dims[1];
    if dstate > MAX_DSTATE {
        return Err(Error::invalid(format!("{op}: operand `A`: dstate must be at most {MAX_DSTATE}, got {dstate}")));
    }

    // B and C: time-invariant (dim, dstate) or time-varying with groups.
    let b = args.b;
    let bc_dtypes: Vec<DType> = if dtype == DType::F32 { vec![DType::F32] } else { vec![DType::F32, dtype] };
    let (groups, bc_dims, bc_meaning, time_varying) = match b.dims.len() {
        2 => (dim, vec![dim, dstate], "[dim, dstate]", false),
        4 => {
            let g = match args.layout {
                Layout::ChannelFirst => b.dims[1],
                Layout::ChannelLast => b.dims[2],
            };
            if g < 1 || dim % g != 0 {
                return Err(Error::invalid(format!(
                    "{op}: operand `B`: groups (= {g}) must be at least 1 and divide dim (= {dim})"
                )));
            }
            match args.layout {
                Layout::ChannelFirst => (g, vec![batch, g, dstate, seqlen], "[batch, groups, dstate, seqlen]", true),
                Layout::ChannelLast => (g, vec![batch, seqlen, g, dstate], "[batch, seqlen, groups, dstate]", true),
            }
        }
        _ => {
            return Err(Error::invalid(format!(
                "{op}: operand `B`: expected rank 4 (time-varying) or rank 2 (dim, dstate), got shape {}",
                super::fmt_dims(&b.dims)
            )))
        }
    };
    expect(b, &format!("{op}: operand `B`"), &bc_dims, bc_meaning, &bc_dtypes)?;
    expect(args.c, &format!("{op}: operand `C` (must match B)"), &bc_dims, bc_meaning, &[b.dtype])?;

    let per_channel = [dim];
    if let Some(d) = args.d {
        expect(d, &format!("{op}: operand `D`"), &per_channel, "[dim]", &[DType::F32])?;
    }
    if let Some(bias) = args.delta_bias {
        expect(bias, &format!("{op}: operand `delta_bias`"), &per_channel, "[dim]", &[DType::F32])?;
    }
    let state_dims = [batch, dim, dstate];
    if let Some(h0) = args.initial_state {
        expect(h0, &format!("{op}: operand `initial_state`"), &state_dims, "[batch, dim, dstate]", &[DType::F32])?;
    }
    expect(args.out, &format!("{op}: result `out`"), &u.dims, x_meaning, &[dtype])?;
    expect(
        args.final_state,
        &format!("{op}: result `final_state`"),
        &state_dims,
        "[batch, dim, dstate]",
        &[DType::F32],
    )?;

    let named: [(Option<&Tensor>, &str); 11] = [
        (Some(u), "u"),
        (Some(args.delta), "delta"),
        (Some(a), "A"),
        (Some(b), "B"),
        (Some(args.c), "C"),
        (args.d, "D"),
        (args.z, "z"),
        (args.delta_bias, "delta_bias"),
        (args.initial_state, "initial_state"),
        (Some(args.out), "out"),
        (Some(args.final_state), "final_state"),
    ];
    for (t, name) in named {
        if let Some(t) = t {
            expect_nonnull(t, &format!("{op}: `{name}`"))?;
        }
    }

    let (x_stride_batch, x_stride_dim, x_stride_seq) = match args.layout {
        Layout::ChannelFirst => (dim * seqlen, seqlen, 1),
        Layout::ChannelLast => (seqlen * dim, 1, dim),
    };
    let (dim_per_group, bc_stride_batch, bc_stride_group, bc_stride_state, bc_stride_seq) = if !time_varying {
        (1, 0, dstate, 1, 0)
    } else {
        match args.layout {
            Layout::ChannelFirst => (dim / groups, groups * dstate * seqlen, dstate * seqlen, seqlen, 1),
            Layout::ChannelLast => (dim / groups, seqlen * groups * dstate, dstate, 1, groups * dstate),
        }
    };
    let params = FwdParams {
        u: u.data,
        delta: args.delta.data,
        a: a.data as *const f32,
        b: b.data,
        c: args.c.data,
        d: opt_ptr(args.d) as *const f32,
        z: opt_ptr(args.z),
        delta_bias: opt_ptr(args.delta_bias) as *const f32,
        initial_state: opt_ptr(args.initial_state) as *const f32,
        out: args.out.data,
        final_state: args.final_state.data as *mut f32,
        batch,
        dim,
        seqlen,
        dstate,
        dim_per_group,
        x_stride_batch,
        x_stride_dim,
        x_stride_seq,
        bc_stride_batch,
        bc_stride_group,
        bc_stride_state,
        bc_stride_seq,
        delta_softplus: args.delta_softplus as i32,
        _reserved: 0,
        workspace: args.workspace.map_or(std::ptr::null_mut(), |w| w.data as *mut f32),
        chunk_len: seqlen,
        n_chunks: 1,
    };
    let workspace_bytes = args.workspace.map_or(0, |w| w.numel() * w.dtype.size_bytes());
    Ok(Fwd { params, dtype, bc_dtype: b.dtype, bc_time_varying: time_varying, workspace_bytes })
}

/// Runs a validated forward call.
pub fn run_fwd(fwd: &Fwd, platform: Platform) -> Result<()> {
    match platform {
        Platform::Cpu => {
            cpu::fwd(fwd);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => cuda::fwd(fwd, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(Error::Unimplemented(
            "selective_scan_fwd: this build of xla-ssm has no CUDA support (built without the `cuda` feature)".into(),
        )),
    }
}

/// The XLA handler's body: decode operands per the `has_*` attributes, validate, run.
pub fn fwd_from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let prefix = |e: Error| match e {
        Error::InvalidArgument(m) if !m.starts_with("selective_scan_fwd") => {
            Error::InvalidArgument(format!("selective_scan_fwd: {m}"))
        }
        other => other,
    };
    let layout = Layout::parse(&frame.attr_str("layout").map_err(prefix)?)?;
    let delta_softplus = frame.attr_bool("delta_softplus").map_err(prefix)?;
    let optional = ["D", "z", "delta_bias", "initial_state"];
    let mut present = [false; 4];
    for (flag, name) in present.iter_mut().zip(optional) {
        let attr = if name == "D" { "has_d".to_string() } else { format!("has_{name}") };
        *flag = frame.attr_bool(&attr).map_err(prefix)?;
    }
    let mut names = vec!["u", "delta", "A", "B", "C"];
    names.extend(optional.iter().zip(present).filter(|(_, p)| *p).map(|(n, _)| *n));
    if frame.num_args() != names.len() {
        return Err(Error::invalid(format!(
            "selective_scan_fwd: expected {} operands ({}) as the has_* attributes say, got {}",
            names.len(),
            names.join(", "),
            frame.num_args()
        )));
    }
    if !(2..=3).contains(&frame.num_rets()) {
        return Err(Error::invalid(format!(
            "selective_scan_fwd: expected 2 or 3 results (out, final_state[, workspace]), got {}",
            frame.num_rets()
        )));
    }
    let operands: Vec<Tensor> =
        names.iter().enumerate().map(|(i, n)| frame.arg(i, n)).collect::<Result<_>>().map_err(prefix)?;
    let find = |name: &str| names.iter().position(|n| *n == name).map(|i| &operands[i]);
    let out = frame.ret(0, "out").map_err(prefix)?;
    let final_state = frame.ret(1, "final_state").map_err(prefix)?;
    let workspace = if frame.num_rets() == 3 { Some(frame.ret(2, "workspace").map_err(prefix)?) } else { None };
    let args = FwdArgs {
        u: &operands[0],
        delta: &operands[1],
        a: &operands[2],
        b: &operands[3],
        c: &operands[4],
        d: find("D"),
        z: find("z"),
        delta_bias: find("delta_bias"),
        initial_state: find("initial_state"),
        out: &out,
        final_state: &final_state,
        workspace: workspace.as_ref(),
        delta_softplus,
        layout,
    };
    let fwd = validate_fwd(&args)?;
    run_fwd(&fwd, platform)
}
