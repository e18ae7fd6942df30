//! Build script: (1) with the `cuda` feature, compile each `kernels/*.cu` into a fatbin (SASS for every
//! arch in XLA_SSM_CUDA_ARCHS, default 80,86,89,90 (90 as 90a), plus PTX for the newest) and generate the
//! table that embeds them; nvcc runs only for kernels whose inputs changed (`FatbinCache`); (2) generate
//! the C header with cbindgen into OUT_DIR (and into include/ when XLA_SSM_WRITE_HEADER=1; a test fails
//! when the committed header drifts).
use std::collections::hash_map::DefaultHasher;
use std::env;
use std::hash::{Hash, Hasher};
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

    let flags: Vec<String> = ["-fatbin", "-O3", "-std=c++17", "--threads", "0", "-Xptxas=-warn-spills"]
        .iter()
        .map(|f| f.to_string())
        .chain(gencode)
        .collect();

    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("kernels/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu" || x == "cuh"))
        .collect();
    sources.sort();
    // What every fatbin depends on besides its own .cu: nvcc, the flags, and the shared headers (any
    // .cu may include any of them).
    let mut common = DefaultHasher::new();
    let nvcc_meta = std::fs::metadata(&nvcc).ok();
    (nvcc.display().to_string(), nvcc_meta.as_ref().map(|m| m.len()), nvcc_meta.and_then(|m| m.modified().ok()))
        .hash(&mut common);
    for var in ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"] {
        println!("cargo:rerun-if-env-changed={var}");
        env::var(var).ok().hash(&mut common);
    }
    flags.hash(&mut common);
    for header in sources.iter().filter(|p| p.extension().is_some_and(|x| x == "cuh")) {
        (header.file_name(), std::fs::read(header).expect("kernels/*.cuh")).hash(&mut common);
    }
    let cache = FatbinCache::new(out);

    // One nvcc per file not in the cache, all at once; each also splits its archs over threads.
    let jobs: Vec<_> = sources
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .map(|src| {
            let stem = src.file_stem().unwrap().to_str().unwrap().to_string();
            let fatbin = out.join(format!("{stem}.fatbin"));
            let mut key = common.clone();
            std::fs::read(src).expect("kernels/*.cu").hash(&mut key);
            let cached = cache.entry(&stem, key.finish());
            let child = if cached.is_file() {
                std::fs::copy(&cached, &fatbin).expect("copying a cached fatbin");
                None
            } else {
                let child = Command::new(&nvcc)
                    .args(&flags)
                    .arg("-o")
                    .arg(&fatbin)
                    .arg(src)
                    .spawn()
                    .unwrap_or_else(|e| panic!("could not run {}: {e}", nvcc.display()));
                Some(child)
            };
            (stem, fatbin, cached, child)
        })
        .collect();
    let mut table =
        String::from("/// (module name, fatbin) for every kernels/*.cu.\npub static FATBINS: &[(&str, &[u8])] = &[\n");
    for (stem, fatbin, cached, child) in jobs {
        if let Some(mut child) = child {
            let status = child.wait().unwrap();
            assert!(status.success(), "nvcc failed on kernels/{stem}.cu");
            cache.store(&stem, &fatbin, &cached);
        }
        table += &format!("    ({stem:?}, include_bytes!({:?})),\n", fatbin.display().to_string());
    }
    table += "];\n";
    std::fs::write(out.join("fatbins.rs"), table).unwrap();
}

/// Compiled fatbins kept between runs of this script, by a hash of everything nvcc reads. `cargo
/// clippy` and `cargo build` / `cargo test` each run the script in an OUT_DIR of their own (clippy's
/// wrapper changes its fingerprint); without the cache each ran nvcc over every kernel again (~12 min
/// of CI's 2 cores). It lives in <target>/, shared by every profile, so `cargo clean` empties it.
struct FatbinCache {
    dir: PathBuf,
}

impl FatbinCache {
    /// Entries kept per kernel file (older ones are removed when a new one is stored).
    const KEEP: usize = 4;

    fn new(out: &Path) -> Self {
        // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out. One cache for every profile: the
        // fatbins depend on the key's inputs only, so a debug build reuses the release build's.
        let dir = out.ancestors().nth(4).expect("OUT_DIR has the layout cargo gives it").join("xla-ssm-fatbins");
        std::fs::create_dir_all(&dir).expect("creating the fatbin cache");
        FatbinCache { dir }
    }

    fn entry(&self, stem: &str, key: u64) -> PathBuf {
        self.dir.join(format!("{stem}-{key:016x}.fatbin"))
    }

    /// Copies a new fatbin in (through a temporary name: a concurrent build never sees half a file),
    /// then drops all but the newest KEEP entries of that kernel.
    fn store(&self, stem: &str, fatbin: &Path, entry: &Path) {
        let tmp = entry.with_extension(format!("tmp{}", std::process::id()));
        std::fs::copy(fatbin, &tmp).expect("writing the fatbin cache");
        std::fs::rename(&tmp, entry).expect("writing the fatbin cache");
        let prefix = format!("{stem}-");
        let mut entries: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_prefix(&prefix)
                    .is_some_and(|rest| rest.len() == 16 + ".fatbin".len() && rest.ends_with(".fatbin"))
            })
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        entries.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        for (_, old) in entries.into_iter().skip(Self::KEEP) {
            let _ = std::fs::remove_file(old);
        }
    }
}
