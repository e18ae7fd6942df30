//! Registering the handlers with a host's XLA: through [`xla_ssm_register_xla_targets`] (C++ and
//! PJRT hosts that hold an `XLA_FFI_Api`), and at load time in a process that already contains XLA,
//! as `XLA_FFI_REGISTER_HANDLER` does in a C++ plugin (EXLA's `load_dylib` relies on that). JAX
//! registers through `jax.ffi` capsules instead (bindings/python/xla_ssm/_lib.py).

use super::ffi::*;
use super::frame::take_error_message;
use super::handlers;
use crate::capi::{call, XlaSsmStatus};
use crate::error::{Error, Result};
use crate::ops::signature::{self, Signature};
use std::ffi::{c_char, CStr};
use std::panic::catch_unwind;

/// One XLA target: its name (`xla_ssm_` and its signature's op) and its handler per platform.
pub struct Target {
    pub name: &'static str,
    pub signature: &'static Signature,
    pub cpu: XLA_FFI_Handler,
    pub cuda: XLA_FFI_Handler,
}

/// Every target the library exports (the Python package checks its own list against this one), in
/// the order of [`signature::ALL`].
pub const TARGETS: &[Target] = &[
    Target {
        name: "xla_ssm_selective_scan_fwd",
        signature: &signature::SELECTIVE_SCAN_FWD,
        cpu: handlers::xla_ssm_selective_scan_fwd_cpu,
        cuda: handlers::xla_ssm_selective_scan_fwd_cuda,
    },
    Target {
        name: "xla_ssm_selective_scan_bwd",
        signature: &signature::SELECTIVE_SCAN_BWD,
        cpu: handlers::xla_ssm_selective_scan_bwd_cpu,
        cuda: handlers::xla_ssm_selective_scan_bwd_cuda,
    },
    Target {
        name: "xla_ssm_selective_scan_chunk_records",
        signature: &signature::SELECTIVE_SCAN_CHUNK_RECORDS,
        cpu: handlers::xla_ssm_selective_scan_chunk_records_cpu,
        cuda: handlers::xla_ssm_selective_scan_chunk_records_cuda,
    },
    Target {
        name: "xla_ssm_selective_scan_carry_fwd",
        signature: &signature::SELECTIVE_SCAN_CARRY_FWD,
        cpu: handlers::xla_ssm_selective_scan_carry_fwd_cpu,
        cuda: handlers::xla_ssm_selective_scan_carry_fwd_cuda,
    },
    Target {
        name: "xla_ssm_selective_scan_carry_bwd",
        signature: &signature::SELECTIVE_SCAN_CARRY_BWD,
        cpu: handlers::xla_ssm_selective_scan_carry_bwd_cpu,
        cuda: handlers::xla_ssm_selective_scan_carry_bwd_cuda,
    },
    Target {
        name: "xla_ssm_selective_state_update",
        signature: &signature::SELECTIVE_STATE_UPDATE,
        cpu: handlers::xla_ssm_selective_state_update_cpu,
        cuda: handlers::xla_ssm_selective_state_update_cuda,
    },
    Target {
        name: "xla_ssm_causal_conv1d_fwd",
        signature: &signature::CAUSAL_CONV1D_FWD,
        cpu: handlers::xla_ssm_causal_conv1d_fwd_cpu,
        cuda: handlers::xla_ssm_causal_conv1d_fwd_cuda,
    },
    Target {
        name: "xla_ssm_causal_conv1d_bwd",
        signature: &signature::CAUSAL_CONV1D_BWD,
        cpu: handlers::xla_ssm_causal_conv1d_bwd_cpu,
        cuda: handlers::xla_ssm_causal_conv1d_bwd_cuda,
    },
    Target {
        name: "xla_ssm_causal_conv1d_update",
        signature: &signature::CAUSAL_CONV1D_UPDATE,
        cpu: handlers::xla_ssm_causal_conv1d_update_cpu,
        cuda: handlers::xla_ssm_causal_conv1d_update_cuda,
    },
    Target {
        name: "xla_ssm_mamba_decode_step",
        signature: &signature::MAMBA_DECODE_STEP,
        cpu: handlers::xla_ssm_mamba_decode_step_cpu,
        cuda: handlers::xla_ssm_mamba_decode_step_cuda,
    },
    Target {
        name: "xla_ssm_ssd_fwd",
        signature: &signature::SSD_FWD,
        cpu: handlers::xla_ssm_ssd_fwd_cpu,
        cuda: handlers::xla_ssm_ssd_fwd_cuda,
    },
    Target {
        name: "xla_ssm_ssd_bwd",
        signature: &signature::SSD_BWD,
        cpu: handlers::xla_ssm_ssd_bwd_cpu,
        cuda: handlers::xla_ssm_ssd_bwd_cuda,
    },
    Target {
        name: "xla_ssm_ssd_part_records",
        signature: &signature::SSD_PART_RECORDS,
        cpu: handlers::xla_ssm_ssd_part_records_cpu,
        cuda: handlers::xla_ssm_ssd_part_records_cuda,
    },
];

