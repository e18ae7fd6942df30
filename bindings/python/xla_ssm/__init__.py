"""xla_ssm: state-space-model kernels (Mamba selective scan, Mamba-2 SSD) as XLA FFI targets, for JAX.

The shared library ``libxla_ssm.so`` is looked for in ``$XLA_SSM_LIBRARY``, then next to this
package, then in ``<repo>/target/release``; it is loaded and its targets registered with
``jax.ffi`` on first use (or by calling :func:`load`).
"""

from ._lib import library_path, load, registered_platforms
from ._scan import CHECKPOINT_LEN, selective_scan
from ._selective_scan import selective_scan_fwd, selective_scan_ref

__all__ = [
    "CHECKPOINT_LEN",
    "library_path",
    "load",
    "registered_platforms",
    "selective_scan",
    "selective_scan_fwd",
    "selective_scan_ref",
]
__version__ = "0.1.0"

# Decode-time operations (docs/decode.md).
from ._decode import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_update,
    mamba_decode_step,
    selective_state_update,
    selective_state_update_ref,
)

__all__ += [
    "causal_conv1d",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "mamba_decode_step",
    "selective_state_update",
    "selective_state_update_ref",
]

# Mamba-2's chunked SSD scan (docs/ssd.md).
from ._ssd import CHUNK_SIZES, ssd, ssd_ref  # noqa: E402

__all__ += ["CHUNK_SIZES", "ssd", "ssd_ref"]
