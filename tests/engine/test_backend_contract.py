"""The backend contract: a device backend is one folder of ``ficco/backends`` (a package
whose Backend subclass has the package's name), found by that name, its priority its
class's, its GPU code reaching torch through ``torch.get_device_module(device_type)``, and its
symmetric-memory provider registered for its device type."""
from __future__ import annotations

import pytest
import torch

from ficco import backends
from ficco.backends.cpu import CpuBackend
from ficco.backends.cuda import CudaBackend
from ficco.backends.rocm import RocmBackend
from ficco.errors import BackendUnavailableError

from .. import backend_cases, harness


def test_backends_are_found_by_package_name_in_priority_order():
    assert backends.names() == ("cpu", "cuda", "rocm")
    assert [backends.backend_class(n) for n in backends.names()] == \
        [CpuBackend, CudaBackend, RocmBackend]
    assert backends.by_priority() == ["rocm", "cuda", "cpu"]       # each class's priority
    assert {c.device_type for c in (CudaBackend, RocmBackend)} == {"cuda"}
    assert CpuBackend.device_type == "cpu"
    with pytest.raises(BackendUnavailableError, match="valid backends: cpu, cuda, rocm"):
        backends.backend_class("gpu")       # shared code, not a backend


def test_the_fp8_forms_are_the_backends():
    assert CpuBackend().fp8_forms() == (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("schedule", ["uniform-fused-1d", "ring"])
def test_a_device_backend_in_one_folder_is_found_and_runs_exactly(schedule):
    """A backend package outside ficco/ (tests/device_backends/fakexpu, on the fake device
    behind ``torch.xpu``): FICCO_BACKEND names it, every torch.cuda function raises while it
    runs, and a dma all-gather + matmul at W=2 (first call and warm call) matches float64."""
    results = harness.run_alone(2, backend_cases.rank_fake_device_backend, schedule, 31,
                                timeout_s=240)
    for r in results:
        assert "fakexpu" in r["names"] and r["backend"] == "FakexpuBackend", r
        assert (r["name"], r["device_type"]) == ("fakexpu", "xpu"), r
        assert r["ran"] == (schedule, "dma") and r["provider"] and r["xpu_patched"], r
        assert max(r["errors"]) < 1e-4, r
