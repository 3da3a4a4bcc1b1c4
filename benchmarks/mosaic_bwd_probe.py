"""GPU probe of the Mosaic GPU backward: speed against cuDNN and the Triton backward.

Run on an H200/H100 from the repository root::

    PYTHONPATH=. python3 benchmarks/mosaic_bwd_probe.py --out bwd.json

The FlashAttention papers' setup: bf16, batch · seq_len = 16384 tokens, heads · head_dim =
2048; backward FLOPs 2.5 · 4·B·H·L²·D (halved when causal), as ``benchmarks.flops``.
Implementations, all on the same inputs and residuals (out, lse from the Mosaic forward):

* ``mosaic``: :func:`pallas_flash.mosaic.backward.backward` with the default backward
  config, the one the API runs (the fused dQ up to head_dim 128, the separate dQ kernel
  above and for causal sequences up to 2048 tokens at head_dim 65-128;
  ``mosaic:deterministic=1`` forces the separate dQ kernel);
* ``mosaic_fused``: the same with ``deterministic=False`` (dQ fused into the dK/dV kernel
  with TMA reduce-adds);
* ``triton``: the Triton backward with its default config;
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``; its backward time
  is the time of forward + backward (``jax.vjp``) minus the time of its forward.

The Pallas backwards are timed as ``delta = rowsum(dO ∘ O)`` plus the kernels, as
:mod:`pallas_flash.autodiff` runs them. For each point the gradients of every
implementation are also compared with cuDNN's (relative error, bf16 against bf16). Every
result is written to the JSON file as soon as it is measured; a table is printed last.

``--key-mask`` gives every implementation a padding-style ``[batch, 1, 1, L]`` mask array
hiding the last 1/16 of the keys (FLOPs still counted unmasked): the Mosaic backward then
reads it as an int8 ring (it takes an explicit config, as every ``mosaic`` entry here);
cuDNN, which takes no such array, gets the same padding as ``key_value_seq_lengths``.

``mosaic:only=dkdv`` and ``mosaic:only=dq`` time one kernel (with the delta pre-pass) while
the other is left out: where the backward's time goes (milliseconds, no TFLOP/s).

``--compile-only`` just compiles the Mosaic backwards at ``--head-dims`` (causal, L 4096):
run it with ``MOSAIC_GPU_DUMP_PTXAS=1`` to read ptxas' register and spill counts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import traceback
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.flops import attention_flops, problem_shape, tflops_per_s
from benchmarks.timing import time_fn
from pallas_flash import triton as triton_backend
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import (
    MosaicBackwardConfig,
    default_backward_config,
    default_config,
    forward,
)

mosaic_backward = importlib.import_module("pallas_flash.mosaic.backward")
backward_common = importlib.import_module("pallas_flash.mosaic.backward.common")
dq_modes = importlib.import_module("pallas_flash.mosaic.backward.dq_modes")
IMPLS = ("mosaic", "mosaic_fused", "triton", "cudnn")


def _spec(name: str) -> dict[str, str]:
    """``mosaic:block_q=64,num_stages=3`` -> {"block_q": "64", "num_stages": "3"}."""
    return dict(item.split("=") for item in name.partition(":")[2].split(",") if item)


def _overrides(name: str) -> dict[str, int]:
    """Fields of MosaicBackwardConfig to change (``regs``, ``resident`` and ``only`` are not
    fields: see :func:`_traced_with`)."""
    return {key: int(value) for key, value in _spec(name).items()
            if key not in ("regs", "only", "resident")}


def _no_dq(st, operands, *, interpret):
    return jnp.zeros(operands[0].shape, operands[0].dtype)


def _no_dkdv(st, operands, *_, interpret):
    zeros = jnp.zeros(operands[1].shape, operands[1].dtype)
    return zeros, zeros


@contextlib.contextmanager
def _traced_with(name: str):
    """Module attributes that the kernels read at trace time, changed for one spec:

    * ``regs=240x24``: the ``setmaxnreg`` split between consumer and producer warpgroups
      (at every head dim; default: ``pallas_flash.mosaic.backward.common._registers``);
    * ``resident=D``: the fused dK/dV kernel keeps K and V in registers up to head_dim D
      (``resident=0``: from SMEM);
    * ``only=dkdv`` / ``only=dq``: the other kernel is replaced by zeros, which times one
      kernel (and the delta pre-pass): where the backward's time goes.
    """
    spec = _spec(name)
    swaps = []
    if "regs" in spec:
        consumer, producer = map(int, spec["regs"].split("x"))
        swaps.append((backward_common, "_registers", lambda head_dim: (consumer, producer)))
    if "resident" in spec:
        swaps.append((dq_modes, "_RESIDENT_MAX_HEAD_DIM", int(spec["resident"])))
    if "only" in spec:
        if spec["only"] not in ("dkdv", "dq"):
            raise ValueError(f"only={spec['only']}: choose dkdv or dq")
        swaps += ([(mosaic_backward, "call_dq", _no_dq)] if spec["only"] == "dkdv" else
                  [(mosaic_backward, "call_dkdv", _no_dkdv),
                   (mosaic_backward, "call_dkdv_d256", _no_dkdv)])
    with contextlib.ExitStack() as stack:
        for module, attr, value in swaps:
            stack.enter_context(mock.patch.object(module, attr, value))
        yield


def mosaic_config(name: str, q_shape, kv_shape, dtype, mask: MaskSpec) -> MosaicBackwardConfig:
    """The backward config a ``mosaic…`` entry times: the API's default
    (:func:`default_backward_config`), the fused dQ for ``mosaic_fused``, then the fields
    the name changes (``mosaic:deterministic=1``: the separate dQ kernel)."""
    config = default_backward_config(q_shape, kv_shape, dtype, mask)
    if name == "mosaic_fused":
        config = dataclasses.replace(config, deterministic=False)
    return dataclasses.replace(config, **_overrides(name))


def _pallas_backward(name: str, q, k, mask: MaskSpec, scale: float, attn_mask=None):
    """A jitted (q, k, v, out, lse, dO) -> (dq, dk, dv) for one Pallas backward."""
    if name == "triton":
        fn = triton_backend.KERNELS.backward
        config = triton_backend.default_config(q.shape, k.shape, q.dtype, mask)
    else:
        fn = mosaic_backward.backward
        config = mosaic_config(name, q.shape, k.shape, q.dtype, mask)

    def run(q, k, v, out, lse, d_out):
        delta = jnp.einsum("btnd,btnd->bnt", out.astype(jnp.float32),
                           d_out.astype(jnp.float32))
        return fn(q, k, v, None, out, lse, d_out, delta, mask=mask, scale=scale,
                  config=config, interpret=False, attn_mask=attn_mask)
    return jax.jit(run)


def bench_point(head_dim: int, seq_len: int, causal: bool, impls, max_seconds: float,
                key_mask: bool = False):
    """One (head_dim, L, causal) point: backward TFLOP/s per implementation."""
    batch, heads = problem_shape(head_dim, seq_len)
    flops = attention_flops(batch, heads, seq_len, head_dim, causal=causal, pass_="bwd")
    mask = MaskSpec(seq_q=seq_len, seq_kv=seq_len, is_causal=causal)
    scale = head_dim ** -0.5
    keys = jax.random.split(jax.random.key(seq_len + head_dim + causal), 4)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v, d_out = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    attn_mask = kv_lengths = None
    if key_mask:
        visible = seq_len - seq_len // 16
        attn_mask = jnp.broadcast_to(jnp.arange(seq_len) < visible, (batch, 1, 1, seq_len))
        # cuDNN takes no [B, 1, 1, L] mask array; the same padding as lengths.
        kv_lengths = jnp.full((batch,), visible, jnp.int32)
    fwd_config = default_config(q.shape, k.shape, q.dtype, mask)
    out, lse = jax.jit(lambda q, k, v: forward(q, k, v, None, mask=mask, scale=scale,
                                               config=fwd_config, interpret=False,
                                               attn_mask=attn_mask))(q, k, v)
    timing = dict(max_seconds=max_seconds, iters=10)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                            key_value_seq_lengths=kv_lengths,
                                            implementation="cudnn")
    cudnn_grads = jax.jit(lambda q, k, v, d: jax.vjp(cudnn, q, k, v)[1](d))
    reference = cudnn_grads(q, k, v, d_out)
    results = {}
    for name in impls:
        entry = dict(head_dim=head_dim, seq_len=seq_len, causal=causal, impl=name,
                     batch=batch, heads=heads)
        try:
            if name == "cudnn":
                fwd_ms = time_fn(jax.jit(cudnn), [(q, k, v)], **timing).median_ms
                both_ms = time_fn(cudnn_grads, [(q, k, v, d_out)], **timing).median_ms
                ms, grads = both_ms - fwd_ms, reference
            else:
                args = (q, k, v, out, lse, d_out)
                with _traced_with(name):
                    fn = _pallas_backward(name, q, k, mask, scale, attn_mask)
                    fn = fn.lower(*args).compile()
                ms = time_fn(fn, [args], **timing).median_ms
                grads = fn(*args)
            entry.update(ms=ms)
            if "only" not in _spec(name):  # one kernel alone: its time only
                entry.update(tflops=tflops_per_s(flops, ms), rel_err_vs_cudnn=[
                    float(np.linalg.norm(np.asarray(g, np.float32) - np.asarray(r, np.float32))
                          / np.linalg.norm(np.asarray(r, np.float32)))
                    for g, r in zip(grads, reference, strict=True)])
        except Exception as e:  # keep probing the other implementations
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        print(f"D={head_dim} L={seq_len} causal={causal} {name}: "
              f"{entry.get('ms', float('nan')):.3f} ms, "
              f"{entry.get('tflops', float('nan')):.0f} TFLOP/s, grad errors vs cuDNN "
              f"{entry.get('rel_err_vs_cudnn')} {entry.get('error', '')[:300]}", flush=True)
        results[name] = entry
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="mosaic_bwd_probe.json")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seq-lens", default="4096,16384")
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    parser.add_argument("--impls", default=";".join(IMPLS),
                        help=f"';'-separated, from {IMPLS}; 'mosaic:block_q=64,num_stages=3' "
                             "times the Mosaic backward with those config fields changed "
                             "(and regs=232x40: the consumer x producer setmaxnreg; "
                             "only=dkdv or only=dq: one kernel alone, its time in ms; "
                             "resident=0: the fused kernel's K and V from SMEM)")
    parser.add_argument("--max-seconds", type=float, default=1.0,
                        help="sampling time per timed function")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--key-mask", action="store_true",
                        help="a [batch, 1, 1, L] mask array hiding the last L/16 keys")
    args = parser.parse_args(argv)
    if args.compile_only:
        for head_dim in map(int, args.head_dims.split(",")):
            batch, heads = problem_shape(head_dim, 4096)
            q = jax.ShapeDtypeStruct((batch, 4096, heads, head_dim), jnp.bfloat16)
            stats = jax.ShapeDtypeStruct((batch, heads, 4096), jnp.float32)
            mask = MaskSpec(seq_q=4096, seq_kv=4096, is_causal=True)
            # The fused dQ needs head_dim <= 128 (MosaicBackwardConfig.check_fits).
            for name in ("mosaic", "mosaic_fused")[:1 if head_dim > 128 else 2]:
                fn = _pallas_backward(name, q, q, mask, head_dim ** -0.5)
                fn.lower(q, q, q, q, stats, q).compile()
        return 0
    causal_modes = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    impls = args.impls.split(";")
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        for seq_len in map(int, args.seq_lens.split(",")):
            for causal in causal_modes:
                rows.append(bench_point(head_dim, seq_len, causal, impls, args.max_seconds,
                                        key_mask=args.key_mask))
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)

    print("\nbackward TFLOP/s (bf16, 16k tokens, hidden 2048); x = / cuDNN")
    print(f"{'D':>4} {'L':>6} {'causal':>6} " + " ".join(f"{n:>16}" for n in impls))
    for row in rows:
        first = next(iter(row.values()))
        cudnn = row.get("cudnn", {}).get("tflops")
        cells = []
        for name in impls:
            tflops = row[name].get("tflops")
            if tflops is None and "ms" in row[name]:
                cells.append(f"{row[name]['ms']:13.3f} ms")
            elif tflops is None:
                cells.append(f"{'error':>16}")
            elif cudnn:
                cells.append(f"{tflops:9.0f} ({tflops / cudnn:.2f}x)")
            else:
                cells.append(f"{tflops:16.0f}")
        print(f"{first['head_dim']:>4} {first['seq_len']:>6} {first['causal']!s:>6} "
              + " ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
