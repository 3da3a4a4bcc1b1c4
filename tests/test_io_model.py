"""pallas_flash.tutorial.io_model against hand computations."""

from __future__ import annotations

import math

import pytest

from pallas_flash.masking import MaskSpec
from pallas_flash.tutorial import io_model


def test_standard_traffic_by_hand():
    # T = S = 4, d = 2, 2-byte inputs, 4-byte scores, one head:
    # reads Q, K, V (3·4·2·2 = 48) + S and P (2·16·4 = 128); writes S, P (128) + O (16).
    t = io_model.standard_attention_traffic(1, 1, 4, 2)
    assert (t.read_bytes, t.write_bytes, t.total_bytes) == (176, 144, 320)
    assert io_model.standard_attention_traffic(3, 5, 4, 2).total_bytes == 15 * 320


def test_tiled_traffic_by_hand():
    # T = S = 8, d = 2, B_r = 4: two query blocks each read all 8 keys of K and V.
    t = io_model.tiled_attention_traffic(1, 1, 8, 2, block_q=4, block_kv=2)
    assert t.read_bytes == 8 * 2 * 2 + 2 * 16 * 2 * 2       # Q once + K, V twice
    assert t.write_bytes == 8 * 2 * 2 + 8 * 4               # O + float32 lse


def test_one_query_block_reads_kv_once():
    t = io_model.tiled_attention_traffic(1, 1, 64, 16, block_q=64, block_kv=16, itemsize=4)
    assert t.read_bytes == (64 + 2 * 64) * 16 * 4


def test_causal_skips_blocks_above_the_diagonal():
    # B_r = B_c = 4, L = 8: query block 0 sees key block 0 only, block 1 sees both.
    assert io_model.kv_keys_loaded(8, 8, 4, 4, mask=MaskSpec(8, 8, is_causal=True)) == 12
    assert io_model.kv_keys_loaded(8, 8, 4, 4) == 16
    dense = io_model.tiled_attention_traffic(1, 1, 4096, 64, block_q=128, block_kv=64)
    causal = io_model.tiled_attention_traffic(1, 1, 4096, 64, block_q=128, block_kv=64,
                                              causal=True)
    assert 0.5 < causal.read_bytes / dense.read_bytes < 0.53


def test_tiled_traffic_grows_as_l_squared_d_over_block():
    def kv_term(length, block_q):
        t = io_model.tiled_attention_traffic(1, 1, length, 64, block_q=block_q, block_kv=64)
        return t.read_bytes - length * 64 * 2

    assert kv_term(4096, 128) == 4 * kv_term(2048, 128)       # ∝ L²
    assert kv_term(4096, 256) * 2 == kv_term(4096, 128)       # ∝ 1 / B_r


def test_flash1_traffic_by_hand():
    # T = S = 8, d = 2, B_c = 4: K, V read once (64 B); per K/V block read Q and O
    # (2·32 B) and l, m (64 B), write O (32 B) and l, m (64 B).
    t = io_model.flash1_attention_traffic(1, 1, 8, 2, block_q=4, block_kv=4)
    assert (t.read_bytes, t.write_bytes) == (64 + 2 * 128, 2 * 96)


def test_sram_constraint_and_paper_blocks():
    assert io_model.sram_elements(64, 64, 128) == 64 * 128 * 2 + 64 * 64
    assert io_model.fits_sram(64, 64, 128, sram_bytes=40960)
    assert not io_model.fits_sram(64, 64, 128, sram_bytes=40959)
    assert io_model.tile_bytes(1, 1, 1, itemsize=2) == 3 * 2 + 2 * 4
    assert io_model.paper_block_sizes(16384, 64) == (64, 64)
    assert io_model.paper_block_sizes(49152, 128) == (96, 96)
    assert io_model.io_bound_elements(1024, 64, 16384) == 1024 ** 2 * 64 ** 2 / 16384


def test_memory_by_hand():
    std = io_model.standard_attention_memory(1, 1, 1024, 64)
    tiled = io_model.tiled_attention_memory(1, 1, 1024, 64)
    io = 4 * 1024 * 64 * 2
    assert std.io_bytes == tiled.io_bytes == io
    assert std.scratch_bytes == 2 * 1024 ** 2 * 4 and std.saved_bytes == 1024 ** 2 * 4
    assert tiled.scratch_bytes == tiled.saved_bytes == 1024 * 4
    assert std.peak_bytes == io + 8 * 1024 ** 2
    # O(L²) vs O(L·d): doubling L quadruples standard's scratch, doubles tiled's.
    assert io_model.standard_attention_memory(1, 1, 2048, 64).scratch_bytes == \
        4 * std.scratch_bytes
    assert io_model.tiled_attention_memory(1, 1, 2048, 64).peak_bytes == 2 * tiled.peak_bytes


def test_ratio_is_about_m_over_d_squared():
    # At fixed d and M both traffics are Θ(L²); FlashAttention's gain is a constant ≈ M/d².
    ratios = []
    for length in (2048, 8192):
        std = io_model.standard_attention_traffic(1, 1, length, 128)
        tiled = io_model.tiled_attention_traffic(1, 1, length, 128, block_q=256, block_kv=64)
        ratios.append(std.total_bytes / tiled.total_bytes)
    assert math.isclose(ratios[0], ratios[1], rel_tol=0.1)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="positive int"):
        io_model.standard_attention_traffic(1, 1, bad, 64)
    with pytest.raises(ValueError, match="positive int"):
        io_model.tiled_attention_traffic(1, 1, 64, 64, block_q=bad, block_kv=16)
