#!/usr/bin/env bash
# Build here, run on a GPU machine that has no Rust: puts the release library and the cargo test
# suite (one executable, tests/suite), stripped and gzipped, into .bundle/ (git-ignored), for the
# device tool's `carry` (64 MiB at most; the library's fatbins alone are ~40 MB unpacked). On the GPU
# machine, from the repo root: `bash scripts/gpu-run.sh` (which first unpacks the library to
# .bundle/libxla_ssm.so; `XLA_SSM_GPU_STEPS= bash scripts/gpu-run.sh` only that).
#   XLA_SSM_CUDA_ARCHS   default 90 here (the lent GPUs are sm_90; faster to build)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh >/dev/null
. scripts/env.sh
export XLA_SSM_CUDA_ARCHS="${XLA_SSM_CUDA_ARCHS:-90}"
cargo build --release
rm -rf .bundle && mkdir -p .bundle
cp "${CARGO_TARGET_DIR:-target}/release/libxla_ssm.so" .bundle/
suite="$(cargo test --release --no-run --test suite --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["target"]["name"] == "suite":
        print(msg["executable"])
')"
cp "$suite" .bundle/suite
strip .bundle/libxla_ssm.so .bundle/suite
gzip -9 .bundle/suite .bundle/libxla_ssm.so
du -sh .bundle
size=$(du -sb .bundle | cut -f1)
if (( size >= 64 * 1024 * 1024 )); then
  echo "gpu-bundle: .bundle is $size bytes, over the 64 MiB the device tool carries" >&2
  exit 1
fi
