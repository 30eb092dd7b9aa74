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
