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

use super::args::{self, Alias};
use super::conv1d::{self, ConvArgs, Kind};
use super::selective_scan::Layout;
use super::state_update::{self, check_indices_host, UpdateArgs, UpdateParams};
use super::{Platform, Tensor};
use crate::error::{Error, Result};
use crate::xla::frame::Frame;
use std::ffi::c_void;

/// Kernel parameters, mirrored by `DecodeParams` in `kernels/decode.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DecodeParams {
    pub ssm: UpdateParams,
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

/// A validated fused step: its two halves, validated as the separate ops validate them.
pub struct Decode {
    pub conv: conv1d::Conv,
    pub update: state_update::Update,
}

const OP: &str = "mamba_decode_step";

fn rename(e: Error) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(
            m.replacen("selective_state_update:", &format!("{OP}:"), 1)
                .replacen("causal_conv1d_update:", &format!("{OP}:"), 1)
                .replace("operand `weight`", "operand `conv_weight`")
                .replace("operand `bias`", "operand `conv_bias`")
                .replace("operand `state`", "operand `ssm_state`")
                .replace("result `state`", "result `ssm_state`"),
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
    if conv.params.n_slots != update.params.n_slots {
        return Err(Error::invalid(format!(
            "{OP}: operands `conv_state` and `ssm_state`: expected the same number of slots, got {} and {}",
            conv.params.n_slots, update.params.n_slots
        )));
    }
    Ok(Decode { conv, update })
}

pub fn run(step: &Decode, platform: Platform) -> Result<()> {
    let (c, u) = (&step.conv, &step.update);
    match platform {
        Platform::Cpu => {
            check_indices_host(OP, u.params.state_batch_indices, u.params.batch, u.params.n_slots)?;
            // SAFETY (both copies): validated, non-overlapping buffers of these sizes.
            if c.alias == Alias::Copy {
                let bytes = c.params.n_slots * c.params.dim * (c.params.width - 1) * c.dtype.size_bytes();
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        c.state_in as *const u8,
                        c.params.conv_state as *mut u8,
                        bytes as usize,
                    )
                };
            }
            if u.alias == Alias::Copy {
                let bytes = state_update::state_bytes(&u.params, u.state_dtype);
                unsafe { std::ptr::copy_nonoverlapping(u.state_in as *const u8, u.params.state as *mut u8, bytes) };
            }
            let xc = conv1d::update_values(c);
            state_update::update_row(u, &xc);
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Platform::Cuda { stream } => {
            use crate::cuda::copy_async;
            if c.alias == Alias::Copy {
                let bytes = c.params.n_slots * c.params.dim * (c.params.width - 1) * c.dtype.size_bytes();
                copy_async(stream, c.params.conv_state, c.state_in, bytes as usize)?;
            }
            if u.alias == Alias::Copy {
                copy_async(stream, u.params.state, u.state_in, state_update::state_bytes(&u.params, u.state_dtype))?;
            }
            let mut ssm = u.params;
            if ssm.batch * ssm.dim == 0 {
                return Ok(());
            }
            let (config, form) = state_update::cuda::geometry(&mut ssm, u.state_dtype, Some(c.params.width));
            let params = DecodeParams {
                ssm,
                conv_state: c.params.conv_state,
                conv_weight: c.params.weight,
                conv_bias: c.params.bias,
                width: c.params.width,
            };
            let types: [crate::DType; 4] = [u.dtype, u.bc_dtype, u.state_dtype, c.weight_dtype];
            let kernel = format!("mamba_decode_step_{}{form}", state_update::cuda::type_suffix(&types));
            crate::cuda::launch(stream, "selective_state_update", &kernel, config, &params)
        }
        #[cfg(not(feature = "cuda"))]
        Platform::Cuda { .. } => Err(Error::Unimplemented(format!(
            "{OP}: this build of xla-ssm has no CUDA support (built without the `cuda` feature)"
        ))),
    }
}

/// The XLA handler's body.
pub fn from_frame(frame: &Frame, platform: Platform) -> Result<()> {
    let dt_softplus = frame.attr_bool("dt_softplus").map_err(args::prefixed(OP))?;
    let (req, opt) = args::operands(
        frame,
        OP,
        &["x", "conv_state", "conv_weight", "ssm_state", "dt", "A", "B", "C"],
        &["conv_bias", "D", "z", "dt_bias", "state_batch_indices"],
    )?;
    let rets = args::results(frame, OP, &["out", "conv_state", "ssm_state"])?;
    let step = validate(&DecodeArgs {
        x: &req[0],
        conv_state: &req[1],
        conv_weight: &req[2],
        conv_bias: opt[0].as_ref(),
        ssm_state: &req[3],
        dt: &req[4],
        a: &req[5],
        b: &req[6],
        c: &req[7],
        d: opt[1].as_ref(),
        z: opt[2].as_ref(),
        dt_bias: opt[3].as_ref(),
        state_batch_indices: opt[4].as_ref(),
        out: &rets[0],
        conv_state_out: &rets[1],
        ssm_state_out: &rets[2],
        dt_softplus,
    })?;
    run(&step, platform)
}