/// The signature of every target (`crate::ops::signature`) as JSON: what each takes and returns, by
/// name, and its attributes. Hosts that build calls by hand and the Python package's tests read it.
#[no_mangle]
pub extern "C" fn xla_ssm_target_signatures() -> *const c_char {
    static JSON: once_cell::sync::Lazy<std::ffi::CString> = once_cell::sync::Lazy::new(|| {
        std::ffi::CString::new(signature::to_json()).expect("the table has no NUL bytes")
    });
    crate::capi::guard(c"".as_ptr(), || JSON.as_ptr())
}

/// Which handlers a platform name selects, as XLA canonicalises it ("cpu" is "Host"; case-blind).
fn platform_is_cuda(platform: &str) -> Result<bool> {
    match platform.to_ascii_lowercase().as_str() {
        "host" | "cpu" => Ok(false),
        "cuda" | "gpu" => Ok(true),
        _ => Err(Error::invalid(format!(
            "xla_ssm_register_xla_targets: platform {platform:?} is not one of \"Host\" (or \"cpu\") and \"CUDA\""
        ))),
    }
}

/// Registers every target with `api` for `platform` ("Host" or "CUDA"); stops at the first error.
fn register_all(api: &XLA_FFI_Api, platform: &str) -> Result<()> {
    let cuda = platform_is_cuda(platform)?;
    if api.struct_size < api_struct_size_min() || api.api_version.major_version != XLA_FFI_API_MAJOR {
        return Err(Error::invalid(format!(
            "xla_ssm_register_xla_targets: not an XLA FFI API table this library knows (struct_size {}, \
             version {}.{})",
            api.struct_size, api.api_version.major_version, api.api_version.minor_version
        )));
    }
    let register = api
        .XLA_FFI_Handler_Register
        .ok_or_else(|| Error::invalid("xla_ssm_register_xla_targets: the API table has no XLA_FFI_Handler_Register"))?;
    let traits = if cuda { XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE } else { 0 };
    for target in TARGETS {
        let handler = if cuda { target.cuda } else { target.cpu };
        // A fresh struct each time: hosts of API 0.4+ rewrite `struct_size` in place when they
        // accept the shorter 0.1 layout.
        let mut args = XLA_FFI_Handler_Register_Args {
            struct_size: handler_register_args_struct_size(),
            extension_start: std::ptr::null_mut(),
            name: XLA_FFI_ByteSpan { ptr: target.name.as_ptr() as *const c_char, len: target.name.len() },
            platform: XLA_FFI_ByteSpan { ptr: platform.as_ptr() as *const c_char, len: platform.len() },
            bundle: XLA_FFI_Handler_Bundle {
                instantiate: None,
                prepare: None,
                initialize: None,
                execute: Some(handler),
            },
            traits,
        };
        // SAFETY: XLA's own entry with a well-formed argument struct; XLA copies the strings.
        let err = unsafe { register(&mut args) };
        if !err.is_null() {
            let msg = take_error_message(api, err);
            return Err(Error::Internal(format!("registering {} for {platform}: {msg}", target.name)));
        }
    }
    Ok(())
}

/// Registers every `xla_ssm_*` target with a host's XLA FFI API table for `platform`: "Host" (or
/// "cpu") for the CPU handlers, "CUDA" for the CUDA ones. For C++ hosts that embed XLA
/// (`xla::ffi::GetXlaFfiApi()`) or reach a PJRT plugin's table. Registering the same handlers again
/// is harmless. On failure `xla_ssm_last_error()` carries the host's message.
///
/// # Safety
/// `api` is null or points at a live `XLA_FFI_Api`; `platform` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn xla_ssm_register_xla_targets(
    api: *const XLA_FFI_Api,
    platform: *const c_char,
) -> XlaSsmStatus {
    call(|| {
        let Some(api) = api.as_ref() else {
            return Err(Error::invalid("xla_ssm_register_xla_targets: `api` is null"));
        };
        if platform.is_null() {
            return Err(Error::invalid("xla_ssm_register_xla_targets: `platform` is null"));
        }
        let platform = CStr::from_ptr(platform)
            .to_str()
            .map_err(|_| Error::invalid("xla_ssm_register_xla_targets: `platform` is not UTF-8"))?;
        register_all(api, platform)
    })
}

