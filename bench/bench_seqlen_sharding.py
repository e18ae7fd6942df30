"""Seqlen-sharded scans (docs/sharding.md): one sequence split over every visible device, against
the same call on one device.

`selective_scan` at 1 x 4096 x 131072 x 16 (channel-first, bf16, with z, D, delta_bias and softplus)
and `ssd` at 1 x 131072 x 64 heads of 64 x 128 (chunk 256, bf16, dt softplus): the forward, and the
forward plus backward (`jax.vjp` in every array argument, a cotangent of ones in the output's
dtype), through `jax.jit`. The sharded outputs and input gradients are checked against the
one-device call in the same run (exit 1 on a mismatch). Times are medians of repetitions of
back-to-back calls after a warm-up.

Then the longest sequence of each op's training step: XLA's compiled memory per device
(arguments + outputs + temporaries) at two lengths gives a cost per token on one device and on
all; from the devices' memory limit follows the longest sequence each can hold, and the sharded
step runs at a length one device cannot hold.

    python bench/bench_seqlen_sharding.py --device gpu   # every visible GPU (2 or more)
    python bench/bench_seqlen_sharding.py --device cpu   # 8 host devices, small shapes: the harness
    python bench/bench_seqlen_sharding.py --device gpu --per-device   # one GPU standing in for each of 2

`--per-device` needs one device: it times each device's work in a two-way split, the sharded
lowering's per-shard function (`_scan_seq.lower`, `_ssd_seq.lower`) at half the length on a mesh
of one device (its exchange is with itself), the way the package runs it on GPUs (the forward's
first pass, exchanged, then the rest) and the way it runs elsewhere (the carry; SSD's end-state
product), against the op at the whole length and at half.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:  # the longest-sequence runs need most of the memory, not XLA's default 75%
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bindings" / "python"))

import bench_selective_scan as fb  # noqa: E402  (timing)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import xla_ssm  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

GIB = 1 << 30


def timeit(fn, *args, reps=10, calls=3):
    """Median milliseconds per call (after a warm-up call)."""
    return fb.time_jax(fn, args, reps=reps, inner=calls) * 1e3


class Scan:
    name = "selective_scan"

    def __init__(self, dim, dstate):
        self.dim, self.dstate = dim, dstate
        self.quantum = 32 * 64  # a shard: whole checkpoint intervals, and whole tiles

    def shape(self, seqlen):
        return f"1x{self.dim}x{seqlen}x{self.dstate}"

    def specs(self):
        """(shape of each array input given seqlen, its PartitionSpec on a mesh axis "seq")."""
        d, n = self.dim, self.dstate
        tok = (lambda L: (1, d, L), P(None, None, "seq"))
        bc = (lambda L: (1, 1, n, L), P(None, None, None, "seq"))
        return dict(u=tok, delta=tok, z=tok, B=bc, C=bc)

    def params(self, rng):
        d, n = self.dim, self.dstate
        return dict(
            A=-jnp.tile(jnp.arange(1, n + 1, dtype=jnp.float32), (d, 1)),
            D=jnp.ones(d, jnp.float32),
            delta_bias=jnp.asarray(np.log(np.expm1(rng.uniform(1e-3, 1e-1, d))), jnp.float32),
        )

    @staticmethod
    def call(a):
        return xla_ssm.selective_scan(**a, delta_softplus=True)


class Ssd:
    name = "ssd"

    def __init__(self, heads, headdim, dstate, chunk):
        self.heads, self.headdim, self.dstate, self.chunk = heads, headdim, dstate, chunk
        self.quantum = chunk

    def shape(self, seqlen):
        return f"1x{seqlen}x{self.heads}x{self.headdim}x{self.dstate}"

    def specs(self):
        h, p, n = self.heads, self.headdim, self.dstate
        x = (lambda L: (1, L, h, p), P(None, "seq", None, None))
        return dict(
            x=x,
            z=x,
            dt=(lambda L: (1, L, h), P(None, "seq", None)),
            B=(lambda L: (1, L, 1, n), P(None, "seq", None, None)),
            C=(lambda L: (1, L, 1, n), P(None, "seq", None, None)),
        )

    def params(self, rng):
        h = self.heads
        return dict(
            A=-jnp.asarray(rng.uniform(1, 16, h), jnp.float32),
            D=jnp.ones(h, jnp.float32),
            dt_bias=jnp.asarray(np.log(np.expm1(rng.uniform(1e-3, 1e-1, h))), jnp.float32),
        )

    def call(self, a):
        return xla_ssm.ssd(**a, chunk_size=self.chunk, dt_softplus=True)


def inputs(op, seqlen, mesh, dtype, seed=0):
    """The op's arrays at `seqlen`, made on the devices already sharded (a host copy of a
    multi-gigabyte input would take longer than the runs)."""
    out = {}
    for i, (name, (shape, spec)) in enumerate(op.specs().items()):
        sharding = NamedSharding(mesh, spec)
        scale = 0.5 if name == "dt" else 1.0
        make = jax.jit(
            lambda key, s=shape(seqlen), sc=scale: (jax.random.normal(key, s, jnp.float32) * sc).astype(dtype),
            out_shardings=sharding,
        )
        out[name] = make(jax.random.key(seed * 100 + i))
    return out


def step_fns(op, params):
    fwd = jax.jit(lambda a: op.call({**a, **params}))

    def train(a, p):
        y, back = jax.vjp(lambda a, p: op.call({**a, **p}), a, p)
        return back(jnp.ones_like(y))

    return fwd, jax.jit(train)


def rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def compiled_bytes(fn, *args):
    """Bytes per device XLA's compiled program needs: arguments, outputs and temporaries."""
    m = fn.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def abstract(op, seqlen, mesh, dtype):
    return {
        k: jax.ShapeDtypeStruct(shape(seqlen), dtype, sharding=NamedSharding(mesh, spec))
        for k, (shape, spec) in op.specs().items()
    }


