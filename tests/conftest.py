"""Fixtures shared by the CPU suite."""

from __future__ import annotations

import pytest
from support import IMPLEMENTATIONS


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def impl(request) -> str:
    """Name of the implementation under test; every test taking it runs for each one."""
    return request.param
