//! Every kernel name the launchers can ask for (xla_ssm::cuda::kernels::all) resolves in its module
//! on the GPU: the instantiation lists of kernels/*.cu and the launchers agree. (Without a GPU, the
//! library's unit test finds each name in the embedded fatbins instead.)
#![cfg(feature = "cuda")]

use crate::common::cuda::{gpu, Stream};

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_kernel_name_resolves_on_the_gpu() {
    gpu();
    let stream = Stream::new();
    let names = xla_ssm::cuda::kernels::all();
    let failed: Vec<String> = names
        .iter()
        .filter_map(|(module, kernel)| {
            xla_ssm::cuda::resolve(stream.ptr(), module, kernel).err().map(|e| format!("{module}: {kernel}: {e}"))
        })
        .collect();
    assert!(failed.is_empty(), "{} of {} kernels did not resolve:\n{}", failed.len(), names.len(), failed.join("\n"));
}
