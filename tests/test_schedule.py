"""The schedule without a Trainer: due steps of both tiers, the overhead budget, the cost note."""

from __future__ import annotations

import pytest
import torch

from curvwatch.schedule import (
    DEFAULT_EVERY,
    DEFAULT_OVERHEAD,
    DEFAULT_TERMS_EVERY,
    DEFAULT_TERMS_OVERHEAD,
    Schedule,
)


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
    s = Schedule(max_overhead=0.1, terms_every_n_train_steps=5)  # a chosen terms cadence shares the budget
    assert s.affordable() == (True, True)  # nothing spent yet
    s.charge(1.0, terms_only=False)
    s.charge(0.1, terms_only=True)
    s.train_seconds = 25.0  # 1.1 s spent: one more full (1 s) fits 10% of 25 s, so does a terms-only one
    assert s.affordable() == (True, True)
    s.train_seconds = 15.0  # 2.1 > 1.5 >= 1.2
    assert s.affordable() == (False, True)
    # the ranks agree through the slowest rank's numbers: a larger spend elsewhere decides
    assert s.affordable(lambda t: t + torch.tensor([10.0, 10.0, 0.0], dtype=torch.float64)) == (False, False)


def test_the_default_terms_tier_has_a_budget_of_its_own():
    s = Schedule()
    assert (s.terms_every_n_train_steps, s.terms_overhead) == (DEFAULT_TERMS_EVERY, DEFAULT_TERMS_OVERHEAD)
    assert [s.due(k) for k in (0, 5, 10, 200)] == [(True, True), (False, False), (False, True), (True, True)]
    s.update = lambda: None
    s.charge(0.5, terms_only=False)  # step 0's full evaluation
    s.charge(0.1, terms_only=True)
    assert (s.eval_seconds, s.terms_seconds) == (0.6, 0.1)
    # full: 0.5 + 0.5 <= 1% of 100 s; terms: 0.1 + 0.1 <= 4% of 100 s (the full seconds do not count against it)
    s.train_seconds = 100.0
    assert s.affordable() == (True, True)
    s.train_seconds = 4.5  # terms 0.2 > 0.18 and full 1.0 > 0.045: neither
    assert s.affordable() == (False, False)
    s.train_seconds = 6.0  # terms 0.2 <= 0.24; full still over its 1%
    assert s.affordable() == (False, True)
    assert "the terms-only budget=0.04" in s.budget_note(30, full_due=False)
    assert "max_overhead=0.01" in s.budget_note(200, full_due=True) and "(0.5 s)" in s.budget_note(200, True)
    # a fixed full schedule keeps the terms tier's own budget; no terms tier: no budget at all
    fixed = Schedule(every_n_train_steps=5, max_overhead=None)
    fixed.charge(1.0, terms_only=True)
    fixed.train_seconds, fixed.update = 10.0, lambda: None
    assert fixed.affordable() == (True, False)
    off = Schedule(every_n_train_steps=5, terms_every_n_train_steps=None, max_overhead=None)
    off.charge(1.0, terms_only=False)
    assert off.affordable() == (True, True) and off.due(10) == (True, False)


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
    s.charge(0.25, terms_only=True)
    s.last_step = 9
    t = Schedule(every_n_train_steps=3)
    t.load_state_dict(s.state_dict())
    assert (t.eval_seconds, t.last_step, t.runs, t.last_eval_seconds) == (0.75, 9, 2, 0.5)
    assert (t.terms_seconds, t.last_terms_seconds) == (0.25, 0.25)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every_n_train_steps": 0}, "Invalid every_n_train_steps=0. Must be an int >= 1."),
        ({"terms_every_n_train_steps": 1.5}, "Invalid terms_every_n_train_steps=1.5"),
        ({"terms_every_n_train_steps": "often"}, "Invalid terms_every_n_train_steps='often'. Must be an int >= 1"),
        ({"max_overhead": -1}, "Invalid max_overhead=-1. Must be a fraction > 0"),
        ({"max_overhead": "sometimes"}, "Invalid max_overhead='sometimes'"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        Schedule(**kwargs)
