"""TritonConfig validation and the heuristic."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_flash.masking import MaskSpec
from pallas_flash.triton import TritonConfig, default_config


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_q", 48), ("block_kv", 8), ("bwd_block_q", 0), ("bwd_block_kv", 100),
     ("num_warps", 3), ("bwd_num_warps", 32), ("num_stages", 0), ("bwd_num_stages", -1)],
)
def test_invalid_fields_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        TritonConfig(**{field: value})


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
def test_heuristic_gives_valid_configs(head_dim):
    shape = (1, 4096, 8, head_dim)
    config = default_config(shape, shape, jnp.bfloat16, MaskSpec(4096, 4096))
    assert isinstance(config, TritonConfig)


def test_heuristic_shrinks_tiles_for_short_sequences():
    config = default_config((1, 20, 2, 64), (1, 40, 2, 64), jnp.float32, MaskSpec(20, 40))
    assert config.block_q == 32 and config.bwd_block_q == 32
    assert config.block_kv == 64 and config.bwd_block_kv == 64


def test_a_query_varying_bias_tile_lowers_stages_then_block_q():
    from pallas_flash.triton.config import SHARED_MEMORY, fit_row_operands
    base = TritonConfig(block_q=256, block_kv=64, num_warps=16, num_stages=3)
    assert fit_row_operands(base, 128, 2, 0) == base                 # no bias: unchanged
    fitted = fit_row_operands(base, 128, 2, 4)                        # float32 [T, S] bias
    assert (fitted.num_stages, fitted.block_q) == (2, 128)
    per_stage = 2 * 64 * 128 * 2 + fitted.block_q * 64 * 4
    assert 2 * per_stage + fitted.block_q * 128 * 2 <= SHARED_MEMORY


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_rows_take_the_sixteen_row_tile(head_dim):
    # A decode step's packed rows (group x new tokens <= 16) against a long cache chunk.
    config = default_config((8, 4, 8, head_dim), (8, 4096, 8, head_dim), jnp.bfloat16,
                            MaskSpec(4, 4096))
    assert (config.block_q, config.num_warps) == (16, 4)
    longer = default_config((8, 17, 8, head_dim), (8, 4096, 8, head_dim), jnp.bfloat16,
                            MaskSpec(17, 4096))
    assert longer.block_q > 16 and longer.num_warps > 4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_head_dim_512_default_fits_shared_memory(dtype):
    """The default tiles for rows of 512 already fit: fitting them changes nothing."""
    from pallas_flash.triton.config import fit_row_operands

    shape = (1, 4096, 8, 512)
    config = default_config(shape, shape, dtype, MaskSpec(4096, 4096))
    itemsize = jnp.dtype(dtype).itemsize
    assert fit_row_operands(config, 512, itemsize, 0, value_dim=512) == config
    assert config.block_q <= 64 and config.bwd_block_q <= 32


def test_a_wide_value_head_lowers_the_forward_tiles():
    """Q/K rows of 64 with V rows of 512: the V tiles, not the query head dim, decide."""
    from pallas_flash.triton.config import SHARED_MEMORY, fit_row_operands

    def need(c, head_dim, value_dim):  # float32: pipelined K and V tiles, and Q
        return c.num_stages * c.block_kv * (head_dim + value_dim) * 4 + c.block_q * head_dim * 4

    base = TritonConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3)
    assert fit_row_operands(base, 64, 4, 0) == base
    fitted = fit_row_operands(base, 64, 4, 0, value_dim=512)
    assert (fitted.num_stages, fitted.block_q, fitted.block_kv) == (2, 64, 32)
    assert need(fitted, 64, 512) <= SHARED_MEMORY < need(base, 64, 512)
    wider = fit_row_operands(base, 512, 4, 0, value_dim=512)
    assert (wider.block_q, wider.block_kv) == (32, 16)
    assert need(wider, 512, 512) <= SHARED_MEMORY
