"""A KerasHub Llama-style model, trained and sampled with Keras's attention and with ours.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 -m benchmarks.keras_hub --out $OUT    # GPU
    PYTHONPATH=. python3 -m benchmarks.keras_hub --quick                          # CPU smoke

A random-init ``keras_hub.models.LlamaCausalLM`` (default: hidden 2048, 16 query heads of
head_dim 128, 4 KV heads, 4 layers, bfloat16), the same weights for every attention:

* ``keras``: Keras's own ``dot_product_attention`` (on a GPU, cuDNN's flash attention
  through ``jax.nn``, which Keras picks by default; elsewhere ``jax.nn``'s XLA path);
* ``pallas_flash``: :func:`pallas_flash.integrations.keras.install`, so the decoder's
  square calls pass ``is_causal=True`` along with KerasHub's dense mask;
* ``pallas_flash_dense_mask``: the same with the dense mask only (no ``is_causal``): what
  routing ``keras.ops`` through pallas_flash without the structured form gives.

Per round and implementation, in turn (``--rounds`` interleaved rounds; the first call of
each compiles and is not timed): ``--steps`` AdamW training steps
(``train_on_batch``, ``batch × seq_len`` tokens each) and one greedy ``generate`` of
``batch`` sequences from a ``--prompt-len`` prompt to ``--max-length`` tokens. tokens/s is
the median over rounds. Each implementation's first training loss and its generated
tokens are compared with the first implementation's. Writes
``keras-hub-<device>-<date>.{json,md}`` to ``--out`` after every round.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import time

# Keras reads its backend once, at import; this benchmark is about the JAX one.
os.environ["KERAS_BACKEND"] = "jax"

import jax
import keras
import keras_hub
import numpy as np

from benchmarks import report
from benchmarks.implementations import error_summary
from pallas_flash.integrations import keras as pf_keras

IMPLEMENTATIONS = ("keras", "pallas_flash", "pallas_flash_dense_mask")


@contextlib.contextmanager
def attention(impl: str):
    """Keras's attention routed as ``impl`` says, for the functions traced inside."""
    if impl == "keras":
        yield
        return
    # No decoder marked causal: every call gets only KerasHub's dense mask.
    causal = () if impl == "pallas_flash_dense_mask" else pf_keras.CAUSAL_DECODERS
    pf_keras.install(causal_decoders=causal)
    try:
        yield
    finally:
        pf_keras.uninstall()


def build_model(args) -> keras.Model:
    """The Llama-style causal LM, random weights from ``--seed``, compiled for AdamW and
    greedy sampling."""
    keras.utils.set_random_seed(args.seed)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=args.vocab, num_layers=args.layers, num_query_heads=args.heads,
        num_key_value_heads=args.kv_heads, hidden_dim=args.heads * args.head_dim,
        intermediate_dim=args.intermediate, max_sequence_length=args.seq_len,
        dtype=args.dtype)
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), sampler="greedy",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_data(args) -> tuple[dict, np.ndarray, dict]:
    """Training batch (inputs, labels) and the generation prompt, from ``--seed``."""
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(1, args.vocab, (args.batch, args.seq_len + 1), dtype=np.int32)
    train = {"token_ids": tokens[:, :-1],
             "padding_mask": np.ones((args.batch, args.seq_len), bool)}
    prompt_ids = np.zeros((args.batch, args.max_length), np.int32)
    prompt_ids[:, :args.prompt_len] = tokens[:, :args.prompt_len]
    prompt = {"token_ids": prompt_ids,
              "padding_mask": np.arange(args.max_length)[None, :].repeat(args.batch, 0)
              < args.prompt_len}
    return train, tokens[:, 1:], prompt


def run_round(impl: str, model, data, args, state: dict) -> dict:
    """One round of ``impl``: its training steps and one generate call, timed. The first
    round also compiles (untimed) and records the first loss and the tokens."""
    train, labels, prompt = data
    with attention(impl):
        if "first_loss" not in state:
            state["first_loss"] = float(
                model.train_on_batch(train, labels, return_dict=True)["loss"])
            generated = model.generate(prompt, stop_token_ids=None)["token_ids"]
            state["tokens"] = generated[:, args.prompt_len:]
        start = time.perf_counter()
        for _ in range(args.steps):
            model.train_on_batch(train, labels)  # returns the loss to the host: synchronised
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(prompt, stop_token_ids=None)
        generate_s = time.perf_counter() - start
    return {"train_tokens_per_s": args.steps * args.batch * args.seq_len / train_s,
            "generate_tokens_per_s": args.batch * (args.max_length - args.prompt_len)
            / generate_s}


