"""Checks shared by the adapters: the library names an adapter relies on still exist."""

from __future__ import annotations

import inspect
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
