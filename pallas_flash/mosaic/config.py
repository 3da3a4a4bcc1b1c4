"""Block sizes of the Hopper forward kernel, their validation, and the default heuristic.

The kernel's CTA holds two consumer warpgroups, each owning ``block_q`` query rows, and a
``num_stages``-deep ring of K and V tiles of ``block_kv`` keys each (FlashAttention-3,
Sec. 3.1). Everything lives in the 227 KiB of shared memory an sm90 CTA may opt into, so
the heuristic shrinks ``block_kv`` as ``head_dim`` grows.
"""

from __future__ import annotations

import dataclasses
import math

from pallas_flash.masking import MaskSpec
from pallas_flash.padding import round_up

#: Shared memory one sm90 CTA may use (the opt-in maximum, checked again at lowering).
SMEM_BUDGET = 232448
#: Every Mosaic GPU SMEM buffer starts on a 1 KiB boundary.
SMEM_ALIGNMENT = 1024
#: The kernel's head dims: wgmma needs K (= head_dim in Q·Kᵀ) to be a multiple of the
#: 128-byte swizzle, i.e. 64 16-bit elements, and N (= head_dim in P·V) at most 256.
HEAD_DIM_MULTIPLE = 64
MAX_HEAD_DIM = 256
#: Consumer warpgroups per CTA (FlashAttention-3's ping-pong pair).
NUM_CONSUMERS = 2
#: Largest head dim at which a backward consumer warpgroup holds dK and dV of its own 64
#: keys (``head_dim`` f32 registers per thread); at 256 two consumers split one key block
#: (:mod:`pallas_flash.mosaic.backward.dkdv_d256`).
MAX_PER_CONSUMER_HEAD_DIM = 128
#: A TMA copy writes shared memory at 128-byte aligned addresses only (a misaligned one
#: faults at run time: CUDA_ERROR_MISALIGNED_ADDRESS).
TMA_SMEM_ALIGNMENT = 128


def _align(nbytes: int) -> int:
    return round_up(nbytes, SMEM_ALIGNMENT)


