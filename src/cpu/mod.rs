//! The CPU backend: the host implementation of every operation, run on the validated parameters of
//! [`crate::ops`]. The shared parts come first, then one module per operation.
//!
//! - [`lanes`]: `W` f32 lanes ([`lanes::V`]), the value the vectorized loops compute with, and the
//!   small array helpers they need inlined.
//! - [`math`]: branch-free polynomial `exp` / `exp2` / softplus / silu / sigmoid that vectorize with
//!   the loops around them; libm-based scalar forms for the decode-time operations.
//! - [`isa`]: the instruction set picked at run time, and the macro that compiles a worker once per
//!   instruction set.
//! - [`elems`]: the element types (f32, bf16, f16), at the staging boundaries only. An operand's
//!   dtype is matched once, into a typed slice ([`elems::Elems`], [`elems::ElemsOut`] for results);
//!   each staging call matches that once, around a small typed loop that converts to or from f32
//!   scratch. Everything between staging works on f32 lanes and is compiled once per instruction
//!   set, not once per element type as well.
//! - [`pool`]: persistent worker threads, and per-thread scratch for a parallel call.
//!
//! The operations: [`selective_scan`] (the forward scan), [`selective_scan_bwd`], [`ssd`] (on the
//! scan), [`state_update`], [`conv1d`], [`mamba_decode`] (conv update, then state update).

pub(crate) mod elems;
pub(crate) mod isa;
pub(crate) mod lanes;
pub(crate) mod math;
pub(crate) mod pool;

pub(crate) mod carry;
pub(crate) mod conv1d;
pub(crate) mod mamba_decode;
pub(crate) mod records;
pub(crate) mod selective_scan;
pub(crate) mod selective_scan_bwd;
pub(crate) mod ssd;
pub(crate) mod state_update;
