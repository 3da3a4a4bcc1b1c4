"""Benchmark suite: FlashAttention-paper conventions, timing harness, reports.

``python -m benchmarks.suite`` times every available attention implementation side by side
and writes JSON, a markdown table and bar charts; ``python -m benchmarks.report`` rebuilds the
table and charts from one or more JSON files.
"""
