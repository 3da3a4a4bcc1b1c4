"""Fingerprints of the Mosaic GPU modules that the default configs lower to, on any machine.

A refactor of ``pallas_flash/mosaic`` should leave the kernels' code unchanged: this lowers
every default-config kernel (bf16 forward and backward at head_dim 64 / 128 / 256, causal
and not, at 1024 and 4096 tokens, with the variants that change the kernel body: segment
ids, soft-cap, window, bias / mask arrays; the FP8 forward) for ``cuda`` on the CPU,
prints each Mosaic GPU module without debug info (no source locations, no symbol or dump
names), and hashes it.

    python -m benchmarks.tools.lowered_modules --out before.json
    python -m benchmarks.tools.lowered_modules --compare before.json

``--compare`` exits 1 when any module differs, naming the cases.

Where two modules differ only in the order of independent ops, what runs on the card may
still be the same: on a GPU machine, ``--sass DIR`` compiles each case instead, with Mosaic
GPU's PTX and SASS dumps into ``DIR/<case>/`` (the SASS needs ``nvdisasm`` on the PATH),
and fingerprints each file (kernel names blanked).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mgpu_core

import pallas_flash
from pallas_flash import fp8

# Names that change with the Python functions' names or with what the process lowered
# before (a dump counter), not with the kernel's code.
_SYMBOL = re.compile(r'(sym_name = |@|dump_basename = )"?[\w.$-]+"?')


def _capture() -> tuple[list[str], Callable[[], None]]:
    """Records the asm (no debug info) of every Mosaic GPU module lowered until restored."""
    modules: list[str] = []
    original = mgpu_core._run_serde_pass

    def recording(module, *args, **kwargs):
        text = module.operation.get_asm(enable_debug_info=False)
        modules.append(_SYMBOL.sub(r"\1_", text))
        return original(module, *args, **kwargs)

    mgpu_core._run_serde_pass = recording

    def restore():
        mgpu_core._run_serde_pass = original
    return modules, restore


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _bf16_cases():
    """(name, function, argument specs): forward, and forward + backward through grad."""
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            for variant in ("plain", "long", "segments", "softcap", "window", "bias_mask"):
                if variant == "bias_mask" and head_dim > 192:
                    continue
                # "long": past the short-sequence defaults (mosaic.config.SHORT_CAUSAL_SEQ).
                seq = 4096 if variant == "long" else 1024
                q, kv = (2, seq, 8, head_dim), (2, seq, 2, head_dim)
                args = [_spec(q), _spec(kv), _spec(kv)]
                kwargs: dict = dict(is_causal=causal, implementation="mosaic")
                if variant == "segments":
                    args.append(_spec((2, seq), jnp.int32))
                elif variant == "softcap":
                    kwargs["logits_soft_cap"] = 30.0
                elif variant == "window":
                    kwargs["local_window_size"] = (256, 0 if causal else 128)
                elif variant == "bias_mask":
                    args += [_spec((1, 8, seq, seq), jnp.float32),
                             _spec((2, 1, 1, seq), jnp.bool_)]

                def attend(q, k, v, *extra, variant=variant, kwargs=kwargs):
                    if variant == "segments":
                        return pallas_flash.attention(q, k, v, q_segment_ids=extra[0],
                                                      **kwargs)
                    if variant == "bias_mask":
                        return pallas_flash.attention(q, k, v, extra[0], extra[1], **kwargs)
                    return pallas_flash.attention(q, k, v, **kwargs)

                def loss(q, k, v, *extra, attend=attend):
                    return jnp.sum(attend(q, k, v, *extra).astype(jnp.float32))

                name = f"d{head_dim}-{'causal' if causal else 'dense'}-{variant}"
                yield f"fwd-{name}", attend, args
                yield f"bwd-{name}", jax.grad(loss, argnums=(0, 1, 2)), args


def _fp8_cases():
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            def attend(q, k, v, causal=causal):
                return fp8.attention_fp8(q, k, v, is_causal=causal, implementation="mosaic")
            shape = (2, 2048, 8, head_dim)
            yield (f"fp8-d{head_dim}-{'causal' if causal else 'dense'}", attend,
                   [_spec(shape)] * 3)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compiled_digests(directory: pathlib.Path) -> list[str]:
    """The PTX and SASS files Mosaic GPU dumped into ``directory``, each with the module's
    dump name (its file name's prefix, a per-process counter) blanked."""
    digests = []
    for path in sorted(p for p in directory.iterdir() if "ptx" in p.name or "sass" in p.name):
        basename = path.name.split(".")[0]
        digests.append(_digest(path.read_text().replace(basename, "_")))
    return digests


def fingerprints(only: str | None = None, sass: str | None = None) -> dict[str, list[str]]:
    """Case name -> SHA-256 of each Mosaic GPU module it lowers to, in lowering order (with
    ``sass``, a directory: of the PTX and SASS each case compiles to, on a GPU machine); ``only``: a
    regular expression the names must match."""
    available = fp8.available_implementations
    fp8.available_implementations = lambda: ("mosaic", "xla")  # lowering needs no GPU
    try:
        return _fingerprints(only, sass)
    finally:
        fp8.available_implementations = available


def _fingerprints(only: str | None, sass: str | None) -> dict[str, list[str]]:
    result = {}
    for name, fn, args in (*_bf16_cases(), *_fp8_cases()):
        if only is not None and not re.search(only, name):
            continue
        if sass is not None:
            directory = pathlib.Path(sass, name)
            directory.mkdir(parents=True, exist_ok=True)
            # Read when each module is lowered (the dump options are set on the module).
            os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_SASS="1",
                              MOSAIC_GPU_DUMP_TO=str(directory))
            jax.jit(fn).trace(*args).lower().compile()
            result[name] = _compiled_digests(directory)
            print(name, " ".join(result[name]), flush=True)
            continue
        modules, restore = _capture()
        try:
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        finally:
            restore()
        result[name] = [_digest(m) for m in modules]
        print(name, " ".join(result[name]), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the fingerprints to this JSON file")
    parser.add_argument("--compare", help="compare with the fingerprints in this JSON file")
    parser.add_argument("--only", help="a regular expression: the cases to lower")
    parser.add_argument("--sass", metavar="DIR",
                        help="compile on the GPU and fingerprint the SASS dumped into DIR")
    args = parser.parse_args(argv)
    got = fingerprints(args.only, args.sass)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            want = json.load(f)
        changed = sorted(k for k in got if want.get(k) != got[k])
        print(f"{len(got) - len(changed)} cases identical, {len(changed)} changed")
        for name in changed:
            print(f"  changed: {name}: {want.get(name)} -> {got.get(name)}")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
