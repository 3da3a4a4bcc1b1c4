"""Which backend runs a call: the registry, availability, and one choice per pass.

Every backend module (``BACKENDS``) is a :class:`pallas_flash.contract.Backend`: its
``KERNELS`` (whose ``name`` is its key here), ``default_config``, ``unsupported`` and
optionally ``unsupported_backward`` (a module without it runs every backward its forward
can).

The forward and the backward are chosen separately: every backward reads the same
residuals (q, k, v, out, lse ``[B, N, T]`` float32, delta), so a backward of one backend
can follow the forward of another. :func:`choose_backward` keeps the forward's backend when
it can run the backward, and otherwise takes the first other candidate, fastest first.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_flash.contract import DTYPES, Backend
from pallas_flash.masking import MaskSpec


# Each backend is imported on first use, by a plain import that static checks see: Mosaic
# needs a jaxlib with Mosaic GPU, and a CPU-only program need not load the GPU kernels.
def _xla() -> Backend:
    from pallas_flash import xla

    return xla


def _triton() -> Backend:
    from pallas_flash import triton

    return triton


def _mosaic() -> Backend:
    from pallas_flash import mosaic

    return mosaic


#: The registry: each backend's name and the function that imports its module.
BACKENDS: dict[str, Callable[[], Backend]] = {"xla": _xla, "triton": _triton, "mosaic": _mosaic}
#: float64 inputs (under jax_enable_x64) run only on the XLA path, computed in float64.
FLOAT64 = np.dtype(np.float64)
FLOAT64_IMPLEMENTATIONS = ("xla",)
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class Features:
    """What a call uses beyond q, k, v and the mask spec: the keywords of ``unsupported``."""

    has_segments: bool = False
    softcap: float | None = None
    has_bias: bool = False
    has_mask: bool = False
    #: The values' head dim where it differs from the query/key one (None: the same; passed
    #: to a backend's checks only when set).
    value_head_dim: int | None = None


#: A call with no segment ids, soft-cap, bias or mask (what the autotuner times).
PLAIN_CALL = Features()


def backend(name: str) -> Backend:
    """The backend module registered as ``name`` (imported on first use).

    Raises:
      ValueError: ``name`` is not a key of ``BACKENDS``.
      ImportError: the module cannot be imported here.
    """
    _check_name(name)
    return BACKENDS[name]()


def available_implementations() -> tuple[str, ...]:
    """Implementations that can run on the default device (``interpret=False``), fastest
    first."""
    if jax.default_backend() != "gpu":
        return ("xla",)
    names = ["triton", "xla"]
    if _is_hopper() and _importable("mosaic"):
        names.insert(0, "mosaic")
    return tuple(names)


def check_implementation(name: str | None, interpret: bool,
                         also: tuple[str, ...] = ()) -> None:
    """Raises ValueError unless ``name`` is None (the dispatcher chooses) or a backend's
    name, and ``interpret`` a bool. ``also``: other names the caller takes
    (``attention``'s ``"cudnn"``), for the message.

    Whether the device runs the backend is not checked here: a program may be lowered for
    another platform than the host's (``.lower(lowering_platforms=("cuda",))`` on a CPU
    host), and Pallas refuses a kernel for a platform it cannot run on when lowering it.
    """
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    if name is not None:
        _check_name(name, also)


def _check_name(name, also: tuple[str, ...] = ()) -> None:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"implementation must be one of {[*sorted(BACKENDS), *also]} "
                         f"or None, got {name!r}")


def default_implementation() -> str:
    """``mosaic`` on Hopper GPUs, ``triton`` on other GPUs, ``xla`` elsewhere."""
    return available_implementations()[0]


def candidates(interpret: bool) -> tuple[str, ...]:
    """The implementations :func:`choose` considers, fastest first: on the CPU in interpret
    mode the Triton kernels run too."""
    if not isinstance(interpret, bool):
        raise ValueError(f"interpret must be a bool, got {interpret!r}")
    return ("triton", "xla") if interpret else available_implementations()


def unsupported(name: str, q_shape, kv_shape, dtype, mask: MaskSpec,
                features: Features) -> str | None:
    """Why backend ``name``'s forward cannot run this call, or None."""
    _check_features(features)
    if jnp.dtype(dtype) == FLOAT64 and name not in FLOAT64_IMPLEMENTATIONS:
        return f"float64 inputs run only on implementation={FLOAT64_IMPLEMENTATIONS[0]!r}"
    return backend(name).unsupported(q_shape, kv_shape, dtype, mask,
                                     **_feature_kwargs(features))


