"""GPU-only tests: compiled kernels at real sizes. Skipped without a CUDA GPU."""

from __future__ import annotations

import jax
import pytest


def _has_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
