"""Tests of curvwatch.data: encoding, correctness of the generated sums, target masking, accuracy."""

from __future__ import annotations

import pytest
import torch

from curvwatch.data import (
    IGNORE_INDEX,
    VOCAB,
    VOCAB_SIZE,
    AdditionDataModule,
    AdditionDataset,
    answer_accuracy,
    decode,
    encode,
    format_sample,
    parse_sample,
    prompt_length,
    sequence_length,
)


def test_vocab():
    assert VOCAB == "0123456789+=" and VOCAB_SIZE == 12


@pytest.mark.parametrize("text", ["0123456789", "12+34=640", "+=+="])
def test_encode_decode_round_trip(text):
    ids = encode(text)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert decode(ids) == text
    assert decode(torch.tensor(ids)) == text


def test_encode_rejects_unknown():
    with pytest.raises(ValueError, match="Invalid character 'x'"):
        encode("1x2")


def test_format_reverses_answer():
    assert format_sample(123, 989, 3) == "123+989=2111"
    assert format_sample(5, 7, 2) == "05+07=210"
    assert parse_sample("05+07=210") == (5, 7, 12)
    with pytest.raises(ValueError, match="Invalid a=100"):
        format_sample(100, 1, 2)


@pytest.mark.parametrize("n_digits", [1, 3, 5])
def test_sums_are_correct(n_digits):
    ds = AdditionDataset(n_digits, n_samples=50, seed=n_digits)
    L = sequence_length(n_digits)
    assert len(ds) == 50 and L == 3 * n_digits + 2
    for i in range(len(ds)):
        input_ids, targets = ds[i]
        assert input_ids.shape == targets.shape == (L,)
        full = decode(torch.cat([input_ids, input_ids.new_tensor([int(targets[-1])])]))
        a, b, s = parse_sample(full)
        assert s == a + b
        assert (a, b) == tuple(ds.operands[i].tolist())
        assert full == format_sample(a, b, n_digits)


def test_targets_masked_on_prompt():
    n = 4
    ds = AdditionDataset(n, n_samples=20, seed=0)
    input_ids, targets = ds.input_ids, ds.targets
    P = prompt_length(n)
    assert (targets[:, : P - 1] == IGNORE_INDEX).all()
    # the scored targets are exactly the n + 1 answer digits, i.e. the inputs shifted by one
    assert (targets[:, P - 1 :] != IGNORE_INDEX).all() and targets.shape[1] - (P - 1) == n + 1
    assert (targets[:, P - 1 : -1] == input_ids[:, P:]).all()
    assert (input_ids[:, P - 1] == VOCAB.index("=")).all()


def test_deterministic_and_distinct():
    a, b = AdditionDataset(2, 500, seed=3), AdditionDataset(2, 500, seed=3)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, AdditionDataset(2, 500, seed=4).input_ids)
    assert len({tuple(p) for p in a.operands.tolist()}) == 500
    full = AdditionDataset(1, 100, seed=0)  # every pair exactly once
    assert len({tuple(p) for p in full.operands.tolist()}) == 100
    with pytest.raises(ValueError, match="Invalid n_samples=101"):
        AdditionDataset(1, 101)


def test_answer_accuracy_is_exact_match():
    ds = AdditionDataset(2, n_samples=8, seed=0)
    logits = torch.nn.functional.one_hot(ds.targets.clamp(min=0), VOCAB_SIZE).float()
    assert answer_accuracy(logits, ds.targets) == 1.0
    logits[0, -1] = logits[0, -1].roll(1)  # one wrong answer digit in one sequence
    logits[1, 0] = logits[1, 0].roll(1)  # a wrong prediction on a masked position does not count
    assert answer_accuracy(logits, ds.targets) == pytest.approx(7 / 8)


def test_datamodule_split_without_overlap():
    dm = AdditionDataModule(n_digits=2, n_train=64, n_val=16, batch_size=8)
    dm.setup("fit")
    train = {tuple(dm.train_set.dataset.operands[i].tolist()) for i in dm.train_set.indices}
    val = {tuple(dm.val_set.dataset.operands[i].tolist()) for i in dm.val_set.indices}
    assert len(train) == 64 and len(val) == 16 and not train & val
    input_ids, targets = next(iter(dm.train_dataloader()))
    assert input_ids.shape == targets.shape == (8, 8)
    assert len(dm.val_dataloader()) == 2
    with pytest.raises(ValueError, match="Invalid n_train=4 for batch_size=8"):
        AdditionDataModule(n_train=4, batch_size=8)
