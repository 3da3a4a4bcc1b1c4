"""Mosaic GPU interpret mode (the kernels on the CPU): the guard its threads need."""

from __future__ import annotations

import os

from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(interpret: bool, num_threads: int) -> plgpu.InterpretGPUParams | None:
    """``plgpu.kernel``'s ``interpret=`` argument: None to compile for the GPU; in interpret
    mode the interpreter's parameters, once the CPU client is known to run the kernel's
    ``num_threads`` warpgroups at once.

    The interpreter runs each warpgroup as a thread whose barrier waits block inside an XLA
    host callback, on the CPU client's thread pool, which XLA sizes by the usable cores
    unless ``PJRT_NPROC`` says otherwise. With fewer pool threads than warpgroups, the
    blocked ones can starve the rest: the call hangs (seen on a 2-core machine with three
    and four warpgroups). Such a call is refused instead.

    Raises:
      ValueError: ``interpret`` is True and the pool is smaller than ``num_threads``.
    """
    if not interpret:
        return None
    pool, source = _cpu_client_threads()
    if pool < num_threads:
        raise ValueError(
            f"interpret=True: the Mosaic GPU interpreter runs this kernel's {num_threads} "
            f"warpgroups as threads that wait on each other inside host callbacks, and the "
            f"CPU client has {pool} threads ({source}), so the call would hang; set "
            f"PJRT_NPROC={max(8, num_threads)} in the environment before JAX starts")
    return plgpu.InterpretGPUParams()


def _cpu_client_threads() -> tuple[int, str]:
    """The CPU client's thread pool size as XLA picks it, and where it comes from."""
    value = os.environ.get("PJRT_NPROC", "")
    if value.isdigit() and int(value) > 0:
        return int(value), f"PJRT_NPROC={value}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return cores, "the usable cores; PJRT_NPROC is not set"
