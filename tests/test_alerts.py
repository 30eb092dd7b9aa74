"""What the monitor tells its user (curvwatch.alerts): the warning categories and the one-time notices."""

from __future__ import annotations

import warnings

import pytest

from curvwatch.alerts import CurvatureNotice, CurvatureWarning, Notices


def test_the_categories_are_siblings():
    assert issubclass(CurvatureWarning, UserWarning) and issubclass(CurvatureNotice, UserWarning)
    assert not issubclass(CurvatureNotice, CurvatureWarning) and not issubclass(CurvatureWarning, CurvatureNotice)


def test_a_notice_is_said_once_per_key_and_survives_a_checkpoint():
    notices = Notices()
    with pytest.warns(CurvatureNotice) as caught:
        notices.once("a", "first")
        notices.once("a", "second")
        notices.once("b", "third")
    assert [str(w.message) for w in caught] == ["first", "third"]
    assert not notices.mark("a") and notices.mark("c") and "c" in notices
    restored = Notices()
    restored.load_state_dict(notices.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored.once("a", "again")  # said before the checkpoint: silent
    assert restored.said == {"a", "b", "c"}
