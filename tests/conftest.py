import os

import pytest

from . import harness

os.environ.setdefault("FICCO_TIMEOUT", "20")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm device (skipped without one)")


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    harness.close_all()
