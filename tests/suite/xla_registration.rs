//! Registration without Python: the cdylib registers every target by itself when it is loaded into a
//! process whose XLA sits in an RTLD_LOCAL library (EXLA's case), does nothing in a process without
//! XLA, and `xla_ssm_register_xla_targets` registers on request and carries the host's errors. A C
//! host (tests/c/xla_registration_host.c) with a fake XLA (tests/c/fake_xla.c) does the loading.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::process::Command;
use xla_ssm::xla::register::TARGETS;

/// The cdylib next to (or one level above) the test executable, as cargo lays them out.
fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut candidates: Vec<PathBuf> = exe.ancestors().skip(1).take(2).map(|d| d.join("libxla_ssm.so")).collect();
    if let Some(lib) = std::env::var_os("XLA_SSM_LIBRARY") {
        candidates.push(PathBuf::from(lib));
    }
    candidates.into_iter().find(|p| p.exists()).expect("libxla_ssm.so not found next to the test executable")
}

fn work_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("xla_registration");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn compile(args: &[&str], what: &str) {
    let target = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let compiler = cc::Build::new()
        .opt_level(0)
        .debug(false)
        .target(&target)
        .host(&target)
        .cargo_metadata(false)
        .out_dir(work_dir())
        .get_compiler();
    let mut cmd = compiler.to_command();
    cmd.args(["-std=c99", "-Wall", "-Wextra", "-Werror"]).args(args);
    let out = cmd.output().unwrap_or_else(|e| panic!("could not run the C compiler {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "compiling {what} failed:\n{cmd:?}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Builds the fake XLA and the host once (the tests run in parallel); returns their paths.
fn build() -> (PathBuf, PathBuf) {
    static BUILT: std::sync::OnceLock<(PathBuf, PathBuf)> = std::sync::OnceLock::new();
    BUILT.get_or_init(build_uncached).clone()
}

fn build_uncached() -> (PathBuf, PathBuf) {
    let work = work_dir();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let fake = work.join("libfake_xla.so");
    let host = work.join("xla_registration_host");
    let s = |p: &Path| p.display().to_string();
    compile(&["-shared", "-fPIC", &s(&src.join("fake_xla.c")), "-o", &s(&fake)], "tests/c/fake_xla.c");
    compile(
        &["-I", &s(&include), "-I", &s(&src), &s(&src.join("xla_registration_host.c")), "-o", &s(&host), "-ldl"],
        "tests/c/xla_registration_host.c",
    );
    (fake, host)
}

fn run(host: &Path, fake: &str) -> (String, String) {
    let out = Command::new(host)
        .arg(fake)
        .arg(library())
        .env_remove("XLA_SSM_NO_AUTO_REGISTER")
        .output()
        .expect("running the host");
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "host exited with {}:\n{stdout}{stderr}", out.status);
    assert!(stdout.lines().any(|l| l == "done"), "{stdout}{stderr}");
    (stdout, stderr)
}

/// The `registered ...` lines expected for `platforms`, in the library's order.
fn expected(platforms: &[&str]) -> Vec<String> {
    platforms
        .iter()
        .flat_map(|platform| {
            let traits = u32::from(*platform == "CUDA");
            TARGETS.iter().map(move |t| {
                format!(
                    "registered {} {platform} exec=ok traits={traits} args_size=84 metadata=0.1 metadata_traits={traits}",
                    t.name
                )
            })
        })
        .collect()
}

fn registered(stdout: &str, from: &str, to: &str) -> Vec<String> {
    let lines: Vec<&str> = stdout.lines().collect();
    let start = lines.iter().position(|l| l.starts_with(from)).expect(from) + 1;
    let end = start + lines[start..].iter().position(|l| l.starts_with(to)).expect(to);
    lines[start..end].iter().map(|l| l.to_string()).collect()
}

#[test]
fn registers_itself_with_the_xla_of_the_process() {
    let (fake, host) = build();
    let (stdout, stderr) = run(&host, &fake.display().to_string());
    assert!(stdout.contains("XLA_FFI_GetApi in the global scope: no"), "{stdout}");
    let platforms: &[&str] = if cfg!(feature = "cuda") { &["Host", "CUDA"] } else { &["Host"] };
    assert_eq!(registered(&stdout, "loaded", "explicit cpu"), expected(platforms), "{stdout}{stderr}");
    assert!(stderr.is_empty(), "load-time registration printed: {stderr}");
}

#[test]
fn registers_on_request_and_reports_the_hosts_errors() {
    let (fake, host) = build();
    let (stdout, _) = run(&host, &fake.display().to_string());
    let line =
        |prefix: &str| stdout.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{prefix}: {stdout}"));
    assert_eq!(line("explicit cpu:"), format!("explicit cpu: status=0 registered={} error=\"\"", TARGETS.len()));
    let cpu: Vec<String> = expected(&["Host"]).iter().map(|l| l.replace(" Host ", " cpu ")).collect();
    assert_eq!(registered(&stdout, "explicit cpu:", "explicit refused:"), cpu);
    // The host refuses the third: the first two stay registered, the status says why.
    let refused = line("explicit refused:");
    assert!(refused.starts_with("explicit refused: status=4 registered=2 "), "{refused}");
    assert!(refused.contains(TARGETS[2].name) && refused.contains("fake XLA: refused"), "{refused}");
    let tpu = line("explicit tpu:");
    assert!(tpu.starts_with("explicit tpu: status=1 ") && tpu.contains("\"TPU\""), "{tpu}");
    assert!(line("explicit null api:").starts_with("explicit null api: status=1 "), "{stdout}");
    assert!(line("explicit null platform:").starts_with("explicit null platform: status=1 "), "{stdout}");
}

#[test]
fn a_process_without_xla_registers_nothing() {
    let (_, host) = build();
    let (stdout, stderr) = run(&host, "-");
    assert_eq!(stdout, "loaded\ndone\n");
    assert!(stderr.is_empty(), "{stderr}");
}
