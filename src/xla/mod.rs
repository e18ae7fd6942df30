//! The XLA host adapter: the C ABI mirror ([`ffi`]), call-frame decoding ([`frame`], [`operands`],
//! then one module per operation), the exported handler symbols ([`handlers`]) and their
//! registration with a host's XLA ([`register`]). The operations never see XLA types.

pub mod conv1d;
pub mod ffi;
pub mod frame;
pub mod handlers;
pub mod mamba_decode;
pub mod operands;
pub mod register;
pub mod selective_scan;
pub mod ssd;
pub mod state_update;