// ---- Load-time registration.

/// The symbols through which a process's XLA hands out its API table: the C one from c_api.h, and
/// the C++ `xla::ffi::GetXlaFfiApi()` that XLA_FFI_REGISTER_HANDLER plugins link against.
const GET_API_SYMBOLS: [&CStr; 2] = [c"XLA_FFI_GetApi", c"_ZN3xla3ffi12GetXlaFfiApiEv"];

/// Set to 1 to keep the library from registering itself when it is loaded.
const NO_AUTO_REGISTER_ENV: &str = "XLA_SSM_NO_AUTO_REGISTER";

type GetApi = unsafe extern "C" fn() -> *const XLA_FFI_Api;

/// The XLA API table of this process, if a loaded object exports one. Looks in every loaded
/// object, not only the global scope: Erlang loads NIFs (EXLA and its libxla_extension.so) with
/// RTLD_LOCAL. jaxlib exports no such symbol, so under JAX this finds nothing.
fn find_process_api() -> Option<&'static XLA_FFI_Api> {
    let mut objects: Vec<std::ffi::CString> = Vec::new();
    unsafe extern "C" fn collect(info: *mut libc::dl_phdr_info, _: usize, data: *mut libc::c_void) -> libc::c_int {
        // SAFETY: `data` is the Vec passed below; `dlpi_name` is null or a C string owned by ld.so.
        let objects = &mut *(data as *mut Vec<std::ffi::CString>);
        let name = (*info).dlpi_name;
        if !name.is_null() {
            objects.push(CStr::from_ptr(name).to_owned());
        }
        0
    }
    // SAFETY: the callback only reads the entry it is given and appends to the Vec.
    unsafe { libc::dl_iterate_phdr(Some(collect), &mut objects as *mut _ as *mut libc::c_void) };
    for object in &objects {
        // The main program is listed as "": dlopen(NULL) names it. RTLD_NOLOAD: never load anything.
        let path = if object.as_bytes().is_empty() { std::ptr::null() } else { object.as_ptr() };
        // SAFETY: a NOLOAD open of an object that is already mapped only takes a reference.
        let handle = unsafe { libc::dlopen(path, libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if handle.is_null() {
            continue;
        }
        let found = GET_API_SYMBOLS.iter().find_map(|symbol| {
            // SAFETY: a lookup in a live handle.
            let sym = unsafe { libc::dlsym(handle, symbol.as_ptr()) };
            (!sym.is_null()).then_some(sym)
        });
        // SAFETY: drops the reference taken above; the object stays mapped (it was already loaded).
        unsafe { libc::dlclose(handle) };
        if let Some(sym) = found {
            // SAFETY: both symbols are `const XLA_FFI_Api* (void)`; the table lives as long as XLA.
            let api = unsafe { std::mem::transmute::<*mut libc::c_void, GetApi>(sym)() };
            return unsafe { api.as_ref() };
        }
    }
    None
}

/// Registers the CPU ("Host") and, in a CUDA build, the CUDA handlers with the XLA already in this
/// process, if there is one. Failures are printed: nothing else can see them at load time.
fn register_at_load() {
    if std::env::var_os(NO_AUTO_REGISTER_ENV).is_some_and(|v| v == "1") {
        return;
    }
    let Some(api) = find_process_api() else { return };
    let platforms: &[&str] = if cfg!(feature = "cuda") { &["Host", "CUDA"] } else { &["Host"] };
    for platform in platforms {
        if let Err(e) = register_all(api, platform) {
            eprintln!("xla_ssm: registering the XLA targets at load time failed: {e}");
        }
    }
}

extern "C" fn register_at_load_boundary() {
    // Nothing may unwind out of a loader constructor.
    let _ = catch_unwind(register_at_load);
}

/// Runs when the library is loaded (ELF `.init_array`, as a C++ static initializer would).
#[used]
#[link_section = ".init_array"]
static REGISTER_AT_LOAD: extern "C" fn() = register_at_load_boundary;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_signature_is_a_target_in_order() {
        let names: Vec<String> = signature::ALL.iter().map(|s| format!("xla_ssm_{}", s.op)).collect();
        let targets: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
        assert_eq!(names, targets);
        assert!(TARGETS.iter().all(|t| t.name == format!("xla_ssm_{}", t.signature.op)));
    }
}
