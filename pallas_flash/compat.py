"""The JAX versions pallas-flash supports, and every private JAX name it uses.

``jax._src`` has no stability promise: its names move between releases. They are imported
here and nowhere else, after a check that the installed jax and jaxlib are of a release
line where each name is known to exist with the behaviour this package relies on (the CI
runs the CPU suite on the oldest and on the newest supported release). A JAX outside that
range fails at import with the range named, not later with an AttributeError deep inside a
transformation.
"""

from __future__ import annotations

import re

import jax
import jaxlib

# Supported: MIN_VERSION <= (major, minor, patch) < END_VERSION; also pyproject.toml's
# dependencies.
MIN_VERSION = (0, 11, 2)
END_VERSION = (0, 13, 0)
SUPPORTED_RANGE = ">=0.11.2,<0.13"


def release(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a JAX version string: ``"0.12.0.1"`` -> ``(0, 12, 0)``,
    ``"0.13.0.dev20261201"`` -> ``(0, 13, 0)``.

    Raises ``ValueError`` for a string that does not start with three dot-separated numbers.
    """
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"version must be a string like '0.12.1', got {version!r}")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def check_version(package: str, version: str) -> None:
    """Raise ``ImportError`` naming the supported range if ``version`` of ``package``
    (``"jax"`` or ``"jaxlib"``) is outside it."""
    if package not in ("jax", "jaxlib"):
        raise ValueError(f"package must be 'jax' or 'jaxlib', got {package!r}")
    if not MIN_VERSION <= release(version) < END_VERSION:
        raise ImportError(
            f"pallas-flash supports {package} {SUPPORTED_RANGE} (0.11.2 through 0.12.x), "
            f"found {package} {version}: install a supported version, e.g. "
            f"pip install 'jax{SUPPORTED_RANGE}' 'jaxlib{SUPPORTED_RANGE}'")


check_version("jax", jax.__version__)
check_version("jaxlib", jaxlib.__version__)

# Imported only after the check: on an unsupported JAX these may not exist.
from jax._src import core as _core  # noqa: E402
from jax._src import custom_derivatives as _custom_derivatives  # noqa: E402
from jax._src.cudnn import fused_attention_stablehlo as cudnn_fused_attention  # noqa: E402
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import batching  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # noqa: E402

# The tracer classes of forward-mode AD, linearize and vmap (pallas_flash.autodiff tells
# whether an input is being differentiated; JAX has no public test for that).
JVPTracer = _ad.JVPTracer
LinearizeTracer = _ad.LinearizeTracer
BatchTracer = batching.BatchTracer
# The effect of a jax.new_ref inside a traced function.
InternalMutableArrayEffect = _core.InternalMutableArrayEffect
# jax.custom_derivatives.linear_call's primitive, which pallas_flash.autodiff gives the
# effects and batching rules JAX lacks.
linear_call_p = _custom_derivatives.linear_call_p
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
# Imported above: interpret_pallas_call, Mosaic GPU's interpreter, whose race detector the
# kernel tests read (get_races()); cudnn_fused_attention, the cuDNN call behind jax.nn's,
# whose FP8 form (use_fp8=True) the FP8 benchmark runs.

__all__ = ["END_VERSION", "MIN_VERSION", "SUPPORTED_RANGE", "BatchTracer",
           "InternalMutableArrayEffect", "JVPTracer", "LinearizeTracer", "batching",
           "check_version", "convert_constvars_jaxpr", "cudnn_fused_attention",
           "interpret_pallas_call", "linear_call_p", "release"]
