"""Byte-level text corpora packed into fixed-length rows with segment ids.

Default corpus: the ``.py`` files of the running Python's standard library (always there,
~30 MB). Documents are split into train/validation *by file*, so validation measures
generalisation to unseen files. Each split's documents are concatenated and cut into rows
of ``seq_len`` bytes; a row can hold the end of one document and the start of the next.
``segment_ids`` number the pieces within a row (1, 2, ...; 0 is padding) so attention
never crosses a document boundary, and ``positions`` restart at 0 in every piece.
"""

from __future__ import annotations

import dataclasses
import sysconfig
import zlib
from pathlib import Path

import numpy as np

# Installed third-party packages live under the stdlib directory; they are not stdlib.
_THIRD_PARTY_DIRS = {"site-packages", "dist-packages"}


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """One split, packed.

    Attributes:
      tokens: ``[rows, seq_len]`` int32 byte values (0 under padding).
      segment_ids: ``[rows, seq_len]`` int32, 1, 2, ... per document piece; 0 = padding.
      positions: ``[rows, seq_len]`` int32 index of each token within its piece.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The batch ``{"tokens", "segment_ids", "positions"}`` of the given row indices."""
        return {"tokens": self.tokens[index], "segment_ids": self.segment_ids[index],
                "positions": self.positions[index]}


def stdlib_dir() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path, suffix: str | None = None) -> list[Path]:
    """Text files under ``root`` (or ``[root]`` for a file), sorted, third-party skipped.

    ``suffix`` (e.g. ``".py"``) keeps only matching names; without it, files whose first
    kilobyte contains a NUL byte are taken for binary and skipped.
    """
    if root.is_file():
        return [root]
    files = []
    for path in sorted(root.rglob(f"*{suffix or ''}")):
        if not path.is_file() or _THIRD_PARTY_DIRS & set(path.relative_to(root).parts):
            continue
        if suffix is None:
            with path.open("rb") as f:
                if b"\0" in f.read(1024):
                    continue
        files.append(path)
    return files


def split_files(files: list[Path], root: Path,
                val_fraction: float) -> tuple[list[Path], list[Path]]:
    """Deterministic train/validation split of ``files`` (at least one of each).

    Files are ordered by the CRC-32 of their path relative to ``root`` — a fixed
    pseudo-random order that does not depend on the machine or on which other files
    exist — and the first ``val_fraction`` of that order is validation.
    """
    if len(files) < 2:
        raise ValueError(f"need at least two files to split by file, got {len(files)}")
    order = sorted(files, key=lambda p: zlib.crc32(p.relative_to(root).as_posix().encode()))
    n_val = min(len(files) - 1, max(1, round(val_fraction * len(files))))
    val = set(order[:n_val])
    return [p for p in files if p not in val], [p for p in files if p in val]


def pack(documents: list[bytes], seq_len: int) -> PackedRows:
    """Concatenate ``documents`` and cut the stream into rows of ``seq_len`` bytes.

    A new segment starts at every document start and at every row start; the last row is
    padded with segment id 0.
    """
    lengths = np.array([len(d) for d in documents if d], dtype=np.int64)
    stream = np.frombuffer(b"".join(documents), dtype=np.uint8)
    total = len(stream)
    if total == 0:
        raise ValueError("no text to pack")
    rows = -(-total // seq_len)
    tokens = np.zeros(rows * seq_len, np.int32)
    tokens[:total] = stream
    doc_starts = np.zeros(rows * seq_len, bool)
    doc_starts[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = True

    starts = doc_starts.reshape(rows, seq_len)
    starts[:, 0] = True
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
    # Position = distance to the latest segment start at or before each column.
    columns = np.broadcast_to(np.arange(seq_len), (rows, seq_len))
    last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
    positions = (columns - last_start).astype(np.int32)

    padding = np.arange(rows * seq_len).reshape(rows, seq_len) >= total
    segment_ids[padding] = 0
    positions[padding] = 0
    return PackedRows(tokens.reshape(rows, seq_len), segment_ids, positions)


def load_corpus(seq_len: int, data: Path | None = None,
                val_fraction: float = 0.05) -> tuple[PackedRows, PackedRows]:
    """``(train, validation)`` packed rows.

    ``data``: a text file or a folder of text files; default: the stdlib ``.py`` files.
    Folders are split by file; a single file by bytes (its last ``val_fraction``).
    """
    if data is None:
        root, suffix = stdlib_dir(), ".py"
    else:
        root, suffix = Path(data), None
    if not root.exists():
        raise FileNotFoundError(f"no such file or folder: {root}")
    files = list_files(root, suffix)
    if not files:
        raise ValueError(f"no text files found under {root}")
    if root.is_file():
        text = root.read_bytes()
        cut = int(len(text) * (1 - val_fraction))
        return pack([text[:cut]], seq_len), pack([text[cut:]], seq_len)
    train, val = split_files(files, root, val_fraction)
    return (pack([p.read_bytes() for p in train], seq_len),
            pack([p.read_bytes() for p in val], seq_len))


def train_batch(split: PackedRows, batch_size: int, seed: int, step: int) -> dict[str, np.ndarray]:
    """Random rows for training step ``step``: a pure function of ``(seed, step)``.

    Needing no iterator state is what makes a resumed run see the same batches as an
    uninterrupted one.
    """
    rng = np.random.default_rng([seed, step])
    return split.rows(rng.integers(0, len(split), batch_size))
