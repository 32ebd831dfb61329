"""GPU tests: marker ``gpu``, skipped cleanly where neither the CUDA nor the ROCm backend can
run. The same command runs them on NVIDIA and AMD: ``python -m pytest tests/gpu -m gpu``."""
from __future__ import annotations

import pytest


def gpu_backend_name() -> str | None:
    """"cuda" or "rocm" when that backend can run here, else None."""
    from ficco.backends.cuda import CudaBackend
    from ficco.backends.rocm import RocmBackend

    for cls in (CudaBackend, RocmBackend):
        if cls.unavailable_reason() is None:
            return cls.name
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA or AMD GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if gpu_backend_name() is not None:
        return
    skip = pytest.mark.skip(reason="no usable GPU backend (CudaBackend and RocmBackend both "
                                   "report themselves unavailable)")
    for item in items:
        # The marker, not ``"gpu" in item.keywords``: keywords hold every parent node's name,
        # so a checkout in a folder named "gpu" had every test of the suite skipped.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
