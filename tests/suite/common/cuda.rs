//! CUDA plumbing shared by the GPU tests (cudarc's thin `result` layer; every call checked).

use cudarc::driver::{result, sys};
use std::ffi::c_void;
use std::sync::Mutex;

/// Makes device 0's primary context current on this thread. The CUDA tests are `#[ignore]`d, so
/// this runs only when asked for (`--ignored`), where a missing device is a failure, not a skip.
pub fn gpu() {
    gpu_on(0);
}

/// Makes device `ordinal`'s primary context current on this thread (for tests that spread work over
/// devices); each device's context is retained once, for the life of the process.
pub fn gpu_on(ordinal: usize) {
    let count = device_count();
    assert!(count > 0, "no CUDA device: the CUDA tests need one");
    assert!(ordinal < count, "no CUDA device {ordinal}: the driver reports {count}");
    static CTXS: Mutex<Vec<Option<usize>>> = Mutex::new(Vec::new());
    let ctx = {
        let mut ctxs = CTXS.lock().unwrap_or_else(|p| p.into_inner());
        if ctxs.len() < count {
            ctxs.resize(count, None);
        }
        *ctxs[ordinal].get_or_insert_with(|| {
            result::init().expect("cuInit");
            let dev = result::device::get(ordinal as i32).expect("cuDeviceGet");
            // SAFETY: a device from cuDeviceGet; retained for the life of the process.
            unsafe { result::primary_ctx::retain(dev) }.expect("cuDevicePrimaryCtxRetain") as usize
        })
    };
    // SAFETY: a live (retained) context.
    unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.expect("cuCtxSetCurrent");
}

/// The CUDA devices the driver reports (0 without a driver).
pub fn device_count() -> usize {
    xla_ssm::cuda::device_count()
}

/// Device `ordinal` as "name (sm_XY, N SMs)": what the library's kernel choices depend on, so two
/// devices with the same description run the same kernels.
pub fn device_description(ordinal: usize) -> String {
    result::init().expect("cuInit");
    let dev = result::device::get(ordinal as i32).expect("cuDeviceGet");
    let name = result::device::get_name(dev).expect("cuDeviceGetName");
    use sys::CUdevice_attribute::*;
    // SAFETY: a device from cuDeviceGet.
    let attr = |which| unsafe { result::device::get_attribute(dev, which) }.expect("cuDeviceGetAttribute");
    let (major, minor) =
        (attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR));
    format!("{name} (sm_{major}{minor}, {} SMs)", attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))
}

/// A device allocation (at least one byte, so never null), freed on drop.
pub struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub len: usize,
}

impl DevBuf {
    pub fn upload(bytes: &[u8]) -> DevBuf {
        // SAFETY: plain allocation and a synchronous copy of `bytes` into it.
        unsafe {
            let ptr = result::malloc_sync(bytes.len().max(1)).expect("cuMemAlloc");
            if !bytes.is_empty() {
                result::memcpy_htod_sync(ptr, bytes).expect("cuMemcpyHtoD");
            }
            DevBuf { ptr, len: bytes.len() }
        }
    }

    pub fn overwrite(&self, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.len);
        if !bytes.is_empty() {
            // SAFETY: `len` bytes were allocated.
            unsafe { result::memcpy_htod_sync(self.ptr, bytes) }.expect("cuMemcpyHtoD");
        }
    }

    pub fn download(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        if self.len > 0 {
            // SAFETY: `len` bytes were allocated.
            unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr) }.expect("cuMemcpyDtoH");
        }
        out
    }

    pub fn data(&self) -> *mut c_void {
        self.ptr as *mut c_void
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `upload`, freed once.
        unsafe { result::free_sync(self.ptr) }.expect("cuMemFree");
    }
}

/// A non-blocking stream created by the test, destroyed on drop.
pub struct Stream(pub sys::CUstream);

impl Stream {
    pub fn new() -> Stream {
        Stream(result::stream::create(result::stream::StreamKind::NonBlocking).expect("cuStreamCreate"))
    }

    pub fn ptr(&self) -> *mut c_void {
        self.0 as *mut c_void
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by `new`.
        unsafe { result::stream::destroy(self.0) }.expect("cuStreamDestroy");
    }
}

pub fn synchronize(stream: *mut c_void) {
    // SAFETY: a live stream (or the legacy default stream, null).
    unsafe { result::stream::synchronize(stream as sys::CUstream) }.expect("cuStreamSynchronize");
}