@dataclasses.dataclass(frozen=True)
class LogitRing:
    """The SMEM ring of a ``bias`` or ``mask`` array that varies along keys: the producer
    fills slot j next to K_j (on K's ready barrier), the consumers read it with S_j.

    Attributes:
      per_query: the array varies along queries too, so a slot holds one
        ``[block_q, block_kv]`` tile per consumer; otherwise one ``[block_kv]`` row that
        every row of the CTA shares, in row 0 of a slot of ``row_slot_rows`` rows.
      itemsize: bytes per element: the bias's dtype, 1 for a mask (read as int8).
    """

    per_query: bool
    itemsize: int

    def row_slot_rows(self, config: MosaicConfig) -> int:
        """Rows per slot of a key-row ring: the fewest whose bytes are a multiple of
        ``TMA_SMEM_ALIGNMENT``, so that every slot's TMA destination is aligned (two for
        an int8 mask of 64 or 192 keys, one from 128 bytes up in powers of two)."""
        return TMA_SMEM_ALIGNMENT // math.gcd(TMA_SMEM_ALIGNMENT,
                                              config.block_kv * self.itemsize)

    def shape(self, config: MosaicConfig) -> tuple[int, ...]:
        if self.per_query:
            return (config.num_stages, config.num_consumers, config.block_q, config.block_kv)
        return (config.num_stages, self.row_slot_rows(config), config.block_kv)

    def nbytes(self, config: MosaicConfig) -> int:
        return math.prod(self.shape(config)) * self.itemsize


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Static tiling of the Mosaic GPU forward kernel.

    Attributes:
      block_q: query rows per consumer warpgroup (B_r); a CTA covers ``2 * block_q`` rows.
        A multiple of 64 (the wgmma M granularity), at most 128 (the f32 S tile costs
        ``block_q * block_kv / 128`` registers per thread).
      block_kv: keys per pipeline stage (B_c); a multiple of 64, at most 256 (wgmma N).
      num_stages: depth of the K/V shared-memory ring filled by the producer warpgroup;
        at least 2 so that the producer can load block j+1 while block j is in use.
      overlap: FA3's intra-warpgroup pipelining (Sec. 3.2): issue S_j = Q·K_jᵀ together
        with O += P_{j-1}·V_{j-1} and run the softmax of S_j while P·V is still on the
        tensor cores. Costs the registers of P_{j-1}, held while its GEMM runs. On by
        default above head_dim 64 (see :func:`default_config` for the timings).
      num_consumers: consumer warpgroups per CTA, 2 (the ping-pong pair) or 3 (FA3's
        choice at head_dim 64, where the softmax is as long as the GEMMs: while one
        warpgroup runs its softmax two others keep the tensor cores busy). With 3 the
        register file is split 3 x 160 + 32, so it needs ``block_q = 64`` and the
        overlapped schedule, whose per-consumer turns extend to a round robin.
      persistent: launch one CTA per SM (at most one per work tile) that loops over work
        tiles (FA3's persistent kernel) instead of one CTA per tile. The producer then
        streams the next tile's K/V, and each consumer loads its next Q tile, while the
        consumers still finish the current tile, so a CTA's fixed costs (pipeline fill,
        epilogue, launch) overlap work: they weigh most on short rows. Causal tiles go
        out in pairs of equal total work (:mod:`pallas_flash.mosaic.scheduler`). The
        bf16 kernel pays an O tile of SMEM beside Q's (a TMA store may still read it when
        the next Q lands); the FP8 kernel gives O tiles of their own where they fit, else
        stores O through its P tiles' memory and syncs its consumers once more per tile.
    """

    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    overlap: bool = False
    num_consumers: int = NUM_CONSUMERS
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.block_q not in (64, 128):
            raise ValueError(f"block_q must be 64 or 128, got {self.block_q}")
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(
                f"block_kv must be a multiple of 64 in [64, 256], got {self.block_kv}")
        if not 2 <= self.num_stages <= 4:
            raise ValueError(f"num_stages must be in [2, 4], got {self.num_stages}")
        if self.num_consumers not in (2, 3):
            raise ValueError(f"num_consumers must be 2 or 3, got {self.num_consumers}")
        if self.num_consumers == 3 and (self.block_q != 64 or not self.overlap):
            raise ValueError(
                "num_consumers=3 needs block_q=64 and overlap=True (160 registers per "
                f"consumer; the serial schedule pairs two consumers), got {self}")

    @property
    def rows_per_cta(self) -> int:
        return self.num_consumers * self.block_q

    def smem_bytes(self, head_dim: int, itemsize: int = 2, *, segments: bool = False,
                   logit_rings: tuple[LogitRing, ...] = ()) -> int:
        """Shared memory of the GPU kernel: Q/O tiles (one shared buffer, two when
        ``persistent``), the K and V rings, LSE, barriers,
        with ``segments`` the ring of the keys' segment ids (int32, next to K's), and the
        rings of the bias / mask arrays (``logit_rings``, next to K's too).

        Matches what Mosaic GPU's lowering counts (checked by tests/test_mosaic.py).
        """
        q_o = _align(self.rows_per_cta * head_dim * itemsize) * (2 if self.persistent else 1)
        kv = 2 * _align(self.num_stages * self.block_kv * head_dim * itemsize)
        lse = _align(self.rows_per_cta * 4)
        kv_ids = _align(self.num_stages * self.block_kv * 4) if segments else 0
        logits = sum(_align(ring.nbytes(self)) for ring in logit_rings)
        # 8-byte mbarriers: Q ready per consumer; K/V ready and K/V free per slot; turn
        # (one per consumer with the overlapped schedule, one shared without).
        turns = self.num_consumers if self.overlap else 1
        barriers = 8 * (self.num_consumers + 4 * self.num_stages + turns)
        return q_o + kv + lse + kv_ids + logits + barriers

    def check_fits(self, head_dim: int, itemsize: int = 2, *, segments: bool = False,
                   logit_rings: tuple[LogitRing, ...] = ()) -> None:
        """Raises ValueError when this config cannot run at ``head_dim`` on an sm90 CTA."""
        need = self.smem_bytes(head_dim, itemsize, segments=segments, logit_rings=logit_rings)
        if need > SMEM_BUDGET:
            raise ValueError(
                f"MosaicConfig {self} needs {need} bytes of shared memory at "
                f"head_dim={head_dim}, more than the {SMEM_BUDGET} an sm90 CTA has; "
                "lower block_kv or num_stages")


def fit_logit_rings(config: MosaicConfig, head_dim: int, itemsize: int, *,
                    segments: bool, logit_rings: tuple[LogitRing, ...]) -> MosaicConfig:
    """The forward's config, shrunk until the bias / mask rings fit next to K and V.

    A tile that varies along queries is read into registers next to S (``block_q *
    block_kv / 128`` more per thread, 128 for a float32 128 x 128 tile), so such a tile
    takes 64-row warpgroups. Then persistence (its O tile), ``num_stages`` and
    ``block_kv`` go, in that order, until the shared memory fits: a float32 tile ring of
    two 128-row CTAs x 128 keys x 2 stages alone is 128 KiB. Block sizes change the
    speed, never the result. Without rings the config is returned as it is, and
    ``check_fits`` still raises for one that does not fit (as it does if even 64 x 64 x 2
    does not: :func:`.forward.unsupported` keeps such head dims out).
    """
    if not logit_rings:
        return config
    if any(ring.per_query for ring in logit_rings) and config.block_q > 64:
        config = dataclasses.replace(config, block_q=64)

    def fits(c: MosaicConfig) -> bool:
        need = c.smem_bytes(head_dim, itemsize, segments=segments, logit_rings=logit_rings)
        return need <= SMEM_BUDGET

    while not fits(config):
        if config.persistent:
            config = dataclasses.replace(config, persistent=False)
        elif config.num_stages > 2:
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        elif config.block_kv > 64:
            config = dataclasses.replace(config, block_kv=config.block_kv - 64)
        else:
            break
    return config


def padded_head_dim(head_dim: int) -> int:
    """The kernel's head dim for a caller's ``head_dim``: the next multiple of 64."""
    return round_up(head_dim, HEAD_DIM_MULTIPLE)


#: Rows of at most this many keys are short for the forward's heuristic: persistent CTAs
#: (the next tile's loads hide a short tile's fixed costs) and, at head_dim 64 dense,
#: 256-key blocks (:func:`default_config` has the timings).
SHORT_FORWARD_SEQ = 2048


def default_config(q_shape, kv_shape, dtype, mask: MaskSpec) -> MosaicConfig:
    """Heuristic per (head_dim, causal, length), from H200 timings (bf16, hidden 2048).

    Always 64 query rows per consumer warpgroup and two stages. Above head_dim 128:
    ``block_kv`` 64 (a 2-stage ring of 128-key blocks exceeds 227 KiB) with the overlapped
    schedule; head_dim 65-128: ``block_kv`` 128, overlapped, with persistent CTAs up to
    ``SHORT_FORWARD_SEQ`` (2048) keys, dense or causal (longer rows gain nothing from
    them). At head_dim 64 the choice follows ``seq_kv`` and the mask, with persistent
    CTAs except on long causal rows:
    dense up to 2048 keys ``64x256``, persistent; dense above, three consumers of 128-key
    blocks, overlapped and persistent; causal up to 2048 ``64x128`` serial, persistent;
    causal from 16384 three consumers, overlapped, not persistent; causal in between
    ``64x128`` serial, not persistent.
    (measurements: docs/tuning.md#mosaic-forward-default_config)
    """
    del dtype
    head_dim = padded_head_dim(q_shape[-1])
    if head_dim > 128:
        return MosaicConfig(block_q=64, block_kv=64, num_stages=2, overlap=True)
    seq_kv = kv_shape[1]
    if head_dim > 64:
        return MosaicConfig(block_q=64, block_kv=128, num_stages=2, overlap=True,
                            persistent=seq_kv <= SHORT_FORWARD_SEQ)
    if mask.is_dense:
        if seq_kv <= SHORT_FORWARD_SEQ:
            return MosaicConfig(block_q=64, block_kv=256, num_stages=2, persistent=True)
        return MosaicConfig(block_q=64, block_kv=128, num_stages=2, overlap=True,
                            num_consumers=3, persistent=True)
    if seq_kv <= SHORT_FORWARD_SEQ:
        return MosaicConfig(block_q=64, block_kv=128, num_stages=2, persistent=True)
    if seq_kv >= 16384:
        return MosaicConfig(block_q=64, block_kv=128, num_stages=2, overlap=True,
                            num_consumers=3)
    return MosaicConfig(block_q=64, block_kv=128, num_stages=2)


def splits_dq(head_dim: int, itemsize: int) -> bool:
    """Whether the fused dQ (``deterministic=False``) is split between the two consumers of
    a dK/dV CTA, each adding half the head dim of dS·K over both consumers' keys (FA3): the
    halves must be whole 128-byte swizzle widths of the K tiles (head_dim 128 in 16 bits);
    otherwise the consumer that owns the step's ring slot adds all of it."""
    return head_dim // NUM_CONSUMERS * itemsize >= 128


@dataclasses.dataclass(frozen=True)
class MosaicBackwardConfig:
    """Static tiling of the two Hopper backward kernels (:mod:`pallas_flash.mosaic.backward`).

    dK/dV kernel: one CTA owns ``NUM_CONSUMERS * block_kv`` keys of one KV head, each
    consumer warpgroup ``block_kv`` of them (dK and dV accumulators: ``block_kv * D / 64``
    f32 registers per thread), and streams ``block_q`` query rows per step. At head_dim
    256 a CTA owns ``block_kv`` keys and its two consumers split them by rows of Sᵀ and
    columns of dK/dV (:mod:`pallas_flash.mosaic.backward.dkdv_d256`; deterministic dQ only).
    dQ kernel: one CTA owns ``NUM_CONSUMERS * dq_block_q`` query rows and streams
    ``dq_block_kv`` keys per step. Both rings are ``num_stages`` deep.

    Attributes:
      block_q: query rows per step of the dK/dV kernel (N of Sᵀ = K·Qᵀ); 64 or 128.
      dq_block_kv: keys per step of the dQ kernel; 32, 64 or 128 (32 leaves room for a
        2-stage K/V ring at head_dim 256).
      num_stages: depth of both kernels' SMEM rings, 2 to 4.
      deterministic: compute dQ in the separate dQ kernel (every dQ tile written by one
        CTA). Otherwise the dK/dV kernel also adds each step's dS·K_j into a
        float32 dQ in GMEM with TMA reduce-adds (FA3; shared by the two consumers at
        head_dim 128, :func:`splits_dq`): five GEMMs instead of seven, but the order of
        the additions, hence the rounding, varies from run to run. :func:`default_backward_config`
        picks it up to head_dim 128, where it is the faster mode (but for short causal
        sequences).
      bulk_dq: with the fused dQ (``deterministic=False``; ignored otherwise), FA3's dQ path
        (:mod:`pallas_flash.mosaic.backward.dq_bulk`): each consumer stages its share of
        dQ in register order and adds it with one non-tensor bulk reduce-add into a
        fragment-ordered float32 accumulator, converted to ``[B, T, N, D]`` by XLA
        afterwards; named barriers instead of the exchange mbarriers. Off by default.

    The keys per dK/dV consumer (:attr:`block_kv`) and the query rows per dQ consumer
    (:attr:`dq_block_q`) are fixed at 64, wgmma's M: dK and dV of more keys, or dQ of more
    rows, do not fit a consumer's registers beside the S and dP tiles.
    """

    block_q: int = 64
    dq_block_kv: int = 128
    num_stages: int = 2
    deterministic: bool = True
    bulk_dq: bool = False

    #: Keys per consumer warpgroup of the dK/dV kernel (wgmma M).
    block_kv = 64
    #: Query rows per consumer warpgroup of the dQ kernel (wgmma M).
    dq_block_q = 64

    def __post_init__(self) -> None:
        if self.block_q not in (64, 128):
            raise ValueError(f"block_q must be 64 or 128, got {self.block_q}")
        if self.dq_block_kv not in (32, 64, 128):
            raise ValueError(f"dq_block_kv must be 32, 64 or 128, got {self.dq_block_kv}")
        if not 2 <= self.num_stages <= 4:
            raise ValueError(f"num_stages must be in [2, 4], got {self.num_stages}")
        if not isinstance(self.bulk_dq, bool):
            raise ValueError(f"bulk_dq must be a bool, got {self.bulk_dq!r}")

    def dkdv_smem_bytes(self, head_dim: int, itemsize: int = 2, *,
                        segments: bool = False, logit_rings: tuple[LogitRing, ...] = ()
                        ) -> int:
        """dK/dV kernel: resident K/V tiles, the Q/dO ring, the lse/delta ring, barriers,
        with ``segments`` the ring of the rows' segment ids (int32, on Q's barrier), and the
        rings of bias / mask arrays (``logit_rings``, on Q's barrier too)."""
        if head_dim > MAX_PER_CONSUMER_HEAD_DIM:
            return self._split_dkdv_smem_bytes(head_dim, itemsize, segments=segments)
        k_v = 2 * _align(NUM_CONSUMERS * self.block_kv * head_dim * itemsize)
        q_do = 2 * _align(self.num_stages * self.block_q * head_dim * itemsize)
        stats = 2 * _align(self.num_stages * self.block_q * 4)
        q_ids = _align(self.num_stages * self.block_q * 4) if segments else 0
        # K, V ready per consumer; Q (with lse) ready, dO (with delta) ready, free per slot.
        barriers = 8 * (2 * NUM_CONSUMERS + 3 * self.num_stages)
        fused_dq = 0
        if not self.deterministic:  # per slot and consumer a dSᵀ tile; the f32 dQ staging
            split = splits_dq(head_dim, itemsize)
            dq_columns = head_dim // NUM_CONSUMERS if split else head_dim
            fused_dq = (_align(self.num_stages * NUM_CONSUMERS * self.block_kv
                               * self.block_q * itemsize)
                        + _align(NUM_CONSUMERS * self.block_q * dq_columns * 4)
                        # exchanged, dq_done (bulk_dq: named barriers instead)
                        + (0 if self.bulk_dq else 8 * (self.num_stages + 1)))
        # Consumers own block_kv keys, the ring walks block_q queries.
        logits = _rings_bytes(logit_rings, owned=self.block_kv, walked=self.block_q,
                              num_stages=self.num_stages)
        return k_v + q_do + stats + q_ids + barriers + fused_dq + logits

    def _split_dkdv_smem_bytes(self, head_dim: int, itemsize: int, *, segments: bool
                               ) -> int:
        """The head-dim-256 dK/dV kernel: K/V of one block, the Q/dO ring, one lse+delta
        ring, the Pᵀ/dSᵀ exchange ring (one [block_kv, block_q] tile each per slot)."""
        k_v = 2 * _align(self.block_kv * head_dim * itemsize)
        q_do = 2 * _align(self.num_stages * self.block_q * head_dim * itemsize)
        stats = _align(self.num_stages * 2 * self.block_q * 4)
        exchange = 2 * _align(self.num_stages * self.block_kv * self.block_q * itemsize)
        q_ids = _align(self.num_stages * self.block_q * 4) if segments else 0
        # K, V ready per half; Q (with the stats) ready, dO ready, free and exchanged per slot.
        barriers = 8 * (2 * NUM_CONSUMERS + 4 * self.num_stages)
        return k_v + q_do + stats + exchange + q_ids + barriers

    def dq_smem_bytes(self, head_dim: int, itemsize: int = 2, *, segments: bool = False,
                      logit_rings: tuple[LogitRing, ...] = ()) -> int:
        """dQ kernel: resident Q/dO tiles, lse/delta, the K and V rings, barriers, with
        ``segments`` the ring of the keys' segment ids (int32, next to K's), and the rings
        of bias / mask arrays (``logit_rings``, next to K's too)."""
        q_do = 2 * _align(NUM_CONSUMERS * self.dq_block_q * head_dim * itemsize)
        stats = 2 * _align(NUM_CONSUMERS * self.dq_block_q * 4)
        kv = 2 * _align(self.num_stages * self.dq_block_kv * head_dim * itemsize)
        kv_ids = _align(self.num_stages * self.dq_block_kv * 4) if segments else 0
        # Q, dO, lse, delta ready per consumer; K/V ready and K/V free per slot.
        barriers = 8 * (4 * NUM_CONSUMERS + 3 * self.num_stages)
        logits = _rings_bytes(logit_rings, owned=self.dq_block_q, walked=self.dq_block_kv,
                              num_stages=self.num_stages)
        return q_do + stats + kv + kv_ids + barriers + logits

    def smem_bytes(self, head_dim: int, itemsize: int = 2, *, segments: bool = False,
                   dkdv_rings: tuple[LogitRing, ...] = (),
                   dq_rings: tuple[LogitRing, ...] = ()) -> int:
        """Shared memory of the larger kernel (the dQ kernel only with ``deterministic``);
        ``dkdv_rings`` / ``dq_rings``: bias / mask rings of each kernel."""
        need = self.dkdv_smem_bytes(head_dim, itemsize, segments=segments,
                                    logit_rings=dkdv_rings)
        if self.deterministic:
            need = max(need, self.dq_smem_bytes(head_dim, itemsize, segments=segments,
                                                logit_rings=dq_rings))
        return need

    def check_fits(self, head_dim: int, itemsize: int = 2, *, segments: bool = False,
                   dkdv_rings: tuple[LogitRing, ...] = (),
                   dq_rings: tuple[LogitRing, ...] = ()) -> None:
        """Raises ValueError when either kernel cannot run at ``head_dim`` on an sm90 CTA
        (``segments``: with segment ids; ``*_rings``: with bias / mask arrays)."""
        if head_dim > MAX_PER_CONSUMER_HEAD_DIM and not self.deterministic:
            raise ValueError(f"deterministic=False (the fused dQ) needs head_dim <= "
                             f"{MAX_PER_CONSUMER_HEAD_DIM}, got head_dim={head_dim}")
        need = self.smem_bytes(head_dim, itemsize, segments=segments, dkdv_rings=dkdv_rings,
                               dq_rings=dq_rings)
        if need > SMEM_BUDGET:
            raise ValueError(
                f"MosaicBackwardConfig {self} needs {need} bytes of shared memory at "
                f"head_dim={head_dim}, more than the {SMEM_BUDGET} an sm90 CTA has; "
                "lower the block sizes or num_stages")


def _rings_bytes(rings: tuple[LogitRing, ...], *, owned: int, walked: int,
                 num_stages: int) -> int:
    """Shared memory of a backward kernel's bias / mask rings (:func:`ring_view`); none
    without rings (32-key dQ blocks, at head_dim 256, have no ring view)."""
    if not rings:
        return 0
    view = ring_view(owned=owned, walked=walked, num_stages=num_stages)
    return sum(_align(ring.nbytes(view)) for ring in rings)


def ring_view(*, owned: int, walked: int, num_stages: int) -> MosaicConfig:
    """A backward kernel's tiling in the forward's terms, which :class:`LogitRing` and the
    forward's bias / mask readers take: consumers own ``owned`` rows, the ring walks blocks
    of ``walked``."""
    return MosaicConfig(block_q=owned, block_kv=walked, num_stages=num_stages)


@dataclasses.dataclass(frozen=True)
class MosaicCallConfig:
    """The Mosaic backend's configs of one ``attention`` call, forward and backward.

    ``attention(config=...)`` takes one of these, or a :class:`MosaicConfig` alone (the
    backward's from :func:`default_backward_config`), or a :class:`MosaicBackwardConfig`
    alone (the forward's from :func:`default_config`).

    Attributes:
      forward: the forward kernel's tiling; None for :func:`default_config`'s.
      backward: the backward kernels' tiling and dQ mode; None for
        :func:`default_backward_config`'s.
    """

    forward: MosaicConfig | None = None
    backward: MosaicBackwardConfig | None = None

    def __post_init__(self) -> None:
        if self.forward is not None and not isinstance(self.forward, MosaicConfig):
            raise ValueError(f"forward must be a MosaicConfig or None, got {self.forward!r}")
        if self.backward is not None and not isinstance(self.backward, MosaicBackwardConfig):
            raise ValueError(
                f"backward must be a MosaicBackwardConfig or None, got {self.backward!r}")


#: Query rows of the one wgmma a decode CTA computes (``group · seq_q`` must fit).
DECODE_ROWS = 64
#: SMEM bytes of one K (or V) tile of the decode kernel: what one TMA ring stage of the
#: read floor carried (``benchmarks/read_floor.py``).
DECODE_TILE_BYTES = 32 * 1024


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the Mosaic decode kernel (:mod:`pallas_flash.mosaic.decode`), which
    ``decode_attention(..., implementation="mosaic")`` runs on a full cache.

    Attributes:
      block_kv: keys per K / V tile, a positive multiple of 64 that divides the chunk.
      num_stages: K / V tiles in flight (the TMA ring's depth), at least 1.

    A warp-specialized variant (a producer warpgroup issuing the loads,
    ``plgpu.emit_pipeline_warp_specialized``) ran no faster on the H200 (2026-12-03,
    ``docs/decode.md``) and is not kept.
    """

    block_kv: int = 128
    num_stages: int = 2

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """SMEM the decode kernel takes at the padded ``head_dim``: the K and V ring, the
        64-row Q tile (which carries O out), and 4 KiB for barriers and the LSE tile (the
        H200's compiler reported 232480 bytes for 64 keys, 3 stages, head_dim 256: 3104
        over the tiles)."""
        tiles = (2 * self.num_stages * self.block_kv + DECODE_ROWS) * head_dim * itemsize
        return tiles + 4096

    def __post_init__(self) -> None:
        if (not isinstance(self.block_kv, int) or isinstance(self.block_kv, bool)
                or self.block_kv < 64 or self.block_kv % 64):
            raise ValueError(f"block_kv must be a positive multiple of 64, got "
                             f"{self.block_kv!r}")
        if (not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool)
                or self.num_stages < 1):
            raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")


def default_decode_config(head_dim: int, itemsize: int = 2) -> DecodeConfig:
    """The largest ``block_kv`` (at most 128) whose K tile fits
    :data:`DECODE_TILE_BYTES`, two stages."""
    block_kv = max(64, min(128, DECODE_TILE_BYTES // (padded_head_dim(head_dim) * itemsize)))
    return DecodeConfig(block_kv=block_kv - block_kv % 64)


#: What ``attention(config=...)`` accepts for the Mosaic backend.
CONFIG_TYPES = (MosaicConfig, MosaicBackwardConfig, MosaicCallConfig)


def forward_config(config, q_shape, kv_shape, dtype, mask: MaskSpec) -> MosaicConfig:
    """The forward's part of any of :data:`CONFIG_TYPES` (its heuristic where absent)."""
    if isinstance(config, MosaicConfig):
        return config
    if isinstance(config, MosaicCallConfig) and config.forward is not None:
        return config.forward
    return default_config(q_shape, kv_shape, dtype, mask)


def backward_config(config, q_shape, kv_shape, dtype, mask: MaskSpec, *,
                    deterministic: bool = False) -> MosaicBackwardConfig:
    """The backward's part of any of :data:`CONFIG_TYPES` (its heuristic where absent).

    ``deterministic``: whether the backward must be reproducible, as the caller decided it
    (:func:`pallas_flash.dispatch.deterministic_backward`: ``attention(...,
    deterministic=True)`` or ``XLA_FLAGS``' deterministic ops). A backward config the
    caller chose with the fused dQ (``deterministic=False``) then raises rather than being
    swapped for a kernel the caller did not ask for.

    Raises:
      ValueError: ``deterministic`` and a given backward config with the fused dQ.
    """
    given = config.backward if isinstance(config, MosaicCallConfig) else config
    if not isinstance(given, MosaicBackwardConfig):
        return default_backward_config(q_shape, kv_shape, dtype, mask,
                                       deterministic=deterministic)
    if deterministic and not given.deterministic:
        raise ValueError(
            "a deterministic backward (attention(..., deterministic=True) or XLA_FLAGS="
            "--xla_gpu_deterministic_ops) needs the separate dQ kernel, but the given "
            f"MosaicBackwardConfig {given} has deterministic=False (the fused dQ, whose "
            "TMA reduce-adds are not reproducible): pass MosaicBackwardConfig("
            "deterministic=True) or no backward config")
    return given


def fit_backward_logit_rings(config: MosaicBackwardConfig, head_dim: int, itemsize: int, *,
                             segments: bool, dkdv_rings: tuple[LogitRing, ...],
                             dq_rings: tuple[LogitRing, ...]) -> MosaicBackwardConfig:
    """``config``, or where the rings of bias / mask arrays do not fit beside it, 64-key
    dQ blocks, then also 64-row dK/dV steps (a float32 tile ring of the dQ kernel with
    128-key blocks is 128 KiB on its own), then the same with the separate dQ kernel (the
    fused dQ's dSᵀ ring and float32 staging tiles take 64 KiB of the dK/dV kernel at
    head_dim 128). Unchanged if nothing fits (``check_fits`` says)."""
    if not dkdv_rings and not dq_rings:
        return config
    tilings = (config, dataclasses.replace(config, dq_block_kv=64),
               dataclasses.replace(config, dq_block_kv=64, block_q=64))
    candidates = [dataclasses.replace(tiling, deterministic=deterministic)
                  for deterministic in dict.fromkeys((config.deterministic, True))
                  for tiling in tilings]
    for candidate in candidates:
        need = candidate.smem_bytes(head_dim, itemsize, segments=segments,
                                    dkdv_rings=dkdv_rings, dq_rings=dq_rings)
        if need <= SMEM_BUDGET:
            return candidate
    return config


#: Up to this many tokens a causal backward at head_dim 65-128 takes the separate dQ
#: kernel by default (:func:`default_backward_config` has the timings).
SHORT_CAUSAL_SEQ = 2048


def default_backward_config(q_shape, kv_shape, dtype, mask: MaskSpec, *,
                            deterministic: bool = False) -> MosaicBackwardConfig:
    """The backward's tiling and dQ mode per head dim, from H200 timings (bf16, hidden 2048).

    64 query rows per step at every head dim (the dK/dV consumers hold dK and dV for 64
    keys each, so the S and dP tiles must stay small), two stages, 128-key dQ blocks.
    Above head_dim 128: ``dq_block_kv=32`` (Q and dO of two 64-row consumers fill 128 KiB,
    and 32-key blocks keep a 2-stage ring) with the separate, deterministic dQ kernel.
    Up to head_dim 128 the fused dQ (FA3; ``deterministic=False``) unless the call asks
    for a reproducible backward (``deterministic``, as the caller decided it from the
    call's argument and ``XLA_FLAGS``' deterministic ops:
    :func:`pallas_flash.dispatch.deterministic_backward`), since its additions into dQ
    come in a varying order; and one exception, causal attention at head_dim 65-128 over
    at most ``SHORT_CAUSAL_SEQ`` (2048) tokens, which takes the separate dQ kernel.
    (measurements: docs/tuning.md#mosaic-backward-default_backward_config)
    """
    del dtype
    head_dim = padded_head_dim(q_shape[-1])
    if head_dim > MAX_PER_CONSUMER_HEAD_DIM:
        # Q and dO of two 64-row consumers fill 128 KiB: 32-key blocks keep a 2-stage ring.
        return MosaicBackwardConfig(block_q=64, dq_block_kv=32, num_stages=2)
    short_causal = (mask.is_causal and head_dim > 64
                    and max(q_shape[1], kv_shape[1]) <= SHORT_CAUSAL_SEQ)
    return MosaicBackwardConfig(block_q=64, dq_block_kv=128, num_stages=2,
                                deterministic=bool(deterministic) or short_causal)
