"""Let `pytest tests/python` find the package in bindings/python without PYTHONPATH."""

import sys
from pathlib import Path

_bindings = Path(__file__).resolve().parents[2] / "bindings" / "python"
if str(_bindings) not in sys.path:
    sys.path.insert(0, str(_bindings))
