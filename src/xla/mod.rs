//! The XLA FFI side: the C ABI mirror ([`ffi`]), call-frame decoding ([`frame`]) and the exported
//! handler symbols ([`handlers`]).

pub mod ffi;
pub mod frame;
pub mod handlers;
