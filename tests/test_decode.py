"""Decode (a few new tokens against a KV cache), contiguous and paged, vs the float64 oracle.

The oracle runs each sequence on its own cache cut to its length, with bottom-right causal
alignment (:class:`MaskSpec` ``causal_alignment="bottom_right"``): the semantics that
:func:`pallas_flash.decode_attention` implements with per-row lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import BACKENDS, F32, assert_matches, fresh_key, random_qkv, rel_err

import pallas_flash as pf
from pallas_flash.decode import default_num_splits, merge_splits
from pallas_flash.masking import MaskSpec
from pallas_flash.mosaic import DecodeConfig
from pallas_flash.paged import gather_pages
from pallas_flash.reference import EMPTY_ROW_LSE, attention_float64


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int = 3
    seq_q: int = 1
    seq_kv: int = 48
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    is_causal: bool = True
    window: tuple[int, int] | None = None
    softcap: float | None = None
    sinks: bool = False
    splits: tuple[int, ...] = (5,)  # for test_decode_matches_oracle_for_every_split

    def __str__(self) -> str:
        parts = [f"t{self.seq_q}", f"h{self.heads}k{self.kv_heads}"]
        if not self.is_causal:
            parts.append("noncausal")
        if self.window:
            parts.append(f"w{self.window[0]}-{self.window[1]}")
        if self.softcap:
            parts.append("cap")
        if self.sinks:
            parts.append("sinks")
        return "-".join(parts)


def _rng() -> np.random.Generator:
    """A NumPy generator seeded from a fresh key (new draws in every test)."""
    return np.random.default_rng(np.asarray(fresh_key()))


def _lengths(case: Case) -> np.ndarray:
    """Ragged lengths in [1, seq_kv]: the full cache, one shorter than seq_q, one between."""
    rng = _rng()
    lengths = np.concatenate([[case.seq_kv, 2], rng.integers(1, case.seq_kv + 1, case.batch)])
    return lengths[:case.batch].astype(np.int32)


def _sinks(case: Case):
    return jax.random.normal(fresh_key(), (case.heads,), jnp.float32) if case.sinks else None


def _oracle(case: Case, q, k, v, lengths, sinks, d_out=None):
    """Per sequence, the float64 oracle on the cache cut to its length; (out, lse [B, N, T])
    and, with ``d_out``, (dq, dk, dv, [d_sinks]) with zero key gradients past the length."""
    outs, lses, grads = [], [], []
    for b, length in enumerate(np.asarray(lengths)):
        if length == 0 and d_out is None:  # no key: out 0, the lse of the sinks alone
            outs.append(np.zeros((1, case.seq_q, case.heads, case.head_dim)))
            lses.append(np.broadcast_to(
                np.float32(EMPTY_ROW_LSE) if sinks is None else np.asarray(sinks)[:, None],
                (1, case.heads, case.seq_q)))
            continue
        spec = MaskSpec(seq_q=case.seq_q, seq_kv=int(length), is_causal=case.is_causal,
                        causal_alignment="bottom_right", window=case.window)
        rows = slice(b, b + 1)
        result = attention_float64(
            q[rows], k[rows, :length], v[rows, :length], mask=spec, softcap=case.softcap,
            sinks=sinks, d_out=None if d_out is None else d_out[rows])
        outs.append(result[0])
        lses.append(result[1])
        if d_out is not None:
            pad = [(0, 0), (0, case.seq_kv - length), (0, 0), (0, 0)]
            dq, dk, dv, *d_sinks = result[2]
            grads.append((dq, np.pad(dk, pad), np.pad(dv, pad), *d_sinks))
    out, lse = np.concatenate(outs), np.concatenate(lses)
    if d_out is None:
        return out, lse
    merged = [np.concatenate([g[i] for g in grads]) for i in range(3)]
    if sinks is not None:
        merged.append(sum(g[3] for g in grads))
    return out, lse, tuple(merged)


def _jitted(fn, **static):
    """``fn`` jitted with the keywords ``static`` fixed (eager dispatch is ~5x slower)."""
    return jax.jit(functools.partial(fn, **static))


CASES = [
    Case(),
    Case(seq_q=4, heads=8, kv_heads=2, sinks=True, splits=(5, 12)),
    Case(seq_q=4, heads=4, kv_heads=1, window=(6, 0), softcap=2.0),  # MQA
    Case(seq_q=1, heads=6, kv_heads=3, window=(5, 5), is_causal=False, softcap=3.0,
         sinks=True),
    Case(seq_q=3, is_causal=False, heads=2, kv_heads=2, window=(4, 1)),  # MHA
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_matches_oracle_for_every_split(case):
    """xla backend, float32. num_splits 5 does not divide 48 (the cache is padded to chunks
    of 10 keys) and leaves 4 chunks wholly past the row of length 2; 12 gives chunks of 4
    keys, a reshape. One split (the heuristic at these sizes) runs in the paged tests."""
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim)
    lengths, sinks = _lengths(case), _sinks(case)
    ref_out, ref_lse = _oracle(case, q, k, v, lengths, sinks)
    for num_splits in case.splits:
        decode = _jitted(pf.decode_attention, is_causal=case.is_causal,
                         local_window_size=case.window, logits_soft_cap=case.softcap,
                         num_splits=num_splits, return_lse=True, implementation="xla")
        out, lse = decode(q, k, v, key_value_seq_lengths=jnp.asarray(lengths), sinks=sinks)
        assert_matches(out, lse, (), ref_out, ref_lse, (), F32, names=())


def test_decode_triton_interpret():
    """The Triton kernels (interpret mode) under the packing, the split and a mask array
    (seq_q > 1 with a window), MQA."""
    case = CASES[2]
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim)
    lengths, sinks = _lengths(case), _sinks(case)
    ref_out, ref_lse = _oracle(case, q, k, v, lengths, sinks)
    out, lse = pf.decode_attention(
        q, k, v, is_causal=case.is_causal, local_window_size=case.window,
        key_value_seq_lengths=jnp.asarray(lengths), logits_soft_cap=case.softcap,
        sinks=sinks, num_splits=2, return_lse=True,
        **BACKENDS["triton"].kwargs(case.head_dim))
    assert_matches(out, lse, (), ref_out, ref_lse, (), F32, names=())


BALANCED_CASES = [
    # seq_q 1, GQA, a softcap and sinks; a row of no key. Lengths past 256 keys: the run-
    # time split counts differ per row (4, 2, 1, 1).
    (Case(batch=4, seq_kv=1024, heads=4, kv_heads=1, softcap=2.0, sinks=True), None,
     (1024, 300, 5, 0)),
    # A window's left edge moves each row's first visible key; fixed 3 splits per row.
    (Case(seq_q=1, seq_kv=200, heads=6, kv_heads=2, window=(37, 0)), 3, None),
    # Several tokens that see the same keys (no per-token mask): 8 packed rows per split.
    (Case(seq_q=4, seq_kv=130, heads=4, kv_heads=2, is_causal=False), 2, None),
    # One length for every row, as a scalar (a cache filled up to one index).
    (Case(batch=2, seq_kv=700, heads=4, kv_heads=2), None, 517),
    # Several tokens that see different keys, where the tokens' band edges fall in a tile
    # inside a part (64-key tiles), not only in its edge tiles: per-token causal edges at
    # a row end on a tile boundary (576; GQA, sinks, run-time counts, a row shorter than
    # seq_q), and a window's per-token left edges across a tile boundary (the row of 536
    # first sees key 382) with a softcap (MQA).
    (Case(seq_q=3, seq_kv=600, heads=8, kv_heads=2, sinks=True), None, (576, 2, 333)),
    (Case(batch=2, seq_q=4, seq_kv=600, heads=4, kv_heads=1, window=(150, 0), softcap=2.0),
     1, (512, 536)),
]


@pytest.mark.parametrize(("case", "num_splits", "lengths"), BALANCED_CASES,
                         ids=lambda x: str(x) if isinstance(x, Case) else None)
def test_decode_balanced_splits_match_oracle(case, num_splits, lengths, monkeypatch):
    """The Triton split kernel with splits balanced per row (interpret mode, float32), and
    that it is the one taken."""
    import pallas_flash.decode as decode_module
    taken = []
    balanced = decode_module._balanced_split_forward
    monkeypatch.setattr(decode_module, "_balanced_split_forward",
                        lambda *a, **k: taken.append(1) or balanced(*a, **k))
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim)
    lengths = _lengths(case) if lengths is None else lengths
    sinks = _sinks(case)
    ref_out, ref_lse = _oracle(case, q, k, v, np.broadcast_to(lengths, (case.batch,)), sinks)
    out, lse = pf.decode_attention(
        q, k, v, is_causal=case.is_causal, local_window_size=case.window,
        key_value_seq_lengths=jnp.asarray(lengths, jnp.int32), logits_soft_cap=case.softcap,
        sinks=sinks, num_splits=num_splits, return_lse=True, implementation="triton",
        interpret=True)
    assert taken
    assert_matches(out, lse, (), ref_out, ref_lse, (), F32, names=())


def test_decode_balanced_splits_differentiate_through_the_chunks():
    """Gradients of the balanced layout (a forward-only kernel call) come from the fixed
    chunks' formulation: Triton interpret, against the oracle."""
    case = Case(seq_kv=64, heads=4, kv_heads=2, sinks=True)
    q, k, v, d_out = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads,
                                case.kv_heads, case.head_dim)
    lengths, sinks = _lengths(case), _sinks(case)

    def f(q, k, v, sinks):
        return pf.decode_attention(q, k, v, key_value_seq_lengths=jnp.asarray(lengths),
                                   sinks=sinks, num_splits=2, implementation="triton",
                                   interpret=True)

    out, vjp = jax.vjp(f, q, k, v, sinks)
    grads = vjp(d_out)
    ref_out, _, ref_grads = _oracle(case, q, k, v, lengths, sinks, d_out)
    assert rel_err(out, ref_out) < 1e-5
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        assert rel_err(got, want) < 2e-5, (name, rel_err(got, want))


