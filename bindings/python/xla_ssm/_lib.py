"""Finding, loading and registering ``libxla_ssm.so`` (once per process)."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import jax

LIBRARY_ENV = "XLA_SSM_LIBRARY"
LIBRARY_NAME = "libxla_ssm.so"

# XLA target names; the handlers are exported as `<target>_cpu` / `<target>_cuda`. A library that
# lacks one (an older build) is refused with the name of what is missing.
TARGETS = (
    "xla_ssm_selective_scan_fwd",
    "xla_ssm_selective_scan_bwd",
    "xla_ssm_selective_scan_chunk_records",
    "xla_ssm_selective_scan_carry_fwd",
    "xla_ssm_selective_scan_carry_bwd",
    "xla_ssm_selective_state_update",
    "xla_ssm_causal_conv1d_fwd",
    "xla_ssm_causal_conv1d_bwd",
    "xla_ssm_causal_conv1d_update",
    "xla_ssm_mamba_decode_step",
    "xla_ssm_ssd_fwd",
    "xla_ssm_ssd_bwd",
    "xla_ssm_ssd_part_records",
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_path: Path | None = None
_platforms: dict[str, tuple[str, ...]] = {}


def candidate_paths() -> list[Path]:
    """Where the library is looked for, in order."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        # An explicit choice: never fall back silently to another build.
        return [Path(env).expanduser()]
    here = Path(__file__).resolve().parent
    paths = [here / LIBRARY_NAME]
    # Run from the source tree (<repo>/bindings/python/xla_ssm): the cargo release build.
    if here.parent.name == "python" and here.parent.parent.name == "bindings":
        paths.append(here.parents[2] / "target" / "release" / LIBRARY_NAME)
    return paths


def library_path() -> Path:
    """The path of the loaded library, or of the one that would be loaded; raises if none is found."""
    return _path if _path is not None else find_library()


def find_library() -> Path:
    """Search `candidate_paths()`; raise FileNotFoundError naming every place looked in."""
    tried = candidate_paths()
    for p in tried:
        if p.is_file():
            return p
    where = "\n".join(f"  - {p}" for p in tried)
    hint = (
        f"{LIBRARY_ENV} is set but names no file"
        if os.environ.get(LIBRARY_ENV)
        else f"build it with `cargo build --release` or set {LIBRARY_ENV}=/path/to/{LIBRARY_NAME}"
    )
    raise FileNotFoundError(f"xla_ssm: cannot find {LIBRARY_NAME}; looked in:\n{where}\n({hint})")


def load() -> ctypes.CDLL:
    """Load the library and register every target it exports, once."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        lib = ctypes.CDLL(str(path))
        lib.xla_ssm_selective_scan_fwd_workspace_bytes.restype = ctypes.c_int64
        lib.xla_ssm_selective_scan_fwd_workspace_bytes.argtypes = [ctypes.c_int64] * 4
        lib.xla_ssm_selective_scan_bwd_workspace_bytes.restype = ctypes.c_int64
        lib.xla_ssm_selective_scan_bwd_workspace_bytes.argtypes = [ctypes.c_int64] * 5
        for fn, args in (
            ("xla_ssm_selective_scan_chunk_records_count", 4),  # (batch, dim, seqlen, dstate)
            ("xla_ssm_selective_scan_chunk_record_floats", 1),  # (dstate)
        ):
            sizer = getattr(lib, fn, None)
            if sizer is None:
                raise OSError(f"xla_ssm: {path} does not export {fn}")
            sizer.restype = ctypes.c_int64
            sizer.argtypes = [ctypes.c_int64] * args
        for fn in (
            "xla_ssm_ssd_fwd_workspace_bytes",
            "xla_ssm_ssd_bwd_workspace_bytes",
            "xla_ssm_ssd_packed_fwd_workspace_bytes",
            "xla_ssm_ssd_packed_bwd_workspace_bytes",
            "xla_ssm_ssd_part_records_floats",
        ):
            sizer = getattr(lib, fn, None)
            if sizer is None:
                raise OSError(f"xla_ssm: {path} does not export {fn}")
            sizer.restype = ctypes.c_int64
            # (batch, seqlen, heads, headdim, dstate, groups, chunk_size, dtype code); packed:
            # (seqlen, num_seqs, heads, headdim, dstate, groups, chunk_size, dtype code)
            sizer.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_int32]
        lib.xla_ssm_last_error.restype = ctypes.c_char_p
        lib.xla_ssm_last_error.argtypes = []
        chunk_dtype = getattr(lib, "xla_ssm_ssd_chunk_states_dtype", None)
        if chunk_dtype is None:
            raise OSError(f"xla_ssm: {path} does not export xla_ssm_ssd_chunk_states_dtype")
        chunk_dtype.restype = ctypes.c_int32
        # (headdim, dstate, chunk_size, dtype code) -> dtype code
        chunk_dtype.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int32]
        for target in TARGETS:
            done = []
            cpu = getattr(lib, target + "_cpu", None)
            if cpu is None:
                raise OSError(f"xla_ssm: {path} does not export {target}_cpu")
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(cpu), platform="cpu")
            done.append("cpu")
            # Absent when the library was built with --no-default-features (no CUDA).
            # Registering for CUDA is harmless where jax has no GPU backend.
            cuda = getattr(lib, target + "_cuda", None)
            if cuda is not None:
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(cuda), platform="CUDA")
                done.append("CUDA")
            _platforms[target] = tuple(done)
        _path = path
        _lib = lib
        return lib


# The C API's dtype codes (XLA_SSM_F32, XLA_SSM_BF16, XLA_SSM_F16), as the sizers and
# xla_ssm_ssd_chunk_states_dtype take and return them.
_DTYPE_CODES = {jax.numpy.dtype(t): code for code, t in enumerate(("float32", "bfloat16", "float16"))}


def dtype_code(dtype) -> int:
    """The C API's code of a float dtype (XlaSsmDtype: f32 0, bf16 1, f16 2)."""
    return _DTYPE_CODES[jax.numpy.dtype(dtype)]


def size(sizer: str, *sizes: int) -> int:
    """A size from the library's `sizer` (e.g. "xla_ssm_ssd_fwd_workspace_bytes": bytes of device
    workspace); a shape the library refuses raises ValueError with its reason."""
    lib = load()
    n = getattr(lib, sizer)(*sizes)
    if n < 0:
        raise ValueError(f"xla_ssm: {lib.xla_ssm_last_error().decode(errors='replace')}")
    return n


def registered_platforms(target: str = "xla_ssm_selective_scan_fwd") -> tuple[str, ...]:
    """Platforms the target was registered for, () when the library lacks it (loads the library)."""
    load()
    return _platforms.get(target, ())


def require(target: str) -> ctypes.CDLL:
    """The loaded library, which has every target (load() refuses one that lacks any)."""
    lib = load()
    assert target in _platforms, target
    return lib
