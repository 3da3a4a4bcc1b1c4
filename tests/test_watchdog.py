"""The suite's hang watchdog (tests/conftest.py): a blocked test ends its process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).parent


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    code = ("import sys, threading, time; sys.path.insert(0, sys.argv[1]); "
            "from conftest import watchdog\n" + body)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, str(TESTS)], capture_output=True,
                          text=True, timeout=120)
    return done, time.monotonic() - start


def test_a_blocked_body_ends_the_process_with_tracebacks():
    done, elapsed = _run("with watchdog(1):\n    threading.Event().wait()")
    assert done.returncode != 0
    assert "Timeout" in done.stderr and "Thread" in done.stderr
    assert elapsed < 60


def test_a_body_that_finishes_cancels_the_timer():
    done, _ = _run("with watchdog(1):\n    pass\ntime.sleep(2)\nprint('survived')")
    assert done.returncode == 0 and "survived" in done.stdout, done.stderr
