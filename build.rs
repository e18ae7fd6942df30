//! Build script: (1) with the `cuda` feature, compile each `kernels/*.cu` into a fatbin (SASS for every
//! arch in XLA_SSM_CUDA_ARCHS, default 80,86,89,90 (90 as 90a), plus PTX for the newest) and generate the table
//! that embeds them; (2) generate the C header with cbindgen into OUT_DIR (and into include/ when
//! XLA_SSM_WRITE_HEADER=1; a test fails when the committed header drifts).
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_ARCHS: &str = "80,86,89,90";

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    for path in ["build.rs", "cbindgen.toml", "src/capi.rs", "src/xla/handlers.rs"] {
        println!("cargo:rerun-if-changed={path}");
    }
    println!("cargo:rerun-if-env-changed=XLA_SSM_WRITE_HEADER");
    header(&out);
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        kernels(&out);
    }
}

fn header(out: &Path) {
    let crate_dir = env::var("CARGO_MANIFEST_DIR").unwrap();
    let config = cbindgen::Config::from_file(Path::new(&crate_dir).join("cbindgen.toml")).expect("cbindgen.toml");
    // Only the C API and the exported handlers make the header, not the crate's internals.
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(Path::new(&crate_dir).join("src/capi.rs"))
        .with_src(Path::new(&crate_dir).join("src/xla/handlers.rs"))
        .generate()
        .expect("cbindgen failed");
    bindings.write_to_file(out.join("xla_ssm.h"));
    if env::var_os("XLA_SSM_WRITE_HEADER").is_some_and(|v| v == "1") {
        bindings.write_to_file(Path::new(&crate_dir).join("include/xla_ssm.h"));
    }
}

/// NVCC, then $CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc, then `nvcc` on PATH.
fn find_nvcc() -> PathBuf {
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if let Some(nvcc) = env::var_os("NVCC") {
        return PathBuf::from(nvcc);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(var) {
            let nvcc = Path::new(&home).join("bin/nvcc");
            if nvcc.exists() {
                return nvcc;
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        if let Some(nvcc) = env::split_paths(&path).map(|d| d.join("nvcc")).find(|p| p.exists()) {
            return nvcc;
        }
    }
    panic!(
        "\n\nxla-ssm: nvcc not found (looked at $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin and PATH).\n\
         Get it from PyPI without a CUDA toolkit:\n  \
         python3 -m venv .venv && .venv/bin/pip install nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
         nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85\n  \
         export NVCC=$PWD/.venv/lib/python3.11/site-packages/nvidia/cu13/bin/nvcc\n\
         (scripts/setup.sh does this), or build a CPU-only library with --no-default-features.\n"
    );
}

fn kernels(out: &Path) {
    let nvcc = find_nvcc();
    println!("cargo:rerun-if-env-changed=XLA_SSM_CUDA_ARCHS");
    println!("cargo:rerun-if-changed=kernels");
    let archs = env::var("XLA_SSM_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.into());
    let mut archs: Vec<u32> = archs
        .split(',')
        .map(|a| a.trim().parse().unwrap_or_else(|_| panic!("XLA_SSM_CUDA_ARCHS: bad arch {a:?} (want e.g. 80,90)")))
        .collect();
    archs.sort_unstable();
    let newest = *archs.last().expect("XLA_SSM_CUDA_ARCHS is empty");
    // sm_90 code is built as sm_90a: the same GPUs, plus wgmma (kernels/ssd_fwd_wgmma.cuh).
    let sass = |a: &u32| if *a == 90 { "90a".to_string() } else { a.to_string() };
    let mut gencode: Vec<String> =
        archs.iter().map(|a| format!("-gencode=arch=compute_{0},code=sm_{0}", sass(a))).collect();
    gencode.push(format!("-gencode=arch=compute_{newest},code=compute_{newest}"));

    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("kernels/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    // One nvcc per file, all at once; each also splits its archs over threads.
    let jobs: Vec<_> = sources
        .iter()
        .map(|src| {
            let stem = src.file_stem().unwrap().to_str().unwrap().to_string();
            let fatbin = out.join(format!("{stem}.fatbin"));
            let child = Command::new(&nvcc)
                .args(["-fatbin", "-O3", "-std=c++17", "--threads", "0", "-Xptxas=-warn-spills"])
                .args(&gencode)
                .arg("-o")
                .arg(&fatbin)
                .arg(src)
                .spawn()
                .unwrap_or_else(|e| panic!("could not run {}: {e}", nvcc.display()));
            (stem, fatbin, child)
        })
        .collect();
    let mut table =
        String::from("/// (module name, fatbin) for every kernels/*.cu.\npub static FATBINS: &[(&str, &[u8])] = &[\n");
    for (stem, fatbin, mut child) in jobs {
        let status = child.wait().unwrap();
        assert!(status.success(), "nvcc failed on kernels/{stem}.cu");
        table += &format!("    ({stem:?}, include_bytes!({:?})),\n", fatbin.display().to_string());
    }
    table += "];\n";
    std::fs::write(out.join("fatbins.rs"), table).unwrap();
}
