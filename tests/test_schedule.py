"""The schedule without a Trainer: due steps of both tiers, the overhead budget, the cost note."""

from __future__ import annotations

import pytest
import torch

from curvwatch.schedule import DEFAULT_EVERY, DEFAULT_OVERHEAD, Schedule


def test_due_steps_of_both_tiers_and_no_step_twice():
    s = Schedule(every_n_train_steps=4, terms_every_n_train_steps=2)
    assert [s.due(k) for k in range(5)] == [(True, True), (False, False), (False, True), (False, False), (True, True)]
    s.last_step = 4
    assert s.due(4) == (False, False)


def test_the_budget_governs_the_default_cadence_only():
    assert (Schedule().every_n_train_steps, Schedule().max_overhead) == (DEFAULT_EVERY, DEFAULT_OVERHEAD)
    assert Schedule(every_n_train_steps=7).max_overhead is None and Schedule(every_n_train_steps=7).note_cost
    assert Schedule(every_n_train_steps=7, max_overhead=0.02).max_overhead == 0.02
    fixed = Schedule(every_n_train_steps=7, max_overhead=None)
    assert fixed.max_overhead is None and not fixed.note_cost
    assert Schedule(max_overhead=None).max_overhead is None


def test_affordable_prices_the_next_evaluation_as_the_last_one():
    s = Schedule(max_overhead=0.1)
    assert s.affordable() == (True, True)  # nothing spent yet
    s.charge(1.0, terms_only=False)
    s.charge(0.1, terms_only=True)
    s.train_seconds = 25.0  # 1.1 s spent: one more full (1 s) fits 10% of 25 s, so does a terms-only one
    assert s.affordable() == (True, True)
    s.train_seconds = 15.0  # 2.1 > 1.5 >= 1.2
    assert s.affordable() == (False, True)
    # the ranks agree through the slowest rank's numbers: a larger spend elsewhere decides
    assert s.affordable(lambda t: t + torch.tensor([10.0, 10.0, 0.0], dtype=torch.float64)) == (False, False)


def test_cost_note_for_an_expensive_chosen_cadence():
    s = Schedule(every_n_train_steps=2)
    s.charge(1.0, terms_only=False)
    # one evaluation (1 s) is 10 training steps (0.1 s each), 5x the 2 trained between evaluations
    s.update = lambda: None
    s.train_seconds = 1.0  # 0.1 s per step at step 10
    note = s.cost_note(10)
    assert "every_n_train_steps=2 is expensive here" in note and "about 10.0 training steps" in note
    assert s.cost_note(1) is None  # before one interval was trained
    cheap = Schedule(every_n_train_steps=1000)
    cheap.charge(1.0, terms_only=False)
    cheap.train_seconds, cheap.update = 1000.0, lambda: None
    assert cheap.cost_note(1000) is None


def test_state_round_trips():
    s = Schedule(every_n_train_steps=3)
    s.charge(0.5, terms_only=False)
    s.last_step = 9
    t = Schedule(every_n_train_steps=3)
    t.load_state_dict(s.state_dict())
    assert (t.eval_seconds, t.last_step, t.runs, t.last_eval_seconds) == (0.5, 9, 1, 0.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every_n_train_steps": 0}, "Invalid every_n_train_steps=0. Must be an int >= 1."),
        ({"terms_every_n_train_steps": 1.5}, "Invalid terms_every_n_train_steps=1.5"),
        ({"max_overhead": -1}, "Invalid max_overhead=-1. Must be a fraction > 0"),
        ({"max_overhead": "sometimes"}, "Invalid max_overhead='sometimes'"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Schedule(**kwargs)
