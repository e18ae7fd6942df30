//! The integration tests, as one binary: the crate is linked once, not once per file.
//!
//! The CUDA tests are `#[ignore]`d so that a machine without a GPU reports them as ignored, not as
//! passed; `scripts/gpu-run.sh` runs them with `--ignored` on a GPU machine, where a missing device
//! fails them.

mod common;
mod decode_common;
mod ssd_common;

mod bad_inputs;
mod c_api;
mod conv1d_packed;
mod cuda_big;
mod determinism;
mod exla_frames;
mod ffi_cpu;
mod ffi_cpu_bwd;
mod ffi_cpu_decode;
mod ffi_cpu_ssd;
mod ffi_cuda;
mod ffi_cuda_bwd;
mod ffi_cuda_decode;
mod ffi_cuda_ssd;
mod headers;
mod kernel_names;
mod packed;
mod params;
mod reference;
mod ssd_packed;
mod ssd_reference;
mod xla_registration;