def test_decode_gradients_match_oracle():
    """Gradients of q, k, v and sinks through the packing, three splits and the merge."""
    case = Case(seq_q=4, heads=4, kv_heads=2, window=(9, 0), sinks=True)
    q, k, v, d_out = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads,
                                case.kv_heads, case.head_dim)
    lengths, sinks = _lengths(case), _sinks(case)

    def f(q, k, v, sinks):
        return pf.decode_attention(q, k, v, local_window_size=case.window,
                                   key_value_seq_lengths=jnp.asarray(lengths), sinks=sinks,
                                   num_splits=3, implementation="xla")

    out, vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
    grads = vjp(d_out)
    ref_out, _, ref_grads = _oracle(case, q, k, v, lengths, sinks, d_out)
    assert rel_err(out, ref_out) < 1e-5
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        assert rel_err(got, want) < 2e-5, (name, rel_err(got, want))


def test_decode_mosaic_interpret_one_small_case():
    """Two 64-key chunks, the second partly past the length; seq_q 2 adds a mask array."""
    case = Case(batch=1, seq_q=2, seq_kv=128, heads=4, kv_heads=2, head_dim=64)
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim, jnp.bfloat16)
    lengths = np.array([70], np.int32)
    ref_out, ref_lse = _oracle(case, q, k, v, lengths, None)
    out, lse = pf.decode_attention(
        q, k, v, key_value_seq_lengths=jnp.asarray(lengths), num_splits=2,
        return_lse=True, **BACKENDS["mosaic"].kwargs(case.head_dim))
    assert_matches(out, lse, (), ref_out, ref_lse, (), jnp.bfloat16, names=())


MOSAIC_DECODE_CASES = [
    Case(batch=2, seq_q=1, seq_kv=256, heads=4, kv_heads=2, head_dim=64, softcap=5.0,
         sinks=True),
    Case(batch=1, seq_q=4, seq_kv=128, heads=8, kv_heads=2, head_dim=64, is_causal=False),
]


@pytest.mark.parametrize("config", [None, DecodeConfig(block_kv=64, num_stages=3)],
                         ids=["default", "b64s3"])
@pytest.mark.parametrize("case", MOSAIC_DECODE_CASES, ids=str)
def test_mosaic_decode_kernel_on_a_full_cache(case, config):
    """A full cache, every key visible: the Mosaic decode kernel runs (one warpgroup per
    chunk and kv head), in interpret mode, against the float64 oracle, output and lse."""
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim, jnp.bfloat16)
    sinks = jnp.linspace(-1.0, 1.0, case.heads) if case.sinks else None

    def decode(q, k, v):
        return pf.decode_attention(q, k, v, is_causal=case.is_causal, sinks=sinks,
                                   logits_soft_cap=case.softcap, num_splits=2, return_lse=True,
                                   implementation="mosaic", interpret=True, config=config)
    assert "decode_kernel" in str(jax.make_jaxpr(decode)(q, k, v))
    out, lse = jax.jit(decode)(q, k, v)
    full = np.full((case.batch,), case.seq_kv, np.int32)
    ref_out, ref_lse = _oracle(case, *(x.astype(jnp.float32) for x in (q, k, v)), full, sinks)
    assert_matches(out, lse, (), ref_out, ref_lse, (), jnp.bfloat16, names=())