def unsupported_backward(name: str, q_shape, kv_shape, dtype, mask: MaskSpec,
                         features: Features, *, bias_grad: bool = False) -> str | None:
    """Why backend ``name``'s backward cannot run this call, or None.

    A backend that cannot run the forward of a call cannot run its backward either.
    """
    if not isinstance(bias_grad, bool):
        raise ValueError(f"bias_grad must be a bool, got {bias_grad!r}")
    reason = unsupported(name, q_shape, kv_shape, dtype, mask, features)
    check = getattr(backend(name), "unsupported_backward", None)
    if reason is None and check is not None:
        reason = check(q_shape, kv_shape, dtype, mask, **_feature_kwargs(features),
                       bias_grad=bias_grad)
    return reason


def choose(q_shape, kv_shape, dtype, mask: MaskSpec, features: Features, *,
           interpret: bool) -> str:
    """The forward's backend: the first of :func:`candidates`, fastest first, that supports
    this call (``xla`` supports every call)."""
    return _first_supported(candidates(interpret), q_shape, kv_shape, dtype, mask, features)


def choose_decode(q_shape, kv_shape, dtype, mask: MaskSpec, features: Features, *,
                  interpret: bool) -> str:
    """The backend of a decode step's packed forward (:mod:`pallas_flash.decode`): Triton
    first where it runs, then :func:`choose`'s order.

    A decode tile has a handful of real query rows. The Mosaic forward's CTA computes at
    least 128 rows (two 64-row wgmma consumers) for each K/V byte, which makes a decode step
    compute-bound; the Triton forward's 16-row tiles keep it bound by HBM. On the H200 the
    Triton decode read K/V 1.0-1.7x as fast as the Mosaic one at every measured point
    (docs/decode.md). The Mosaic backend's own decode kernel
    (:mod:`pallas_flash.mosaic.decode`, one 64-row warpgroup per chunk, full caches only)
    read at 0.95-1.00x the Triton decode's rate (decode-2026-12-03-mosaic-kernel.md), so
    Triton stays first.
    """
    order = candidates(interpret)
    if "triton" in order:
        order = ("triton", *(name for name in order if name != "triton"))
    return _first_supported(order, q_shape, kv_shape, dtype, mask, features)


def _first_supported(order, q_shape, kv_shape, dtype, mask: MaskSpec,
                     features: Features) -> str:
    """The first backend of ``order`` whose forward runs this call (``xla`` runs every one)."""
    for name in order:
        if unsupported(name, q_shape, kv_shape, dtype, mask, features) is None:
            return name
    return "xla"


def choose_backward(forward: str, q_shape, kv_shape, dtype, mask: MaskSpec,
                    features: Features, *, bias_grad: bool, interpret: bool) -> str:
    """The backward's backend after a forward on ``forward``: ``forward`` itself when it can
    run this backward, else the first other of :func:`candidates` that can.

    Raises:
      ValueError: no backend can run this backward (each one's reason is in the message).
    """
    reasons = {}
    others = [name for name in candidates(interpret) if name != forward]
    for name in (forward, *others):
        reasons[name] = unsupported_backward(name, q_shape, kv_shape, dtype, mask, features,
                                             bias_grad=bias_grad)
        if reasons[name] is None:
            return name
    raise ValueError("no implementation can run this backward: " + "; ".join(
        f"{name}: {reason}" for name, reason in reasons.items()))


