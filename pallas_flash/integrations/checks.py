"""What the adapters share: the check that the library names an adapter relies on still
exist, and the one-time warning of a call handed back to the library's own attention."""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Iterable


def require(owner: object, names: Iterable[str], *, tested: str,
            call_parameters: Iterable[str] = ()) -> None:
    """Raises ``ImportError`` naming the tested versions when a name moved.

    Args:
      owner: the library's module or class that should hold ``names``.
      names: attributes the adapter reads or overrides (private ones included).
      tested: the library versions the adapter was tested with, for the message.
      call_parameters: parameter names ``owner`` (a callable) must accept.
    """
    missing = [name for name in names if not hasattr(owner, name)]
    if call_parameters:
        accepted = inspect.signature(owner).parameters
        missing += [f"{name}=" for name in call_parameters if name not in accepted]
    if missing:
        raise ImportError(
            f"{getattr(owner, '__qualname__', owner)} lacks {', '.join(missing)}, which the "
            f"pallas_flash adapter relies on; it was tested with {tested}")


_lock = threading.Lock()
_warned: set[tuple[str, str]] = set()


def warn_once(adapter: str, reason: str, fallback: str) -> None:
    """Warns, once per process for each ``(adapter, reason)``, that calls for ``reason``
    run ``fallback`` (the library's own attention) instead of pallas_flash.

    Args:
      adapter: the adapter's module name, e.g. ``"pallas_flash.integrations.keras"``.
      reason: what the call asked for that the adapter cannot honour.
      fallback: what runs instead, e.g. ``"Keras's own dot_product_attention"``.
    """
    with _lock:
        if (adapter, reason) in _warned:
            return
        _warned.add((adapter, reason))
    warnings.warn(f"{adapter}: {reason}; running {fallback} for these calls", stacklevel=3)


def reset_warnings() -> None:
    """Forgets which warnings :func:`warn_once` gave, so each is given again."""
    with _lock:
        _warned.clear()
