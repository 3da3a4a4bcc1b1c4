"""Train the byte-level transformer of :mod:`models.transformer` on real text.

    python -m models.train --preset tiny                 # ~2 minutes on a laptop CPU
    python -m models.train --preset small --seq-len 4096 # every local GPU, data parallel
    python -m models.train --preset small --seq-len 32768 --context-parallel 4

Data parallel over all local devices by default (``--data-parallel``); each row can also be
split over ``--context-parallel`` devices (zigzag order, ring attention). Writes
``<out>/loss.png``, ``<out>/metrics.json`` and orbax checkpoints under ``<out>/checkpoints``;
``--resume`` continues from the latest one (``--overwrite`` starts
afresh in a folder that already holds a run).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from models import data
from models.transformer import (
    BASELINE_IMPLEMENTATIONS,
    OUR_IMPLEMENTATIONS,
    PRESETS,
    Transformer,
    TransformerConfig,
    attention_kwargs,
    count_params,
    generate,
)
from pallas_flash import to_zigzag
from pallas_flash.dispatch import available_implementations

# The training mesh: the batch is split over DATA, each row's tokens over CONTEXT.
DATA, CONTEXT = "data", "context"

# Per-preset defaults of the optimisation flags (the architecture is in PRESETS).
TRAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {"steps": 300, "batch_size": 16, "learning_rate": 3e-3, "warmup_steps": 30},
    "small": {"steps": 5000, "batch_size": 8, "learning_rate": 6e-4, "warmup_steps": 200},
}


class OutFolderError(ValueError):
    """``--out`` already holds a run that this one would mix into: the user's to resolve
    with a flag, so :func:`main` reports it in one line instead of a traceback."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none to show (None, switches)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _per_preset(name: str) -> str:
    """'(tiny: 300, small: 5000)' for a flag whose default depends on the preset."""
    values = {preset: (TRAIN_DEFAULTS[preset] | {"seq_len": PRESETS[preset].seq_len})[name]
              for preset in PRESETS}
    return "(" + ", ".join(f"{preset}: {value:g}" for preset, value in values.items()) + ")"


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="python -m models.train",
        description=(
            "Train a byte-level decoder-only transformer whose attention is "
            "pallas_flash.attention. Default corpus: the .py files of Python's standard "
            "library, split into train/validation by file, packed into rows with segment ids "
            "(attention never crosses a document). Writes a loss plot, metrics.json and "
            "orbax checkpoints to --out, and prints a generated sample at the end."),
        formatter_class=_HelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="model size (tiny: CPU, ~2 min; small: ~76M params, GPU)")
    p.add_argument("--steps", type=int, help=f"optimizer steps {_per_preset('steps')}")
    p.add_argument("--batch-size", type=int, help=f"rows per step {_per_preset('batch_size')}")
    p.add_argument("--seq-len", type=int, help=f"tokens (bytes) per row {_per_preset('seq_len')}")
    p.add_argument("--learning-rate", type=float,
                   help=f"peak learning rate {_per_preset('learning_rate')}")
    p.add_argument("--warmup-steps", type=int,
                   help=f"linear warm-up steps {_per_preset('warmup_steps')}")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay (matrices only)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--implementation",
                   choices=(*OUR_IMPLEMENTATIONS, *BASELINE_IMPLEMENTATIONS),
                   help="attention: ours (mosaic, triton, xla) or a jax.nn.dot_product_attention "
                        "baseline (cudnn, xla_dense); default: fastest of ours available")
    p.add_argument("--data-parallel", type=int, metavar="N",
                   help="devices the batch is split over (parameters replicated); default: "
                        "every local device not used by --context-parallel")
    p.add_argument("--context-parallel", type=int, default=1, metavar="N",
                   help="devices each row is split over, in zigzag order, attention through "
                        "pallas_flash.ring_attention (--seq-len: a multiple of 2N)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype; auto = bfloat16 on GPU, float32 elsewhere "
                        "(parameters are always float32)")
    p.add_argument("--data", type=Path,
                   help="train on this text file or folder instead of the stdlib sources")
    p.add_argument("--val-fraction", type=float, default=0.05,
                   help="share of files (or of a single file's bytes) held out")
    p.add_argument("--eval-every", type=int, help="steps between validation runs "
                   "(default: steps/10)")
    p.add_argument("--eval-rows", type=int, default=64, help="validation rows per evaluation")
    p.add_argument("--checkpoint-every", type=int,
                   help="steps between checkpoints (default: same as --eval-every)")
    runs = p.add_mutually_exclusive_group()
    runs.add_argument("--resume", action="store_true",
                      help="continue from the latest checkpoint in --out; a --steps, "
                           "--warmup-steps or --learning-rate other than the run's is "
                           "refused (it would change the learning-rate schedule) unless "
                           "--new-schedule is given")
    runs.add_argument("--overwrite", action="store_true",
                      help="delete the checkpoints already in --out and start afresh")
    p.add_argument("--new-schedule", action="store_true",
                   help="with --resume: continue on the schedule of the flags given now "
                        "(the change is printed) instead of refusing")
    p.add_argument("--out", type=Path, help="output folder (default: runs/<preset>)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed")
    p.add_argument("--prompt", default="def ", help="start of the generated sample")
    p.add_argument("--sample-tokens", type=int, default=200,
                   help="bytes to generate at the end (0: no sample)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 = greedy")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` and fill the per-preset defaults."""
    args = build_parser().parse_args(argv)
    for name, value in TRAIN_DEFAULTS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.seq_len is None:
        args.seq_len = PRESETS[args.preset].seq_len
    if args.eval_every is None:
        args.eval_every = max(1, args.steps // 10)
    if args.checkpoint_every is None:
        args.checkpoint_every = args.eval_every
    if args.out is None:
        args.out = Path("runs") / args.preset
    if args.new_schedule and not args.resume:
        raise ValueError("--new-schedule applies to --resume only")
    return args


def make_mesh(args: argparse.Namespace) -> Mesh:
    """The ``(data, context)`` mesh of ``--data-parallel`` x ``--context-parallel``.

    Checks the flags against the local devices, the batch, the sequence and the attention
    implementation first, so that a bad combination fails before any work, naming its flag.
    ``--data-parallel`` defaults to every local device that ``--context-parallel`` leaves
    (``jax.local_device_count() // context_parallel``).
    """
    if jax.process_count() > 1:
        raise ValueError(f"models.train runs in one process; this is one of "
                         f"{jax.process_count()} (jax.distributed): multi-host training is "
                         "not supported")
    devices = jax.local_devices()
    context = args.context_parallel
    if context < 1:
        raise ValueError(f"--context-parallel must be at least 1, got {context}")
    data_parallel = args.data_parallel
    if data_parallel is None:
        data_parallel = max(1, len(devices) // context)
        default = (f" (the default: the {len(devices)} local device(s) over --context-parallel "
                   f"{context}; pass --data-parallel to choose)")
    else:
        default = ""
        if data_parallel < 1:
            raise ValueError(f"--data-parallel must be at least 1, got {data_parallel}")
    if data_parallel * context > len(devices):
        raise ValueError(
            f"--data-parallel {data_parallel} x --context-parallel {context} needs "
            f"{data_parallel * context} devices; there are {len(devices)} local "
            f"{devices[0].platform} device(s)")
    if args.batch_size % data_parallel:
        raise ValueError(f"--batch-size {args.batch_size} does not split over --data-parallel "
                         f"{data_parallel}{default}: it must be a multiple")
    if context > 1:
        if args.seq_len % (2 * context):
            raise ValueError(
                f"--seq-len {args.seq_len} does not split over --context-parallel {context}: "
                f"zigzag order cuts each row into 2 x {context} equal chunks, so it must be "
                f"a multiple of {2 * context}")
        if args.implementation in BASELINE_IMPLEMENTATIONS:
            raise ValueError(
                f"--context-parallel {context} runs attention through "
                f"pallas_flash.ring_attention, which --implementation {args.implementation} "
                f"(a jax.nn.dot_product_attention baseline) cannot: use one of "
                f"{', '.join(OUR_IMPLEMENTATIONS)}")
    if args.implementation in OUR_IMPLEMENTATIONS and (
            args.implementation not in available_implementations()):
        raise ValueError(
            f"--implementation {args.implementation} cannot run on the "
            f"{devices[0].platform} devices here (available: "
            f"{', '.join(available_implementations())})")
    return jax.make_mesh((data_parallel, context), (DATA, CONTEXT),
                         axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:data_parallel * context])


def compute_dtype(name: str) -> Any:
    """``--dtype`` -> a jnp dtype."""
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return jnp.dtype(name)


# The flags that define the learning-rate schedule, recorded in <out>/schedule.json.
SCHEDULE_FLAGS = ("steps", "warmup_steps", "learning_rate")


def learning_rate_schedule(steps: int, warmup_steps: int, learning_rate: float
                           ) -> optax.Schedule:
    """Linear warm-up to ``learning_rate``, then cosine decay to 10% of it at ``steps``.

    Called with the optimizer's update count: step ``s`` (1-based) uses ``schedule(s - 1)``.
    """
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
        decay_steps=max(steps, warmup_steps + 1), end_value=0.1 * learning_rate)


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """Clip, then AdamW on :func:`learning_rate_schedule`."""
    schedule = learning_rate_schedule(args.steps, args.warmup_steps, args.learning_rate)

    def decay_mask(params):
        # Decay matrices only: shrinking norm scales towards 0 is not regularisation.
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(args.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay,
                    mask=decay_mask))


def with_targets(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``batch`` plus each token's next-token ``targets`` and loss ``weights`` ([batch, seq]).

    A target that starts a new segment (a different document) or falls on padding has
    weight 0: nothing in the row before it is allowed to predict it; so has the last column,
    which has no next token. Computed on whole rows, before a row is split over devices, so
    that a shard needs nothing of its neighbour's.
    """
    tokens, segments = batch["tokens"], batch["segment_ids"]
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    weights = np.zeros(tokens.shape, np.float32)
    weights[:, :-1] = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    return {**batch, "targets": targets, "weights": weights}


def loss_terms(model: Transformer, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(sum of weighted cross-entropies, sum of weights)`` over the tokens of ``batch`` (a
    batch of :func:`with_targets`, or a shard of one). The loss, the mean cross-entropy of
    predicting each byte from the bytes before it, is their ratio over all shards."""
    logits = model(batch["tokens"], positions=batch["positions"],
                   segment_ids=batch["segment_ids"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.sum(nll * batch["weights"]), jnp.sum(batch["weights"])


def batch_placer(mesh: Mesh, seq_len: int):
    """``place(rows) -> batch on the mesh``: adds the targets, reorders each row into zigzag
    order (:func:`pallas_flash.to_zigzag`) when the context axis splits it, and splits rows
    over ``data`` and tokens over ``context``. Positions and segment ids move with their
    tokens, so RoPE and the document masks see each token's place in the whole row."""
    sharding = NamedSharding(mesh, P(DATA, CONTEXT))
    context = mesh.shape[CONTEXT]
    order = None
    if context > 1:
        order = np.asarray(to_zigzag(np.arange(seq_len), context, axis=0))

    def place(rows: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        batch = with_targets(rows)
        if order is not None:
            batch = {name: x[:, order] for name, x in batch.items()}
        return jax.device_put(batch, sharding)

    return place


def make_steps(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, mesh: Mesh):
    """Jitted ``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` and
    ``eval_step(params, batch) -> loss`` on the model's parameter state, for parameters
    replicated over ``mesh`` and batches placed by :func:`batch_placer`.

    On more than one device the model runs on each device's shard inside ``jax.shard_map``
    and the loss terms are summed over the mesh (a mean over the global tokens); the
    gradient of the replicated parameters is then summed over the mesh by ``shard_map``'s
    transpose. ``train_step`` donates the parameters and optimizer state it is given
    (their buffers become the new ones': one copy of the training state per device).
    """

    def local_terms(params, batch):
        return loss_terms(nnx.merge(graphdef, params), batch)

    terms = local_terms
    if mesh.size > 1:
        def summed_terms(params, batch):
            return jax.lax.psum(local_terms(params, batch), (DATA, CONTEXT))

        terms = jax.shard_map(summed_terms, mesh=mesh, in_specs=(P(), P(DATA, CONTEXT)),
                              out_specs=P())

    def loss_of(params, batch):
        total, count = terms(params, batch)
        return total / jnp.maximum(count, 1.0)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_of)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, jax.jit(loss_of)


def init_training(args: argparse.Namespace, config: TransformerConfig, mesh: Mesh):
    """``(model, (params, opt_state), (train_step, eval_step))`` of a fresh run: the model
    (attention through ring attention over ``context`` when the mesh splits rows), its
    parameters and optimizer state replicated over ``mesh``, and :func:`make_steps`."""
    context_axis = CONTEXT if mesh.shape[CONTEXT] > 1 else None
    model = Transformer(config, dtype=compute_dtype(args.dtype), rngs=nnx.Rngs(args.seed),
                        **attention_kwargs(args.implementation, context_axis=context_axis))
    tx = make_optimizer(args)
    graphdef, params = nnx.split(model, nnx.Param)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    return model, (params, opt_state), make_steps(graphdef, tx, mesh)


def evaluate(eval_step, params, val: data.PackedRows, batch_size: int, rows: int,
             place) -> float:
    """Mean loss over the first ``rows`` validation rows (wrapping around a short split);
    ``place`` (:func:`batch_placer`) puts each batch on the devices."""
    index = np.arange(max(batch_size, rows - rows % batch_size)) % len(val)
    losses = [eval_step(params, place(val.rows(index[i:i + batch_size])))
              for i in range(0, len(index), batch_size)]
    return float(np.mean(jax.device_get(losses)))


def plot_losses(history: dict[str, list], path: Path) -> None:
    """Train and validation loss against step, saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["step"], history["loss"], lw=0.8, alpha=0.6, label="train")
    ax.plot(history["val_step"], history["val_loss"], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats / byte)", title=path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def open_checkpoints(out: Path, resume: bool, overwrite: bool) -> ocp.CheckpointManager:
    """The run's checkpoint manager; refuses to mix a fresh run into an earlier one."""
    directory = out / "checkpoints"
    if overwrite:
        shutil.rmtree(directory, ignore_errors=True)
    manager = ocp.CheckpointManager(directory,
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    if not resume and manager.latest_step() is not None:
        raise OutFolderError(
            f"{directory} already holds checkpoints (latest: step {manager.latest_step()}); "
            "pass --resume to continue that run or --overwrite to start afresh")
    return manager


def check_schedule(args: argparse.Namespace, out: Path, checkpoint_step: int | None) -> None:
    """Record the run's schedule flags in ``<out>/schedule.json``; when resuming from
    ``checkpoint_step``, refuse different ones (they would bend the learning-rate curve
    under the steps already taken) unless ``--new-schedule``, and say how it changes."""
    path = out / "schedule.json"
    wanted = {name: getattr(args, name) for name in SCHEDULE_FLAGS}
    if checkpoint_step is not None:
        if args.steps < checkpoint_step:
            raise ValueError(f"--steps {args.steps} is before the checkpoint's step "
                             f"{checkpoint_step}: nothing to resume")
        if not path.exists():
            print(f"{path} is missing: the schedule of the resumed run cannot be checked")
        elif (saved := json.loads(path.read_text())) != wanted:
            change = describe_schedule_change(saved, wanted, checkpoint_step)
            if not args.new_schedule:
                raise ValueError(f"{change}. Resume with the run's flags, or pass "
                                 "--new-schedule to continue on the new schedule")
            print(f"new schedule: {change}")
    path.write_text(json.dumps(wanted))


def describe_schedule_change(saved: dict[str, Any], wanted: dict[str, Any],
                             checkpoint_step: int) -> str:
    """What resuming at ``checkpoint_step`` with the ``wanted`` schedule flags instead of
    the ``saved`` ones does to the learning rate."""
    flags = ", ".join(f"--{name.replace('_', '-')} {saved[name]:g} -> {wanted[name]:g}"
                      for name in SCHEDULE_FLAGS if saved[name] != wanted[name])
    old, new = (learning_rate_schedule(**flags_) for flags_ in (saved, wanted))
    return (f"the run in this folder was trained on another schedule ({flags}): resuming at "
            f"step {checkpoint_step + 1}, its learning rate would change from "
            f"{float(old(checkpoint_step)):.3g} to {float(new(checkpoint_step)):.3g}, and "
            f"the cosine decay end at step {wanted['steps']} (was {saved['steps']})")


# (step key, value key) of every series in the history; a resumed run keeps what came
# before its checkpoint.
_SERIES = (("step", "loss"), ("val_step", "val_loss"), ("rate_step", "tokens_per_s"))


def _restore(manager: ocp.CheckpointManager, params, opt_state, history_path: Path):
    """Latest checkpoint and the history up to it, or ``None`` if there is none."""
    step = manager.latest_step()
    if step is None:
        return None
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                          {"params": params, "opt_state": opt_state})
    restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    saved = json.loads(history_path.read_text())
    history = {}
    for steps, values in _SERIES:
        kept = [i for i, s in enumerate(saved.get(steps, [])) if s <= step]
        history[steps] = [saved[steps][i] for i in kept]
        history[values] = [saved[values][i] for i in kept]
    return step, restored["params"], restored["opt_state"], history


