"""Packed sequences (`cu_seqlens`): 8 sequences of mixed lengths (64 to 4096) packed into 16384
tokens, against one unpacked sequence of the same total length and against padding every sequence
to the longest (a batch of 8 x 4096).

Per operation, through `jax.jit`, bf16 (GPU) or f32 (CPU smoke): the forward, and the forward plus
backward (`jax.vjp` with a cotangent in the output's dtype). `selective_scan` at dim 4096, dstate
16, channel-last ("bld", the natural layout of packed tokens) and channel-first; `ssd` at 64 heads
of 64 x 128 (CPU: 4 heads of 16 x 16). Every packed output is checked against the
per-sequence calls in the same run (exit 1 on a mismatch). Times are medians of repetitions of
back-to-back calls after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python"))

import bench_selective_scan as fb  # noqa: E402  (timing)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import xla_ssm  # noqa: E402

LENGTHS = [4096, 64, 2500, 1200, 4096, 300, 3000, 1128]  # 16384 tokens, longest 4096
CPU_LENGTHS = [300, 8, 150, 62, 4, 240, 100, 160]  # 1024


def timeit(fn, *args, reps=20, calls=5):
    """Median microseconds per call (after a warm-up call)."""
    return fb.time_jax(fn, args, reps=reps, inner=calls) * 1e6


def vjp(f, *args):
    """f's forward and backward (a cotangent of ones), jitted."""

    def run(a, *rest):
        out, back = jax.vjp(lambda a: f(a, *rest), a)
        return back(jnp.ones_like(out))

    return jax.jit(run)


def scan_inputs(rng, dim, dstate, lens, layout, dtype):
    total = sum(lens)
    x = (1, dim, total) if layout == "bdl" else (1, total, dim)
    bc = (1, 1, dstate, total) if layout == "bdl" else (1, total, 1, dstate)
    r = lambda s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
    dt = np.log(np.expm1(rng.uniform(1e-3, 1e-1, dim))).astype(np.float32)
    return dict(
        u=r(x), delta=r(x, 0.5), A=-jnp.tile(jnp.arange(1, dstate + 1, dtype=jnp.float32), (dim, 1)),
        B=r(bc), C=r(bc), D=jnp.ones(dim, jnp.float32), z=r(x), delta_bias=jnp.asarray(dt),
    )  # fmt: skip


def padded(a, lens, seq_axis):
    """The packed sequences as a zero-padded batch (len(lens), ..., max(lens)); seq_axis(name): the
    operand's seqlen axis, None for per-channel parameters."""
    cu = np.concatenate([[0], np.cumsum(lens)])
    top = max(lens)
    out = {}
    for k, v in a.items():
        axis = seq_axis(k)
        if axis is None:
            out[k] = v
            continue
        rows = []
        for s in range(len(lens)):
            piece = jax.lax.slice_in_dim(v, int(cu[s]), int(cu[s + 1]), axis=axis)
            pad = [(0, 0)] * v.ndim
            pad[axis] = (0, top - lens[s])
            rows.append(jnp.pad(piece, pad))
        out[k] = jnp.concatenate(rows, axis=0)
    return out


def bench_scan(dim, dstate, lens, layout, dtype, results):
    rng = np.random.default_rng(0)
    a = scan_inputs(rng, dim, dstate, lens, layout, dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    kw = dict(delta_softplus=True, layout=layout)
    packed = jax.jit(lambda a, c: xla_ssm.selective_scan(**a, **kw, cu_seqlens=c))
    whole = jax.jit(lambda a: xla_ssm.selective_scan(**a, **kw))
    ax, bc_ax = (2, 3) if layout == "bdl" else (1, 1)
    pad = padded(a, lens, lambda k: ax if k in ("u", "delta", "z") else bc_ax if k in ("B", "C") else None)

    # The check: packed == each sequence on its own (the padded batch's rows, cut back).
    got = np.asarray(packed(a, cu), np.float32)
    want = np.asarray(jax.jit(lambda a: xla_ssm.selective_scan(**a, **kw))(pad), np.float32)
    top, cu_np = max(lens), np.asarray(cu)
    err = 0.0
    for s, n in enumerate(lens):
        g = got[..., cu_np[s] : cu_np[s + 1]] if layout == "bdl" else got[:, cu_np[s] : cu_np[s + 1]]
        w = want[s : s + 1, ..., :n] if layout == "bdl" else want[s : s + 1, :n]
        err = max(err, float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)))
    ok = err <= (1e-5 if dtype == jnp.float32 else 2e-2)

    row = dict(op="selective_scan", layout=layout, dim=dim, dstate=dstate, lens=lens, rel_err=err, ok=ok)
    row["fwd_packed_us"] = timeit(packed, a, cu)
    row["fwd_unpacked_us"] = timeit(whole, a)
    row["fwd_padded_us"] = timeit(whole, pad)
    row["train_packed_us"] = timeit(vjp(lambda a, c: xla_ssm.selective_scan(**a, **kw, cu_seqlens=c), cu), a, cu)
    row["train_unpacked_us"] = timeit(vjp(lambda a: xla_ssm.selective_scan(**a, **kw)), a)
    row["train_padded_us"] = timeit(vjp(lambda a: xla_ssm.selective_scan(**a, **kw)), pad)
    results.append(row)
    print(
        f"selective_scan {layout} {dim}x{sum(lens)}x{dstate}: fwd packed {row['fwd_packed_us']:.0f} us, "
        f"unpacked {row['fwd_unpacked_us']:.0f} ({row['fwd_packed_us'] / row['fwd_unpacked_us']:.2f}x), "
        f"padded {row['fwd_padded_us']:.0f}; fwd+bwd packed {row['train_packed_us']:.0f}, unpacked "
        f"{row['train_unpacked_us']:.0f} ({row['train_packed_us'] / row['train_unpacked_us']:.2f}x), padded "
        f"{row['train_padded_us']:.0f}; max rel err {err:.1e} {'ok' if ok else 'MISMATCH'}",
        flush=True,
    )
    return ok