def test_mosaic_decode_kernel_gradients_take_the_main_backward():
    case = Case(batch=1, seq_q=1, seq_kv=128, heads=4, kv_heads=2, head_dim=64)
    q, k, v, d_out = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads,
                                case.kv_heads, case.head_dim, jnp.bfloat16)
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: pf.decode_attention(
        q, k, v, num_splits=2, implementation="mosaic", interpret=True)), q, k, v)
    full = np.full((case.batch,), case.seq_kv, np.int32)
    ref_out, _, ref_grads = _oracle(case, *(x.astype(jnp.float32) for x in (q, k, v)),
                                    full, None, d_out.astype(jnp.float32))
    assert rel_err(out, ref_out) < 1e-2
    for name, got, want in zip(("dq", "dk", "dv"), vjp(d_out), ref_grads, strict=True):
        assert rel_err(got, want) < 2e-2, name


def test_mosaic_decode_kernel_is_taken_only_for_a_full_cache():
    """Lengths, a window or a per-token mask take the main Mosaic forward; a DecodeConfig
    for such a call, or one that cannot run the shapes, raises."""
    from pallas_flash import mosaic
    packed, chunk = (4, 8, 2, 128), (4, 256, 2, 128)
    plain = MaskSpec(seq_q=8, seq_kv=256)
    kernels, config = mosaic.decode_kernels(packed, chunk, jnp.bfloat16, plain,
                                            has_segments=False, has_mask=False, config=None)
    assert kernels is mosaic.DECODE_KERNELS and config == DecodeConfig(block_kv=128)
    for overrides in (dict(has_segments=True), dict(has_mask=True)):
        kw = {"has_segments": False, "has_mask": False, **overrides}
        assert mosaic.decode_kernels(packed, chunk, jnp.bfloat16, plain, config=None,
                                     **kw) is None
    causal = MaskSpec(seq_q=8, seq_kv=256, is_causal=True)
    assert mosaic.decode_kernels(packed, chunk, jnp.bfloat16, causal, has_segments=False,
                                 has_mask=False, config=None) is None
    assert mosaic.decode_kernels(packed, chunk, jnp.bfloat16, plain, has_segments=False,
                                 has_mask=False, config=mosaic.MosaicConfig()) is None
    with pytest.raises(ValueError, match="whole blocks"):
        mosaic.decode_kernels(packed, (4, 192, 2, 128), jnp.bfloat16,
                              MaskSpec(seq_q=8, seq_kv=192), has_segments=False,
                              has_mask=False, config=DecodeConfig(block_kv=128))
    with pytest.raises(ValueError, match="shared memory"):
        mosaic.decode_kernels(packed, chunk, jnp.bfloat16, plain, has_segments=False,
                              has_mask=False, config=DecodeConfig(block_kv=128, num_stages=4))
    with pytest.raises(ValueError, match="at most 64 packed rows"):
        mosaic.decode_kernels((4, 65, 2, 128), chunk, jnp.bfloat16,
                              MaskSpec(seq_q=65, seq_kv=256), has_segments=False,
                              has_mask=False, config=DecodeConfig())


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_kv=96), "block_kv must be a positive multiple of 64"),
    (dict(block_kv=True), "block_kv must be"),
    (dict(num_stages=0), "num_stages must be a positive int"),
    (dict(num_stages=2.0), "num_stages must be a positive int"),
])
def test_decode_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodeConfig(**kwargs)


def test_rows_without_any_key_give_zero_and_the_empty_lse():
    q, k, v, _ = random_qkv(2, 1, 32, 4, 2, 16)
    decode = _jitted(pf.decode_attention, num_splits=4, return_lse=True,
                     implementation="xla")
    out, lse = decode(q, k, v, key_value_seq_lengths=jnp.array([0, 0]))
    assert np.all(np.asarray(out) == 0)
    assert np.all(np.asarray(lse) == np.float32(EMPTY_ROW_LSE))


def test_merge_splits_takes_minus_inf_chunks_without_nan():
    out = jax.random.normal(fresh_key(), (1, 3, 2, 1, 4), jnp.float32)
    lse = jnp.array([[[[0.5, -jnp.inf]], [[-jnp.inf, -jnp.inf]], [[1.5, -jnp.inf]]]])
    out = out.at[:, 1].set(0).at[:, :, 1].set(0)  # empty chunks hold out 0
    merged, merged_lse = merge_splits(out, lse)
    expected_lse = np.logaddexp(0.5, 1.5)
    assert np.allclose(merged_lse[0, 0, 0], expected_lse, rtol=1e-6)
    assert merged_lse[0, 0, 1] == np.float32(EMPTY_ROW_LSE)
    expected = (np.exp(0.5 - expected_lse) * out[0, 0, 0] + np.exp(1.5 - expected_lse)
                * out[0, 2, 0])
    assert np.allclose(merged[0, 0], expected, rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(merged[0, 1]) == 0)


@pytest.mark.parametrize(("batch", "kv_heads", "seq_kv", "expected"), [
    (32, 8, 8192, 1),      # 256 units fill 264 slots to 97 %: one wave, no second
    (20, 8, 8192, 1),      # 160 units fill 61 %: still one
    (16, 8, 8192, 2),      # 128 units fill 48 %: 2 splits
    (8, 8, 32768, 4),      # 2.5 wanted, raised to 4, the next divisor
    (1, 8, 131072, 32),    # 19.8 wanted, raised to 32, the next divisor
    (8, 8, 12289, 1),      # prime: no divisor from 3 up, lowered to 1
    (1, 1, 300, 1),        # a chunk of at least 256 keys
    (64, 8, 4096, 1),      # enough units already
])
def test_default_num_splits(batch, kv_heads, seq_kv, expected):
    assert default_num_splits(batch, kv_heads, seq_kv) == expected


@pytest.mark.parametrize(("batch", "kv_heads", "seq_kv", "expected"), [
    (32, 8, 8192, 2),      # 1.24 wanted: 2
    (8, 8, 32768, 8),      # 4.95 wanted, raised to 8, the next divisor
    (12, 8, 8192, 4),      # 3.3 wanted, raised to 4
])
def test_default_num_splits_ragged_aims_at_twice_the_units(batch, kv_heads, seq_kv, expected):
    assert default_num_splits(batch, kv_heads, seq_kv, ragged=True) == expected


# --- paged ----------------------------------------------------------------------------


