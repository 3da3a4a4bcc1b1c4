"""Standard attention and the papers' loops (tutorial/loops.py) against the oracle, and the
seed's two checks."""

from __future__ import annotations

import numpy as np
import pytest
from support import IMPLEMENTATIONS, implementation_kwargs, random_qkv, rel_err

import pallas_flash as pf
from pallas_flash.masking import MaskSpec
from pallas_flash.reference import attention_float64, standard_attention
from pallas_flash.tutorial.loops import flash_attention_v1, flash_attention_v2

ALGORITHMS = {
    "standard": standard_attention,
    "flash_v1": flash_attention_v1,
    "flash_v2": flash_attention_v2,
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize(
    "mask",
    [MaskSpec(64, 96), MaskSpec(64, 96, True), MaskSpec(96, 64, True, "bottom_right"),
     MaskSpec(96, 96, False, window=(20, 7))],
    ids=["full", "causal", "causal-bottom-right", "window"],
)
def test_algorithms_match_oracle(name, mask):
    q, k, v, _ = random_qkv(2, mask.seq_q, mask.seq_kv, 4, 2, 32)
    out, lse = ALGORITHMS[name](q, k, v, mask=mask)
    ref_out, ref_lse = attention_float64(q, k, v, mask=mask)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl", ["flash_v1", "flash_v2", *sorted(IMPLEMENTATIONS)])
def test_seed_equivalence(impl, causal):
    """The tutorial's check: tiled == standard attention, B=2, H=4, L=128, d=64, fp32."""
    q, k, v, _ = random_qkv(2, 128, 128, 4, 4, 64)
    mask = MaskSpec(128, 128, causal)
    expected, _ = standard_attention(q, k, v, mask=mask)
    if impl in ALGORITHMS:
        out, _ = ALGORITHMS[impl](q, k, v, mask=mask)
    else:
        out = pf.attention(q, k, v, is_causal=causal, **implementation_kwargs(impl, 64))
    assert np.max(np.abs(np.asarray(out) - np.asarray(expected))) < 1e-5


@pytest.mark.parametrize("loop", [flash_attention_v1, flash_attention_v2])
def test_loops_refuse_tiles_that_do_not_divide_the_sequence(loop):
    q, k, v, _ = random_qkv(1, 64, 48, 2, 2, 16)
    with pytest.raises(ValueError, match=r"block_kv \(32\) must divide the sequence length "
                                         r"\(48\)"):
        loop(q, k, v)
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        loop(q, k, v, block_q=0, block_kv=16)
