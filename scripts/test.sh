#!/usr/bin/env bash
# Every check CI runs: formatting, clippy, cargo tests, and the JAX tests against the release library.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

section() { printf '\n==== %s [%s]\n' "$*" "$(date +%T)"; }

section "setup"
bash scripts/setup.sh
# shellcheck source=scripts/env.sh
. scripts/env.sh
# Without a GPU (CI) the kernels are only checked, not built to run: nvcc's front end compiles each
# to sm_80 PTX, unoptimized (-Xcicc -O0), and no ptxas runs. That takes 52 s of a 2-core machine
# against ~4 min optimized and ~6 min with sm_80 SASS; the parsing and template checks are the same,
# and the optimized SASS (the default build's) is what scripts/gpu-bundle.sh compiles for the GPU
# tests. With a GPU here, the default archs, as a user builds them.
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
  export XLA_SSM_CUDA_ARCHS="${XLA_SSM_CUDA_ARCHS:-compute_80}"
  export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-Xcicc -O0"
fi

section "cargo fmt --check"
cargo fmt --check

section "cargo clippy --release --all-targets -- -D warnings"
cargo clippy --release --all-targets -- -D warnings

section "cargo clippy --no-default-features (the CPU-only library)"
cargo clippy --release --all-targets --no-default-features -- -D warnings

# The unit tests (the library's internals) build in the dev profile: ~1 min, with overflow checks.
# In release they would compile the whole crate a second time (~15 min of CPU).
section "cargo test --lib (unit tests, dev profile)"
cargo test --lib

section "cargo test --release --test suite (the integration tests; the CUDA ones are ignored without a GPU)"
suite_log="$(mktemp)"
cargo test --release --test suite 2>&1 | tee "$suite_log"
ignored="$(sed -n 's/^test result: .* \([0-9][0-9]*\) ignored.*/\1/p' "$suite_log" | tail -n 1)"
rm -f "$suite_log"
echo "NOTE: ${ignored:-0} CUDA tests were ignored, not run: there is no GPU here (scripts/gpu-run.sh runs them)."

section "cargo test --release --doc"
cargo test --release --doc

section "Elixir binding: the parts that run without Hex (bindings/elixir/test/run_pure.sh; installs Debian's elixir if missing)"
bash bindings/elixir/test/run_pure.sh

section "cargo build --release (the library pytest loads)"
cargo build --release

export XLA_SSM_LIBRARY="$PWD/target/release/libxla_ssm.so"
export PYTHONPATH="$PWD/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
# Beside pytest (each mostly keeps one core busy): the compatibility check, then the quick CPU
# benchmarks and the pip install; their log follows pytest's. (A subshell: its EXIT trap is its own.)
beside() (
  set -e
  bash scripts/compat.sh
  section "bench (CPU, quick): our CPU target against jax.lax.scan, outputs checked" &&
  python bench/bench_selective_scan.py --device cpu --quick --no-baselines --out "${TMPDIR:-/tmp}/xla_ssm_bench"

  section "bench (CPU, quick): decode step (bench/bench_decode.py), outputs checked" &&
  python bench/bench_decode.py --device cpu --out "${TMPDIR:-/tmp}/xla_ssm_bench"

  section "bench (CPU, quick): SSD (bench/bench_ssd.py), outputs and gradients checked" &&
  python bench/bench_ssd.py --device cpu --quick --out "${TMPDIR:-/tmp}/xla_ssm_bench"

  section "pip install ./bindings/python into a throwaway venv; import it from elsewhere (the shipped library loads)"
  # NVCC (scripts/env.sh) and XLA_SSM_CUDA_ARCHS are those of the build above, so cargo has nothing to
  # redo; pip's cache serves the pinned nvcc and jax.
  pip_tmp="$(mktemp -d)"
  trap 'rm -rf "$pip_tmp"' EXIT
  python -m venv "$pip_tmp/venv"
  "$pip_tmp/venv/bin/python" -m pip install --disable-pip-version-check --quiet ./bindings/python
  (cd "$pip_tmp" && env -u XLA_SSM_LIBRARY -u PYTHONPATH "$pip_tmp/venv/bin/python" - <<'PY'
import sys, numpy as np, xla_ssm
lib = xla_ssm.library_path()
assert str(lib).startswith(sys.prefix), f"loaded {lib}, not the one in the venv"
rng = np.random.default_rng(0)
u, delta = rng.standard_normal((2, 2, 8, 33), np.float32)
A = -rng.uniform(0.5, 2, (8, 4)).astype(np.float32)
B, C = rng.standard_normal((2, 2, 1, 4, 33), np.float32)
out, h = xla_ssm.selective_scan(u, delta, A, B, C, delta_softplus=True, return_final_state=True)
ref, ref_h = xla_ssm.selective_scan_ref(u, delta, A, B, C, delta_softplus=True)
np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
np.testing.assert_allclose(h, ref_h, rtol=1e-4, atol=1e-4)
print(f"pip-installed xla_ssm OK: {lib}, targets on {xla_ssm.registered_platforms()}")
PY
  )
)
beside_log="$(mktemp)"
beside >"$beside_log" 2>&1 &
beside_pid=$!

section "pytest tests/python"
# Two processes: the checks beside keep one core busy for the first minutes only (alone on 2 cores:
# 250 s against 406 s in one process).
python -m pytest tests/python -q -ra -n 2

section "beside pytest: JAX compatibility, the smoke subset under jax 0.5.0 (the first jax.ffi), 0.9.0 (EXLA's XLA) and the newest (scripts/compat.sh); the quick CPU benchmarks; pip install"
beside_status=0
wait "$beside_pid" || beside_status=$?
cat "$beside_log"
rm -f "$beside_log"
if [ "$beside_status" -ne 0 ]; then
  echo "a check beside pytest failed (exit $beside_status)" >&2
  exit "$beside_status"
fi

section "C++ host through PJRT: XLA's CPU plugin (PyPI lammps-jax-pjrt-cpu, PJRT 0.115) runs both targets (tests/cpp)"
pjrt_dir="$PWD/.compat/pjrt-cpu-0.11.2"
if [ ! -f "$pjrt_dir/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so" ]; then
  python -m pip install --disable-pip-version-check --quiet --no-deps --target "$pjrt_dir" lammps-jax-pjrt-cpu==0.11.2
fi
XLA_SSM_PJRT_PLUGIN="$pjrt_dir/lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so" bash tests/cpp/run.sh "$XLA_SSM_LIBRARY"

section "all tests passed"
