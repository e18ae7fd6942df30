#!/usr/bin/env bash
# Builds tests/cpp/pjrt_ffi_host.cc with g++ and runs it: libxla_ssm's FFI targets
# (xla_ssm_selective_scan_fwd, xla_ssm_ssd_fwd) through a PJRT plugin, without JAX, checked against
# the library's host C API.
#
#   bash tests/cpp/run.sh [path/to/libxla_ssm.so]
#
# The library: the argument, else $XLA_SSM_LIBRARY, else .bundle/libxla_ssm.so (scripts/gpu-bundle.sh),
# else target/release/libxla_ssm.so.
# The plugin: $XLA_SSM_PJRT_PLUGIN, else the CUDA plugin of the `jax-cuda13-pjrt` wheel in
# $PYTHON's (default python3) environment: <site-packages>/jax_plugins/xla_cuda13/xla_cuda_plugin.so.
# (Any PJRT plugin of C API 0.115 or later whose platform is "cuda" or "cpu" works, e.g. a CPU plugin
# with a library built by `cargo build --release --no-default-features`.)
# The binary goes to $XLA_SSM_PJRT_HOST_BIN (default: a temporary directory). Exit status: the
# program's (0 only if every check passed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"

lib="${1:-${XLA_SSM_LIBRARY:-}}"
if [[ -z "$lib" ]]; then
  for cand in "$ROOT/.bundle/libxla_ssm.so" "$ROOT/target/release/libxla_ssm.so"; do
    if [[ -f "$cand" ]]; then lib="$cand"; break; fi
  done
fi
if [[ -z "$lib" || ! -f "$lib" ]]; then
  echo "run.sh: no libxla_ssm.so (give its path, set XLA_SSM_LIBRARY, or build it)" >&2
  exit 2
fi

# The plugin's directory without importing jax_plugins.xla_cuda13 (its __init__ imports jax), and
# the NVIDIA wheels' library directories, which jax preloads before it loads the plugin.
plugin="${XLA_SSM_PJRT_PLUGIN:-}"
nvidia_libs=""
if find_out="$("$PYTHON" - <<'EOF'
import glob, importlib.util, os, site, sys
plugin = ""
try:
    spec = importlib.util.find_spec("jax_plugins.xla_cuda13")
    if spec and spec.submodule_search_locations:
        cand = os.path.join(list(spec.submodule_search_locations)[0], "xla_cuda_plugin.so")
        if os.path.isfile(cand):
            plugin = cand
except Exception:
    pass
dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(d)]
if not plugin:
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d, "jax_plugins", "xla_cuda*", "xla_cuda_plugin.so")))
        if found:
            plugin = found[-1]
            break
libs = []
for d in dirs:
    for sub in ("nvidia/cu13/lib", "nvidia/cudnn/lib", "nvidia/nccl/lib", "nvidia/nvshmem/lib"):
        p = os.path.join(d, sub)
        if os.path.isdir(p):
            libs.append(p)
print(plugin)
print(":".join(libs))
EOF
)"; then
  if [[ -z "$plugin" ]]; then plugin="$(sed -n 1p <<<"$find_out")"; fi
  nvidia_libs="$(sed -n 2p <<<"$find_out")"
fi
if [[ -z "$plugin" || ! -f "$plugin" ]]; then
  echo "run.sh: no PJRT plugin: install jax-cuda13-pjrt in $PYTHON's environment or set XLA_SSM_PJRT_PLUGIN" >&2
  exit 2
fi
if [[ -n "$nvidia_libs" ]]; then
  export LD_LIBRARY_PATH="$nvidia_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

bin="${XLA_SSM_PJRT_HOST_BIN:-}"
if [[ -z "$bin" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  bin="$tmp/pjrt_ffi_host"
fi
"${CXX:-g++}" -std=c++17 -O1 -Wall -Wextra -Werror -I "$ROOT/include" -I "$ROOT/tests/cpp" \
  "$ROOT/tests/cpp/pjrt_ffi_host.cc" -o "$bin" -ldl
echo "plugin:  $plugin"
echo "library: $lib"
"$bin" "$plugin" "$lib"