def _scattered_pool(k, v, page_size: int, extra_pages: int = 3):
    """Contiguous k, v [B, S, K, D] -> pools with the pages in random order (plus unused
    pages of noise) and the page table that addresses them (built in NumPy: cheap)."""
    k, v = np.asarray(k), np.asarray(v)
    batch, seq_kv = k.shape[:2]
    per_seq = seq_kv // page_size
    num_pages = batch * per_seq + extra_pages
    rng = _rng()
    order = rng.permutation(num_pages)[:batch * per_seq]
    pools = []
    for x in (k, v):
        pool = rng.standard_normal((num_pages, page_size, *k.shape[2:])).astype(k.dtype)
        pool[order] = x.reshape(batch * per_seq, page_size, *k.shape[2:])
        pools.append(jnp.asarray(pool))
    return pools[0], pools[1], jnp.asarray(order.reshape(batch, per_seq).astype(np.int32))


@pytest.mark.parametrize("seq_q", [1, 4, 20])
def test_paged_matches_oracle(seq_q):
    """Pages scattered at random; seq_q 20 takes the chunked-prefill path."""
    case = Case(seq_q=seq_q, seq_kv=64, heads=4, kv_heads=2, window=(30, 0) if seq_q == 4
                else None, sinks=seq_q == 1)
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim)
    key_pages, value_pages, table = _scattered_pool(k, v, page_size=8)
    lengths, sinks = _lengths(case), _sinks(case)
    ref_out, ref_lse = _oracle(case, q, k, v, lengths, sinks)
    paged = _jitted(pf.paged_attention, local_window_size=case.window, return_lse=True,
                    implementation="xla")
    out, lse = paged(q, key_pages, value_pages, table, jnp.asarray(lengths), sinks=sinks)
    assert_matches(out, lse, (), ref_out, ref_lse, (), F32, names=())


@pytest.mark.parametrize("seq_q", [1, 4])
def test_paged_reads_pages_in_place_on_triton(seq_q, monkeypatch):
    """The direct path (Triton forward reading tiles through the page table, interpret mode):
    ragged lengths, GQA, a window with 4 tokens, sinks with one; gradients through its VJP."""
    case = Case(seq_q=seq_q, seq_kv=64, heads=4, kv_heads=2, sinks=seq_q == 1,
                window=(30, 0) if seq_q == 4 else None, softcap=2.0 if seq_q == 4 else None)
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim)
    key_pages, value_pages, table = _scattered_pool(k, v, page_size=16)
    lengths, sinks = _lengths(case), _sinks(case)
    d_out = jax.random.normal(fresh_key(), q.shape, jnp.float32)
    ref_out, ref_lse, ref_grads = _oracle(case, q, k, v, lengths, sinks, d_out=d_out)
    # Fail loudly if the call took the gather fallback instead of the direct read.
    from pallas_flash import paged
    monkeypatch.setattr(paged, "gather_pages", None)
    call = _jitted(pf.paged_attention, local_window_size=case.window, return_lse=True,
                   logits_soft_cap=case.softcap, implementation="triton", interpret=True)
    out, lse = call(q, key_pages, value_pages, table, jnp.asarray(lengths), sinks=sinks)
    assert_matches(out, lse, (), ref_out, ref_lse, (), F32, names=())
    monkeypatch.undo()

    def loss(q, key_pages, value_pages, sinks):
        return jnp.sum(call(q, key_pages, value_pages, table, jnp.asarray(lengths),
                            sinks=sinks)[0] * d_out)

    dq, dkp, dvp, *d_sinks = jax.grad(loss, argnums=(0, 1, 2, 3) if case.sinks else (0, 1, 2))(
        q, key_pages, value_pages, sinks)
    # Page gradients back in sequence order; pages no table entry names get none.
    dk = np.asarray(dkp)[np.asarray(table)].reshape(k.shape)
    dv = np.asarray(dvp)[np.asarray(table)].reshape(v.shape)
    for got, want in zip((dq, dk, dv, *d_sinks), ref_grads, strict=True):
        assert rel_err(got, want) < 1e-5
    unused = np.setdiff1d(np.arange(key_pages.shape[0]), np.asarray(table))
    assert not np.any(np.asarray(dkp)[unused]) and not np.any(np.asarray(dvp)[unused])
    # Forward mode too: <d_out, J·t> = <Jᵀ·d_out, t> with the gradients above.
    t_q, t_k = (jax.random.normal(fresh_key(), x.shape, jnp.float32) for x in (q, key_pages))
    _, (t_out, _) = jax.jvp(lambda q, kp: call(q, kp, value_pages, table, jnp.asarray(lengths),
                                               sinks=sinks), (q, key_pages), (t_q, t_k))
    forward = float(jnp.sum(t_out * d_out))
    reverse = float(jnp.sum(dq * t_q) + jnp.sum(dkp * t_k))
    assert abs(forward - reverse) < 1e-4 * float(jnp.sum(jnp.abs(t_out * d_out)))


@pytest.mark.parametrize(("seq_q", "num_splits"), [(1, 3), (1, 7), (4, 4)])
def test_paged_splits_are_balanced_per_row(seq_q, num_splits):
    """The direct read's splits cut each row's own keys into equal parts (Triton, interpret
    mode): split counts that divide no page count, rows shorter than the split count (empty
    splits), a window and the per-token band with 4 tokens; against the float64 oracle."""
    from pallas_flash.decode import paged_split_forward

    case = Case(batch=4, seq_q=seq_q, seq_kv=96, heads=4, kv_heads=2,
                window=(40, 0) if seq_q == 4 else None)
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim)
    key_pages, value_pages, table = _scattered_pool(k, v, page_size=16)
    lengths = np.array([case.seq_kv, 2, 37, 64], np.int32)
    ref_out, ref_lse = _oracle(case, q, k, v, lengths, None)
    out, lse = jax.jit(functools.partial(
        paged_split_forward, window=case.window, scale=case.head_dim ** -0.5, softcap=None,
        interpret=True, num_splits=num_splits))(q, key_pages, value_pages, table,
                                                jnp.asarray(lengths))
    assert_matches(out, jnp.swapaxes(lse, 1, 2), (), ref_out, ref_lse, (), F32, names=())


@pytest.mark.parametrize(("seq_q", "group", "is_causal", "window"),
                         [(3, 1, True, None), (1, 3, False, (4, 2)), (3, 1, True, (2, 0))],
                         ids=["causal-tokens", "window", "causal-window-tokens"])
