#!/usr/bin/env bash
# Set up the build and test toolchain that is not Rust: a virtual environment at <repo>/.venv
# with CUDA's compiler from PyPI (pinned) and JAX, numpy, pytest (and pytest-xdist, which runs the
# tests in two processes). Idempotent: a second run that
# finds everything installed does not call pip.
#
#   PYTHON=python3.11 bash scripts/setup.sh     # which interpreter makes the venv (default: python3.11, else python3)
#   XLA_SSM_JAX_CUDA=1|0                        # force / forbid jax[cuda13] (default: when nvidia-smi sees a GPU)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

REQS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85   # nv/target, needed by cuda_fp16.h / cuda_bf16.h
  jax
  numpy
  pytest
  pytest-xdist
)

want_cuda_jax="${XLA_SSM_JAX_CUDA:-auto}"
if [ "$want_cuda_jax" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    want_cuda_jax=1
  else
    want_cuda_jax=0
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY="${PYTHON:-}"
  if [ -z "$PY" ]; then
    if command -v python3.11 >/dev/null 2>&1; then PY=python3.11; else PY=python3; fi
  fi
  echo "setup: creating $VENV with $("$PY" --version 2>&1)"
  if ! "$PY" -m venv "$VENV"; then
    rm -rf "$VENV"
    echo "setup: '$PY -m venv' failed; install the venv module (Debian: apt-get install python3-venv)" >&2
    exit 1
  fi
fi

# Exit 0 when every requirement is installed (name==version exactly when pinned).
satisfied() {
  "$VENV/bin/python" - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for req in sys.argv[1:]:
    name, _, pinned = req.partition("==")
    name = name.split("[")[0]
    try:
        have = version(name)
    except PackageNotFoundError:
        missing.append(req)
        continue
    if pinned and have != pinned:
        missing.append(f"{req} (have {have})")
sys.exit(1 if missing else 0)
PY
}

pip_install() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check --quiet "$@"
}

if [ "$want_cuda_jax" = 1 ]; then
  # jax[cuda13] brings the CUDA plugin; jax-cuda13-plugin stands for it in the check.
  if satisfied "${REQS[@]}" jax-cuda13-plugin; then
    echo "setup: $VENV is up to date (jax with CUDA)"
  else
    echo "setup: installing ${REQS[*]} jax[cuda13] into $VENV"
    if ! pip_install "${REQS[@]}" "jax[cuda13]"; then
      echo "setup: WARNING: jax[cuda13] did not install; falling back to CPU-only jax" >&2
      pip_install "${REQS[@]}"
    fi
  fi
elif satisfied "${REQS[@]}"; then
  echo "setup: $VENV is up to date"
else
  echo "setup: installing ${REQS[*]} into $VENV"
  pip_install "${REQS[@]}"
fi

# shellcheck source=scripts/env.sh
. "$ROOT/scripts/env.sh"
if [ ! -x "$NVCC" ]; then
  echo "setup: nvcc not found at $NVCC" >&2
  exit 1
fi
echo "setup: NVCC=$NVCC ($("$NVCC" --version | tail -1))"