def bench_ssd(heads, headdim, dstate, lens, dtype, results):
    """SSD at `heads` heads of headdim x dstate, one group, chunk 256 (a tensor-core shape: a packed
    forward runs on the tensor-core kernels, and so does this backward, which has no states)."""
    rng = np.random.default_rng(1)
    total = sum(lens)
    r = lambda s, sc=1.0: jnp.asarray(rng.standard_normal(s) * sc, dtype)  # noqa: E731
    a = dict(
        x=r((1, total, heads, headdim)), dt=r((1, total, heads), 0.5), B=r((1, total, 1, dstate)),
        C=r((1, total, 1, dstate)), z=r((1, total, heads, headdim)),
        A=-jnp.asarray(rng.uniform(1, 16, heads), jnp.float32), D=jnp.ones(heads, jnp.float32),
        dt_bias=jnp.asarray(np.log(np.expm1(rng.uniform(1e-3, 1e-1, heads))), jnp.float32),
    )  # fmt: skip
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    kw = dict(chunk_size=256, dt_softplus=True)
    packed = jax.jit(lambda a, c: xla_ssm.ssd(**a, **kw, cu_seqlens=c))
    whole = jax.jit(lambda a: xla_ssm.ssd(**a, **kw))
    pad = padded(a, lens, lambda k: 1 if k in ("x", "dt", "B", "C", "z") else None)

    got = np.asarray(packed(a, cu), np.float32)
    want = np.asarray(whole(pad), np.float32)
    cu_np, err = np.asarray(cu), 0.0
    for s, n in enumerate(lens):
        g, w = got[:, cu_np[s] : cu_np[s + 1]], want[s : s + 1, :n]
        err = max(err, float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)))
    ok = err <= (1e-5 if dtype == jnp.float32 else 2e-2)
    row = dict(op="ssd", heads=heads, headdim=headdim, dstate=dstate, lens=lens, rel_err=err, ok=ok)
    row["fwd_packed_us"] = timeit(packed, a, cu)
    row["fwd_unpacked_us"] = timeit(whole, a)
    row["fwd_padded_us"] = timeit(whole, pad)
    row["train_packed_us"] = timeit(vjp(lambda a, c: xla_ssm.ssd(**a, **kw, cu_seqlens=c), cu), a, cu)
    row["train_unpacked_us"] = timeit(vjp(lambda a: xla_ssm.ssd(**a, **kw)), a)
    row["train_padded_us"] = timeit(vjp(lambda a: xla_ssm.ssd(**a, **kw)), pad)
    results.append(row)
    print(
        f"ssd {heads}x{headdim}x{dstate} over {total} tokens: fwd packed {row['fwd_packed_us']:.0f} us, unpacked "
        f"{row['fwd_unpacked_us']:.0f} ({row['fwd_packed_us'] / row['fwd_unpacked_us']:.2f}x), padded "
        f"{row['fwd_padded_us']:.0f}; fwd+bwd packed {row['train_packed_us']:.0f}, unpacked "
        f"{row['train_unpacked_us']:.0f} ({row['train_packed_us'] / row['train_unpacked_us']:.2f}x), padded "
        f"{row['train_padded_us']:.0f}; max rel err {err:.1e} {'ok' if ok else 'MISMATCH'}",
        flush=True,
    )
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--out", default="bench/results/packed.json")
    args = ap.parse_args()
    gpu = args.device == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    lens, dim = (LENGTHS, 4096) if gpu else (CPU_LENGTHS, 64)
    results = []
    ok = all([bench_scan(dim, 16, lens, layout, dtype, results) for layout in ("bld", "bdl")])
    ok &= bench_ssd(64, 64, 128, lens, dtype, results) if gpu else bench_ssd(4, 16, 16, lens, dtype, results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(device=str(jax.devices()[0]), results=results), indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