def test_split_kernel_reads_each_part_on_its_own_interval(seq_q, group, is_causal, window):
    """The Triton split kernel against float64, part by part: intervals that start and end
    inside a tile, fit in one tile, reach the cache's end (not a whole tile), are empty;
    each packed row sees its token's band (per-token causal edges, a window) within them;
    the lengths vector it hands to ``part_interval`` holds every row's length, then zeros."""
    from pallas_flash.decode import CacheVisibility
    from pallas_flash.triton import TritonConfig
    from pallas_flash.triton.decode import split_forward

    batch, rows, kv_heads, seq_kv, head_dim, num_splits, scale = 3, 3, 2, 100, 16, 3, 0.3
    lengths = np.array([50, 3, 98], np.int32)

    def part_interval(all_lengths, length, part, xp=jnp):
        lo = xp.minimum(part * 37 + length % 7 + xp.sum(all_lengths) - 151, seq_kv)
        return lo, xp.minimum(lo + length - 20 * part, seq_kv)

    band = CacheVisibility(seq_q=seq_q, group=group, is_causal=is_causal, window=window)
    q = jax.random.normal(fresh_key(), (batch, rows, kv_heads, head_dim), jnp.float32)
    k, v = (jax.random.normal(fresh_key(), (batch, seq_kv, kv_heads, head_dim), jnp.float32)
            for _ in range(2))
    out, lse = split_forward(q, k, v, jnp.asarray(lengths), part_interval, band,
                             num_splits=num_splits, scale=scale, softcap=None,
                             config=TritonConfig(block_q=16, block_kv=16, num_warps=4,
                                                 num_stages=2), interpret=True)
    assert out.shape == (batch, num_splits, rows, kv_heads, head_dim)
    assert lse.shape == (batch, num_splits, kv_heads, rows)
    qd, kd, vd = (np.asarray(x, np.float64) for x in (q, k, v))
    keys = np.arange(seq_kv)
    seen = set()
    for b in range(batch):
        for part in range(num_splits):
            lo, hi = part_interval(lengths, int(lengths[b]), part, xp=np)
            seen.add("empty" if hi <= lo else "one tile" if lo // 16 == (hi - 1) // 16
                     else "to the end" if hi == seq_kv else "across tiles")
            for r in range(rows):
                pos = lengths[b] - seq_q + r // group
                visible = (keys >= lo) & (keys < hi) & (keys < lengths[b])
                if is_causal:
                    visible &= keys <= pos
                if window is not None:
                    visible &= (keys >= pos - window[0]) & (keys <= pos + window[1])
                for h in range(kv_heads):
                    if not visible.any():
                        np.testing.assert_array_equal(np.asarray(out[b, part, r, h]), 0.0)
                        assert np.asarray(lse[b, part, h, r]) == np.float32(EMPTY_ROW_LSE)
                        seen.add("row sees nothing")
                        continue
                    logits = scale * kd[b, visible, h] @ qd[b, r, h]
                    weights = np.exp(logits - logits.max())
                    ref_out = weights @ vd[b, visible, h] / weights.sum()
                    assert rel_err(out[b, part, r, h], ref_out) < 1e-5
                    np.testing.assert_allclose(float(lse[b, part, h, r]),
                                               logits.max() + np.log(weights.sum()),
                                               rtol=1e-5)
    assert {"empty", "one tile", "to the end", "across tiles", "row sees nothing"} <= seen


def test_balanced_splits_cut_each_row_evenly():
    """Part bounds (what the split kernel computes per program): equal parts to a key, empty
    parts where a row has fewer keys than parts, and past a row's own count."""
    from pallas_flash.decode import _part_bound

    first, visible, parts = jnp.array([[0], [5], [0]]), jnp.array([[10], [2], [0]]), jnp.arange(5)
    np.testing.assert_array_equal(np.asarray(_part_bound(first, visible, 4, parts)),
                                  [[0, 2, 5, 7, 10], [5, 5, 6, 6, 7], [0] * 5])
    counts = jnp.array([[2], [4], [1]])
    np.testing.assert_array_equal(np.asarray(_part_bound(first, visible, counts, parts)),
                                  [[0, 5, 10, 10, 10], [5, 5, 6, 6, 7], [0] * 5])


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_traced_lengths_out_of_range_are_clamped(implementation):
    """Under jit the lengths cannot be checked: a length past the cache reads as the whole
    cache (never past it), a negative one as an empty row; also through the paged read."""
    case = Case(batch=3, seq_kv=32, heads=4, kv_heads=2)
    q, k, v, _ = random_qkv(case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads,
                            case.head_dim)
    kwargs = dict(implementation=implementation,
                  interpret=implementation == "triton")
    decode = jax.jit(lambda lengths: pf.decode_attention(
        q, k, v, key_value_seq_lengths=lengths, **kwargs))
    wild = decode(jnp.array([37, -3, 7], jnp.int32))
    clamped = decode(jnp.array([32, 0, 7], jnp.int32))
    np.testing.assert_array_equal(np.asarray(wild), np.asarray(clamped))
    with jax.enable_x64(True):  # an int64 length clamps before it would wrap to 5
        wide = decode(jnp.array([2 ** 32 + 5, -3, 7], jnp.int64))
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(clamped))
    assert np.all(np.asarray(clamped[1]) == 0) and np.any(np.asarray(clamped[0]) != 0)

    table = jnp.arange(6, dtype=jnp.int32).reshape(3, 2)
    pages = [x.reshape(6, 16, *x.shape[2:]) for x in (k, v)]  # row b: pages 2b, 2b + 1
    paged = jax.jit(lambda lengths: pf.paged_attention(q, *pages, table, lengths, **kwargs))
    np.testing.assert_allclose(np.asarray(paged(jnp.array([37, -3, 7], jnp.int32))),
                               np.asarray(clamped), atol=1e-5)


def test_out_of_range_page_ids_are_clamped_on_read():
    pages = jax.random.normal(fresh_key(), (5, 8, 1, 4), jnp.float32)
    table = jnp.array([[7, -3, 2]], jnp.int32)
    gathered = np.asarray(gather_pages(pages, table))
    expected = np.concatenate([pages[4], pages[0], pages[2]])[None]
    assert np.array_equal(gathered, expected)


def test_out_of_range_page_ids_are_clamped_by_the_direct_read(monkeypatch):
    """A traced table cannot be checked: its ids are clamped into the pool."""
    pages = jax.random.normal(fresh_key(), (2, 3, 16, 1, 16), jnp.float32)
    q = jax.random.normal(fresh_key(), (1, 1, 2, 16), jnp.float32)
    table = jnp.array([[7, -3]], jnp.int32)  # read as pages 2 and 0
    lengths = jnp.array([32], jnp.int32)
    from pallas_flash import paged
    monkeypatch.setattr(paged, "gather_pages", None)  # the direct read, not the gather
    direct = jax.jit(lambda table: pf.paged_attention(
        q, *pages, table, lengths, implementation="triton", interpret=True))(table)
    monkeypatch.undo()
    clamped = pf.paged_attention(q, *pages, jnp.array([[2, 0]], jnp.int32), lengths,
                                 implementation="xla")
    assert np.max(np.abs(np.asarray(direct) - np.asarray(clamped))) < 1e-5


