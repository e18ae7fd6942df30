//! CUDA through the driver API, loaded at run time (cudarc's dynamic loading): the embedded fatbins,
//! a per-context module cache, and the launch helper. Nothing here allocates device memory or
//! synchronizes a stream.

use crate::error::{Error, Result};
use cudarc::driver::sys;
use once_cell::sync::OnceCell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Mutex;

pub(crate) mod carry;
pub(crate) mod conv1d;
pub mod kernels;
pub(crate) mod mamba_decode;
pub(crate) mod selective_scan;
pub(crate) mod selective_scan_bwd;
pub(crate) mod ssd;
pub(crate) mod ssd_mma;
pub(crate) mod state_update;

include!(concat!(env!("OUT_DIR"), "/fatbins.rs"));

/// Turns a driver status into an [`Error`] carrying the driver's own name and message.
pub fn check(result: sys::CUresult, what: &str) -> Result<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver is loaded (we got a status from it); both return static strings.
    unsafe {
        sys::cuGetErrorName(result, &mut name);
        sys::cuGetErrorString(result, &mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            format!("{result:?}")
        } else {
            // SAFETY: a static NUL-terminated string from the driver (above).
            unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    Err(Error::Cuda(format!("{what}: {} ({})", s(text), s(name))))
}

/// Loads libcuda and calls cuInit once; afterwards returns the same answer.
pub fn driver() -> Result<()> {
    static INIT: OnceCell<std::result::Result<(), String>> = OnceCell::new();
    INIT.get_or_init(|| {
        // SAFETY: probing for the library has no preconditions.
        if !unsafe { sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so) could not be loaded".into());
        }
        // SAFETY: cuInit may be called any number of times.
        check(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| e.message().to_string())
    })
    .clone()
    .map_err(Error::Cuda)
}

/// Whether a CUDA device can be used from this process (for tests and hosts that want to skip).
pub fn device_count() -> usize {
    if driver().is_err() {
        return 0;
    }
    let mut n = 0;
    // SAFETY: the driver is initialised.
    match unsafe { sys::cuDeviceGetCount(&mut n) } {
        sys::CUresult::CUDA_SUCCESS => n.max(0) as usize,
        _ => 0,
    }
}

/// Functions cached by (context, kernel name); modules are loaded once per context and never unloaded
/// (they live as long as the context, which XLA keeps for the process).
struct Cache {
    modules: HashMap<(usize, &'static str), usize>,
    functions: HashMap<(usize, String), Function>,
}

/// A loaded kernel.
#[derive(Clone, Copy)]
struct Function {
    handle: sys::CUfunction,
    /// The dynamic shared memory it was allowed, beyond the default 48 KiB.
    shared_allowed: u32,
    /// Compiled for a virtual arch of sm_90 or newer: its `pdl_*` calls are real instructions, so it
    /// may be launched overlapping (on a newer GPU that JITs the sm_80 PTX they compile to nothing).
    pdl: bool,
}

// SAFETY: a CUfunction is a handle that the driver lets any thread use.
unsafe impl Send for Function {}

/// Dynamic shared memory a kernel may take without opting in.
const DEFAULT_DYNAMIC_SHARED: u32 = 48 * 1024;

static CACHE: Mutex<Option<Cache>> = Mutex::new(None);

/// The context that owns `stream` (the current one for the legacy default stream).
fn stream_context(stream: sys::CUstream) -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    if stream.is_null() {
        // SAFETY: plain query.
        check(unsafe { sys::cuCtxGetCurrent(&mut ctx) }, "cuCtxGetCurrent")?;
        if ctx.is_null() {
            return Err(Error::Cuda("no CUDA context is current and no stream was given".into()));
        }
    } else {
        // SAFETY: `stream` is a live stream handed over by the host.
        check(unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }, "cuStreamGetCtx")?;
    }
    Ok(ctx)
}

