#!/usr/bin/env bash
# Build here, run on a GPU machine that has no Rust: puts the release library and the compiled GPU
# cargo test binaries (ffi_cuda*; CI runs the CPU ones), stripped (the tests gzipped), into .bundle/
# (git-ignored), for the device tool's `carry` (64 MiB at most: each test binary embeds the kernels).
# On the GPU machine, from the repo root: `bash scripts/gpu-run.sh` (tests, JAX on CUDA, demo).
# XLA_SSM_GPU_TESTS="ffi_cuda ffi_cuda_bwd" bundles only those test binaries (each ~10 MB gzipped: all
# four and the library come near the 64 MiB); gpu-run.sh runs the ones bundled.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh >/dev/null
. scripts/env.sh
export XLA_SSM_CUDA_ARCHS="${XLA_SSM_CUDA_ARCHS:-90}"  # the lent GPUs are sm_90; faster to build
cargo build --release
rm -rf .bundle && mkdir -p .bundle/tests
cp "${CARGO_TARGET_DIR:-target}/release/libxla_ssm.so" .bundle/
# Every integration-test executable, named after its test file.
cargo test --release --no-run --test '*' --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
wanted = sys.argv[1].split()
for line in sys.stdin:
    msg = json.loads(line)
    target = msg.get("target", {})
    name = target.get("name", "")
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and "test" in target.get("kind", []) \
            and (name in wanted if wanted else name.startswith("ffi_cuda")):
        shutil.copy(msg["executable"], ".bundle/tests/" + name)
        print("bundled test", name)
' "${XLA_SSM_GPU_TESTS:-}"
strip .bundle/libxla_ssm.so .bundle/tests/*
# Each test binary embeds every kernel (~15 MB at sm_90): gzipped, the bundle fits the device tool's
# 64 MiB carry; scripts/gpu-run.sh unpacks them.
gzip -9 .bundle/tests/*
du -sh .bundle
size=$(du -sb .bundle | cut -f1)
if (( size >= 64 * 1024 * 1024 )); then
  echo "gpu-bundle: .bundle is $size bytes, over the 64 MiB the device tool carries; bundle fewer tests (XLA_SSM_GPU_TESTS)" >&2
  exit 1
fi