def test_concrete_page_tables_are_checked_where_the_tokens_use_them():
    """Ids of a concrete table: those past a row's tokens are never read, and may hold
    anything (free entries marked -1); with traced lengths every entry may be read, so the
    whole table is checked; a traced table is clamped (id 8 of an 8-page pool reads page
    7), as documented."""
    pages = [jax.random.normal(fresh_key(), (8, 8, 1, 16), jnp.float32) for _ in range(2)]
    q = jax.random.normal(fresh_key(), (2, 1, 2, 16), jnp.float32)
    lengths = jnp.array([16, 4], jnp.int32)
    free = jnp.array([[3, 5], [7, -1]], jnp.int32)  # row 1 uses entry 0 only
    out = pf.paged_attention(q, *pages, free, lengths, implementation="xla")
    filled = pf.paged_attention(q, *pages, jnp.array([[3, 5], [7, 0]], jnp.int32), lengths,
                                implementation="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(filled))
    new = jnp.ones((2, 1, 1, 16), jnp.float32)
    written, _ = pf.write_pages(*pages, free, lengths - 1, new, new)
    assert np.all(np.asarray(written[7, 3]) == 1) and np.all(np.asarray(written[5, 7]) == 1)
    with pytest.raises(ValueError, match=r"page_table ids must lie in \[0, 8\).*got -1"):
        jax.jit(lambda n: pf.paged_attention(q, *pages, free, n, implementation="xla"))(
            lengths)
    past_the_pool = jnp.array([[3, 8], [7, 0]], jnp.int32)
    with pytest.raises(ValueError, match=r"\[0, 8\) \(the pool holds 8 pages.*got 8"):
        pf.paged_attention(q, *pages, past_the_pool, lengths, implementation="xla")
    clamped = jax.jit(lambda table: pf.paged_attention(q, *pages, table, lengths,
                                                       implementation="xla"))(past_the_pool)
    last_page = pf.paged_attention(q, *pages, jnp.array([[3, 7], [7, 0]], jnp.int32),
                                   lengths, implementation="xla")
    np.testing.assert_array_equal(np.asarray(clamped), np.asarray(last_page))


def test_write_pages_round_trip():
    """Prefill 13 tokens, then decode 1 and 3 more through jit with donated pools; the
    gathered cache holds every token at its position, and other pages are untouched."""
    batch, kv_heads, head_dim, page_size = 2, 2, 4, 8
    num_pages = 9
    key_pages = jnp.zeros((num_pages, page_size, kv_heads, head_dim), jnp.float32)
    value_pages = jnp.full_like(key_pages, -1.0)
    table = jnp.array([[3, 0, 7], [5, 1, 2]], jnp.int32)
    write = jax.jit(pf.write_pages, donate_argnums=(0, 1))
    lengths = jnp.zeros((batch,), jnp.int32)
    written_k, written_v = [], []
    for count in (13, 1, 3):
        new_k = jax.random.normal(fresh_key(), (batch, count, kv_heads, head_dim))
        new_v = jax.random.normal(fresh_key(), (batch, count, kv_heads, head_dim))
        key_pages, value_pages = write(key_pages, value_pages, table, lengths, new_k, new_v)
        lengths = lengths + count
        written_k.append(new_k)
        written_v.append(new_v)
    total = int(lengths[0])
    for pages, written in ((key_pages, written_k), (value_pages, written_v)):
        cache = np.asarray(gather_pages(pages, table))
        assert np.array_equal(cache[:, :total], np.concatenate(written, axis=1))
    assert np.all(np.asarray(key_pages[jnp.array([4, 6, 8])]) == 0)
    assert np.all(np.asarray(value_pages[jnp.array([4, 6, 8])]) == -1)


def test_write_through_an_out_of_range_page_id_is_dropped():
    """Through a traced table (a concrete one is checked)."""
    key_pages = jnp.zeros((2, 8, 1, 4), jnp.float32)
    table = jnp.array([[9, 1]], jnp.int32)
    new = jnp.ones((1, 10, 1, 4), jnp.float32)  # 8 slots of page 9 (dropped), 2 of page 1
    key_pages, _ = jax.jit(pf.write_pages)(key_pages, key_pages, table, jnp.array([0]), new,
                                           new)
    assert np.all(np.asarray(key_pages[0]) == 0)
    assert np.all(np.asarray(key_pages[1, :2]) == 1) and np.all(np.asarray(key_pages[1, 2:]) == 0)


def test_writes_through_negative_ids_or_past_the_table_are_dropped():
    """Under jit (no check of the table or cache_lengths), a negative id does not wrap to a
    page from the end of the pool, and a position past the table does not land in its last
    page; a negative length writes nothing."""
    pages = jnp.zeros((6, 8, 1, 4), jnp.float32)
    new = jnp.ones((1, 2, 1, 4), jnp.float32)
    for bad_id in (-1, -6):
        table = jnp.array([[0, bad_id]], jnp.int32)
        written, _ = jax.jit(pf.write_pages)(pages, pages, table, jnp.array([7]), new, new)
        # Token 7 goes to page 0's last slot; token 8 through the bad id nowhere.
        assert np.all(np.asarray(written[0, 7]) == 1)
        assert np.sum(np.asarray(written)) == 4, bad_id
    table = jnp.array([[0, 1]], jnp.int32)
    written, _ = jax.jit(pf.write_pages)(pages, pages, table, jnp.array([15]), new, new)
    # Position 15 is page 1's last slot; position 16 is past the table's 2 pages.
    assert np.all(np.asarray(written[1, 7]) == 1)
    assert np.sum(np.asarray(written)) == 4
    for length in (-2, -1):  # positions -2, -1 / -1, 0: only position 0 is written
        written, _ = jax.jit(pf.write_pages)(pages, pages, table, jnp.array([length]), new,
                                             new)
        assert np.sum(np.asarray(written)) == 4 * (length + 2), length


def _paged_args(**overrides):
    args = dict(query=jnp.ones((2, 1, 4, 8)), key_pages=jnp.ones((6, 8, 2, 8)),
                value_pages=jnp.ones((6, 8, 2, 8)), page_table=jnp.zeros((2, 3), jnp.int32),
                cache_lengths=jnp.array([5, 24]))
    args.update(overrides)
    return args


@pytest.mark.parametrize(("overrides", "match"), [
    (dict(key_pages=jnp.ones((6, 8, 2))), "key_pages must have rank 4"),
    (dict(value_pages=jnp.ones((6, 8, 2, 8), jnp.int32)), "value_pages dtype"),
    (dict(value_pages=jnp.ones((6, 8, 1, 8))), "same shape"),
    (dict(key_pages=jnp.ones((6, 12, 2, 8)), value_pages=jnp.ones((6, 12, 2, 8))),
     "page_size"),
    (dict(page_table=jnp.zeros((2, 3), jnp.int16)), "page_table must be an int32"),
    (dict(page_table=jnp.zeros((6,), jnp.int32)), "page_table must be an int32"),
    (dict(cache_lengths=jnp.array([5.0, 24.0])), "cache_lengths must have an integer"),
    (dict(cache_lengths=jnp.array([5, 24, 1])), "cache_lengths must have shape"),
    (dict(cache_lengths=jnp.array([5, 25])), "cache_lengths must lie in"),
    (dict(cache_lengths=jnp.array([-1, 2])), "cache_lengths must lie in"),
    (dict(query=jnp.ones((3, 1, 4, 8))), "query must have the batch of page_table"),
    (dict(query=jnp.ones((4, 8))), "query must have rank 4"),
    (dict(query=jnp.ones((2, 1, 3, 8))), "multiple of key/value"),
    (dict(key_pages=jnp.ones((0, 8, 2, 8)), value_pages=jnp.ones((0, 8, 2, 8))),
     "at least one page"),
    # A table of another batch than the query's is the table's fault, not the lengths'.
    (dict(page_table=jnp.zeros((3, 3), jnp.int32)),
     r"page_table must have one row per sequence, query's batch 2, got shape \(3, 3\)"),
    # Ids that the cached tokens use (row 1: all three entries) outside the 6-page pool.
    (dict(page_table=jnp.array([[0, 0, 0], [1, 2, 6]], jnp.int32)),
     r"page_table ids must lie in \[0, 6\) \(the pool holds 6 pages.*got 6 at \[1, 2\]"),
    (dict(page_table=jnp.array([[0, 0, 0], [1, -1, 2]], jnp.int32)),
     r"page_table ids must lie in \[0, 6\).*got -1 at \[1, 1\]"),
    (dict(page_table=np.array([[8, 0, 0], [1, 2, 3]], np.int32)), r"got 8 at \[0, 0\]"),
])
def test_paged_attention_rejects_bad_input(overrides, match):
    with pytest.raises(ValueError, match=match):
        pf.paged_attention(**_paged_args(**overrides))


@pytest.mark.parametrize(("overrides", "match"), [
    (dict(new_key=jnp.ones((2, 1, 2, 4))), "new_key must have shape"),
    (dict(new_value=jnp.ones((2, 1, 2, 8), jnp.bfloat16)), "new_value dtype"),
    (dict(new_value=jnp.ones((2, 2, 2, 8))), "same shape"),
    (dict(cache_lengths=jnp.array([5, 24])), r"cache_lengths \+ seq_new must lie in"),
    (dict(page_table=jnp.zeros((3, 3), jnp.int32)),
     "page_table must have one row per sequence, new_key's batch 2"),
    (dict(new_key=jnp.ones((3, 1, 2, 8)), new_value=jnp.ones((3, 1, 2, 8))),
     "new_key must have the batch of page_table and cache_lengths"),
    # Row 0 writes token 5 (entry 0), row 1 token 23 (entry 2).
    (dict(page_table=jnp.array([[6, 0, 0], [1, 2, 3]], jnp.int32)), r"got 6 at \[0, 0\]"),
    (dict(page_table=jnp.array([[0, 0, 0], [1, 2, -2]], jnp.int32)),
     r"got -2 at \[1, 2\]"),
])
def test_write_pages_rejects_bad_input(overrides, match):
    args = _paged_args()
    del args["query"]
    args.update(new_key=jnp.ones((2, 1, 2, 8)), new_value=jnp.ones((2, 1, 2, 8)),
                cache_lengths=jnp.array([5, 23]))
    args.update(overrides)
    with pytest.raises(ValueError, match=match):
        pf.write_pages(**args)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(query=jnp.ones((2, 17, 4, 8))), "seq_q must be at most 16"),
    (dict(num_splits=0), "num_splits"),
    (dict(num_splits=2.0), "num_splits"),
    (dict(key_value_seq_lengths=jnp.array([1, 33])), "key_value_seq_lengths must lie in"),
    (dict(key_value_seq_lengths=jnp.array([1])), "key_value_seq_lengths must have shape"),
    (dict(key_value_seq_lengths=33), "key_value_seq_lengths must lie in"),
    (dict(key_value_seq_lengths=jnp.array(2.0)), "integer dtype"),
    (dict(key_value_seq_lengths=jnp.array([1.0, 2.0])), "integer dtype"),
    (dict(is_causal=1), "is_causal must be a bool"),
    (dict(sinks=jnp.ones((3,))), "sinks must have shape"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(local_window_size=-2), "local_window_size"),
    (dict(key=jnp.ones((2, 32, 3, 8)), value=jnp.ones((2, 32, 3, 8))), "multiple of key/value"),
])
def test_decode_attention_rejects_bad_input(kwargs, match):
    args = dict(query=jnp.ones((2, 1, 4, 8)), key=jnp.ones((2, 32, 2, 8)),
                value=jnp.ones((2, 32, 2, 8)), implementation="xla")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pf.decode_attention(**args)


