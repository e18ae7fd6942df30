#!/usr/bin/env bash
# The JAX compatibility check: one venv per JAX version (under .compat/, reused), each running the
# smoke subset of tests/python (the tests marked `compat`: forward, grad, vmap, decode, SSD) on the
# CPU against the same built library.
#
#   bash scripts/compat.sh                  # the oldest supported (0.5.0), 0.9.0 (EXLA's XLA), the newest
#   bash scripts/compat.sh 0.7.2 0.10.2     # any versions; "newest" means the newest on PyPI
#
# The library: $XLA_SSM_LIBRARY, else target/release/libxla_ssm.so (build it first). jax >= 0.11
# needs Python >= 3.12: python3.12 (or $PYTHON312) is used for those and for "newest"; without it,
# "newest" is the newest release for Python 3.11, and the script says so. Exit status: non-zero if
# any version fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

LIB="${XLA_SSM_LIBRARY:-$ROOT/target/release/libxla_ssm.so}"
if [ ! -f "$LIB" ]; then
  echo "compat: no library at $LIB (cargo build --release, or set XLA_SSM_LIBRARY)" >&2
  exit 2
fi
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.5.0 0.9.0 newest)

# The first of the candidates that runs (a pyenv shim may exist for a version pyenv has not enabled).
find_python() {
  local c
  for c in "$@"; do
    if [ -n "$c" ] && "$c" -c 'import venv' >/dev/null 2>&1; then
      echo "$c"
      return
    fi
  done
}
pyenv_root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
PY311="$(find_python "${PYTHON311:-}" python3.11 "$pyenv_root"/versions/3.11*/bin/python3.11 python3)"
PY312="$(find_python "${PYTHON312:-}" python3.12 "$pyenv_root"/versions/3.12*/bin/python3.12)"

# "Major.minor" of a version as one comparable number: 0.11.2 -> 11.
minor() { echo "$1" | cut -d. -f2; }

failed=()
for want in "${versions[@]}"; do
  py="$PY311"
  if [ "$want" = newest ] || [ "$(minor "$want")" -ge 11 ]; then
    if [ -n "$PY312" ]; then
      py="$PY312"
    elif [ "$want" = newest ]; then
      echo "compat: NOTE: no python3.12 here, so \"newest\" is the newest jax for $("$py" --version)"
    else
      echo "compat: jax $want needs Python >= 3.12 and there is no python3.12 (set PYTHON312)" >&2
      failed+=("$want")
      continue
    fi
  fi
  venv="$ROOT/.compat/jax-$want-py$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
  fi
  spec=(jax jaxlib)
  [ "$want" = newest ] || spec=("jax==$want" "jaxlib==$want")
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check --quiet --upgrade "${spec[@]}" numpy pytest; then
    echo "compat: could not install jax $want" >&2
    failed+=("$want")
    continue
  fi
  have="$("$venv/bin/python" -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__)')"
  printf '\n==== compat: jax %s (asked: %s, %s) [%s]\n' "$have" "$want" "$("$venv/bin/python" --version)" "$(date +%T)"
  if ! (cd "$ROOT" && XLA_SSM_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings/python" JAX_PLATFORMS=cpu \
        "$venv/bin/python" -m pytest -q -m compat -p no:cacheprovider \
        tests/python/test_selective_scan_jax.py tests/python/test_selective_scan_grad.py \
        tests/python/test_decode_jax.py tests/python/test_ssd_jax.py); then
    failed+=("$want ($have)")
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "compat: FAILED for jax: ${failed[*]}" >&2
  exit 1
fi
echo "compat: every version passed: ${versions[*]}"
