#!/usr/bin/env bash
# On a GPU machine with the .bundle/ from scripts/gpu-bundle.sh: the CUDA cargo tests, the JAX tests
# (which then run on the GPU), and the demo. Logs go to $OUT when set (the device tool's folder).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/bindings/python" XLA_SSM_LIBRARY="$ROOT/.bundle/libxla_ssm.so"
status=0
nvidia-smi -L
bin_dir="$(mktemp -d)"
trap 'rm -rf "$bin_dir"' EXIT
# The test binaries bundled (gpu-bundle.sh may have been told to bundle fewer), or XLA_SSM_GPU_TESTS.
bundled="$(ls .bundle/tests 2>/dev/null | sed 's/\.gz$//' | tr '\n' ' ')"
for t in ${XLA_SSM_GPU_TESTS:-$bundled}; do
  echo "== cargo test binary: $t"
  exe=".bundle/tests/$t"
  if [[ ! -f "$exe" && -f "$exe.gz" ]]; then  # gpu-bundle.sh gzips them
    gzip -dc "$exe.gz" > "$bin_dir/$t" && chmod +x "$bin_dir/$t"
    exe="$bin_dir/$t"
  fi
  "$exe" --test-threads=1 2>&1 | tee "$LOG/test_$t.log" | tail -n 5 || status=1
done
echo "== pytest (JAX on the GPU)"
python3 -m pytest -q tests/python 2>&1 | tee "$LOG/pytest.log" | tail -n 8 || status=1
echo "== demo"
python3 examples/selective_scan_demo.py 2>&1 | tee "$LOG/demo.log" | tail -n 15 || status=1
exit $status
