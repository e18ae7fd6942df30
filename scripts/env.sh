# Source me (bash/zsh): `. scripts/env.sh`. Activates <repo>/.venv (made by scripts/setup.sh) and
# exports NVCC (the PyPI nvcc build.rs uses), CUDA_INCLUDE_DIR, and puts nvcc on PATH.
# Sourced, so no `set -e` here: it must not change the caller's shell options.

_xla_ssm_root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
if [ -f "$_xla_ssm_root/.venv/bin/activate" ]; then
  # shellcheck disable=SC1091
  . "$_xla_ssm_root/.venv/bin/activate"
  _xla_ssm_cu="$(ls -d "$_xla_ssm_root"/.venv/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -n 1)"
  if [ -n "$_xla_ssm_cu" ]; then
    export NVCC="$_xla_ssm_cu/bin/nvcc"
    export CUDA_INCLUDE_DIR="$_xla_ssm_cu/include"
    case ":$PATH:" in
      *":$_xla_ssm_cu/bin:"*) ;;
      *) export PATH="$_xla_ssm_cu/bin:$PATH" ;;
    esac
  fi
  unset _xla_ssm_cu
else
  echo "env.sh: $_xla_ssm_root/.venv is missing; run: bash scripts/setup.sh" >&2
fi
export XLA_SSM_ROOT="$_xla_ssm_root"
unset _xla_ssm_root
