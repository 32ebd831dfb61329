import os
import tempfile

import pytest

from . import harness
from .timeout_fallback import pytest_addoption, pytest_runtest_call  # noqa: F401 - hooks

os.environ.setdefault("FICCO_TIMEOUT", "20")
# a calibrated profile in the user's cache (characterize --quick) must not change what the
# tests' selectors decide: the suite gets a cache of its own (the rank pool inherits it)
os.environ.setdefault("FICCO_CACHE_DIR", tempfile.mkdtemp(prefix="ficco-tests-cache-"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm device (skipped without one)")


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    harness.close_all()
