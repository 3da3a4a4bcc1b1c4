"""HBM traffic and memory of attention: the FlashAttention papers' IO model as functions.

Everything here is arithmetic on shapes; nothing runs on a device. Units are explicit in
every name: ``*_bytes`` are bytes, ``*_elements`` are array elements. Shapes follow the
package: ``batch`` sequences, ``heads`` heads, ``seq_q`` queries and ``seq_kv`` keys per
sequence (``seq_kv`` defaults to ``seq_q``), ``head_dim`` = d.

* :func:`standard_attention_traffic` — the baseline (FlashAttention paper, Algorithm 0):
  three kernels that write the scores S and the probabilities P to HBM and read them back.
  Θ(L·d + L²) bytes per head.
* :func:`tiled_attention_traffic` — FlashAttention-2's forward, as our Triton and Mosaic
  kernels run it: one program per query block keeps Q_i on chip and streams every K/V block
  its rows can see, so K and V are read once per query block: ≈ 2·L²·d / B_r elements,
  i.e. Θ(L²·d²/M) when B_r = Θ(M/d) (M = on-chip memory per program).
* :func:`flash1_attention_traffic` — FlashAttention-1's loop order (K/V outer, Q inner),
  the one the paper's Theorem 2 analyses: Q, O, l, m are re-read and re-written once per
  K/V block.
* :func:`sram_elements`, :func:`tile_bytes`, :func:`paper_block_sizes` — what one step
  keeps on chip, and the paper's choice of block sizes for a budget M.
* :func:`standard_attention_memory`, :func:`tiled_attention_memory` — the HBM footprint:
  O(L²) scratch (S and P) against O(L) (the log-sum-exp).

Default element sizes: inputs and output ``itemsize=2`` (bf16/fp16); scores,
probabilities, the softmax statistics and the accumulator are float32 (4 bytes), as in
:func:`pallas_flash.reference.standard_attention` and in our kernels.
"""

from __future__ import annotations

import dataclasses
import math

from pallas_flash.masking import MaskSpec

#: Bytes of one float32 element (scores, statistics, accumulators).
F32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes moved between HBM and the chip by one attention forward."""

    read_bytes: int
    write_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes


@dataclasses.dataclass(frozen=True)
class Memory:
    """HBM footprint of one attention forward, in bytes.

    Attributes:
      io_bytes: Q, K, V and O (the arrays every implementation must hold).
      scratch_bytes: what the forward additionally keeps alive at its peak
        (standard: S and P; tiled: the log-sum-exp it writes for the backward).
      saved_bytes: what must be kept from the forward for the backward besides Q, K, V, O
        (standard: P; tiled: the log-sum-exp).
    """

    io_bytes: int
    scratch_bytes: int
    saved_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Inputs, output and scratch alive together."""
        return self.io_bytes + self.scratch_bytes


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def standard_attention_traffic(batch: int, heads: int, seq_q: int, head_dim: int, *,
                               seq_kv: int | None = None, itemsize: int = 2,
                               score_itemsize: int = F32_BYTES) -> Traffic:
    """HBM bytes of standard attention run as three kernels (each reads its inputs from HBM
    and writes its output there):

    1. S = Q·Kᵀ: read Q [T, d], K [S, d]; write S [T, S]
    2. P = softmax(S): read S; write P [T, S]
    3. O = P·V: read P, V [S, d]; write O [T, d]

    Per head: reads ``(T + 2S)·d`` input elements and ``2·T·S`` score elements, writes
    ``2·T·S`` score elements and ``T·d`` output elements.
    """
    seq_kv = seq_q if seq_kv is None else seq_kv
    _check_positive(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
                    itemsize=itemsize, score_itemsize=score_itemsize)
    per_head_in = (seq_q + 2 * seq_kv) * head_dim * itemsize
    scores = seq_q * seq_kv * score_itemsize
    reads = per_head_in + 2 * scores           # Q, K, V; S (step 2) and P (step 3)
    writes = 2 * scores + seq_q * head_dim * itemsize  # S, P, O
    n = batch * heads
    return Traffic(read_bytes=n * reads, write_bytes=n * writes)


