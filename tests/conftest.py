import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_terminal_summary(terminalreporter):
    """Print the largest relative error each test module saw against its reference (closed forms vs torch.func)."""
    from tests.utils import WORST

    if not WORST:
        return
    terminalreporter.section("largest relative error per test module (actual vs reference, Frobenius)")
    for (module, rtol), err in sorted(WORST.items()):
        terminalreporter.write_line(f"{module:32s} tolerance {rtol:.0e}: worst {err:.2e}")


@pytest.fixture(autouse=True, scope="session")
def _spread_limit_lifted():
    """Every debiased real-loss key gets its value, however uncertain (``closed_form.solver.debiasing.SPREAD_LIMIT``
    lifted for the whole session, module-scoped fixtures included), unless the test is marked ``spread_limit``: the
    tiny models and few samples of most tests give large spreads, and which keys a run withholds would change the key
    sets, warnings and counts those tests are about. The limit itself is tested by the marked tests
    (``test_sampled_curvature.py``, ``test_real_loss.py``); the 2-process scripts (``ddp_script.py``,
    ``fsdp_script.py``) run with it. Yields the shipped value."""
    from curvwatch.closed_form.solver import debiasing

    shipped = debiasing.SPREAD_LIMIT
    debiasing.SPREAD_LIMIT = float("inf")
    yield shipped
    debiasing.SPREAD_LIMIT = shipped


@pytest.fixture(autouse=True)
def _spread_limit_when_marked(request, monkeypatch, _spread_limit_lifted):
    """The shipped ``SPREAD_LIMIT`` in the tests marked ``spread_limit``."""
    if request.node.get_closest_marker("spread_limit") is not None:
        from curvwatch.closed_form.solver import debiasing

        monkeypatch.setattr(debiasing, "SPREAD_LIMIT", _spread_limit_lifted)
