//! The exported XLA FFI handlers, one per operation and platform, and the one wrapper they share:
//! metadata handshake, stage check, panic catching and error conversion.

use super::ffi::*;
use super::frame::{make_error, Call, Frame};
use super::{conv1d, mamba_decode, selective_scan, ssd, state_update};
use crate::error::{Error, Result};
use crate::ops::conv1d::Kind;
use crate::ops::selective_scan::carry::Direction;
use crate::ops::Platform;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs `body` for one XLA call. Nothing unwinds out of here: a panic becomes an INTERNAL error.
///
/// # Safety
/// `frame` must be a call frame built by XLA (or laid out as the C header says).
pub unsafe fn run_handler(
    frame: *mut XLA_FFI_CallFrame,
    traits: XLA_FFI_Handler_Traits,
    body: impl FnOnce(&Frame) -> Result<()>,
) -> *mut XLA_FFI_Error {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let Some(raw) = frame.as_mut() else {
            // No API table to report through; a host that passes no frame gets nothing done.
            return std::ptr::null_mut();
        };
        let api_ptr = raw.api;
        let fail = |e: Error| match api_ptr.as_ref() {
            Some(api) => make_error(api, &e),
            None => {
                // No table to make an error with: say it where a person can see it.
                eprintln!("xla_ssm: {e}");
                std::ptr::null_mut()
            }
        };
        match Call::decode(raw) {
            Err(msg) => fail(Error::invalid(msg)),
            Ok(Call::Metadata(ext)) => {
                // Only the fields of API 0.1 are written: hosts pass a 0.1-sized metadata struct
                // (the later `state_type_id` is value-initialised by XLA and lies past its size).
                let metadata = &mut *ext.metadata;
                let (major_version, minor_version) = HANDLER_API_VERSION;
                metadata.api_version = XLA_FFI_Api_Version {
                    struct_size: api_version_struct_size(),
                    extension_start: std::ptr::null_mut(),
                    major_version,
                    minor_version,
                };
                metadata.traits = traits;
                std::ptr::null_mut()
            }
            Ok(Call::Run(frame)) => {
                if frame.stage() != XLA_FFI_EXECUTION_STAGE_EXECUTE {
                    // Only an execute handler is registered: other stages have nothing to do.
                    return std::ptr::null_mut();
                }
                match body(&frame) {
                    Ok(()) => std::ptr::null_mut(),
                    Err(e) => make_error(frame.api(), &e),
                }
            }
        }
    }));
    match outcome {
        Ok(err) => err,
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            match frame.as_ref().and_then(|f| f.api.as_ref()) {
                Some(api) => make_error(api, &Error::Internal(format!("xla_ssm panicked: {what}"))),
                None => std::ptr::null_mut(),
            }
        }
    }
}

// The handlers are written out (not macro-generated) so that cbindgen puts them in the header.

/// XLA FFI handler of `xla_ssm_selective_scan_fwd` for platform "cpu" (register with
/// `jax.ffi.register_ffi_target(..., platform="cpu")`).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_fwd_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| selective_scan::fwd_from_frame(frame, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_selective_scan_fwd` for platform "CUDA". Runs on XLA's stream,
/// allocates nothing and never synchronizes, so it is safe in CUDA graphs (command buffers).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_fwd_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        selective_scan::fwd_from_frame(frame, Platform::Cuda { stream })
    })
}

/// XLA FFI handler of `xla_ssm_selective_scan_bwd` for platform "cpu" (docs/selective_scan_bwd.md).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_bwd_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| selective_scan::bwd_from_frame(frame, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_selective_scan_bwd` for platform "CUDA". Runs on XLA's stream, with
/// the workspace result as its only scratch, and never synchronizes, so it is safe in CUDA graphs.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_bwd_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        selective_scan::bwd_from_frame(frame, Platform::Cuda { stream })
    })
}

// ---- Mamba-2's chunked SSD scan (docs/ssd.md).

/// XLA FFI handler of `xla_ssm_ssd_fwd` (Mamba-2 SSD forward) for platform "cpu".
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_fwd_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| ssd::fwd_from_frame(frame, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_ssd_fwd` for platform "CUDA". Runs on XLA's stream with the workspace
/// result as its only scratch, and never synchronizes, so it is safe in CUDA graphs.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_fwd_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        ssd::fwd_from_frame(frame, Platform::Cuda { stream })
    })
}

/// XLA FFI handler of `xla_ssm_ssd_bwd` (Mamba-2 SSD backward) for platform "cpu".
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_bwd_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| ssd::bwd_from_frame(frame, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_ssd_bwd` for platform "CUDA". Runs on XLA's stream with the workspace
/// result as its only scratch, and never synchronizes, so it is safe in CUDA graphs.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_bwd_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        ssd::bwd_from_frame(frame, Platform::Cuda { stream })
    })
}