def table(header: str, rows: list[dict]) -> str:
    lines = [f"# KerasHub Llama, Keras's attention vs pallas_flash: {header}", "",
             "tokens/s, median over interleaved rounds; vs keras: the ratio to Keras's own "
             "attention. Loss gap: |first training loss - first implementation's|; tokens "
             "equal: share of generated tokens equal to the first implementation's.", "",
             "| attention | train tokens/s | vs keras | generate tokens/s | vs keras "
             "| loss gap | tokens equal |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = next((r for r in rows if r["impl"] == "keras" and r["error"] is None), None)
    for r in rows:
        if r["error"] is not None:
            continue
        ratios = [f"{r[k] / base[k]:.2f}" if base else "—"
                  for k in ("train_tokens_per_s", "generate_tokens_per_s")]
        lines.append(f"| {r['impl']} | {r['train_tokens_per_s']:.0f} | {ratios[0]} | "
                     f"{r['generate_tokens_per_s']:.0f} | {ratios[1]} | {r['loss_gap']:.2g} "
                     f"| {r['tokens_equal']:.3f} |")
    lines += report.not_run([f"{r['impl']}: {r['error']}" for r in rows
                             if r["error"] is not None])
    return "\n".join(lines)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: a tiny float32 model, one round")
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS),
                        help=f"comma list from {', '.join(IMPLEMENTATIONS)}")
    for name, help_ in (("layers", "default 4"), ("heads", "query heads, default 16"),
                        ("kv-heads", "default 4"), ("head-dim", "default 128"),
                        ("intermediate", "MLP width, default 5632"),
                        ("vocab", "default 32000"), ("batch", "default 8"),
                        ("seq-len", "training length, default 2048"),
                        ("prompt-len", "default 128"),
                        ("max-length", "generated length incl. prompt, default 640"),
                        ("steps", "timed training steps per round, default 10"),
                        ("rounds", "default 3")):
        parser.add_argument(f"--{name}", type=int, default=None, help=help_)
    parser.add_argument("--dtype", default=None, help="default bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    defaults = (dict(layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=128,
                     batch=2, seq_len=32, prompt_len=4, max_length=12, steps=1, rounds=1,
                     dtype="float32") if args.quick else
                dict(layers=4, heads=16, kv_heads=4, head_dim=128, intermediate=5632,
                     vocab=32000, batch=8, seq_len=2048, prompt_len=128, max_length=640,
                     steps=10, rounds=3, dtype="bfloat16"))
    report.fill_defaults(args, defaults)
    args.impl_names = args.impls.split(",")
    for name in args.impl_names:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"--impls takes names from {IMPLEMENTATIONS}, got {name!r}")
    for name in ("layers", "heads", "kv_heads", "head_dim", "batch", "steps", "rounds",
                 "prompt_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                             f"got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads "
                         f"({args.kv_heads})")
    if not args.prompt_len < args.max_length <= args.seq_len:
        raise ValueError(f"need --prompt-len < --max-length <= --seq-len, got "
                         f"{args.prompt_len}, {args.max_length}, {args.seq_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = (f"{jax.devices()[0].device_kind}, jax {jax.__version__}, keras "
              f"{keras.__version__}, keras-hub {keras_hub.__version__}, "
              f"{datetime.date.today()}; {args.layers} layers, {args.heads} heads "
              f"({args.kv_heads} KV) × head_dim {args.head_dim}, {args.dtype}; train "
              f"{args.batch} × {args.seq_len}, generate {args.batch} × {args.prompt_len} → "
              f"{args.max_length}")
    data = make_data(args)
    models, states, rates = {}, {}, {impl: [] for impl in args.impl_names}
    errors: dict[str, str] = {}
    for _ in range(args.rounds):
        for impl in args.impl_names:
            if impl in errors:
                continue
            try:
                if impl not in models:
                    models[impl], states[impl] = build_model(args), {}
                rates[impl].append(run_round(impl, models[impl], data, args, states[impl]))
            except Exception as exc:  # one implementation failing (out of memory) is a row
                errors[impl] = error_summary(exc)
                models.pop(impl, None)
        rows = summarize(args.impl_names, rates, states, errors)
        if args.out:  # after every round: a run cut short keeps what it measured
            report.write_rows(args.out, report.file_stem(
                "keras-hub", jax.devices()[0].device_kind, str(datetime.date.today())), header,
                              jax.__version__, rows, table(header, rows))
    for row in rows:
        print(json.dumps(row), flush=True)
    print(table(header, rows))
    return 0


def summarize(impls: list[str], rates: dict[str, list[dict]], states: dict[str, dict],
              errors: dict[str, str]) -> list[dict]:
    """One row per implementation: median tokens/s over its rounds, and its agreement with
    the first implementation that ran (first loss, generated tokens)."""
    rows = []
    first = next((states[i] for i in impls if i not in errors and "tokens" in states.get(i, {})),
                 None)
    for impl in impls:
        if impl in errors or not rates[impl]:
            rows.append(dict(impl=impl, error=errors.get(impl, "did not run")))
            continue
        state = states[impl]
        rows.append(dict(
            impl=impl, error=None, rounds=len(rates[impl]),
            train_tokens_per_s=statistics.median(r["train_tokens_per_s"] for r in rates[impl]),
            generate_tokens_per_s=statistics.median(
                r["generate_tokens_per_s"] for r in rates[impl]),
            first_loss=state["first_loss"],
            loss_gap=abs(state["first_loss"] - first["first_loss"]),
            tokens_equal=float(np.mean(state["tokens"] == first["tokens"]))))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
