"""Helpers for looking inside the kernels rather than timing them.

``python -m benchmarks.tools.profile_backward`` drives Nsight Compute over one forward +
backward and summarises its exports per kernel; ``python -m benchmarks.tools.lowered_modules``
fingerprints the Mosaic GPU modules the default configs lower to, so that a refactor can
show it left the kernels unchanged.
"""
