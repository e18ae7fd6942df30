//! The C API: a C program (tests/c/selective_scan_host.c) compiled with the system C compiler against
//! include/xla_ssm.h and linked to the cdylib, run and checked; plus the host entry point called from
//! Rust for the dtypes the C program does not cover.
#![cfg(target_os = "linux")]

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use xla_ssm::capi::*;

/// The directory holding libxla_ssm.so. In a cargo build the test executable lives in
/// `<target>/<profile>/deps/` and the cdylib in `<target>/<profile>/` (this follows CARGO_TARGET_DIR
/// and the profile); a bundle of test executables (scripts/gpu-bundle.sh) keeps it one level up or
/// names it in XLA_SSM_LIBRARY.
fn library_dir() -> PathBuf {
    let lib = "libxla_ssm.so";
    let exe = std::env::current_exe().expect("current_exe");
    let mut candidates: Vec<PathBuf> = exe.ancestors().skip(1).take(2).map(Path::to_path_buf).collect();
    if let Some(dir) = std::env::var_os("XLA_SSM_LIBRARY").and_then(|p| Some(PathBuf::from(p).parent()?.to_path_buf()))
    {
        candidates.push(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    candidates.push(target.join(if cfg!(debug_assertions) { "debug" } else { "release" }));
    candidates
        .iter()
        .find(|d| d.join(lib).exists())
        .unwrap_or_else(|| panic!("{lib} not found in any of {candidates:?}"))
        .clone()
}

/// The header and the C source, as of this test's build (so the test needs no source tree to run).
const HEADER: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/include/xla_ssm.h"));
const C_SOURCE: &str = include_str!("../c/selective_scan_host.c");

#[test]
fn c_program_against_the_header_and_the_cdylib() {
    let mut work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c_api");
    if std::fs::create_dir_all(&work).is_err() {
        work = std::env::temp_dir().join(format!("xla_ssm_c_api_{}", std::process::id()));
        std::fs::create_dir_all(&work).unwrap();
    }
    std::fs::create_dir_all(work.join("include")).unwrap();
    std::fs::write(work.join("include/xla_ssm.h"), HEADER).unwrap();
    let source = work.join("selective_scan_host.c");
    std::fs::write(&source, C_SOURCE).unwrap();
    let lib_dir = library_dir();
    let target = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let compiler = cc::Build::new()
        .opt_level(0)
        .debug(false)
        .target(&target)
        .host(&target)
        .cargo_metadata(false)
        .out_dir(&work)
        .get_compiler();
    let exe = work.join("selective_scan_host");
    let mut cmd = compiler.to_command();
    cmd.args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg("-I")
        .arg(work.join("include"))
        .arg(&source)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib_dir.display()))
        .arg("-lxla_ssm")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-lm");
    let built = cmd.output().unwrap_or_else(|e| panic!("could not run the C compiler {cmd:?}: {e}"));
    assert!(
        built.status.success(),
        "compiling tests/c/selective_scan_host.c failed:\n{cmd:?}\n{}{}",
        String::from_utf8_lossy(&built.stdout),
        String::from_utf8_lossy(&built.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    print!("{stdout}");
    assert!(run.status.success(), "{} exited with {}:\n{stdout}{stderr}", exe.display(), run.status);
    assert!(stdout.lines().any(|l| l == "c api ok"), "no \"c api ok\" in:\n{stdout}{stderr}");
    assert!(stdout.contains(&format!("xla_ssm {}", env!("CARGO_PKG_VERSION"))), "{stdout}");
}

pub fn last_error() -> String {
    // SAFETY: a NUL-terminated string owned by the library, valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(xla_ssm_last_error()) }.to_string_lossy().into_owned()
}

/// The host entry point with bf16/f16 data and both layouts, against the reference.
#[test]
fn host_entry_point_all_dtypes() {
    for (dtype, bc_dtype, layout, groups) in [
        (Dt::BF16, Dt::BF16, Layout::Bld, 2),
        (Dt::BF16, Dt::F32, Layout::Bdl, 0),
        (Dt::F16, Dt::F16, Layout::Bdl, 1),
        (Dt::F16, Dt::F32, Layout::Bld, 4),
        (Dt::F32, Dt::F32, Layout::Bld, 0),
    ] {
        let case = Case { dtype, bc_dtype, layout, groups, ..Case::new(2, 8, 37, 16).all_optional() };
        let p = Problem::random(&case);
        let r = p.reference();
        let mut call = HostCall::new(&p);
        let ptr = |call: &mut HostCall, name: &str| {
            call.args.iter_mut().find(|(o, _)| o.name == name).map_or(std::ptr::null_mut(), |(_, h)| h.ptr())
        };
        let (out, final_state) = (call.rets[0].1.ptr(), call.rets[1].1.ptr() as *mut f32);
        let args = case.fwd_capi_args(|name| ptr(&mut call, name), out, final_state);
        // SAFETY: host buffers of the described sizes.
        let status = unsafe { xla_ssm_selective_scan_fwd_host(&args) };
        assert_eq!(status, XLA_SSM_OK, "{}", last_error());
        assert_eq!(last_error(), "");
        let (out, state) = call.outputs(&case);
        check_outputs(&p, &r, &out, &state);

        // A bad call names what is wrong, and leaves the results alone.
        let mut bad = args;
        bad.bc_dtype = if dtype == Dt::BF16 { Dt::F16.capi() } else { Dt::BF16.capi() };
        let before = call.rets[0].1.bytes().to_vec();
        // SAFETY: as above.
        assert_eq!(unsafe { xla_ssm_selective_scan_fwd_host(&bad) }, XLA_SSM_INVALID_ARGUMENT);
        assert!(last_error().contains("`B`"), "{}", last_error());
        assert_eq!(call.rets[0].1.bytes(), &before[..]);
    }
}

/// Without CUDA the device entry point refuses cleanly (a CUDA error or, without the `cuda`
/// feature, UNIMPLEMENTED), after validating.
#[test]
fn cuda_launch_without_cuda() {
    if xla_ssm_cuda_device_count() > 0 {
        println!("skipped: a CUDA device is present (tests/suite/ffi_cuda.rs covers it)");
        return;
    }
    let case = Case::new(1, 2, 3, 4);
    let p = Problem::random(&case);
    let mut call = HostCall::new(&p);
    let mut args = XlaSsmSelectiveScanFwdArgs {
        cu_seqlens: std::ptr::null(),
        num_seqs: 0,
        batch: 1,
        dim: 2,
        seqlen: 3,
        dstate: 4,
        groups: 1,
        dtype: XLA_SSM_F32,
        bc_dtype: XLA_SSM_F32,
        layout: XLA_SSM_LAYOUT_BDL,
        delta_softplus: true,
        u: call.args[0].1.ptr(),
        delta: call.args[1].1.ptr(),
        a: call.args[2].1.ptr() as *const f32,
        b: call.args[3].1.ptr(),
        c: call.args[4].1.ptr(),
        d: std::ptr::null(),
        z: std::ptr::null(),
        delta_bias: std::ptr::null(),
        initial_state: std::ptr::null(),
        out: call.rets[0].1.ptr(),
        workspace: std::ptr::null_mut(),
        workspace_bytes: 0,
        checkpoint_len: 0,
        checkpoints: std::ptr::null_mut(),
        final_state: call.rets[1].1.ptr() as *mut f32,
    };
    // SAFETY: never dereferenced without a device (the call fails first).
    let status = unsafe { xla_ssm_selective_scan_fwd_cuda_launch(&args, std::ptr::null_mut()) };
    let want = if cfg!(feature = "cuda") { XLA_SSM_CUDA_ERROR } else { XLA_SSM_UNIMPLEMENTED };
    assert_eq!(status, want, "{}", last_error());
    assert!(!last_error().is_empty());
    args.layout = 5;
    // SAFETY: as above.
    let status = unsafe { xla_ssm_selective_scan_fwd_cuda_launch(&args, std::ptr::null_mut()) };
    assert_eq!(status, XLA_SSM_INVALID_ARGUMENT);
    assert!(last_error().contains("layout"), "{}", last_error());
}

/// The host forward with checkpoints, then the host backward, against the f64 reference; a bad
/// gradient pointer set is refused naming it.
#[test]
fn host_backward_round_trip() {
    for (dtype, bc_dtype, layout, groups) in
        [(Dt::F32, Dt::F32, Layout::Bdl, 1), (Dt::BF16, Dt::F32, Layout::Bld, 0), (Dt::F16, Dt::F16, Layout::Bdl, 2)]
    {
        let case = Case { dtype, bc_dtype, layout, groups, ..Case::new(2, 8, 70, 16).all_optional() };
        let bp = BwdProblem::random(&case, 32, true);
        let mut args: Vec<(Operand, HostBuf)> =
            bp.p.operands()
                .into_iter()
                .map(|o| {
                    let h = HostBuf::from_bytes(&o.bytes);
                    (o, h)
                })
                .collect();
        let mut fwd_rets: Vec<(Operand, HostBuf)> = bp
            .poisoned_fwd_results()
            .into_iter()
            .map(|o| {
                let h = HostBuf::from_bytes(&o.bytes);
                (o, h)
            })
            .collect();
        let ptr = |list: &mut Vec<(Operand, HostBuf)>, name: &str| {
            list.iter_mut().find(|(o, _)| o.name == name).map_or(std::ptr::null_mut(), |(_, h)| h.ptr())
        };
        let (out, final_state) = (ptr(&mut fwd_rets, "out"), ptr(&mut fwd_rets, "final_state") as *mut f32);
        let fwd = XlaSsmSelectiveScanFwdArgs {
            checkpoint_len: 32,
            checkpoints: ptr(&mut fwd_rets, "checkpoints") as *mut f32,
            ..case.fwd_capi_args(|name| ptr(&mut args, name), out, final_state)
        };
        // SAFETY: host buffers of the described sizes.
        assert_eq!(unsafe { xla_ssm_selective_scan_fwd_host(&fwd) }, XLA_SSM_OK, "{}", last_error());
        let checkpoints = Dt::F32.decode(fwd_rets[2].1.bytes());
        assert_close("checkpoints", &case, &checkpoints, &bp.reference_checkpoints(), Tol::F32);

        let mut bwd_args: Vec<(Operand, HostBuf)> = bp
            .bwd_operands(&checkpoints)
            .into_iter()
            .map(|o| {
                let h = HostBuf::from_bytes(&o.bytes);
                (o, h)
            })
            .collect();
        let mut grads: Vec<(Operand, HostBuf)> = bp
            .poisoned_grads()
            .into_iter()
            .map(|o| {
                let h = HostBuf::from_bytes(&o.bytes);
                (o, h)
            })
            .collect();
        let args = XlaSsmSelectiveScanBwdArgs {
            cu_seqlens: std::ptr::null(),
            num_seqs: 0,
            batch: fwd.batch,
            dim: fwd.dim,
            seqlen: fwd.seqlen,
            dstate: fwd.dstate,
            groups: fwd.groups,
            dtype: fwd.dtype,
            bc_dtype: fwd.bc_dtype,
            layout: fwd.layout,
            delta_softplus: fwd.delta_softplus,
            u: fwd.u,
            delta: fwd.delta,
            a: fwd.a,
            b: fwd.b,
            c: fwd.c,
            d: fwd.d,
            z: fwd.z,
            delta_bias: fwd.delta_bias,
            initial_state: fwd.initial_state,
            checkpoint_len: 32,
            checkpoints: ptr(&mut bwd_args, "checkpoints") as *const f32,
            dout: ptr(&mut bwd_args, "dout"),
            dfinal_state: ptr(&mut bwd_args, "dfinal_state") as *const f32,
            du: ptr(&mut grads, "du"),
            ddelta: ptr(&mut grads, "ddelta"),
            da: ptr(&mut grads, "dA") as *mut f32,
            db: ptr(&mut grads, "dB"),
            dc: ptr(&mut grads, "dC"),
            dd: ptr(&mut grads, "dD") as *mut f32,
            dz: ptr(&mut grads, "dz"),
            ddelta_bias: ptr(&mut grads, "ddelta_bias") as *mut f32,
            dinitial_state: ptr(&mut grads, "dinitial_state") as *mut f32,
            workspace: std::ptr::null_mut(),
            workspace_bytes: 0,
        };
        // SAFETY: host buffers of the described sizes.
        assert_eq!(unsafe { xla_ssm_selective_scan_bwd_host(&args) }, XLA_SSM_OK, "{}", last_error());
        let rets: Vec<(&str, i32, &[u8])> = grads.iter().map(|(o, h)| (o.name, o.dtype, h.bytes())).collect();
        check_grads(&bp, &bp.reference(), &bp.decode_grads(&rets));

        // dz is required when z is given.
        let bad = XlaSsmSelectiveScanBwdArgs { dz: std::ptr::null_mut(), ..args };
        // SAFETY: as above.
        assert_eq!(unsafe { xla_ssm_selective_scan_bwd_host(&bad) }, XLA_SSM_INVALID_ARGUMENT);
        assert!(last_error().contains("`dz`") && last_error().contains("selective_scan_bwd"), "{}", last_error());
    }
}

/// The forward's workspace size: per chunk after the first, per row, a record of the tiled kernel's
/// states (8 per thread, 2 to 32 threads per channel) and the chunk's sum of dt.
#[test]
fn fwd_workspace_bytes() {
    // 1 x 128 channels = 2 tiles of 64: 16 chunks of 64 steps (split_plan, at every dstate).
    let bytes = |dstate| xla_ssm_selective_scan_fwd_workspace_bytes(1, 128, 1024, dstate);
    let records =
        [(1, 17), (16, 17), (17, 33), (32, 33), (33, 65), (64, 65), (65, 129), (128, 129), (129, 257), (256, 257)];
    for (dstate, record) in records {
        assert_eq!(bytes(dstate), 15 * 128 * record * 4, "dstate {dstate}");
    }
    assert_eq!(bytes(257), -1, "past the largest dstate: refused");
    assert!(last_error().contains("dstate must be at most 256"), "{}", last_error());
    assert_eq!(xla_ssm_selective_scan_fwd_workspace_bytes(64, 4096, 1024, 16), 0, "enough tiles: no split");
}

/// The backward's workspace size: the layout of the CUDA backward (BwdLayout in
/// src/ops/selective_scan/mod.rs).
#[test]
fn bwd_workspace_bytes() {
    // groups 0, 2 blocks: the sequence splits into 2 parts (one 32-step checkpoint chunk each), so
    // per part and row: n floats each of dB, dC, dA and one each of dD, ddelta_bias; and a record of
    // n + 1 floats per row for the second part.
    let (parts, rows, n) = (2, 16, 4);
    assert_eq!(
        xla_ssm_selective_scan_bwd_workspace_bytes(2, 8, 40, 4, 0),
        4 * (2 * parts * rows * n + parts * (rows * n + 2 * rows) + (parts - 1) * rows * (n + 1))
    );
    // groups 2 of 100 channels: 2 tiles of 64 channels each; 10 steps: one checkpoint chunk, no split.
    assert_eq!(
        xla_ssm_selective_scan_bwd_workspace_bytes(1, 200, 10, 16, 2),
        4 * (2 * 2 * 2 * 16 * 10 + 200 * 16 + 400)
    );
    assert_eq!(xla_ssm_selective_scan_bwd_workspace_bytes(0, 8, 40, 4, 1), 0);
}

/// Sizes a call would refuse give -1 and say why; none of them can crash the process (these used to
/// divide by zero or overflow).
#[test]
fn workspace_sizers_refuse_bad_sizes() {
    let huge = i64::MAX / 2;
    let cases: [(&str, &dyn Fn() -> i64, &str); 8] = [
        (
            "bwd dstate 1025",
            &|| xla_ssm_selective_scan_bwd_workspace_bytes(1, 64, 64, 1025, 0),
            "dstate must be at most 256",
        ),
        ("bwd negative", &|| xla_ssm_selective_scan_bwd_workspace_bytes(1, -64, 64, 16, 0), "non-negative"),
        ("bwd groups", &|| xla_ssm_selective_scan_bwd_workspace_bytes(1, 64, 64, 16, 3), "divide dim"),
        ("bwd overflow", &|| xla_ssm_selective_scan_bwd_workspace_bytes(huge, huge, huge, 16, 0), "2^48"),
        ("fwd overflow", &|| xla_ssm_selective_scan_fwd_workspace_bytes(1, huge, 3, 16), "2^48"),
        ("ssd overflow", &|| xla_ssm_ssd_bwd_workspace_bytes(huge, huge, 64, 64, 128, 1, 256, XLA_SSM_BF16), "2^48"),
        ("ssd chunk", &|| xla_ssm_ssd_fwd_workspace_bytes(1, 64, 4, 64, 64, 1, 100, XLA_SSM_BF16), "chunk_size"),
        ("ssd dtype", &|| xla_ssm_ssd_fwd_workspace_bytes(1, 64, 4, 64, 64, 1, 64, 9), "unknown dtype code 9"),
    ];
    for (what, sizer, reason) in cases {
        assert_eq!(sizer(), -1, "{what}");
        assert!(last_error().contains(reason), "{what}: {}", last_error());
    }
    // A valid call clears the last error.
    assert!(xla_ssm_ssd_fwd_workspace_bytes(1, 64, 4, 64, 64, 1, 64, XLA_SSM_BF16) >= 0);
    assert_eq!(last_error(), "");
}
