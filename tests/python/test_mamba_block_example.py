"""examples/mamba_block.py: the block runs through xla_ssm, matches the lax.scan reference, and trains."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import pytest
from test_selective_scan_jax import assert_close

_path = Path(__file__).resolve().parents[2] / "examples" / "mamba_block.py"
_spec = importlib.util.spec_from_file_location("mamba_block", _path)
mb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mb)


@pytest.fixture(scope="module")
def setup():
    kp, kd = jax.random.split(jax.random.PRNGKey(1))
    params = mb.init_params(kp, d_model=8, d_state=4)
    x, target = mb.make_data(kd, 2, 37, 8, 2)
    return params, x, target


def test_block_matches_reference(setup):
    params, x, _ = setup
    ours = jax.jit(mb.mamba_block)(params, x)
    want = jax.jit(mb.mamba_block, static_argnums=2)(params, x, mb.reference_scan)
    assert ours.shape == x.shape
    assert_close("block", ours, want, (2e-5, 1e-4))


def test_block_grads_match_reference(setup):
    params, x, target = setup
    grad = jax.jit(jax.grad(mb.loss_fn), static_argnums=3)
    ours = grad(params, x, target, mb.xla_ssm.selective_scan)
    want = grad(params, x, target, mb.reference_scan)
    for k in params:
        assert_close(f"d{k}", ours[k], want[k], (1e-4, 1e-3))


def test_block_trains(capsys):
    """The example's own check: the loss of the last steps is below 0.9x that of the first."""
    assert mb.main(["--steps", "12", "--batch", "2", "--seqlen", "32", "--d-model", "8"]) == 0, capsys.readouterr().out
