"""The Trainer-free record of a run (curvwatch.logbook): entries, commit, rewind, skips and checkpoints."""

import math

import pytest

from curvwatch.engine import NONFINITE, BlockError, Evaluation
from curvwatch.logbook import HEADLINES, Logbook, LogError, flatten
from curvwatch.rules import RuleSet

BLOCKS = {"layer0/attn": ("attention", 0, None), "layer0/ln_1": ("layernorm", 0, 1e-5)}


def _flat(qq: float, var_min: float = 1.0) -> dict[tuple[str, str], float]:
    return {
        ("layer0/attn", "hessian/QQ/h0"): qq,
        ("layer0/attn", "hessian/VV/h0"): 2.0,
        ("layer0/ln_1", "ln/var_min"): var_min,
        ("layer0/ln_1", "ln/var_min_over_eps"): var_min / 1e-5,
    }


def test_record_does_not_count_until_commit():
    book = Logbook("curv/", 1e-2)
    entry = book.record(3, _flat(5.0), Evaluation(), BLOCKS, 0.25, 0.01, terms_only=False)
    assert book.evaluations == 0 and book.last_norms == {} and book.peak == {}
    assert entry.values["curv/layer0/attn/hessian/QQ/h0"] == 5.0
    assert entry.values["curv/layer0/attn/hessian/max"] == 5.0
    assert entry.logged["curv/summary/max_hessian"] == 5.0 and entry.logged["curv_hessian/layer0/attn"] == 5.0
    assert entry.logged["curv/summary/evaluations"] == 1.0 and entry.logged["curv/summary/eval_time_s"] == 0.25
    assert "curv/layer0/attn/hessian/max" not in entry.logged  # log_level="summary" (default)
    assert [row["hessian_max"] for row in entry.table] == [5.0, None]
    assert entry.norms == {"layer0/attn": 5.0} and entry.step == 3
    book.commit(entry)
    assert book.evaluations == 1 and book.peak == {"value": 5.0, "block": "layer0/attn", "step": 3}
    assert book.headlines()["summary/max_hessian"] == 5.0 and set(book.headlines()) <= set(HEADLINES)


def test_terms_only_entries_keep_the_last_full_norms():
    book = Logbook("", 1e-2, count_terms=True)
    book.commit(book.record(0, _flat(5.0), Evaluation(), BLOCKS, 0.1, 0.0, terms_only=False))
    entry = book.record(1, {("layer0/ln_1", "ln/var_min"): 0.5}, Evaluation(), BLOCKS, 0.1, 0.0, terms_only=True)
    assert "summary/terms_eval_time_s" in entry.summary and entry.summary["summary/terms_evaluations"] == 1.0
    book.commit(entry)
    assert (book.evaluations, book.terms_evaluations) == (1, 1)
    assert book.last_norms == {"layer0/attn": 5.0} and book.last_summary["summary/max_hessian"] == 5.0


def test_rule_states_rewind_a_failed_entry():
    book = Logbook("", 1e-2, rules=RuleSet(collapse_patience=1))
    book.commit(book.record(0, _flat(1.0), Evaluation(), BLOCKS, 0.0, 0.0, False))
    saved = book.rule_states()
    entry = book.record(1, _flat(1.0, var_min=1e-5), Evaluation(), BLOCKS, 0.0, 0.0, False)  # var_min/eps = 1
    assert [a.kind for a in entry.fired] == ["ln_collapse"] and book.fired == 1
    assert "layer0/ln_1" in entry.fired[0].message
    book.load_rule_states(saved)
    assert book.fired == 0 and book.history == [] and book.evaluations == 1


def test_nonfinite_blocks_are_flags_not_numbers():
    flat = flatten({"layer0/attn": {"hessian/QQ/h0": math.nan, "hessian/VV/h0": 1.0}, "layer0/ln_1": {"x": math.inf}})
    assert flat == {("layer0/ln_1", "x"): math.inf, ("layer0/attn", NONFINITE): 1.0}
    entry = Logbook("p/").record(0, flat, Evaluation(), BLOCKS, 0.0, 0.0, False)
    assert entry.values["p/layer0/attn/skipped_nonfinite"] == 1.0 and entry.summary["summary/nonfinite_blocks"] == 1
    assert not any(k.startswith("p/layer0/attn/hessian") for k in entry.values)
    assert entry.logged["p/summary/nonfinite_blocks"] == 1 and "p/layer0/attn/skipped_nonfinite" not in entry.logged
    blocks = Logbook("p/", log_level="blocks").record(0, flat, Evaluation(), BLOCKS, 0.0, 0.0, False)
    assert blocks.logged["p/layer0/attn/skipped_nonfinite"] == 1.0 and blocks.logged["p/layer0/ln_1/x"] == math.inf


@pytest.mark.parametrize(
    ("level", "logged"),
    [
        ("summary", {"curv_hessian/layer0/attn", "curv/summary/max_hessian"}),
        ("blocks", {"curv_hessian/layer0/attn", "curv/summary/max_hessian", "curv/layer0/attn/hessian/max",
                    "curv/layer0/ln_1/ln/var_min"}),
        ("all", {"curv_hessian/layer0/attn", "curv/summary/max_hessian", "curv/layer0/attn/hessian/max",
                 "curv/layer0/ln_1/ln/var_min", "curv/layer0/attn/hessian/QQ/h0"}),
    ],
)  # fmt: skip
def test_log_level_filters_what_reaches_the_loggers_not_what_is_computed(level, logged):
    book = Logbook("curv/", 1e-2, rules=RuleSet(), log_level=level)
    entry = book.record(0, _flat(5.0, var_min=1e-6), Evaluation(), BLOCKS, 0.0, 0.0, False)
    assert logged <= set(entry.logged) <= set(entry.values)
    everything = Logbook("curv/", 1e-2, log_level="all").record(0, _flat(5.0, 1e-6), Evaluation(), BLOCKS, 0, 0, False)
    assert entry.values == everything.values and entry.summary == everything.summary
    assert entry.norms == {"layer0/attn": 5.0} and entry.table == everything.table
    assert entry.summary["summary/ln/var_min_over_eps"] == pytest.approx(0.1)
    assert [a.kind for a in entry.fired] == ["ln_collapse"] or entry.fired == [] and book.rules is not None


@pytest.mark.parametrize(
    ("error", "what"),
    [
        (None, "an evaluation failed on another rank"),
        (BlockError("layer0/ffn", ValueError("bad")), "evaluating block 'layer0/ffn' raised ValueError: bad"),
        (LogError(OSError("disk full")), "summarizing or logging the numbers raised OSError: disk full"),
        (RuntimeError("x"), "RuntimeError: x"),
    ],
)
def test_skip_says_what_went_wrong(error, what):
    book = Logbook()
    assert book.skip(7, error) == what and book.skipped == 1 and book.errors == [f"step 7: {what}"]


def test_state_round_trip_and_bounded_errors():
    book = Logbook("", 1e-2, rules=RuleSet())
    book.commit(book.record(0, _flat(2.0), Evaluation(), BLOCKS, 0.0, 0.0, False))
    for step in range(30):
        book.skip(step, RuntimeError(str(step)))
    state = book.state_dict()
    assert len(state["errors"]) == 20 and state["errors"][-1] == "step 29: RuntimeError: 29"
    other = Logbook("", 1e-2, rules=RuleSet())
    other.load_state_dict(state)
    assert other.state_dict() == state
    old = Logbook()
    old.load_state_dict({"evaluations": 3})  # a checkpoint written before some keys existed
    assert (old.evaluations, old.skipped, old.peak) == (3, 0, {})
