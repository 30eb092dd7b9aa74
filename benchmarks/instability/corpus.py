"""The suite's text: byte-level tokens of the Python standard library's own top-level source files.

Nobody here wrote it and nothing is downloaded: the files ship with the interpreter that runs the suite. The
file list is fixed (every ``*.py`` directly under ``sysconfig.get_paths()["stdlib"]``, sorted by name), the
bytes are concatenated with a blank line between files, and a SHA-256 of the result goes into every result
file, so two machines with the same Python version train on the same bytes.

Batches are windows of ``L + 1`` bytes at offsets drawn with a seeded ``torch.Generator``: batch ``i`` of a
run is the same whatever else the run does (a control and its unstable twin see the same batches).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

VOCAB_SIZE = 256  # bytes


@dataclass(frozen=True)
class Corpus:
    """The token stream and where it came from.

    Args:
        tokens: ``(N,)`` uint8 byte values.
        files: The file names, in the order they were concatenated.
        root: The standard-library folder they were read from.
        sha256: Hash of the concatenated bytes.
    """

    tokens: Tensor
    files: tuple[str, ...]
    root: str
    sha256: str

    def describe(self) -> dict[str, object]:
        """What the results record about the text."""
        return {
            "root": self.root,
            "files": len(self.files),
            "first_file": self.files[0],
            "last_file": self.files[-1],
            "bytes": int(self.tokens.numel()),
            "sha256": self.sha256,
        }


@lru_cache(maxsize=2)
def load_corpus(max_bytes: int = 2_000_000) -> Corpus:
    """The first ``max_bytes`` bytes of the sorted top-level standard-library sources.

    Args:
        max_bytes: Length cap (the first files in name order are enough for runs of a few hundred steps).

    Raises:
        FileNotFoundError: If the standard-library folder holds no ``*.py`` file (an embedded interpreter).

    Example:
        >>> corpus = load_corpus(10_000)
        >>> corpus.tokens.shape, corpus.tokens.dtype
        (torch.Size([10000]), torch.uint8)
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(
            f"No *.py files under the standard library folder {root}; the instability suite trains on them."
        )
    chunks, used, total = [], [], 0
    for path in files:
        data = path.read_bytes() + b"\n\n"
        chunks.append(data)
        used.append(path.name)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()
    return Corpus(tokens, tuple(used), str(root), hashlib.sha256(blob).hexdigest())


def batch_offsets(n_tokens: int, n_batches: int, batch_size: int, seq_len: int, seed: int) -> Tensor:
    """``(n_batches, batch_size)`` window starts, uniform over the stream, from a generator seeded by ``seed``."""
    generator = torch.Generator().manual_seed(10_007 * seed + 17)
    return torch.randint(0, n_tokens - seq_len - 1, (n_batches, batch_size), generator=generator)


class WindowBatches(torch.utils.data.Dataset):
    """Batch ``i``: ``(input_ids, targets)``, both ``(batch_size, seq_len)`` long, targets shifted by one byte.

    Used with ``DataLoader(batch_size=None)``: each item already is a batch.

    Example:
        >>> data = WindowBatches(load_corpus(10_000), n_batches=3, batch_size=2, seq_len=8, seed=0)
        >>> x, y = data[0]
        >>> x.shape, bool((x[:, 1:] == y[:, :-1]).all())
        (torch.Size([2, 8]), True)
    """

    def __init__(self, corpus: Corpus, n_batches: int, batch_size: int, seq_len: int, seed: int) -> None:
        self.tokens = corpus.tokens.long()
        self.offsets = batch_offsets(corpus.tokens.numel(), n_batches, batch_size, seq_len, seed)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.offsets.shape[0]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        idx = self.offsets[i].unsqueeze(1) + torch.arange(self.seq_len + 1)  # (B, L + 1)
        window = self.tokens[idx]
        return window[:, :-1], window[:, 1:]
