//! The committed headers must be what cbindgen makes of the sources: include/xla_ssm.h (the C API in
//! src/capi/ and the exported XLA handlers) and kernels/params.h (the kernels' parameter structs,
//! defined once in src/ops/). `XLA_SSM_WRITE_HEADERS=1 cargo test --test suite headers` rewrites
//! them. Needs the source tree (it reads the sources when it runs).

use std::path::{Path, PathBuf};

/// What the C header is made of, in its order: the C API, then the exported XLA handlers.
const HEADER_SOURCES: [&str; 6] = [
    "src/capi/mod.rs",
    "src/capi/selective_scan.rs",
    "src/capi/ssd.rs",
    "src/capi/decode.rs",
    "src/xla/handlers.rs",
    "src/xla/register.rs",
];

/// Where the kernel parameter structs are defined.
const PARAMS_SOURCES: [&str; 7] = [
    "src/ops/selective_scan/mod.rs",
    "src/ops/selective_scan/carry.rs",
    "src/ops/state_update/mod.rs",
    "src/ops/conv1d/mod.rs",
    "src/ops/mamba_decode/mod.rs",
    "src/ops/ssd/mod.rs",
    "src/ops/ssd/plan.rs",
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// cbindgen's header of `sources` under `config`, as text.
fn cbindgen_header(config: &str, sources: &[&str]) -> String {
    let config = cbindgen::Config::from_file(root().join(config)).unwrap_or_else(|e| panic!("{config}: {e}"));
    let bindings = sources
        .iter()
        .fold(cbindgen::Builder::new().with_config(config), |b, src| b.with_src(root().join(src)))
        .generate()
        .expect("cbindgen failed");
    let mut text = Vec::new();
    bindings.write(&mut text);
    String::from_utf8(text).expect("UTF-8 header")
}

/// The C API header.
fn generated() -> String {
    cbindgen_header("cbindgen.toml", &HEADER_SOURCES)
}

/// The kernels' parameter header.
fn generated_params() -> String {
    cbindgen_header("kernels/params.cbindgen.toml", &PARAMS_SOURCES)
}

/// Compares `path` with `want`, or writes it when XLA_SSM_WRITE_HEADERS=1.
fn check_committed(path: PathBuf, want: &str) {
    if std::env::var_os("XLA_SSM_WRITE_HEADERS").is_some_and(|v| v == "1") {
        std::fs::write(&path, want).unwrap();
        return;
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != want {
        let first = have.lines().zip(want.lines()).position(|(a, b)| a != b).unwrap_or(have.lines().count());
        let line = |s: &str| s.lines().nth(first).unwrap_or("<end of file>").to_string();
        panic!(
            "{} is out of date with the sources (first difference at line {}:\n  committed: {}\n  generated: {}\n).\n\
             Regenerate it with `XLA_SSM_WRITE_HEADERS=1 cargo test --test suite headers` and commit it.",
            path.display(),
            first + 1,
            line(&have),
            line(want)
        );
    }
}

#[test]
fn committed_c_header_is_up_to_date() {
    check_committed(root().join("include/xla_ssm.h"), &generated());
}

#[test]
fn committed_kernel_params_header_is_up_to_date() {
    check_committed(root().join("kernels/params.h"), &generated_params());
}

#[test]
fn c_header_declares_the_exported_symbols() {
    let header = generated();
    for symbol in [
        "xla_ssm_selective_scan_fwd_host(",
        "xla_ssm_selective_scan_fwd_cuda_launch(",
        "xla_ssm_last_error(",
        "xla_ssm_version(",
        "xla_ssm_cuda_device_count(",
        "xla_ssm_selective_scan_fwd_cpu(",
        "xla_ssm_selective_scan_fwd_cuda(",
        "xla_ssm_register_xla_targets(",
        "typedef struct XlaSsmSelectiveScanFwdArgs",
    ] {
        assert!(header.contains(symbol), "the header lacks {symbol}");
    }
}
