"""The build step of the `xla_ssm` wheel: compile the Rust crate at the repository root (../..) with
cargo and ship libxla_ssm.so inside the package. Metadata lives in pyproject.toml.

Build-time environment:
  NVCC=/path/to/nvcc        nvcc for build.rs (default: the pinned PyPI nvcc this build installed,
                            <site-packages>/nvidia/cu13/bin/nvcc)
  XLA_SSM_CPU_ONLY=1        cargo build --no-default-features: CPU targets only, no nvcc needed
  XLA_SSM_CUDA_ARCHS=90     GPU architectures (build.rs; default 80,90)
  XLA_SSM_PREBUILT=/path/libxla_ssm.so   ship this library instead of building one
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
CRATE = HERE.parents[1]
LIBRARY = "libxla_ssm.so"


def _truthy(name):
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def _pypi_nvcc():
    """The nvcc of the nvidia-cuda-nvcc wheel among this build's requirements (pip puts them on
    sys.path, not necessarily in this interpreter's site-packages)."""
    for entry in sys.path:
        nvcc = Path(entry) / "nvidia" / "cu13" / "bin" / "nvcc"
        if nvcc.is_file():
            return nvcc
    return None


def build_library(log) -> Path:
    prebuilt = os.environ.get("XLA_SSM_PREBUILT")
    if prebuilt:
        path = Path(prebuilt).expanduser()
        if not path.is_file():
            raise RuntimeError(f"XLA_SSM_PREBUILT={prebuilt} names no file")
        return path
    if not (CRATE / "Cargo.toml").is_file():
        raise RuntimeError(f"xla_ssm: the Rust crate is not at {CRATE} (build from the repository, or set XLA_SSM_PREBUILT)")
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if not cargo:
        raise RuntimeError("xla_ssm: cargo not found (install Rust 1.89+, or set XLA_SSM_PREBUILT)")
    env = dict(os.environ)
    cmd = [cargo, "build", "--release", "--lib", "--manifest-path", str(CRATE / "Cargo.toml"),
           "--message-format=json-render-diagnostics"]  # fmt: skip
    if _truthy("XLA_SSM_CPU_ONLY"):
        # Its own target dir: a CPU-only build must not replace target/release's CUDA library.
        cmd += ["--no-default-features", "--target-dir", str(CRATE / "target" / "python-cpu-only")]
    elif not env.get("NVCC"):
        nvcc = _pypi_nvcc()
        if nvcc is None:
            raise RuntimeError("xla_ssm: the PyPI nvcc is missing from the build environment; set NVCC")
        env["NVCC"] = str(nvcc)
    log(f"xla_ssm: {' '.join(cmd)} (NVCC={env.get('NVCC', '-')})")
    proc = subprocess.run(cmd, env=env, cwd=CRATE, stdout=subprocess.PIPE, text=True, check=False)
    found = None
    for line in proc.stdout.splitlines():
        msg = json.loads(line) if line.startswith("{") else {}
        if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == "xla_ssm":
            found = next((Path(f) for f in msg["filenames"] if f.endswith(LIBRARY)), found)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"xla_ssm: cargo build failed (exit {proc.returncode}); its errors are above")
    return found


class BuildPyWithLibrary(build_py):
    """build_py, then the library next to the package's modules."""

    def run(self):
        super().run()
        lib = build_library(lambda msg: print(msg, file=sys.stderr))
        dest = Path(self.build_lib) / "xla_ssm" / LIBRARY
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lib, dest)
        print(f"xla_ssm: shipping {lib} as {dest}", file=sys.stderr)


class BinaryDistribution(Distribution):
    """Holds a native library: a platform wheel (platlib), not py3-none-any."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """No Python extension module inside, so any Python 3 (py3-none-<platform>)."""

    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel})