def deterministic_backward(requested: bool = False) -> bool:
    """Whether a backward must be bitwise reproducible: the call asks for it
    (``attention(..., deterministic=True)``), or ``XLA_FLAGS`` asks XLA for deterministic
    GPU ops (``--xla_gpu_deterministic_ops``, which XLA's own cuDNN attention honours).

    The one place that decides; each backend's backward then runs its reproducible
    variant (Mosaic: the separate dQ kernel; Triton and XLA have no other).
    """
    return bool(requested) or _xla_deterministic_ops()


def _xla_deterministic_ops() -> bool:
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            return value.lower() in ("", "true", "1")
    return False


def check_arrays(query, key, value, *, any_head_dims: bool = False) -> None:
    """Raises ValueError, naming the argument, unless ``query``, ``key`` and ``value`` are
    the attention inputs the API accepts: rank 4 ``[batch, seq, heads, head_dim]``, one
    dtype of ``DTYPES`` or float64, matching batch, query heads a multiple of key/value
    heads, at least one head (batch and sequences may be empty), key and value of one
    batch, length and head count.

    Head dims: by default key and value have the query's head dim, at most
    ``MAX_HEAD_DIM`` (what the decode, paged and ring paths take). With
    ``any_head_dims`` (:func:`pallas_flash.attention`) the value head dim may differ from
    the query/key one and neither has an upper bound here: each backend says what it
    takes (``unsupported``), and the XLA path takes every size.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(
                f"{name} must have rank 4 [batch, seq, heads, head_dim] (or 3, without "
                f"batch), got shape {getattr(x, 'shape', None)}")
        if jnp.dtype(x.dtype) not in (*DTYPES, FLOAT64):
            raise ValueError(
                f"{name} dtype must be one of bfloat16, float16, float32, float64, "
                f"got {x.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            "query, key and value must share one dtype, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}")
    if any_head_dims:
        if key.shape[:3] != value.shape[:3]:
            raise ValueError(
                "key and value must have the same [batch, seq_kv, kv_heads], got "
                f"{key.shape} and {value.shape}")
        if value.shape[3] < 1:
            raise ValueError(f"value head_dim must be at least 1, got {value.shape[3]}")
    elif key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape, got {key.shape} and {value.shape}")
    if query.shape[0] != key.shape[0]:
        raise ValueError(
            f"key batch size {key.shape[0]} does not match query batch size {query.shape[0]}")
    if query.shape[3] != key.shape[3]:
        raise ValueError(
            f"key head_dim {key.shape[3]} does not match query head_dim {query.shape[3]}")
    top = None if any_head_dims else MAX_HEAD_DIM
    if query.shape[3] < 1 or (top is not None and query.shape[3] > top):
        raise ValueError(f"query head_dim must be in [1, {top}], got {query.shape[3]}"
                         if top else f"query head_dim must be at least 1, got {query.shape[3]}")
    if query.shape[2] < 1 or key.shape[2] < 1:
        raise ValueError(
            f"query and key must have at least one head, got {query.shape} and {key.shape}")
    if query.shape[2] % key.shape[2]:
        raise ValueError(
            f"query heads ({query.shape[2]}) must be a multiple of key/value heads "
            f"({key.shape[2]})")


def _feature_kwargs(features: Features) -> dict:
    """``features`` as the keywords of a backend's ``unsupported``: ``value_head_dim`` only
    when set, so a backend without other value head dims keeps its signature."""
    kwargs = dataclasses.asdict(features)
    if kwargs["value_head_dim"] is None:
        del kwargs["value_head_dim"]
    return kwargs


def _check_features(features) -> None:
    if not isinstance(features, Features):
        raise ValueError(f"features must be a dispatch.Features, got {features!r}")


def _is_hopper() -> bool:
    device = jax.devices()[0]
    return getattr(device, "compute_capability", "") in ("9.0", "9.0a")


def _importable(name: str) -> bool:
    try:
        backend(name)
    except ImportError:
        return False
    return True
