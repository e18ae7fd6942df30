"""Let `pytest tests/python` find the package in bindings/python without PYTHONPATH, and give the
host platform 8 devices for the sharding tests (read when JAX starts its CPU backend, so it must be
set before any test touches a device; harmless for the other tests, which use the default device)."""

import os
import sys
from pathlib import Path

_bindings = Path(__file__).resolve().parents[2] / "bindings" / "python"
if str(_bindings) not in sys.path:
    sys.path.insert(0, str(_bindings))

_flag = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "compat: the smoke subset scripts/compat.sh runs under every supported JAX version",
    )