/// Makes `ctx` current for the guard's lifetime.
struct ContextGuard;
impl ContextGuard {
    fn push(ctx: sys::CUcontext) -> Result<ContextGuard> {
        // SAFETY: ctx is a live context.
        check(unsafe { sys::cuCtxPushCurrent_v2(ctx) }, "cuCtxPushCurrent")?;
        Ok(ContextGuard)
    }
}
impl Drop for ContextGuard {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: pops what `push` pushed.
        unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

/// The kernel in `ctx`, allowed at least `shared_bytes` of dynamic shared memory.
fn function(ctx: sys::CUcontext, module: &'static str, kernel: &str, shared_bytes: u32) -> Result<Function> {
    let mut guard = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    let cache = guard.get_or_insert_with(|| Cache { modules: HashMap::new(), functions: HashMap::new() });
    let key = (ctx as usize, kernel.to_string());
    if let Some(&f) = cache.functions.get(&key) {
        if shared_bytes <= f.shared_allowed.max(DEFAULT_DYNAMIC_SHARED) {
            return Ok(f);
        }
    }
    let module_handle = match cache.modules.get(&(ctx as usize, module)) {
        Some(&m) => m as sys::CUmodule,
        None => {
            let image = FATBINS
                .iter()
                .find(|(name, _)| *name == module)
                .ok_or_else(|| Error::Internal(format!("no embedded CUDA module named {module}")))?
                .1;
            let mut m: sys::CUmodule = std::ptr::null_mut();
            // SAFETY: a fatbin produced by nvcc at build time; the context is current.
            check(
                unsafe { sys::cuModuleLoadData(&mut m, image.as_ptr() as *const c_void) },
                &format!(
                    "loading CUDA module {module} (does the fatbin have code for this GPU? see XLA_SSM_CUDA_ARCHS)"
                ),
            )?;
            cache.modules.insert((ctx as usize, module), m as usize);
            m
        }
    };
    let name = CString::new(kernel).map_err(|_| Error::Internal("kernel name has a NUL".into()))?;
    let mut f: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: the module is loaded in this context.
    check(
        unsafe { sys::cuModuleGetFunction(&mut f, module_handle, name.as_ptr()) },
        &format!("looking up kernel {kernel}"),
    )?;
    if shared_bytes > DEFAULT_DYNAMIC_SHARED {
        // SAFETY: a live function of this context.
        check(
            unsafe {
                sys::cuFuncSetAttribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_bytes as i32,
                )
            },
            &format!("allowing {kernel} {shared_bytes} bytes of shared memory"),
        )?;
    }
    let mut ptx_arch = 0;
    // SAFETY: a live function of this context.
    check(
        unsafe { sys::cuFuncGetAttribute(&mut ptx_arch, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PTX_VERSION, f) },
        &format!("querying {kernel}'s PTX version"),
    )?;
    let function = Function { handle: f, shared_allowed: shared_bytes, pdl: ptx_arch >= 90 };
    cache.functions.insert(key, function);
    Ok(function)
}

/// An attribute of the current context's device.
fn device_attribute(which: sys::CUdevice_attribute) -> Result<i32> {
    let mut device: sys::CUdevice = 0;
    let mut value = 0;
    // SAFETY: plain queries in the current context.
    check(unsafe { sys::cuCtxGetDevice(&mut device) }, "cuCtxGetDevice")?;
    check(unsafe { sys::cuDeviceGetAttribute(&mut value, which, device) }, "cuDeviceGetAttribute")?;
    Ok(value)
}

