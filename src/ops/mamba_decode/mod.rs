//! `mamba_decode_step`: one token through the SSM part of a Mamba layer in one launch (docs/decode.md):
//!
//! ```text
//! xc = silu(causal_conv1d_update(x, conv_state, conv_weight, conv_bias))     (conv_state in place)
//! out = selective_state_update(ssm_state, xc, dt, A, B, C, D, z, dt_bias)    (ssm_state in place)
//! ```
//! dt, B and C are inputs: in a Mamba-1 layer they come from x_proj of xc, a matmul over all channels,
//! which has to run between the two halves (so there a token costs two launches: causal_conv1d_update,
//! then selective_state_update); this fused target fits layers whose dt, B, C do not depend on the conv
//! output (as in Mamba-2, where in_proj produces them).

use super::buffers::check_buffers;
use super::conv1d::{self, ConvArgs, Kind};
use super::selective_scan::Layout;
use super::state_update::{self, check_indices_host, UpdateArgs, UpdateParams};
use super::{Platform, Tensor};
use crate::error::{Error, Result};
use std::ffi::c_void;

/// Kernel parameters of the fused step; generated into kernels/params.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DecodeParams {
    /// `ssm.x` is the conv's input.
    pub ssm: UpdateParams,
    /// (n_slots, dim, width - 1), dtype of x, updated in place.
    pub conv_state: *mut c_void,
    pub conv_weight: *const c_void,
    pub conv_bias: *const c_void,
    pub width: i64,
}

/// The operands of one fused step.
pub struct DecodeArgs<'a> {
    pub x: &'a Tensor,
    pub conv_state: &'a Tensor,
    pub conv_weight: &'a Tensor,
    pub conv_bias: Option<&'a Tensor>,
    pub ssm_state: &'a Tensor,
    pub dt: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub c: &'a Tensor,
    pub d: Option<&'a Tensor>,
    pub z: Option<&'a Tensor>,
    pub dt_bias: Option<&'a Tensor>,
    pub state_batch_indices: Option<&'a Tensor>,
    pub out: &'a Tensor,
    pub conv_state_out: &'a Tensor,
    pub ssm_state_out: &'a Tensor,
    pub dt_softplus: bool,
}

validated! {
    /// A validated fused step: its two halves, validated as the separate ops validate them.
    pub struct Decode {
        conv: conv1d::Conv,
        update: state_update::Update,
    }
}

pub const OP: &str = "mamba_decode_step";

/// The fused step validates through `selective_state_update` and `causal_conv1d_update`: their
/// messages, in this op's names.
fn rename(e: Error) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(
            m.replacen("selective_state_update:", &format!("{OP}:"), 1)
                .replacen("causal_conv1d_update:", &format!("{OP}:"), 1)
                .replace("`weight", "`conv_weight")
                .replace("`bias", "`conv_bias")
                .replace("`state`", "`ssm_state`")
                .replace("`state (", "`ssm_state ("),
        ),
        other => other,
    }
}

pub fn validate(a: &DecodeArgs) -> Result<Decode> {
    state_update::expect_rows(OP, a.x)?;
    let update = state_update::validate(&UpdateArgs {
        state: a.ssm_state,
        x: a.x,
        dt: a.dt,
        a: a.a,
        b: a.b,
        c: a.c,
        d: a.d,
        z: a.z,
        dt_bias: a.dt_bias,
        state_batch_indices: a.state_batch_indices,
        out: a.out,
        state_out: a.ssm_state_out,
        dt_softplus: a.dt_softplus,
    })
    .map_err(rename)?;
    let conv = conv1d::validate(&ConvArgs {
        kind: Kind::Update,
        x: a.x,
        weight: a.conv_weight,
        bias: a.conv_bias,
        initial_states: None,
        cu_seqlens: None,
        dout: None,
        conv_state: Some((a.conv_state, a.conv_state_out)),
        state_batch_indices: a.state_batch_indices,
        out: a.out,
        dweight: None,
        dbias: None,
        dinitial_states: None,
        silu: true,
        layout: Layout::ChannelFirst,
    })
    .map_err(rename)?;
    if conv.params().n_slots != update.params().n_slots {
        return Err(Error::invalid(format!(
            "{OP}: operands `conv_state` and `ssm_state`: expected the same number of slots, got {} and {}",
            conv.params().n_slots,
            update.params().n_slots
        )));
    }
    let operands = [
        ("x", Some(a.x)),
        ("conv_state", Some(a.conv_state)),
        ("conv_weight", Some(a.conv_weight)),
        ("conv_bias", a.conv_bias),
        ("ssm_state", Some(a.ssm_state)),
        ("dt", Some(a.dt)),
        ("A", Some(a.a)),
        ("B", Some(a.b)),
        ("C", Some(a.c)),
        ("D", a.d),
        ("z", a.z),
        ("dt_bias", a.dt_bias),
        ("state_batch_indices", a.state_batch_indices),
    ];
    let results = [("out", Some(a.out)), ("conv_state", Some(a.conv_state_out)), ("ssm_state", Some(a.ssm_state_out))];
    check_buffers(OP, &operands, &results)?;
    Ok(Decode { conv, update })
}

pub fn run(step: &Decode, platform: Platform) -> Result<()> {
    let (c, u) = (&step.conv, &step.update);
    match platform {
        Platform::Cpu => {
            check_indices_host(OP, u.params().state_batch_indices, u.params().batch, u.params().n_slots)?;
            for copy in [c.state_copy(), u.state_copy()].into_iter().flatten() {
                // SAFETY: validated, distinct host buffers of that size.
                unsafe { copy.on_host() };
            }
            crate::cpu::mamba_decode::step(c, u);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => crate::cuda::mamba_decode::step(c, u, stream),
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(Error::Unimplemented(format!(
            "{OP}: this build of xla-ssm has no CUDA support (built without the `cuda` feature)"
        ))),
    }
}