/// XLA FFI handler of `xla_ssm_ssd_part_records` for platform "cpu" (docs/ssd.md, "Part records").
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_part_records_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| ssd::part_records_from_frame(frame, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_ssd_part_records` for platform "CUDA". Runs on XLA's stream,
/// allocates nothing and never synchronizes, so it is safe in CUDA graphs.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_ssd_part_records_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        ssd::part_records_from_frame(frame, Platform::Cuda { stream })
    })
}

// ---- Decode-time targets (docs/decode.md). In-place operands are aliased to their results with
// `input_output_aliases`; without the alias the handler copies the operand into the result first.

/// XLA FFI handler of `xla_ssm_selective_scan_chunk_records` for platform "cpu"
/// (docs/selective_scan_fwd.md, "Chunk records").
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_chunk_records_cpu(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| selective_scan::chunk_records_from_frame(frame, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_selective_scan_chunk_records` for platform "CUDA". Runs on XLA's
/// stream, allocates nothing and never synchronizes, so it is safe in CUDA graphs.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_chunk_records_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        selective_scan::chunk_records_from_frame(frame, Platform::Cuda { stream })
    })
}

/// XLA FFI handler of `xla_ssm_selective_scan_carry_fwd` for platform "cpu"
/// (docs/selective_scan_carry.md).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_carry_fwd_cpu(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| selective_scan::carry_from_frame(frame, Direction::Fwd, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_selective_scan_carry_fwd` for platform "CUDA". Runs on XLA's stream,
/// allocates nothing and never synchronizes, so it is safe in CUDA graphs.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_carry_fwd_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        selective_scan::carry_from_frame(frame, Direction::Fwd, Platform::Cuda { stream })
    })
}

/// XLA FFI handler of `xla_ssm_selective_scan_carry_bwd` for platform "cpu"
/// (docs/selective_scan_carry.md).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_carry_bwd_cpu(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| selective_scan::carry_from_frame(frame, Direction::Bwd, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_selective_scan_carry_bwd` for platform "CUDA". Runs on XLA's stream,
/// allocates nothing and never synchronizes, so it is safe in CUDA graphs.
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_scan_carry_bwd_cuda(
    call_frame: *mut XLA_FFI_CallFrame,
) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        selective_scan::carry_from_frame(frame, Direction::Bwd, Platform::Cuda { stream })
    })
}

/// XLA FFI handler of `xla_ssm_selective_state_update` (selective state update (one decode token, state in place)) for platform "cpu".
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_state_update_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| state_update::from_frame(frame, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_selective_state_update` for platform "CUDA". Runs on XLA's stream, allocates
/// nothing and never synchronizes (the copy of a non-aliased state is an async device copy), so it is
/// safe in CUDA graphs (command buffers).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_selective_state_update_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        state_update::from_frame(frame, Platform::Cuda { stream })
    })
}

/// XLA FFI handler of `xla_ssm_causal_conv1d_fwd` (causal conv1d forward) for platform "cpu".
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_causal_conv1d_fwd_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| conv1d::from_frame(frame, Platform::Cpu, Kind::Fwd))
}

/// XLA FFI handler of `xla_ssm_causal_conv1d_fwd` for platform "CUDA". Runs on XLA's stream, allocates
/// nothing and never synchronizes (the copy of a non-aliased state is an async device copy), so it is
/// safe in CUDA graphs (command buffers).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_causal_conv1d_fwd_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        conv1d::from_frame(frame, Platform::Cuda { stream }, Kind::Fwd)
    })
}

/// XLA FFI handler of `xla_ssm_causal_conv1d_bwd` (causal conv1d backward) for platform "cpu".
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_causal_conv1d_bwd_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| conv1d::from_frame(frame, Platform::Cpu, Kind::Bwd))
}

/// XLA FFI handler of `xla_ssm_causal_conv1d_bwd` for platform "CUDA". Runs on XLA's stream, allocates
/// nothing and never synchronizes (the copy of a non-aliased state is an async device copy), so it is
/// safe in CUDA graphs (command buffers).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_causal_conv1d_bwd_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        conv1d::from_frame(frame, Platform::Cuda { stream }, Kind::Bwd)
    })
}

/// XLA FFI handler of `xla_ssm_causal_conv1d_update` (causal conv1d update (conv state in place)) for platform "cpu".
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_causal_conv1d_update_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| conv1d::from_frame(frame, Platform::Cpu, Kind::Update))
}

/// XLA FFI handler of `xla_ssm_causal_conv1d_update` for platform "CUDA". Runs on XLA's stream, allocates
/// nothing and never synchronizes (the copy of a non-aliased state is an async device copy), so it is
/// safe in CUDA graphs (command buffers).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_causal_conv1d_update_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        conv1d::from_frame(frame, Platform::Cuda { stream }, Kind::Update)
    })
}

/// XLA FFI handler of `xla_ssm_mamba_decode_step` (fused decode step (conv update + SiLU + state update + gate)) for platform "cpu".
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_mamba_decode_step_cpu(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, 0, |frame| mamba_decode::from_frame(frame, Platform::Cpu))
}

/// XLA FFI handler of `xla_ssm_mamba_decode_step` for platform "CUDA". Runs on XLA's stream, allocates
/// nothing and never synchronizes (the copy of a non-aliased state is an async device copy), so it is
/// safe in CUDA graphs (command buffers).
///
/// # Safety
/// Called by XLA with a valid call frame.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_mamba_decode_step_cuda(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(call_frame, XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE, |frame| {
        let stream = frame.stream()?;
        mamba_decode::from_frame(frame, Platform::Cuda { stream })
    })
}
