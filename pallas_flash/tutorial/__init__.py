"""The tutorial: the papers' algorithms and experiments around the package, not part of it.

* :mod:`~pallas_flash.tutorial.cli` — the ``pallas-flash`` command (``check``, ``bench``,
  ``memory``, ``io``); ``python -m pallas_flash`` is the same program.
* :mod:`~pallas_flash.tutorial.demo` — the equivalence check of ``make demo``.
* :mod:`~pallas_flash.tutorial.loops` — FlashAttention-1 and -2's loops in plain JAX.
* :mod:`~pallas_flash.tutorial.io_model` — the papers' HBM-traffic and memory model.
* :mod:`~pallas_flash.tutorial.fp8_study` — FlashAttention-3's FP8 numerics in XLA: the
  forward reference, its online version and the FP8 backward of the accuracy study.

These import the package; the package never imports them.
"""
