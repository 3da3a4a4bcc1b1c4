"""Set-up shared by the CPU suite (the backends under test: tests/support.py)."""

from __future__ import annotations

import os

# Mosaic GPU's interpret mode runs each warpgroup as a thread that can block in a host
# callback while it waits on a barrier; XLA's CPU client sizes its thread pool by the core
# count, so on a 2-core machine two waiting warpgroups can starve the third (a hang, seen
# here). More pool threads than cores fixes it; set before the CPU client is created.
os.environ.setdefault("PJRT_NPROC", "8")
