#!/usr/bin/env bash
# Build here, run on a GPU machine that has no Rust: puts the release library, the compiled cargo test
# binaries and the Python package into .bundle/ (git-ignored), for the device tool's `carry`.
# On the GPU machine, from the repo root: `bash scripts/gpu-run.sh` (tests, JAX on CUDA, demo).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh >/dev/null
. scripts/env.sh
export XLA_SSM_CUDA_ARCHS="${XLA_SSM_CUDA_ARCHS:-90}"  # the lent GPUs are sm_90; faster to build
cargo build --release
rm -rf .bundle && mkdir -p .bundle/tests
cp target/release/libxla_ssm.so .bundle/
# Every integration-test executable, named after its test file.
cargo test --release --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and "test" in msg["target"]["kind"]:
        shutil.copy(msg["executable"], ".bundle/tests/" + msg["target"]["name"])
        print("bundled test", msg["target"]["name"])
'
du -sh .bundle