def kv_keys_loaded(seq_q: int, seq_kv: int, block_q: int, block_kv: int, *,
                   mask: MaskSpec | None = None) -> int:
    """Keys one head's forward loads over all its query blocks (with repeats).

    A program owns ``block_q`` query rows and loads the K/V blocks ``[first, last)`` of
    :meth:`MaskSpec.kv_blocks`; without a mask that is every key, once per query block
    (``ceil(T / B_r) · S``); causal skips the blocks above the diagonal (about half).
    """
    _check_positive(seq_q=seq_q, seq_kv=seq_kv, block_q=block_q, block_kv=block_kv)
    mask = MaskSpec(seq_q, seq_kv) if mask is None else mask
    total = 0
    for q_start in range(0, seq_q, block_q):
        first, _, _, last = (int(x) for x in mask.kv_blocks(q_start, block_q, block_kv))
        total += max(0, min(last * block_kv, seq_kv) - first * block_kv)
    return total


def tiled_attention_traffic(batch: int, heads: int, seq_q: int, head_dim: int, *,
                            block_q: int, block_kv: int, seq_kv: int | None = None,
                            itemsize: int = 2, causal: bool = False) -> Traffic:
    """HBM bytes of the FlashAttention-2 forward with tiles ``block_q × block_kv``
    (B_r × B_c). Our Triton kernel (and the Mosaic one, whose CTA owns
    ``num_consumers·block_q`` rows: pass that) works this way.

    Reads Q once (``T·d``), and K and V once per query block for the blocks its rows see
    (:func:`kv_keys_loaded` keys, ``2·d`` elements each); writes O (``T·d``) and the
    float32 log-sum-exp (``T``). Dense: ≈ ``T·d + 2·⌈T/B_r⌉·S·d`` reads — the ``K/V
    re-read once per query block`` term that grows as L²·d / B_r.
    """
    seq_kv = seq_q if seq_kv is None else seq_kv
    _check_positive(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
                    block_q=block_q, block_kv=block_kv, itemsize=itemsize)
    mask = MaskSpec(seq_q, seq_kv, is_causal=causal)
    keys = kv_keys_loaded(seq_q, seq_kv, block_q, block_kv, mask=mask)
    reads = seq_q * head_dim * itemsize + 2 * keys * head_dim * itemsize
    writes = seq_q * head_dim * itemsize + seq_q * F32_BYTES
    n = batch * heads
    return Traffic(read_bytes=n * reads, write_bytes=n * writes)


def flash1_attention_traffic(batch: int, heads: int, seq_q: int, head_dim: int, *,
                             block_q: int, block_kv: int, seq_kv: int | None = None,
                             itemsize: int = 2) -> Traffic:
    """HBM bytes of FlashAttention-1's loop order (paper, Algorithm 1), dense mask.

    K/V blocks are the outer loop (each read once); for every K/V block the inner loop
    reads every Q_i, O_i, l_i, m_i and writes O_i, l_i, m_i back. ``block_q`` only sets
    how the inner loop is cut; the traffic is ``⌈S/B_c⌉`` passes over Q and O:
    ``Θ(T·S·d / B_c)``, which is the paper's ``Θ(L²d²/M)`` with ``B_c = Θ(M/d)``.
    """
    seq_kv = seq_q if seq_kv is None else seq_kv
    _check_positive(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
                    block_q=block_q, block_kv=block_kv, itemsize=itemsize)
    kv_blocks = math.ceil(seq_kv / block_kv)
    row = seq_q * head_dim * itemsize   # all of Q, or all of O
    stats = 2 * seq_q * F32_BYTES       # l and m
    reads = 2 * seq_kv * head_dim * itemsize + kv_blocks * (2 * row + stats)
    writes = kv_blocks * (row + stats)
    n = batch * heads
    return Traffic(read_bytes=n * reads, write_bytes=n * writes)


def sram_elements(block_q: int, block_kv: int, head_dim: int) -> int:
    """``B_r·d + B_c·d + B_r·B_c``: elements of Q_i, K_j and S_ij, the working set in the
    tutorial's constraint ``B_r·d + B_c·d + B_r·B_c ≤ M`` (M in elements; V_j reuses K_j's
    space and P_ij overwrites S_ij)."""
    _check_positive(block_q=block_q, block_kv=block_kv, head_dim=head_dim)
    return block_q * head_dim + block_kv * head_dim + block_q * block_kv


