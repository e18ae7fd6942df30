//! The committed C header must be what build.rs generates from the sources (cbindgen, into OUT_DIR).
//! Both are read at compile time, so this test also holds when its executable runs elsewhere.

const COMMITTED: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/include/xla_ssm.h"));
const GENERATED: &str = include_str!(concat!(env!("OUT_DIR"), "/xla_ssm.h"));

#[test]
fn committed_header_is_up_to_date() {
    if COMMITTED != GENERATED {
        let first = COMMITTED
            .lines()
            .zip(GENERATED.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| COMMITTED.lines().count().min(GENERATED.lines().count()));
        let line = |s: &str| s.lines().nth(first).unwrap_or("<end of file>").to_string();
        panic!(
            "include/xla_ssm.h is out of date with the sources (first difference at line {}:\n  committed: {}\n  generated: {}\n).\n\
             Regenerate it with `XLA_SSM_WRITE_HEADER=1 cargo build` and commit include/xla_ssm.h.",
            first + 1,
            line(COMMITTED),
            line(GENERATED)
        );
    }
}

#[test]
fn header_declares_the_exported_symbols() {
    for symbol in [
        "xla_ssm_selective_scan_fwd_host(",
        "xla_ssm_selective_scan_fwd_cuda_launch(",
        "xla_ssm_last_error(",
        "xla_ssm_version(",
        "xla_ssm_cuda_device_count(",
        "xla_ssm_selective_scan_fwd_cpu(",
        "xla_ssm_selective_scan_fwd_cuda(",
        "typedef struct XlaSsmSelectiveScanFwdArgs",
    ] {
        assert!(COMMITTED.contains(symbol), "include/xla_ssm.h lacks {symbol}");
    }
}
