#!/usr/bin/env bash
# The whole suite (`mix test`: the pure tests plus test/nx_test.exs, which needs Nx but not EXLA)
# on a machine without Hex: Nx is compiled from source checkouts instead.
#   XLA_SSM_NX_SRC=<dir>  holding nx/ (the nx/ folder of elixir-nx/nx, e.g. tag v0.13.1),
#                         complex/ (elixir-nx/complex) and telemetry/ (beam-telemetry/telemetry)
#   an Elixir >= 1.17 on PATH (Nx 0.13 requires it; Debian 12's 1.14 is too old)
# The checkouts are copied to a scratch dir, where Nx's Hex dependencies are rewritten as path ones.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
binding="$(dirname "$here")"
src="${XLA_SSM_NX_SRC:?set XLA_SSM_NX_SRC to a dir with nx/, complex/ and telemetry/ source checkouts}"
work="${XLA_SSM_NX_WORK:-$(mktemp -d)}"

mkdir -p "$work/src"
for dep in nx complex telemetry; do
  [ -d "$work/src/$dep" ] || cp -r "$src/$dep" "$work/src/$dep"
done
python3 - "$work/src" <<'PY'
import re, sys
root = sys.argv[1]
def set_deps(path, deps):
    text = open(path).read()
    text = re.sub(r"  defp deps do\n.*?\n  end\n", "  defp deps do\n    " + deps + "\n  end\n", text, count=1, flags=re.S)
    open(path, "w").write(text)
set_deps(root + "/nx/mix.exs", '[{:complex, path: "../complex"}, {:telemetry, path: "../telemetry"}]')
set_deps(root + "/complex/mix.exs", "[]")
PY

mkdir -p "$work/project"
cat > "$work/project/mix.exs" <<EXS
defmodule XlaSsmNxRun.MixProject do
  use Mix.Project

  def project do
    [
      app: :xla_ssm,
      version: "0.1.0",
      elixirc_paths: ["$binding/lib", "$binding/test/support"],
      test_paths: ["$binding/test"],
      deps: [
        {:nx, path: "$work/src/nx"},
        {:complex, path: "$work/src/complex", override: true},
        {:telemetry, path: "$work/src/telemetry", override: true}
      ]
    ]
  end

  def application, do: [extra_applications: [:logger]]
end
EXS
cd "$work/project"
MIX_ENV=test mix test "$@"