/// Shared memory of one multiprocessor of the stream's device, and what the driver reserves of it
/// per resident block (bytes): what decides how many blocks of a kernel an SM holds.
pub fn sm_shared_memory(stream: *mut c_void) -> Result<(u32, u32)> {
    driver()?;
    let ctx = stream_context(stream as sys::CUstream)?;
    let _current = ContextGuard::push(ctx)?;
    let bytes = |which| device_attribute(which).map(|v| v.max(0) as u32);
    use sys::CUdevice_attribute::*;
    Ok((
        bytes(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?,
        bytes(CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)?,
    ))
}

/// The compute capability (major, minor) of the stream's device.
pub fn compute_capability(stream: *mut c_void) -> Result<(i32, i32)> {
    driver()?;
    let ctx = stream_context(stream as sys::CUstream)?;
    let _current = ContextGuard::push(ctx)?;
    use sys::CUdevice_attribute::*;
    Ok((
        device_attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        device_attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// How to launch a kernel: an (x, y, z) grid of 1-D blocks and their dynamic shared memory.
#[derive(Debug, Clone, Copy)]
pub struct LaunchConfig {
    pub grid: (u64, u64, u64),
    pub block: u32,
    pub shared_bytes: u32,
}

/// Launches `module`'s `kernel` on `stream` with one by-value parameter struct.
///
/// # Safety
/// `P` is the `#[repr(C)]` parameter struct the kernel reads by value, and every pointer in it
/// addresses device memory of the stream's context that is valid, for the kernel's reads and
/// writes, at the sizes the other fields describe, until the kernel has finished. The operations
/// ensure this by launching only with parameters built by their `validate` functions from buffers
/// whose shapes were checked (the host vouches for the buffers themselves).
pub unsafe fn launch<P>(
    stream: *mut c_void,
    module: &'static str,
    kernel: &str,
    config: LaunchConfig,
    params: &P,
) -> Result<()> {
    // SAFETY: the caller's promise, passed on.
    unsafe { launch_ex(stream, module, kernel, config, params, Start::AfterPrevious) }
}

/// Finds `module`'s `kernel` in the context of `stream` (loading the module there if it is not yet):
/// for tests, and for hosts that check a build against their GPU before a call needs it.
pub fn resolve(stream: *mut c_void, module: &'static str, kernel: &str) -> Result<()> {
    driver()?;
    let ctx = stream_context(stream as sys::CUstream)?;
    let _current = ContextGuard::push(ctx)?;
    function(ctx, module, kernel, 0).map(|_| ())
}

/// When a kernel may start, relative to the one ahead of it on the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Once that one has finished (stream order).
    AfterPrevious,
    /// When the kernel was compiled for sm_90 or newer, once every block of that one has run
    /// `pdl_launch_dependents` (kernels/common.cuh; programmatic dependent launch). The kernel must
    /// run `pdl_wait_prerequisite` before it reads anything that one writes, and before it finishes
    /// where later work does. Otherwise, as `AfterPrevious`.
    Overlapping,
}

/// [`launch`], with the kernel's [`Start`].
///
/// # Safety
/// As [`launch`].
pub unsafe fn launch_ex<P>(
    stream: *mut c_void,
    module: &'static str,
    kernel: &str,
    config: LaunchConfig,
    params: &P,
    start: Start,
) -> Result<()> {
    let LaunchConfig { grid, block, shared_bytes } = config;
    if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
        return Ok(());
    }
    driver()?;
    if grid.0 > i32::MAX as u64 || grid.1 > u16::MAX as u64 || grid.2 > u16::MAX as u64 {
        return Err(Error::invalid(format!("{kernel}: problem too large for one launch ({grid:?} blocks)")));
    }
    let stream = stream as sys::CUstream;
    let ctx = stream_context(stream)?;
    let _current = ContextGuard::push(ctx)?;
    let function = function(ctx, module, kernel, shared_bytes)?;
    let f = function.handle;
    let mut args = [params as *const P as *mut c_void];
    if start == Start::Overlapping && function.pdl {
        let mut attribute = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue { programmaticStreamSerializationAllowed: 1 },
        };
        let launch_config = sys::CUlaunchConfig {
            gridDimX: grid.0 as u32,
            gridDimY: grid.1 as u32,
            gridDimZ: grid.2 as u32,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared_bytes,
            hStream: stream,
            attrs: &mut attribute,
            numAttrs: 1,
        };
        // SAFETY: as below; the attribute outlives the call.
        return check(
            unsafe { sys::cuLaunchKernelEx(&launch_config, f, args.as_mut_ptr(), std::ptr::null_mut()) },
            &format!("launching {kernel}"),
        );
    }
    // SAFETY: `P` is the kernel's #[repr(C)] parameter struct, which the kernel reads by value.
    check(
        unsafe {
            sys::cuLaunchKernel(
                f,
                grid.0 as u32,
                grid.1 as u32,
                grid.2 as u32,
                block,
                1,
                1,
                shared_bytes,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        &format!("launching {kernel}"),
    )
}

/// Enqueues a device-to-device copy of `bytes` on `stream` (capturable in CUDA graphs): for in-place
/// operands that XLA did not alias to their results.
///
/// # Safety
/// `dst` and `src` address device buffers of at least `bytes` bytes in the stream's context that do
/// not overlap (or are the same buffer, which copies nothing).
pub unsafe fn copy_async(stream: *mut c_void, dst: *mut c_void, src: *const c_void, bytes: usize) -> Result<()> {
    if bytes == 0 || std::ptr::eq(dst, src) {
        return Ok(());
    }
    driver()?;
    let stream = stream as sys::CUstream;
    let ctx = stream_context(stream)?;
    let _current = ContextGuard::push(ctx)?;
    // SAFETY: device buffers of at least `bytes` bytes in this context, validated by the caller.
    check(
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst as sys::CUdeviceptr, src as sys::CUdeviceptr, bytes, stream) },
        "cuMemcpyDtoDAsync",
    )
}
