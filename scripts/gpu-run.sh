#!/usr/bin/env bash
# On a GPU machine with the .bundle/ from scripts/gpu-bundle.sh (no Rust needed): the CUDA cargo
# tests, the JAX tests (which then run on the GPU), the C++ host through PJRT, the CUDA kernel tests
# (nvcc), and the demo. Logs go to $OUT when set (the device tool's folder).
#   XLA_SSM_GPU_STEPS="cargo pytest cpp kernels demo"   the default, in this order; add `sanitize`
#   for compute-sanitizer's four tools over the CUDA tests (tests/cuda/sanitize.sh; slow); empty:
#   only unpack the library (for running a benchmark against .bundle/libxla_ssm.so by hand)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOG="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/bindings/python" XLA_SSM_LIBRARY="$ROOT/.bundle/libxla_ssm.so"
steps=" ${XLA_SSM_GPU_STEPS-cargo pytest cpp kernels demo} "
status=0
# The bundle carries the library gzipped (scripts/gpu-bundle.sh).
if [ ! "$XLA_SSM_LIBRARY" -nt "$XLA_SSM_LIBRARY.gz" ]; then
  gzip -dc "$XLA_SSM_LIBRARY.gz" >"$XLA_SSM_LIBRARY"
fi
nvidia-smi -L

if [[ "$steps" == *" cargo "* ]]; then
  # The CUDA tests are the suite's ignored ones (without a GPU they report themselves ignored).
  echo "== cargo tests needing a GPU (the suite's ignored tests)"
  exe="$(mktemp)"
  gzip -dc .bundle/suite.gz > "$exe" && chmod +x "$exe"
  "$exe" --ignored --test-threads=1 2>&1 | tee "$LOG/cargo_gpu.log" | tail -n 5 || status=1
  rm -f "$exe"
fi
if [[ "$steps" == *" pytest "* ]]; then
  echo "== pytest (JAX on the GPU)"
  python3 -m pytest -q -ra tests/python 2>&1 | tee "$LOG/pytest.log" | tail -n 8 || status=1
fi
if [[ "$steps" == *" cpp "* ]]; then
  echo "== C++ host through PJRT (tests/cpp, jax-cuda13-pjrt's CUDA plugin)"
  bash tests/cpp/run.sh "$XLA_SSM_LIBRARY" 2>&1 | tee "$LOG/cpp_host.log" | tail -n 3 || status=1
fi
if [[ "$steps" == *" kernels "* ]]; then
  echo "== CUDA kernel tests (tests/cuda: the kernels alone, against double-precision references)"
  bash tests/cuda/run.sh check 2>&1 | tee "$LOG/tests_cuda.log" | tail -n 15 || status=1
fi
if [[ "$steps" == *" sanitize "* ]]; then
  echo "== compute-sanitizer: memcheck, racecheck, initcheck, synccheck (tests/cuda/sanitize.sh)"
  bash tests/cuda/sanitize.sh 2>&1 | tee "$LOG/sanitize.log" | tail -n 12 || status=1
fi
if [[ "$steps" == *" demo "* ]]; then
  echo "== demo"
  python3 examples/selective_scan_demo.py 2>&1 | tee "$LOG/demo.log" | tail -n 15 || status=1
fi
exit $status
