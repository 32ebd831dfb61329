"""A device backend written as one folder, as a new device's would be: a GPU torch exposes as
a device module (here ``torch.xpu``, whose streams and events the fake device of
tests/fake_gpu.py stands in for) with the vendor calls of the fake device. Put this folder's
parent on ``ficco.backends.__path__`` and ``FICCO_BACKEND=fakexpu`` finds it by its name;
its device has no built-in profile, so ``FICCO_PROFILE`` names one.
"""
from __future__ import annotations

from ficco.backends.gpu import GpuBackend
from tests import fake_gpu


class FakexpuBackend(fake_gpu.backend_class("cuda", base=GpuBackend)):
    """The fake device behind ``torch.xpu``: no line of ficco names it."""

    name = "fakexpu"
    device_type = "xpu"
    priority = -1          # never the automatic choice

    @classmethod
    def unavailable_reason(cls):
        return None if fake_gpu.installed() else "the fake device is not installed"

    def target(self):
        return "fakexpu:fake"


__all__ = ["FakexpuBackend"]
