"""Wall-clock timing of jitted JAX functions: the package's timer, shared with the autotuner.

``time_fn`` lives in :mod:`pallas_flash.tuning` (the package may not import the benchmarks);
see its module docstring for how samples are taken.
"""

from pallas_flash.tuning import Timing, time_fn

__all__ = ["Timing", "time_fn"]
