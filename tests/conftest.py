"""Set-up shared by the CPU suite (the backends under test: tests/support.py)."""

from __future__ import annotations

import contextlib
import faulthandler
import os

import pytest

# Mosaic GPU's interpret mode runs each warpgroup as a thread that can block in a host
# callback while it waits on a barrier; XLA's CPU client sizes its thread pool by the core
# count, so on a 2-core machine two waiting warpgroups can starve the third (a hang, seen
# here). More pool threads than cores fixes it; set before the CPU client is created.
os.environ.setdefault("PJRT_NPROC", "8")

# Eight CPU devices, for the sharding tests (tests/test_sharding.py): XLA reads the flag when
# the CPU client is created, so it is set here, before any test initialises jax. Unsharded
# computations still run on the first device only.
_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}=8".strip()

#: A test still running after this long is taken for a hang (the slowest CPU test takes
#: about 12 s on 2 cores; GPU tests compile for a minute or two).
TEST_TIMEOUT_S = 900


@contextlib.contextmanager
def watchdog(seconds: float):
    """Ends the process (exit code 1, every thread's traceback on stderr) if the body runs
    longer than ``seconds``. A kernel protocol bug in interpret mode (a barrier that never
    completes) blocks a warpgroup thread forever; this turns the hang into a failure: under
    pytest-xdist the worker's crash fails the test and a new worker takes over."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _fail_hangs():
    with watchdog(TEST_TIMEOUT_S):
        yield
