#!/usr/bin/env bash
# Like gpu-bundle.sh, for a GPU machine that copies another checkout: builds here and puts the
# library, the decode test binaries, the Python package, its tests and bench/bench_decode.py into
# ${1:-.bundle-dec}/, a self-contained tree. On the GPU machine, from that folder:
#   PYTHONPATH=python XLA_SSM_LIBRARY=$PWD/libxla_ssm.so ./tests/ffi_cuda_decode --test-threads=1
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$(realpath -m "${1:-$ROOT/.bundle-dec}")"
cd "$ROOT"
. scripts/env.sh
export XLA_SSM_CUDA_ARCHS="${XLA_SSM_CUDA_ARCHS:-90}"
cargo build --release
rm -rf "$DEST" && mkdir -p "$DEST/tests" "$DEST/bench"
cp target/release/libxla_ssm.so "$DEST/"
cargo test --release --no-run --message-format=json 2>/dev/null | DEST="$DEST" python3 -c '
import json, os, shutil, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and "test" in msg["target"]["kind"]:
        shutil.copy(msg["executable"], os.environ["DEST"] + "/tests/" + msg["target"]["name"])
'
cp -r bindings/python "$DEST/python"
rm -rf "$DEST/python/build" "$DEST/python/xla_ssm/__pycache__"
cp -r tests/python "$DEST/tests/python"
cp bench/bench_decode.py "$DEST/bench/"
du -sh "$DEST"