def train(args: argparse.Namespace) -> dict[str, list]:
    """Run training as configured by :func:`parse_args`. Returns the history (also written
    to metrics.json): ``step``/``loss`` (train), ``val_step``/``val_loss`` and
    ``rate_step``/``tokens_per_s``: throughput of the training steps alone over each
    logging interval (evaluation and checkpointing excluded), with the step it ends at."""
    config = PRESETS[args.preset]
    mesh = make_mesh(args)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    manager = open_checkpoints(out, args.resume, args.overwrite)
    check_schedule(args, out, manager.latest_step() if args.resume else None)
    train_rows, val_rows = data.load_corpus(args.seq_len, args.data, args.val_fraction)
    model, (params, opt_state), (train_step, eval_step) = init_training(args, config, mesh)
    print(f"{args.preset}: {count_params(model) / 1e6:.2f}M parameters, "
          f"{len(train_rows)} train / {len(val_rows)} validation rows of {args.seq_len} bytes, "
          f"{jax.default_backend()}, data parallel {mesh.shape[DATA]} x context parallel "
          f"{mesh.shape[CONTEXT]}")

    place = batch_placer(mesh, args.seq_len)
    history: dict[str, list] = {name: [] for series in _SERIES for name in series}
    history_path = out / "metrics.json"
    start = 0
    if args.resume and (restored := _restore(manager, params, opt_state, history_path)):
        start, params, opt_state, history = restored
        print(f"resumed from step {start}")
    else:
        history["val_step"].append(0)
        history["val_loss"].append(
            evaluate(eval_step, params, val_rows, args.batch_size, args.eval_rows, place))
        print(f"step 0: validation {history['val_loss'][0]:.3f}")

    def save(step):
        history_path.write_text(json.dumps(history))
        manager.save(step, args=ocp.args.StandardSave({"params": params,
                                                        "opt_state": opt_state}))

    tokens_per_step = args.batch_size * args.seq_len
    pending: list[tuple[int, jax.Array]] = []   # losses not yet fetched (no sync per step)
    bar = tqdm(range(start + 1, args.steps + 1), initial=start, total=args.steps,
               unit="step", dynamic_ncols=True, file=sys.stderr)   # results go to stdout
    tick, ticked = time.perf_counter(), start
    for step in bar:
        batch = place(data.train_batch(train_rows, args.batch_size, args.seed, step))
        params, opt_state, loss = train_step(params, opt_state, batch)
        pending.append((step, loss))
        last = step == args.steps
        evaluating, saving = step % args.eval_every == 0, step % args.checkpoint_every == 0
        if step % 10 == 0 or evaluating or saving or last:
            history["step"] += [s for s, _ in pending]
            history["loss"] += [float(v) for _, v in pending]
            pending.clear()
            rate = tokens_per_step * (step - ticked) / (time.perf_counter() - tick)
            history["rate_step"].append(step)
            history["tokens_per_s"].append(rate)
            bar.set_postfix(loss=f"{history['loss'][-1]:.3f}", tok_s=f"{rate:,.0f}")
        if evaluating or last:
            history["val_step"].append(step)
            history["val_loss"].append(
                evaluate(eval_step, params, val_rows, args.batch_size, args.eval_rows, place))
            bar.write(f"step {step}: train {history['loss'][-1]:.3f}  "
                      f"validation {history['val_loss'][-1]:.3f}")
        if saving or last:
            save(step)
        if step % 10 == 0 or evaluating or saving or last:
            tick, ticked = time.perf_counter(), step  # the next interval times steps only
    bar.close()
    manager.wait_until_finished()

    plot_path = out / "loss.png"
    plot_losses(history, plot_path)
    if args.sample_tokens > 0:
        nnx.update(model, params)
        prompt = jnp.array([list(args.prompt.encode())], jnp.int32)
        new = generate(model, prompt, args.sample_tokens, temperature=args.temperature,
                       rng=jax.random.key(args.seed))
        text = bytes(np.asarray(new[0], np.uint8)).decode("utf-8", errors="replace")
        print(f"--- sample ({'greedy' if args.temperature == 0 else f'T={args.temperature}'})"
              f" ---\n{args.prompt}{text}\n---")
    print(f"loss plot: {plot_path}\ncheckpoint: {manager.directory / str(manager.latest_step())}")
    if history["val_loss"]:
        print(f"final validation loss {history['val_loss'][-1]:.3f} nats/byte "
              f"({history['val_loss'][-1] / math.log(2):.3f} bits/byte)")
    return history


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m models.train``."""
    try:
        train(parse_args(argv))
    except OutFolderError as error:
        raise SystemExit(f"models.train: {error}") from None


if __name__ == "__main__":
    main()
