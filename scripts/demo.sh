#!/usr/bin/env bash
# The main job: set up, build the library, run the selective-scan demo (GPU if JAX has one, else CPU).
# Extra arguments go to the demo, e.g. `bash scripts/demo.sh --cpu --shape 2,256,512,16`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

echo "== setup"
bash scripts/setup.sh
# shellcheck source=scripts/env.sh
. scripts/env.sh

echo "== cargo build --release"
cargo build --release

echo "== examples/selective_scan_demo.py"
export XLA_SSM_LIBRARY="$PWD/target/release/libxla_ssm.so"
export PYTHONPATH="$PWD/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
python examples/selective_scan_demo.py "$@"