def bench_speed(op, seqlen, one, many, dtype, tol):
    rng = np.random.default_rng(0)
    params = op.params(rng)
    fwd, train = step_fns(op, params)
    row = dict(op=op.name, shape=op.shape(seqlen), devices=many.size)
    a1 = inputs(op, seqlen, one, dtype)
    an = inputs(op, seqlen, many, dtype)
    y1, yn = fwd(a1), fwd(an)
    g1, gn = train(a1, params), train(an, params)
    errs = {"y": rel_err(yn, y1)}
    for k in a1:
        errs["d" + k] = rel_err(gn[0][k], g1[0][k])
    row["rel_err"] = errs
    row["ok"] = all(e <= tol for e in errs.values())
    del y1, yn, g1, gn
    row["fwd_one_ms"] = timeit(fwd, a1)
    row["fwd_sharded_ms"] = timeit(fwd, an)
    row["train_one_ms"] = timeit(train, a1, params)
    row["train_sharded_ms"] = timeit(train, an, params)
    del a1, an
    # One device at one shard's length: the sharded call's floor; the rest is the exchange and the
    # correction.
    part = inputs(op, seqlen // many.size, one, dtype)
    row["fwd_shard_alone_ms"] = timeit(fwd, part)
    row["train_shard_alone_ms"] = timeit(train, part, params)
    del part
    print(
        f"{op.name} {row['shape']} bf16 over {many.size} devices: forward {row['fwd_sharded_ms']:.2f} ms vs "
        f"{row['fwd_one_ms']:.2f} on one ({row['fwd_sharded_ms'] / row['fwd_one_ms']:.3f}x); forward+backward "
        f"{row['train_sharded_ms']:.2f} vs {row['train_one_ms']:.2f} "
        f"({row['train_sharded_ms'] / row['train_one_ms']:.3f}x); one shard's length alone on one device: "
        f"{row['fwd_shard_alone_ms']:.2f} / {row['train_shard_alone_ms']:.2f}; max rel err {max(errs.values()):.1e} "
        f"{'ok' if row['ok'] else 'MISMATCH ' + str(errs)}",
        flush=True,
    )
    return row


def bench_longest(op, one, many, dtype, limit, probe, run):
    """The longest training step one device and all devices can hold, from XLA's compiled memory at
    two lengths (linear in seqlen); then the step on all devices at a length one cannot hold."""
    params = op.params(np.random.default_rng(0))
    _, train = step_fns(op, params)
    q = op.quantum * many.size
    fits = {}
    for mesh, label in ((one, "one"), (many, "all")):
        l1, l2 = probe, 2 * probe
        b1, b2 = (compiled_bytes(train, abstract(op, L, mesh, dtype), params) for L in (l1, l2))
        per_token = (b2 - b1) / (l2 - l1)
        longest = int((limit - (b1 - per_token * l1)) / per_token) // q * q
        fits[label] = dict(bytes_per_token=per_token, longest=longest)
    row = dict(op=op.name, devices=many.size, limit_bytes=limit, **{f"{k}_{m}": v for m, f in fits.items() for k, v in f.items()})
    print(
        f"{op.name} training step, memory limit {limit / GIB:.1f} GiB a device: one device holds up to "
        f"{fits['one']['longest']:,} tokens ({fits['one']['bytes_per_token'] / 1024:.1f} KiB a token), "
        f"{many.size} devices {fits['all']['longest']:,} ({fits['all']['bytes_per_token'] / 1024:.1f} KiB a token a device)",
        flush=True,
    )
    if run:
        # Past what one device holds by a fifth, well inside what all hold (XLA's allocator needs
        # room beyond its compiled figures: fragmentation).
        L = min(fits["one"]["longest"] * 6 // 5, fits["all"]["longest"] * 3 // 4) // q * q + q
        need_one = compiled_bytes(train, abstract(op, L, one, dtype), params)
        try:
            a = inputs(op, L, many, dtype)
            t = time.perf_counter()
            g = train(a, params)
            jax.block_until_ready(g)
            first = time.perf_counter() - t
            ms = timeit(train, a, params, reps=3, calls=1)
        except Exception as e:  # out of memory, say: reported, and the other op still runs
            print(f"  {op.shape(L)} on {many.size} devices failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            row.update(run_seqlen=L, one_device_needs=need_one, error=str(e)[:1000], ok=False)
            return row
        finite = all(bool(jnp.all(jnp.isfinite(g[0][k]))) for k in ("B", "C"))
        peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in many.devices.flat)
        row.update(run_seqlen=L, run_ms=ms, first_call_s=first, one_device_needs=need_one, peak_bytes=peak, finite=finite)
        print(
            f"  ran {op.shape(L)} on {many.size} devices: {ms:.1f} ms a step (first call {first:.1f} s), peak "
            f"{f'{peak / GIB:.1f} GiB' if peak else 'unknown'} a device; one device would need {need_one / GIB:.1f} GiB; gradients "
            f"{'finite' if finite else 'NOT FINITE'}",
            flush=True,
        )
        row["ok"] = finite and need_one > limit
        if need_one <= limit:
            print("  (one device could hold that: the memory figures are off)", flush=True)
    return row


def bench_per_device(op, seqlen, one, dtype):
    """Each device's forward in a two-way split, timed on one device (see the module's doc)."""
    from xla_ssm import _scan, _scan_seq, _ssd, _ssd_seq

    params = op.params(np.random.default_rng(0))
    fwd, _ = step_fns(op, params)
    row = dict(op=op.name, shape=op.shape(seqlen), devices=1, per_device=True)
    row["fwd_one_ms"] = timeit(fwd, inputs(op, seqlen, one, dtype))
    half = {**inputs(op, seqlen // 2, one, dtype), **params}
    row["fwd_shard_alone_ms"] = timeit(fwd, half)
    if op.name == "selective_scan":
        seq, ffi = _scan_seq, _scan._ffi_call
        cfg = _scan._Cfg(True, "bdl", 4, True, True, True, False, True)
        order = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
        calls = {"": _scan._Call("fwd", cfg, 0), "_checkpoints": _scan._Call("fwd", cfg, xla_ssm.CHECKPOINT_LEN)}
    else:
        seq, ffi = _ssd_seq, _ssd._ffi_call
        cfg = _ssd._Cfg(op.chunk, True, 0.0, float("inf"), 1, True, True, False, True)
        order = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias"]
        calls = {"": _ssd._Call("fwd", cfg, False), "_checkpoints": _ssd._Call("fwd", cfg, True)}
    ops = [jax.device_put(half[k], NamedSharding(one, P())) for k in order]  # replicated: shard_map's in_specs
    platforms = seq.RECORDS_PLATFORMS
    for suffix, call in calls.items():
        for way, records_on in (("records", (one.devices.flat[0].platform,)), ("other", ())):
            seq.RECORDS_PLATFORMS = records_on
            n_out = 2 + int(bool(call[2]))
            per = jax.shard_map(
                seq.lower(call, ("seq",), one, ffi), mesh=one, in_specs=(P(),) * len(ops), out_specs=(P(),) * n_out,
                check_vma=False,
            )
            row[f"per_device_{way}{suffix}_ms"] = timeit(jax.jit(per), *ops)
    seq.RECORDS_PLATFORMS = platforms
    print(
        f"{op.name} {row['shape']} bf16, each device's forward in a two-way split, on one device: "
        f"{row['per_device_records_ms']:.2f} ms with the forward's first pass exchanged first "
        f"({row['per_device_records_ms'] / row['fwd_one_ms']:.3f}x the whole {row['fwd_one_ms']:.2f}; its shard alone "
        f"{row['fwd_shard_alone_ms']:.2f}), {row['per_device_other_ms']:.2f} the other way; with checkpoints "
        f"{row['per_device_records_checkpoints_ms']:.2f} / {row['per_device_other_checkpoints_ms']:.2f}",
        flush=True,
    )
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--skip-longest", action="store_true", help="only the speed of the main shapes")
    ap.add_argument("--longest-only", action="store_true", help="only the longest sequences (e.g. in a process of their own)")
    ap.add_argument("--limit-gib", type=float, help="memory a device may use (default: its allocator's limit)")
    ap.add_argument("--per-device", action="store_true", help="one device: each device's work in a two-way split")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    devices = jax.devices()
    if args.per_device:
        one = jax.make_mesh((1,), ("seq",), devices=devices[:1])
        gpu = args.device == "gpu"
        ops = [Scan(4096, 16), Ssd(64, 64, 128, 256)] if gpu else [Scan(64, 16), Ssd(4, 64, 64, 64)]
        seqlen = 131072 if gpu else 8192
        print(f"{devices[0].device_kind}; jax {jax.__version__}", flush=True)
        results = [bench_per_device(op, seqlen, one, jnp.bfloat16) for op in ops]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(devices=[devices[0].device_kind], jax=jax.__version__, time=time.strftime("%Y-%m-%d %H:%M"))
        (out / f"seqlen_sharding_per_device_{args.device}.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
        return
    if len(devices) < 2:
        sys.exit(f"bench_seqlen_sharding: needs 2 or more devices, found {len(devices)}")
    one = jax.make_mesh((1,), ("seq",), devices=devices[:1])
    many = jax.make_mesh((len(devices),), ("seq",), devices=devices)
    gpu = args.device == "gpu"
    dtype = jnp.bfloat16
    if gpu:
        seqlen, ops = 131072, [Scan(4096, 16), Ssd(64, 64, 128, 256)]
        stats = devices[0].memory_stats() or {}
        limit = args.limit_gib * GIB if args.limit_gib else stats.get("bytes_limit")
        if limit is None:
            sys.exit("bench_seqlen_sharding: no memory limit from the allocator: pass --limit-gib")
        probe = 1 << 18
    else:
        seqlen, ops = 8192, [Scan(64, 16), Ssd(4, 16, 16, 64)]
        probe = 1 << 15
        limit = None
    print(f"{len(devices)} x {devices[0].device_kind}; jax {jax.__version__}", flush=True)
    results, ok = [], True
    for op in [] if args.longest_only else ops:
        row = bench_speed(op, seqlen, one, many, dtype, tol=2e-2)
        results.append(row)
        ok &= row["ok"]
    if not args.skip_longest:
        for op in ops:
            if limit is None:  # the CPU has no memory limit: one device's need at 4x the probe stands in
                params = op.params(np.random.default_rng(0))
                op_limit = compiled_bytes(step_fns(op, params)[1], abstract(op, 4 * probe, one, dtype), params)
            else:
                op_limit = limit
            row = bench_longest(op, one, many, dtype, op_limit, probe, run=True)
            results.append(row)
            ok &= row["ok"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(devices=[d.device_kind for d in devices], jax=jax.__version__, time=time.strftime("%Y-%m-%d %H:%M"))
    name = f"seqlen_sharding_{args.device}{'_longest' if args.longest_only else ''}.json"
    (out / name).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print("all outputs match" if ok else "MISMATCH or failed run", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
