"""Generated n-digit addition data (answers written least-significant digit first); no downloads.

A sample for ``n`` digits is the string ``a+b=s`` where ``a`` and ``b`` are zero-padded to ``n`` digits and
the sum ``s = a + b`` is zero-padded to ``n + 1`` digits and then **reversed**, e.g. for ``n = 3``::

    123+989=2111      # 123 + 989 = 1112, written reversed as "2111"

Writing the answer least-significant digit first lets each answer digit be computed from the two operand
digits and the carry, which a small model can read off the previous answer digit; this follows the
addition tasks of Quirke & Barez (2024) and Ormaniec et al. (2024).

A full sample has ``3n + 3`` tokens. For next-token prediction the model sees the first ``3n + 2`` of them
(:func:`sequence_length`) and is trained only on the ``n + 1`` answer tokens; every other target is
``IGNORE_INDEX``.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

# Vocabulary: the ten digits, then '+' and '='. Nothing else (no BOS, EOS or padding).
VOCAB = "0123456789+="
VOCAB_SIZE = len(VOCAB)
PLUS = VOCAB.index("+")
EQUALS = VOCAB.index("=")
# Target value skipped by torch.nn.functional.cross_entropy.
IGNORE_INDEX = -100

_STOI = {ch: i for i, ch in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    """Turn a string over :data:`VOCAB` into token ids.

    Raises:
        ValueError: If ``text`` contains a character outside the vocabulary.

    Example:
        >>> encode("12+3=")
        [1, 2, 10, 3, 11]
    """
    try:
        return [_STOI[ch] for ch in text]
    except KeyError as err:
        raise ValueError(f"Invalid character {err.args[0]!r} in {text!r}. Allowed: {VOCAB!r}.") from None


def decode(ids: Tensor | list[int]) -> str:
    """Turn token ids back into a string; ``IGNORE_INDEX`` entries are skipped.

    Example:
        >>> decode([1, 2, 10, 3, 11])
        '12+3='
    """
    if isinstance(ids, Tensor):
        ids = ids.tolist()
    return "".join(VOCAB[i] for i in ids if i != IGNORE_INDEX)


def sequence_length(n_digits: int) -> int:
    """Length ``3n + 2`` of a model input (the full sample minus its last token).

    Example:
        >>> sequence_length(5)
        17
    """
    return 3 * n_digits + 2


def prompt_length(n_digits: int) -> int:
    """Length ``2n + 2`` of the prompt ``a+b=``; the answer occupies the next ``n + 1`` tokens."""
    return 2 * n_digits + 2


def format_sample(a: int, b: int, n_digits: int) -> str:
    """The full sample string ``a+b=reversed(sum)`` for ``n_digits``-digit operands.

    Raises:
        ValueError: If an operand does not fit in ``n_digits`` digits or is negative.

    Example:
        >>> format_sample(123, 989, 3)
        '123+989=2111'
    """
    for name, value in (("a", a), ("b", b)):
        if not 0 <= value < 10**n_digits:
            raise ValueError(f"Invalid {name}={value} for n_digits={n_digits}. Must be in [0, 10**n_digits).")
    answer = str(a + b).zfill(n_digits + 1)[::-1]
    return f"{a:0{n_digits}d}+{b:0{n_digits}d}={answer}"


def parse_sample(text: str) -> tuple[int, int, int]:
    """Inverse of :func:`format_sample`: ``(a, b, sum)`` with the sum read back in normal order.

    Example:
        >>> parse_sample("123+989=2111")
        (123, 989, 1112)
    """
    prompt, answer = text.split("=")
    a, b = prompt.split("+")
    return int(a), int(b), int(answer[::-1])


def answer_accuracy(logits: Tensor, targets: Tensor) -> Tensor:
    """Exact-match accuracy: the fraction of sequences whose every answer token is predicted.

    Predictions are the argmax of the teacher-forced logits. When every answer token of a sequence is
    right, greedy decoding would produce the same tokens, so this equals greedy generation accuracy.

    Args:
        logits: ``(B, L, vocab)`` next-token logits.
        targets: ``(B, L)`` target ids, ``IGNORE_INDEX`` where not scored.

    Returns:
        0-d float tensor in ``[0, 1]``.

    Example:
        >>> targets = torch.tensor([[IGNORE_INDEX, 3, 4], [IGNORE_INDEX, 1, 1]])
        >>> logits = torch.nn.functional.one_hot(torch.tensor([[0, 3, 4], [0, 1, 2]]), VOCAB_SIZE).float()
        >>> answer_accuracy(logits, targets)
        tensor(0.5000)
    """
    scored = targets != IGNORE_INDEX
    correct = (logits.argmax(dim=-1) == targets) | ~scored
    return correct.all(dim=-1).float().mean()


class AdditionDataset(Dataset):
    """``n_samples`` distinct random additions of two ``n_digits``-digit numbers.

    Operands are drawn uniformly from ``[0, 10**n_digits)`` with ``numpy.random.default_rng(seed)``; pairs
    are distinct, so a split of one dataset into train and validation never leaks.

    Items are ``(input_ids, targets)``, both long tensors of shape ``(3n + 2,)``: ``input_ids`` is the
    sample without its last token, ``targets`` the sample without its first token, with ``IGNORE_INDEX`` on
    the first ``2n + 1`` positions so that only the ``n + 1`` answer tokens are scored.

    Args:
        n_digits: Digits per operand, ``>= 1``.
        n_samples: Number of samples, at most ``10 ** (2 * n_digits)``.
        seed: Seed of the generator.

    Raises:
        ValueError: If ``n_digits < 1`` or ``n_samples`` is not in ``[1, 10 ** (2 * n_digits)]``.

    Example:
        >>> ds = AdditionDataset(n_digits=3, n_samples=10, seed=0)
        >>> input_ids, targets = ds[0]
        >>> input_ids.shape, int((targets != IGNORE_INDEX).sum())
        (torch.Size([11]), 4)
    """

    def __init__(self, n_digits: int, n_samples: int, seed: int = 0) -> None:
        if n_digits < 1:
            raise ValueError(f"Invalid n_digits={n_digits}. Must be >= 1.")
        n_pairs = 10 ** (2 * n_digits)
        if not 1 <= n_samples <= n_pairs:
            raise ValueError(
                f"Invalid n_samples={n_samples} for n_digits={n_digits}. "
                f"Must be in [1, {n_pairs}] (the number of distinct pairs)."
            )
        self.n_digits = n_digits
        self.seed = seed
        rng = np.random.default_rng(seed)
        if n_samples * 4 > n_pairs:  # dense regime: sample pair indices without replacement
            pair_ids = rng.choice(n_pairs, size=n_samples, replace=False)
            pairs = [divmod(int(i), 10**n_digits) for i in pair_ids]
        else:  # sparse regime: rejection of the rare duplicates
            seen: set[tuple[int, int]] = set()
            pairs = []
            while len(pairs) < n_samples:
                for a, b in rng.integers(0, 10**n_digits, size=(n_samples - len(pairs), 2)).tolist():
                    if (a, b) not in seen:
                        seen.add((a, b))
                        pairs.append((a, b))
        self.operands = torch.tensor(pairs, dtype=torch.long).reshape(n_samples, 2)  # (N, 2)
        tokens = torch.tensor([encode(format_sample(a, b, n_digits)) for a, b in pairs], dtype=torch.long)
        tokens = tokens.reshape(n_samples, 3 * n_digits + 3)  # (N, 3n + 3)
        self.input_ids = tokens[:, :-1].contiguous()  # (N, 3n + 2)
        self.targets = tokens[:, 1:].clone()  # (N, 3n + 2)
        self.targets[:, : prompt_length(n_digits) - 1] = IGNORE_INDEX

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.input_ids[index], self.targets[index]


class AdditionDataModule(L.LightningDataModule):
    """Train/validation loaders over one :class:`AdditionDataset` split without overlap.

    Args:
        n_digits: Digits per operand.
        n_train: Number of training samples.
        n_val: Number of validation samples.
        batch_size: Batch size of both loaders.
        seed: Seed of the data generator (the shuffling order follows the global torch seed).
        num_workers: DataLoader workers; 0 keeps everything in the main process.

    Example:
        >>> dm = AdditionDataModule(n_digits=2, n_train=32, n_val=8, batch_size=4)
        >>> dm.setup("fit")
        >>> input_ids, targets = next(iter(dm.train_dataloader()))
        >>> input_ids.shape
        torch.Size([4, 8])
    """

    def __init__(
        self,
        n_digits: int = 5,
        n_train: int = 50_000,
        n_val: int = 1_000,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("n_train", n_train), ("n_val", n_val), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"Invalid {name}={value}. Must be >= 1.")
        if n_train < batch_size:
            raise ValueError(
                f"Invalid n_train={n_train} for batch_size={batch_size}. The training loader drops the last "
                "partial batch, so n_train must be >= batch_size."
            )
        self.n_digits = n_digits
        self.n_train = n_train
        self.n_val = n_val
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: Subset | None = None
        self.val_set: Subset | None = None

    @property
    def sequence_length(self) -> int:
        """Model input length ``3n + 2``."""
        return sequence_length(self.n_digits)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        full = AdditionDataset(self.n_digits, self.n_train + self.n_val, seed=self.seed)
        self.train_set = Subset(full, range(self.n_train))
        self.val_set = Subset(full, range(self.n_train, self.n_train + self.n_val))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers
        )