# --- benchmarks/decode.py -----------------------------------------------------------------


def test_decode_benchmark_runs_on_tiny_shapes(tmp_path):
    from benchmarks import decode as bench

    assert bench.main(["--points", "2x128@16", "--impls", "pallas_flash,paged64,xla,fa3",
                       "--implementation", "xla", "--heads", "4", "--kv-heads", "2",
                       "--dtype", "float32", "--rounds", "2", "--iters", "2", "--ragged",
                       "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("decode-ragged-*.json")
    rows = {r["impl"]: r for r in json.loads(json_path.read_text())["rows"]}
    for name in ("pallas_flash", "paged64", "xla"):
        assert rows[name]["gbps"] > 0 and len(rows[name]["round_ms"]) == 2
        assert rows[name]["max_abs_diff"] < 1e-5, name
    assert "head_dim 128 only" in rows["fa3"]["error"]
    # Paired ratios: per-round base / own time, their median.
    per_round = [b / x for b, x in zip(rows["pallas_flash"]["round_ms"],
                                       rows["paged64"]["round_ms"], strict=True)]
    assert rows["paged64"]["vs_pallas_flash"] == pytest.approx(np.median(per_round))
    assert "vs_fa3" not in rows["pallas_flash"]        # fa3 did not run
    markdown = json_path.with_suffix(".md").read_text()
    assert "| paged64 / pallas_flash |" in markdown and "/ fa3" not in markdown
    assert "\nNot run:\n\n- fa3 at 2 × 128 @ 16: " in markdown
    assert rows["pallas_flash"]["implementation"] == "xla"
    assert "pallas_flash on implementation='xla'" in markdown


def test_decode_benchmark_fill_gives_every_row_that_length(tmp_path):
    from benchmarks import decode as bench

    assert bench.main(["--points", "2x96@16", "--impls", "pallas_flash,xla",
                       "--implementation", "xla", "--heads", "4", "--kv-heads", "2",
                       "--dtype", "float32", "--rounds", "1", "--iters", "1", "--fill", "0.25",
                       "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("decode-fill0.25-*.json")
    rows = json.loads(json_path.read_text())["rows"]
    assert [r["cached_tokens"] for r in rows] == [2 * 24, 2 * 24]
    assert rows[0]["max_abs_diff"] == 0 and rows[1]["max_abs_diff"] < 1e-5
    for bad in (["--fill", "0"], ["--fill", "0.5", "--ragged"]):
        with pytest.raises(SystemExit):
            bench.main(["--points", "2x96@16", *bad])


def test_read_floors_read_every_key_of_their_split(tmp_path):
    from benchmarks import decode as bench
    from benchmarks import read_floor

    k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 96, 2, 16)), jnp.float32)
            for i in (0, 1))
    sums = read_floor.triton_reader(k.shape, 3, block_kv=16, interpret=True)(None, k, v)
    want = (k + v).reshape(2, 3, 32, 2, 16).sum(axis=2).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(sums, want, rtol=1e-5, atol=1e-5)
    zeros = read_floor.tma_reader(k.shape, 3, block_kv=16, interpret=True)(None, k, v)
    assert zeros.shape == (2 * 2 * 3, 8, 16) and not np.any(zeros)
    with pytest.raises(ValueError, match="block_kv 64"):
        read_floor.triton_reader(k.shape, 3, block_kv=64)
    # In the benchmark: timed, not compared with the attention calls, and the ratio bases.
    assert bench.main(["--points", "2x128@16", "--impls", "pallas_flash,read_triton,read_tma",
                       "--implementation", "xla", "--heads", "4", "--kv-heads", "2",
                       "--dtype", "float32", "--rounds", "2", "--iters", "1",
                       "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("decode-*.json")
    rows = {r["impl"]: r for r in json.loads(json_path.read_text())["rows"]}
    assert "max_abs_diff" not in rows["read_tma"] and rows["read_tma"]["gbps"] > 0
    assert rows["pallas_flash"]["vs_read_tma"] > 0 and rows["pallas_flash"]["vs_read_triton"] > 0
    assert "| pallas_flash / read_tma |" in json_path.with_suffix(".md").read_text()
    calls = bench.make_calls(["read_tma"], *[jnp.zeros((1, 8, 1, 8))] * 3,
                             jnp.ones((1,), jnp.int32), None, 0)
    assert "full cache" in calls["read_tma"]  # with cache lengths: a reason, not a call


def test_decode_benchmark_bandwidth_and_points():
    from benchmarks import decode as bench

    # 2 · 1000 tokens · 8 heads · 128 · 2 bytes in 1 ms = 4.096 GB/s.
    assert bench.kv_gbps(1000, 8, 128, 2, 1.0) == pytest.approx(4.096)
    assert bench.parse_point("32x8192@128") == (32, 8192, 128)
    with pytest.raises(ValueError, match="32x8192@128"):
        bench.parse_point("32x8192")


def test_decode_prefers_triton_where_mosaic_runs_too(monkeypatch):
    from pallas_flash import dispatch
    monkeypatch.setattr(dispatch, "available_implementations",
                        lambda: ("mosaic", "triton", "xla"))
    monkeypatch.setattr(dispatch, "unsupported", lambda name, *args: None)
    args = ((2, 4, 8, 128), (2, 4096, 8, 128), jnp.bfloat16, MaskSpec(4, 4096),
            dispatch.Features())
    assert dispatch.choose(*args, interpret=False) == "mosaic"
    assert dispatch.choose_decode(*args, interpret=False) == "triton"
    # Where Triton cannot run a call, the decode takes the next backend in choose's order.
    monkeypatch.setattr(dispatch, "unsupported",
                        lambda name, *args: "no" if name == "triton" else None)
    assert dispatch.choose_decode(*args, interpret=False) == "mosaic"


def test_direct_read_only_where_triton_takes_the_call_unpadded(monkeypatch):
    """A head dim the Triton kernel pads (it would pad the whole pool) and float64 (Triton
    refuses it) take the gathered path: the first gives the same attention, the second
    the dispatcher's error."""
    from pallas_flash import paged
    pages = jax.random.normal(fresh_key(), (2, 4, 16, 1, 24), jnp.float32)
    q = jax.random.normal(fresh_key(), (1, 1, 2, 24), jnp.float32)
    table, lengths = jnp.array([[3, 1]], jnp.int32), jnp.array([30], jnp.int32)
    want = pf.paged_attention(q, *pages, table, lengths, implementation="xla")
    monkeypatch.setattr(paged, "paged_split_forward", None)  # the direct read would fail
    got = pf.paged_attention(q, *pages, table, lengths, implementation="triton",
                             interpret=True)
    assert rel_err(got, want) < 1e-5
    with jax.enable_x64(True):
        pages64, q64 = pages.astype(jnp.float64)[..., :16], q.astype(jnp.float64)[..., :16]
        with pytest.raises(ValueError, match="float64"):
            pf.paged_attention(q64, *pages64, table, lengths, implementation="triton",
                               interpret=True)


def test_float64_decode_is_computed_in_float64():
    """Split or not, a float64 decode matches the float64 oracle to float64 rounding (the
    split merge once cast the lse to float32: 6e-8)."""
    with jax.enable_x64(True):
        q, k, v, _ = random_qkv(2, 1, 300, 4, 2, 16, jnp.float64)
        want = attention_float64(q, k, v, mask=MaskSpec(1, 300))[0]
        for num_splits in (1, 3):
            got = pf.decode_attention(q, k, v, num_splits=num_splits, implementation="xla")
            assert got.dtype == jnp.float64
            assert rel_err(got, want) < 1e-12, num_splits


@pytest.mark.parametrize(("out_shape", "lse_shape", "match"), [
    ((1, 2, 3, 1), (1, 2, 1, 3), "out must have rank 5"),
    ((1, 2, 3, 1, 4), (1, 2, 3, 1), "lse must have shape"),
])
def test_merge_splits_checks_shapes(out_shape, lse_shape, match):
    with pytest.raises(ValueError, match=match):
        merge_splits(jnp.zeros(out_shape), jnp.zeros(lse_shape))
    with pytest.raises(ValueError, match="out must be floating"):
        merge_splits(jnp.zeros((1, 2, 3, 1, 4), jnp.int32), jnp.zeros((1, 2, 1, 3)))
