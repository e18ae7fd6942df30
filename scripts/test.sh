#!/usr/bin/env bash
# Every check CI runs: formatting, clippy, cargo tests, and the JAX tests against the release library.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

section() { printf '\n==== %s\n' "$*"; }

section "setup"
bash scripts/setup.sh
# shellcheck source=scripts/env.sh
. scripts/env.sh

section "cargo fmt --check"
cargo fmt --check

section "cargo clippy --release --all-targets -- -D warnings"
cargo clippy --release --all-targets -- -D warnings

section "cargo clippy --no-default-features (the CPU-only library)"
cargo clippy --release --all-targets --no-default-features -- -D warnings

section "cargo test --release (with each test's output: GPU tests print 'skipped: no CUDA device' here)"
cargo test --release -- --show-output

section "cargo build --release (the library pytest loads)"
cargo build --release

section "pytest tests/python"
export XLA_SSM_LIBRARY="$PWD/target/release/libxla_ssm.so"
export PYTHONPATH="$PWD/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
python -m pytest tests/python -q -ra

section "bench (CPU, quick): our CPU target against jax.lax.scan, outputs checked"
python bench/bench_selective_scan.py --device cpu --quick --no-baselines --out "${TMPDIR:-/tmp}/xla_ssm_bench"

section "bench (CPU, quick): decode step (bench/bench_decode.py), outputs checked"
python bench/bench_decode.py --device cpu --out "${TMPDIR:-/tmp}/xla_ssm_bench"

section "all tests passed"
