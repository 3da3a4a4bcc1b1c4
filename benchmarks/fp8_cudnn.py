"""cuDNN's FP8 attention beside pallas-flash's: speed (default) and accuracy (``--accuracy``).

On the H200, from the repository root::

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 -m benchmarks.fp8_cudnn --out $OUT
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 -m benchmarks.fp8_cudnn --accuracy --out $OUT

**cuDNN FP8.** JAX reaches cuDNN's FP8 forward only through its private
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., use_fp8=True)``
(jax 0.11.2): e4m3 Q, K, V (layout BTNH) with one scale per tensor, an e4m3 output, and
``(out, amax_s, amax_o)`` returned. It runs the cudnn-frontend SDPA_FP8 graph, whose
arithmetic is (every ``scale``/``descale`` multiplies)::

    S  = (Q8·K8ᵀ) · scale · descale_q · descale_k            float32 accumulation
    P  = softmax(S);  amax_s = max P;  P8 = e4m3(P · scale_s)
    O  = (P8·V8) · descale_s · descale_v;  amax_o = max |O|;  out8 = e4m3(O · scale_o)

So ``descale_q/k/v`` are our scales (``x ≈ x8 · scale``, :func:`pallas_flash.fp8.quantize`
with ``block=None``), ``scale_s = 448`` and ``descale_s = 1/448`` round P in [0, 1] as our
kernel does (P·448), ``scale_o = 1 / out_scale`` (``out ≈ out8 · out_scale``); the
backward's entries of ``fp8_params`` are ones (a forward call does not read them).
Forward-only calls need ``head_dim <= 256`` and a multiple of 16; no mask but causal.

**Speed** (default): per point (``--head-dims`` × ``--seq-lens`` × ``--causal``; batch =
``--tokens`` / L, heads = ``--hidden`` / head_dim; bf16 N(0, 1) inputs) every
implementation of ``--impls`` is jitted, checked, then timed in ``--rounds`` interleaved
rounds (each round times every implementation once with ``pallas_flash.tuning.time_fn``);
the median over rounds gives TFLOP/s (forward 4·B·H·L²·D, halved when causal):

* ``cudnn_fp8``: cuDNN FP8 on operands quantized beforehand (per tensor, e4m3 out): its
  best case, no quantization pass timed;
* ``cudnn_bf16``: ``jax.nn.dot_product_attention(implementation="cudnn")``;
* ``fa3``: ``flash_attn3_jax.flash_mha`` (bf16) where it imports, head_dim 128 only;
* ``ours_fp8``: the whole ``pallas_flash.fp8.attention_fp8`` (bf16 in and out, per-block
  quantization included): the call a user makes;
* ``ours_fp8_quantized``: ``fp8.attention_fp8_quantized`` on ``fp8.quantize_operands``'
  per-block operands (V already transposed): the kernel alone;
* ``ours_bf16``: ``pallas_flash.attention`` (``--bf16-implementation``, default the
  package's choice);
* ``ours_tensor_e4m3out`` (only when named): ``attention_fp8_quantized`` on cuDNN's very
  operands with an e4m3 output, cuDNN's exact contract;
* ``ours_fp8:SPEC`` (only when named): ``ours_fp8`` with the kernel config ``SPEC``
  (``64x128x2op``: ``block_q`` 64, ``block_kv`` 128, 2 stages, overlapped, persistent).

Before timing, each output's last ``--check-rows`` rows of the first two heads of the first
sequence are compared with the float64 oracle: relative error ‖out − ref‖ / ‖ref‖ above
``--tolerance`` (bf16) or ``--fp8-tolerance`` (FP8: e4m3 alone costs 5–9 % at N(0, 1) and
L ≤ 4096, and 17 % at L 16384, cuDNN's FP8 and ours alike on the H200, 2026-12-02) marks
the row *wrong* and it is not timed. A failing implementation is a row with its error,
never a crash. Ratios are TFLOP/s over the anchors' TFLOP/s at the same point.

**Accuracy** (``--accuracy``; the CPU runs it too, cuDNN then "not available"): batch 1,
``--heads`` heads, inputs N(0, 1) ("gaussian") or with 0.1 % outliers of 10·N(0, 1)
("outliers", FlashAttention-3's test: ``benchmarks.fp8_accuracy.with_outliers``), rounded to
bf16; every method against the same float64 oracle of those bf16 inputs; relative error
and RMSE. The per-tensor methods share one set of e4m3 operands and one output scale (the
oracle's max |out| / 448), so ``cudnn_fp8`` and ``ours_tensor_e4m3out`` differ only in
their kernels; ``*_hadamard`` rotate Q and K by the same random Hadamard matrix first
(incoherent processing; for cuDNN the caller rotates). ``--out DIR`` writes
``fp8-cudnn[-accuracy]-<date>[-tag].{json,md}``, after every point.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from benchmarks import report
from benchmarks.flops import attention_flops, problem_shape, tflops_per_s
from benchmarks.fp8_accuracy import with_outliers
from benchmarks.implementations import error_summary
from benchmarks.timing import time_fn
from pallas_flash import fp8
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import MosaicConfig, forward_fp8
from pallas_flash.reference import attention_float64
from pallas_flash.tutorial.cli import int_list

E4M3_MAX = fp8.E4M3_MAX

SPEED_IMPLS = ("cudnn_fp8", "cudnn_bf16", "fa3", "ours_fp8", "ours_fp8_quantized", "ours_bf16",
               "ours_tensor_e4m3out")
#: ``ours_fp8:SPEC``: the whole ``attention_fp8`` with the kernel config ``SPEC``
#: (:func:`parse_config`, e.g. ``64x128x2op``).
CONFIGURED = "ours_fp8:"
DEFAULT_SPEED_IMPLS = SPEED_IMPLS[:6]
#: The speeds every other implementation is divided by (when they ran at the point).
ANCHORS = ("cudnn_fp8", "ours_bf16", "cudnn_bf16")
_FP8 = frozenset({"cudnn_fp8", "ours_fp8", "ours_fp8_quantized", "ours_tensor_e4m3out"})

def parse_config(spec: str) -> MosaicConfig:
    """A kernel config from ``block_q x block_kv x num_stages`` and flags.

    ``"64x128x2o"`` is ``MosaicConfig(64, 128, 2, overlap=True)``; ``c3`` after the stages
    (``"64x128x2oc3"``) asks for three consumer warpgroups, a final ``p`` (``"64x128x2op"``)
    for persistent CTAs.

    Raises:
      ValueError: if ``spec`` is not of that form, or names a config the kernel rejects.
    """
    persistent = spec.endswith("p")
    body, _, consumers = spec.removesuffix("p").partition("c")
    overlap = body.endswith("o")
    sizes = body.removesuffix("o").split("x")
    if len(sizes) != 3 or not all(size.isdigit() for size in sizes) or not (
            consumers == "" or consumers.isdigit()):
        raise ValueError(f"config {spec!r}: expected BLOCKQxBLOCKKVxSTAGES[o][cN][p], "
                         "e.g. 64x128x2op")
    block_q, block_kv, stages = (int(size) for size in sizes)
    return MosaicConfig(block_q, block_kv, stages, overlap=overlap,
                        num_consumers=int(consumers or 2), persistent=persistent)


def rel_err(x, ref) -> float:
    """``‖x − ref‖ / ‖ref‖`` in float64 (the FP8 literature's relative error)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


DISTRIBUTIONS = ("gaussian", "outliers")
CUDNN_METHODS = ("cudnn_fp8", "cudnn_fp8_hadamard")
OURS_METHODS = ("ours_tensor_e4m3out", "ours_tensor", "ours_tensor_hadamard_e4m3out",
                "ours_block", "ours_block_hadamard")
ACCURACY_METHODS = ("bf16", *CUDNN_METHODS, *OURS_METHODS)
#: (label, ours, cuDNN): error ratios on identical operands and output format.
EQUAL_FOOTING = (("ours / cudnn", "ours_tensor_e4m3out", "cudnn_fp8"),
                 ("ours / cudnn, Hadamard", "ours_tensor_hadamard_e4m3out",
                  "cudnn_fp8_hadamard"))


# --- cuDNN ------------------------------------------------------------------------------------

def cudnn_unavailable() -> str | None:
    """None where cuDNN can run, else a sentence saying why not."""
    platform = jax.devices()[0].platform
    if platform != "gpu":
        return f"not available: cuDNN needs an NVIDIA GPU (this is {platform})"
    return None


def cudnn_fp8(q8: jax.Array, k8: jax.Array, v8: jax.Array, q_scale, k_scale, v_scale,
              out_scale, *, is_causal: bool, scale: float | None = None):
    """cuDNN's FP8 forward on per-tensor e4m3 operands: ``(out8, amax_s, amax_o)``.

    Args:
      q8, k8, v8: ``[B, L, N, D]`` float8_e4m3fn (``D <= 256``, a multiple of 16).
      q_scale, k_scale, v_scale: float32 scalars, ``x ≈ x8 · scale`` (cuDNN's descales).
      out_scale: float32 scalar: ``out ≈ out8 · out_scale`` (cuDNN's ``scale_o`` is its
        reciprocal: cuDNN multiplies).
      is_causal: cuDNN's ``MaskType.CAUSAL`` (top-left, the same as ours when T == S).
      scale: softmax scale, default ``1/√D``.

    Returns:
      ``out8`` like ``q8`` (e4m3), and float32 ``amax_s = max P``, ``amax_o = max |out|``
      (before ``scale_o``), each of shape ``(1, 1, 1, 1)``.
    """
    from pallas_flash.compat import cudnn_fused_attention as cudnn  # jax's private cuDNN call

    def param(x):
        return jnp.reshape(jnp.asarray(x, jnp.float32), (1, 1, 1, 1))

    params = {name: param(1.0) for name in cudnn.fp8_params_keys}
    params.update(descale_q=param(q_scale), descale_k=param(k_scale), descale_v=param(v_scale),
                  scale_s=param(E4M3_MAX), descale_s=param(1.0 / E4M3_MAX),
                  scale_o=param(1.0 / jnp.asarray(out_scale, jnp.float32)))
    scale = 1.0 / math.sqrt(q8.shape[-1]) if scale is None else scale
    mask_type = cudnn.MaskType.CAUSAL if is_causal else cudnn.MaskType.NO_MASK
    return cudnn.dot_product_attention(q8, k8, v8, fp8_params=params, scale=scale,
                                       mask_type=mask_type, qkv_layout="BTNH", use_fp8=True)


# --- speed ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Call:
    """One implementation at one point: a jitted ``fn(*args)`` and how to read its output."""

    fn: Callable
    args: tuple
    output: Callable[[Any], jax.Array] = lambda out: out   # -> [B, L, N, D], any float dtype


def make_calls(names: Sequence[str], q, k, v, causal: bool, args) -> dict[str, Call | str]:
    """name -> :class:`Call`, or a sentence saying why it cannot run here."""
    head_dim = q.shape[-1]
    calls: dict[str, Call | str] = {}
    no_cudnn = cudnn_unavailable()
    tensor_ops = out_scale = None
    if {"cudnn_fp8", "ours_tensor_e4m3out"} & set(names):
        tensor_ops = [x for xs in zip(*(fp8.quantize(x, None) for x in (q, k, v)), strict=True)
                      for x in xs]                                # q8, k8, v8, sq, sk, sv
        # |out| <= max |v|: a scale no output overflows (delayed scaling knows such a bound).
        out_scale = jnp.max(jnp.abs(v.astype(jnp.float32))) / E4M3_MAX
    for name in names:
        try:
            if name in ("cudnn_fp8", "cudnn_bf16") and no_cudnn:
                calls[name] = no_cudnn
            elif name == "cudnn_fp8":
                calls[name] = Call(
                    jax.jit(functools.partial(cudnn_fp8, is_causal=causal)),
                    (*tensor_ops, out_scale), lambda out: fp8.dequantize(out[0], out_scale, None))
            elif name == "cudnn_bf16":
                calls[name] = Call(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn")), (q, k, v))
            elif name == "fa3":
                if head_dim != 128:
                    calls[name] = "not available: FA3's JAX wheel covers head_dim 128 only"
                    continue
                from flash_attn3_jax import flash_mha  # optional: a cp312 wheel, GPU only
                calls[name] = Call(jax.jit(lambda q, k, v: flash_mha(
                    q, k, v, softmax_scale=head_dim ** -0.5, is_causal=causal)), (q, k, v))
            elif name == "ours_fp8":
                calls[name] = Call(jax.jit(lambda q, k, v: fp8.attention_fp8(
                    q, k, v, is_causal=causal, implementation=args.fp8_implementation)),
                    (q, k, v))
            elif name.startswith(CONFIGURED):
                calls[name] = Call(jax.jit(functools.partial(
                    fp8.attention_fp8, is_causal=causal, implementation=args.fp8_implementation,
                    config=parse_config(name.removeprefix(CONFIGURED)))), (q, k, v))
            elif name == "ours_fp8_quantized":
                config = forward_fp8.default_config(head_dim, is_causal=causal,
                                                    seq_kv=k.shape[1])
                ops = fp8.quantize_operands(q, k, v, block_q=config.block_q,
                                            block_kv=config.block_kv)
                calls[name] = Call(jax.jit(functools.partial(
                    fp8.attention_fp8_quantized, v_transposed=True, is_causal=causal,
                    config=config, implementation=args.fp8_implementation)),
                    (ops.q, ops.k, ops.vt, ops.q_scale, ops.k_scale, ops.v_scale))
            elif name == "ours_bf16":
                calls[name] = Call(jax.jit(lambda q, k, v: pf.attention(
                    q, k, v, is_causal=causal, implementation=args.bf16_implementation)),
                    (q, k, v))
            elif name == "ours_tensor_e4m3out":
                calls[name] = Call(jax.jit(lambda *a: fp8.attention_fp8_quantized(
                    *a[:6], out_scale=a[6], is_causal=causal,
                    implementation=args.fp8_implementation)),
                    (*tensor_ops, out_scale), lambda out: fp8.dequantize(out[0], out_scale, None))
            else:
                raise ValueError(f"unknown implementation {name!r}; choose from "
                                 f"{','.join(SPEED_IMPLS)}")
        except ImportError as e:
            calls[name] = f"not importable: {e}"
        except Exception as e:  # e.g. quantizing its operands: this call, not the point
            calls[name] = error_summary(e)
    return calls


def oracle_slice(q, k, v, causal: bool, rows: int, heads: int) -> np.ndarray:
    """The float64 output of the last ``rows`` queries of the first ``heads`` heads of the
    first sequence (under a causal mask the last rows see every key, so the slice is
    exact with the diagonal aligned bottom-right)."""
    mask = MaskSpec(seq_q=rows, seq_kv=k.shape[1], is_causal=causal,
                    causal_alignment="bottom_right")
    out, _ = attention_float64(q[:1, -rows:, :heads], k[:1, :, :heads], v[:1, :, :heads],
                               mask=mask)
    return np.asarray(out, np.float64)


def run_point(head_dim: int, seq_len: int, causal: bool, args) -> list[dict]:
    """Every implementation at one point: checked, then timed in interleaved rounds."""
    batch, heads = problem_shape(head_dim, seq_len, tokens=args.tokens, hidden=args.hidden)
    keys = jax.random.split(jax.random.key(args.seed), 3)
    q, k, v = (jax.random.normal(key, (batch, seq_len, heads, head_dim), jnp.bfloat16)
               for key in keys)
    names = args.impls.split(",")
    flops = attention_flops(batch, heads, seq_len, head_dim, causal=causal, pass_="fwd")
    base = dict(head_dim=head_dim, seq_len=seq_len, batch=batch, heads=heads, causal=causal,
                flops=flops)
    rows = {name: dict(base, impl=name, error=None) for name in names}
    calls = make_calls(names, q, k, v, causal, args)
    check_rows, check_heads = min(args.check_rows, seq_len), min(2, heads)
    expected = oracle_slice(q, k, v, causal, check_rows, check_heads)
    runnable = []
    for name, call in calls.items():
        if isinstance(call, str):
            rows[name]["error"] = call
            continue
        try:  # compiles; a failing implementation is a row, not a crash
            out = call.output(jax.block_until_ready(call.fn(*call.args)))
            got = np.asarray(out[:1, -check_rows:, :check_heads], np.float64)
        except Exception as e:
            rows[name]["error"] = error_summary(e)
            continue
        err = rel_err(got, expected)
        fp8_call = name in _FP8 or name.startswith(CONFIGURED)
        tolerance = args.fp8_tolerance if fp8_call else args.tolerance
        rows[name].update(rel_err=err if math.isfinite(err) else None, tolerance=tolerance)
        if not err < tolerance:
            rows[name]["error"] = (f"wrong result: relative error {err:.3g} > {tolerance}"
                                   if math.isfinite(err) else "wrong result: non-finite output")
            continue
        runnable.append(name)
    samples: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(args.rounds):
        for name in list(runnable):
            try:
                timing = time_fn(calls[name].fn, [calls[name].args], iters=args.iters,
                                 warmup=1, max_seconds=args.max_seconds)
            except Exception as e:
                rows[name]["error"] = error_summary(e)
                runnable.remove(name)
                continue
            samples[name].append(timing.median_ms)
    for name in runnable:
        ms = statistics.median(samples[name])
        rows[name].update(ms=ms, round_ms=samples[name], tflops=tflops_per_s(flops, ms))
    for row in rows.values():
        if "tflops" in row:
            row["ratios"] = {anchor: row["tflops"] / rows[anchor]["tflops"]
                             for anchor in ANCHORS
                             if anchor != row["impl"] and "tflops" in rows.get(anchor, {})}
    return list(rows.values())


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if "tflops" in row:
        return report.fmt_tflops(row["tflops"])
    error = row.get("error") or ""
    if error.startswith(("not available", "not importable", "not run")):
        return "n/a"
    return "WRONG" if error.startswith("wrong result") else "failed"


#: (numerator, anchor) ratio columns of the speed table.
SPEED_RATIOS = (("ours_fp8", "cudnn_fp8"), ("ours_fp8", "ours_bf16"),
                ("ours_fp8", "cudnn_bf16"), ("ours_fp8_quantized", "cudnn_fp8"))


def speed_table(header: str, rows: list[dict], rounds: int) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    points = list(dict.fromkeys((r["head_dim"], r["seq_len"], r["causal"]) for r in rows))
    by_key = {(r["head_dim"], r["seq_len"], r["causal"], r["impl"]): r for r in rows}
    configured = [(a, b) for a in impls if a.startswith(CONFIGURED)
                  for b in ("cudnn_fp8", "ours_bf16") if b in impls]
    ratios = [(a, b) for a, b in SPEED_RATIOS if a in impls and b in impls] + configured
    lines = [f"# FP8 attention vs cuDNN FP8: {header}", "",
             "Forward TFLOP/s (4·B·H·L²·D, halved when causal; median over "
             f"{rounds} interleaved rounds); ratios: TFLOP/s over TFLOP/s at the same point. "
             "n/a: not available here; WRONG: failed the float64 check, not timed.", "",
             "| D | L | causal | " + " | ".join(impls) + " | "
             + " | ".join(f"{a} / {b}" for a, b in ratios) + " |",
             "|---:|---:|:---|" + "---:|" * (len(impls) + len(ratios))]
    for d, length, causal in points:
        cells = [_cell(by_key.get((d, length, causal, impl))) for impl in impls]
        for a, b in ratios:
            ratio = by_key.get((d, length, causal, a), {}).get("ratios", {}).get(b)
            cells.append("" if ratio is None else f"{ratio:.2f}×")
        lines.append(f"| {d} | {length} | {'yes' if causal else 'no'} | " + " | ".join(cells)
                     + " |")
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines += ["", "Not timed:", ""]
        lines += [f"- {r['impl']} at D {r['head_dim']}, L {r['seq_len']}"
                  f"{', causal' if r['causal'] else ''}: {r['error']}" for r in errors]
    return "\n".join(lines)


def speed_main(args) -> int:
    date = datetime.date.today().isoformat()
    header = (f"{jax.devices()[0].device_kind}, {date}, jax {jax.__version__}, bf16 N(0, 1) "
              f"inputs, batch·L = {args.tokens} tokens, heads·head_dim = {args.hidden}, "
              f"fp8 implementation {args.fp8_implementation or 'default'}, bf16 "
              f"implementation {args.bf16_implementation or 'default'}")
    stem = report.file_stem("fp8-cudnn", jax.devices()[0].device_kind, date, args.tag)
    start = time.perf_counter()
    rows: list[dict] = []
    for head_dim in args.head_dims:
        for seq_len in args.seq_lens:
            for causal in _causal_modes(args.causal):
                if args.time_limit and time.perf_counter() - start > args.time_limit:
                    rows += [dict(impl=name, head_dim=head_dim, seq_len=seq_len,
                                  causal=causal, error=f"not run: time limit "
                                  f"{args.time_limit} s") for name in args.impls.split(",")]
                    continue
                try:
                    point = run_point(head_dim, seq_len, causal, args)
                except Exception as e:  # inputs, quantization, oracle: the point, not the run
                    point = [dict(impl=name, head_dim=head_dim, seq_len=seq_len, causal=causal,
                                  error=error_summary(e)) for name in args.impls.split(",")]
                rows += point
                for row in point:
                    print(json.dumps(row), flush=True)
                if args.out:  # after every point: a run cut short keeps what it measured
                    report.write_rows(args.out, stem, header, jax.__version__, rows,
                                      speed_table(header, rows, args.rounds))
    text = speed_table(header, rows, args.rounds)
    if args.out:
        report.write_rows(args.out, stem, header, jax.__version__, rows, text)
    print(text)
    return 0


# --- accuracy ---------------------------------------------------------------------------------

def sample_inputs(distribution: str, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """bf16 inputs: N(0, 1) ("gaussian") or N(0, 1) with outliers ("outliers")."""
    if distribution == "gaussian":
        return jax.random.normal(key, shape).astype(jnp.bfloat16)
    if distribution == "outliers":
        return with_outliers(key, shape).astype(jnp.bfloat16)
    raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")


@functools.cache
def accuracy_methods(causal: bool, implementation: str | None) -> dict[str, Callable]:
    """method -> jitted ``fn(arrays) -> out`` (float, ``[B, L, N, D]``). ``arrays``: q, k, v
    (bf16), ``tensor`` and ``rotated`` (``(q8, k8, v8, sq, sk, sv)``: per-tensor e4m3
    operands, Q and K rotated in the second), ``out_scale`` and ``rotation_key``. Cached,
    so points of one shape share the compilations."""
    kw = dict(is_causal=causal, implementation=implementation)

    def cudnn(ops, out_scale):
        return fp8.dequantize(cudnn_fp8(*ops, out_scale, is_causal=causal)[0], out_scale, None)

    def ours_e4m3(ops, out_scale):
        out8, _ = fp8.attention_fp8_quantized(*ops, out_scale=out_scale, **kw)
        return fp8.dequantize(out8, out_scale, None)

    methods = {
        "bf16": lambda a: pf.attention(a["q"], a["k"], a["v"], is_causal=causal),
        "cudnn_fp8": lambda a: cudnn(a["tensor"], a["out_scale"]),
        "cudnn_fp8_hadamard": lambda a: cudnn(a["rotated"], a["out_scale"]),
        "ours_tensor_e4m3out": lambda a: ours_e4m3(a["tensor"], a["out_scale"]),
        "ours_tensor": lambda a: fp8.attention_fp8_quantized(*a["tensor"], **kw),
        "ours_tensor_hadamard_e4m3out": lambda a: ours_e4m3(a["rotated"], a["out_scale"]),
        "ours_block": lambda a: fp8.attention_fp8(a["q"], a["k"], a["v"], **kw),
        "ours_block_hadamard": lambda a: fp8.attention_fp8(
            a["q"], a["k"], a["v"], hadamard_key=a["rotation_key"], **kw),
    }
    return {name: jax.jit(fn) for name, fn in methods.items()}


def measure_accuracy(seq_len: int, head_dim: int, heads: int, distribution: str, causal: bool,
                     seed: int, implementation: str | None = None,
                     headroom: float = 1.0) -> dict:
    """Relative error and RMSE of every method against the float64 oracle at one point."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (1, seq_len, heads, head_dim)
    q, k, v = (sample_inputs(distribution, key, shape) for key in keys[:3])
    mask = MaskSpec(seq_q=seq_len, seq_kv=seq_len, is_causal=causal)
    expected = np.asarray(attention_float64(q, k, v, mask=mask)[0], np.float64)
    out_scale = float(np.abs(expected).max()) * headroom / E4M3_MAX
    rotation = fp8.random_hadamard(keys[3], head_dim)
    tensor = [fp8.quantize(x, None) for x in (q, k, v)]
    rotated = [fp8.quantize(x.astype(jnp.float32) @ rotation, None) for x in (q, k)]

    def operands(quantized):  # [(x8, s)] * 3 -> (q8, k8, v8, sq, sk, sv)
        return tuple(x8 for x8, _ in quantized) + tuple(s for _, s in quantized)
    arrays = dict(q=q, k=k, v=v, tensor=operands(tensor), rotated=operands([*rotated, tensor[2]]),
                  out_scale=jnp.float32(out_scale), rotation_key=keys[3])
    row = dict(seq_len=seq_len, head_dim=head_dim, heads=heads, batch=1,
               distribution=distribution, causal=causal, out_scale=out_scale, rel={},
               rmse={}, errors={})
    no_cudnn = cudnn_unavailable()
    for name, fn in accuracy_methods(causal, implementation).items():
        if name in CUDNN_METHODS and no_cudnn:
            row["errors"][name] = no_cudnn
            continue
        try:
            got = np.asarray(jax.block_until_ready(fn(arrays)), np.float64)
        except Exception as e:  # a failing method is a cell, not a crash
            row["errors"][name] = error_summary(e)
            continue
        if not np.isfinite(got).all():
            row["errors"][name] = f"{int(np.sum(~np.isfinite(got)))} non-finite outputs"
            continue
        row["rel"][name] = rel_err(got, expected)
        row["rmse"][name] = float(np.sqrt(np.mean((got - expected) ** 2)))
    rel = row["rel"]
    for label, ours, theirs in EQUAL_FOOTING:
        row[label] = rel[ours] / rel[theirs] if ours in rel and theirs in rel else None
    ours_best = min((n for n in OURS_METHODS if n in rel), key=rel.get, default=None)
    cudnn_best = min((n for n in CUDNN_METHODS if n in rel), key=rel.get, default=None)
    row["ours best"], row["cudnn best"] = ours_best, cudnn_best
    row["ours best / cudnn best"] = (rel[ours_best] / rel[cudnn_best]
                                     if ours_best and cudnn_best else None)
    return row


def accuracy_table(rows: list[dict], metric: str = "rel") -> str:
    """One line per (L, D, inputs, causal), a column per method, and the error ratios."""
    labels = [label for label, _, _ in EQUAL_FOOTING]
    title = "relative error ‖out − ref‖ / ‖ref‖" if metric == "rel" else "RMSE"
    lines = [f"## {title}", "",
             "| L | D | inputs | causal | " + " | ".join(ACCURACY_METHODS) + " | "
             + " | ".join(labels) + " | ours best / cudnn best |",
             "|---:|---:|:---|:---|" + "---:|" * (len(ACCURACY_METHODS) + len(labels) + 1)]
    for row in rows:
        cells = []
        for name in ACCURACY_METHODS:
            if name in row[metric]:
                cells.append(f"{row[metric][name]:.2e}")
            else:
                cells.append("n/a" if row["errors"].get(name, "").startswith("not available")
                             else "failed")
        for label in [*labels, "ours best / cudnn best"]:
            cells.append("—" if row[label] is None else f"{row[label]:.2f}×")
        lines.append(f"| {row['seq_len']} | {row['head_dim']} | {row['distribution']} | "
                     f"{'yes' if row['causal'] else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def accuracy_markdown(header: str, rows: list[dict]) -> str:
    lines = [f"# FP8 attention accuracy, ours vs cuDNN: {header}", "",
             "Every method against the float64 oracle of the same bf16 inputs (batch 1). "
             "`cudnn_fp8` and `ours_tensor_e4m3out` take the same per-tensor e4m3 operands "
             "and give an e4m3 output with the same scale (the oracle's max |out| / 448), "
             "dequantized; `*_hadamard`: Q and K rotated by one random Hadamard matrix before "
             "that quantization. `ours_tensor`: those operands, bf16 output. `ours_block`: "
             "`fp8.attention_fp8` (bf16 in, per-block scales, bf16 out). `bf16`: "
             "`pallas_flash.attention`. Ratios are errors over errors: ≤ 1 means ours is no "
             "less accurate. inputs: N(0, 1) or N(0, 1) with 0.1 % outliers of 10·N(0, 1).",
             "", accuracy_table(rows, "rel"), "", accuracy_table(rows, "rmse")]
    failed = [(row, name, error) for row in rows for name, error in row["errors"].items()
              if not error.startswith("not available")]
    if failed:
        lines += ["", "Failed:", ""]
        lines += [f"- {name} at L {row['seq_len']}, D {row['head_dim']}, "
                  f"{row['distribution']}{', causal' if row['causal'] else ''}: {error}"
                  for row, name, error in failed]
    unavailable = sorted({e for row in rows for e in row["errors"].values()
                          if e.startswith("not available")})
    if unavailable:
        lines += ["", "n/a: " + "; ".join(unavailable)]
    return "\n".join(lines) + "\n"


def accuracy_main(args) -> int:
    date = datetime.date.today().isoformat()
    header = (f"{jax.devices()[0].device_kind}, {date}, jax {jax.__version__}, "
              f"{args.heads} heads, seed {args.seed}, fp8 implementation "
              f"{args.fp8_implementation or 'default'}")
    stem = report.file_stem("fp8-cudnn-accuracy", jax.devices()[0].device_kind, date,
                            args.tag)
    rows: list[dict] = []
    for seq_len in args.seq_lens:
        for head_dim in args.head_dims:
            for distribution in args.distributions.split(","):
                for causal in _causal_modes(args.causal):
                    rows.append(measure_accuracy(seq_len, head_dim, args.heads, distribution,
                                                 causal, args.seed, args.fp8_implementation,
                                                 args.out_headroom))
                    print(json.dumps(rows[-1]), flush=True)
                    if args.out:
                        report.write_rows(args.out, stem, header, jax.__version__, rows,
                                          accuracy_markdown(header, rows))
    print(accuracy_markdown(header, rows))
    return 0


# --- command line -----------------------------------------------------------------------------

def _causal_modes(text: str) -> tuple[bool, ...]:
    return {"no": (False,), "yes": (True,), "both": (False, True)}[text]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accuracy", action="store_true",
                        help="the accuracy study instead of the speed benchmark")
    parser.add_argument("--head-dims", type=int_list, default=None,
                        help="default 128,256")
    parser.add_argument("--seq-lens", type=int_list, default=None,
                        help="default 2048,4096,8192,16384 (speed), 1024,4096 (accuracy)")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default=None,
                        help="default both (speed), no (accuracy)")
    parser.add_argument("--fp8-implementation", choices=("mosaic", "xla"), default=None,
                        help="pallas_flash.fp8's backend (default: mosaic on Hopper, else xla)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="folder for the JSON and markdown files")
    parser.add_argument("--tag", default="", help="appended to the file names")
    speed = parser.add_argument_group("speed")
    speed.add_argument("--impls", default=",".join(DEFAULT_SPEED_IMPLS),
                       help=f"comma list among {','.join(SPEED_IMPLS)} and {CONFIGURED}SPEC")
    speed.add_argument("--bf16-implementation", default=None,
                       help="pallas_flash.attention's backend for ours_bf16 (default: its choice)")
    speed.add_argument("--tokens", type=int, default=16384, help="batch × seq_len")
    speed.add_argument("--hidden", type=int, default=2048, help="heads × head_dim")
    speed.add_argument("--rounds", type=int, default=3)
    speed.add_argument("--iters", type=int, default=10, help="samples per timing")
    speed.add_argument("--max-seconds", type=float, default=0.5,
                       help="per timing, once 5 samples are taken")
    speed.add_argument("--check-rows", type=int, default=256,
                       help="query rows compared with the float64 oracle")
    speed.add_argument("--tolerance", type=float, default=0.05, help="bf16 relative error")
    speed.add_argument("--fp8-tolerance", type=float, default=0.25, help="FP8 relative error")
    speed.add_argument("--time-limit", type=float, default=540,
                       help="no new point after this many seconds (0: none)")
    accuracy = parser.add_argument_group("accuracy")
    accuracy.add_argument("--heads", type=int, default=4)
    accuracy.add_argument("--distributions", default=",".join(DISTRIBUTIONS))
    accuracy.add_argument("--out-headroom", type=float, default=1.0,
                          help="the e4m3 output scale is headroom × max |oracle| / 448")
    args = parser.parse_args(argv)
    if args.head_dims is None:
        args.head_dims = (128, 256)
    if args.seq_lens is None:
        args.seq_lens = (1024, 4096) if args.accuracy else (2048, 4096, 8192, 16384)
    if args.causal is None:
        args.causal = "no" if args.accuracy else "both"
    unknown = {name for name in args.impls.split(",") if not _known_impl(name)}
    if unknown:
        parser.error(f"unknown implementations {sorted(unknown)}; choose from "
                     f"{','.join(SPEED_IMPLS)} or {CONFIGURED}SPEC (e.g. {CONFIGURED}64x128x2op)")
    unknown = set(args.distributions.split(",")) - set(DISTRIBUTIONS)
    if unknown:
        parser.error(f"unknown distributions {sorted(unknown)}; choose from "
                     f"{','.join(DISTRIBUTIONS)}")
    return args


def _known_impl(name: str) -> bool:
    """A name of :data:`SPEED_IMPLS`, or ``ours_fp8:SPEC`` with a config ``SPEC`` parses."""
    if name in SPEED_IMPLS:
        return True
    try:
        return name.startswith(CONFIGURED) and bool(parse_config(name.removeprefix(CONFIGURED)))
    except ValueError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return accuracy_main(args) if args.accuracy else speed_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