def tile_bytes(block_q: int, block_kv: int, head_dim: int, *, itemsize: int = 2) -> int:
    """Bytes of one FA2 forward step's full working set, everything counted separately:
    Q_i [B_r, d], K_j and V_j [B_c, d] in the input dtype; S_ij/P_ij [B_r, B_c] and the
    accumulator O_i [B_r, d] in float32. On a GPU part of it lives in registers, part in
    shared memory, so this is an upper bound on shared memory, not what a compiler assigns
    (``pallas_flash.mosaic.MosaicConfig.smem_bytes`` is the exact count for that kernel)."""
    _check_positive(block_q=block_q, block_kv=block_kv, head_dim=head_dim, itemsize=itemsize)
    inputs = (block_q + 2 * block_kv) * head_dim * itemsize
    return inputs + (block_q * block_kv + block_q * head_dim) * F32_BYTES


def fits_sram(block_q: int, block_kv: int, head_dim: int, sram_bytes: int, *,
              itemsize: int = 2) -> bool:
    """Whether ``sram_elements(...) · itemsize ≤ sram_bytes`` (the tutorial's constraint,
    converted to bytes with one element size for Q, K and S)."""
    return sram_elements(block_q, block_kv, head_dim) * itemsize <= sram_bytes


def paper_block_sizes(sram_elements_budget: int, head_dim: int) -> tuple[int, int]:
    """``(B_r, B_c)`` of FlashAttention's Algorithm 1 line 1 for an on-chip memory of M
    elements: ``B_c = ⌈M / 4d⌉``, ``B_r = min(⌈M / 4d⌉, d)``."""
    _check_positive(sram_elements_budget=sram_elements_budget, head_dim=head_dim)
    block_kv = math.ceil(sram_elements_budget / (4 * head_dim))
    return min(block_kv, head_dim), block_kv


def io_bound_elements(seq_len: int, head_dim: int, sram_elements_budget: int) -> float:
    """``L²·d² / M``: the order of FlashAttention's HBM accesses (Theorem 2), in elements
    per head, without its constant."""
    _check_positive(seq_len=seq_len, head_dim=head_dim,
                    sram_elements_budget=sram_elements_budget)
    return seq_len ** 2 * head_dim ** 2 / sram_elements_budget


def standard_attention_memory(batch: int, heads: int, seq_q: int, head_dim: int, *,
                              seq_kv: int | None = None, itemsize: int = 2,
                              score_itemsize: int = F32_BYTES) -> Memory:
    """Standard attention: S and P ``[B, H, T, S]`` are alive together at the softmax
    (scratch ``2·B·H·T·S`` score elements) and P is kept for the backward."""
    seq_kv = seq_q if seq_kv is None else seq_kv
    _check_positive(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
                    itemsize=itemsize, score_itemsize=score_itemsize)
    n = batch * heads
    io = n * 2 * (seq_q + seq_kv) * head_dim * itemsize
    scores = n * seq_q * seq_kv * score_itemsize
    return Memory(io_bytes=io, scratch_bytes=2 * scores, saved_bytes=scores)


def tiled_attention_memory(batch: int, heads: int, seq_q: int, head_dim: int, *,
                           seq_kv: int | None = None, itemsize: int = 2) -> Memory:
    """Tiled attention: S and P only ever exist as on-chip tiles; the only HBM scratch is
    the float32 log-sum-exp ``[B, H, T]`` (one number per row instead of FA1's l and m),
    which with O is all the backward needs."""
    seq_kv = seq_q if seq_kv is None else seq_kv
    _check_positive(batch=batch, heads=heads, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
                    itemsize=itemsize)
    n = batch * heads
    io = n * 2 * (seq_q + seq_kv) * head_dim * itemsize
    lse = n * seq_q * F32_BYTES
    return Memory(io_bytes=io, scratch_bytes=lse, saved_bytes=lse)
