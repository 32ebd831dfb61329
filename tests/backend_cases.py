"""Rank-side cases of a device backend that is one folder (tests/device_backends/fakexpu):
found by its package name, its GPU code reaching torch through ``torch.xpu`` (the fake
device's streams and events), its symmetric memory registered for its device type."""
from __future__ import annotations

import os
from pathlib import Path

import torch

FOLDER = str(Path(__file__).resolve().parent / "device_backends")
#: what GpuBackend would call on torch.cuda if it still named it
_CUDA_NAMES = ("Stream", "Event", "current_stream", "stream", "synchronize", "set_device",
               "current_device", "is_current_stream_capturing", "get_device_properties")


class _NotCuda:
    """Stands in for every torch.cuda function while the fake device backend runs: the
    backend must reach its device through torch.xpu only."""

    def __init__(self, name):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"torch.cuda.{self.name} called by a backend of device type xpu")


def rank_fake_device_backend(rank, world, schedule, seed):
    import ficco
    from ficco import api, backends
    from tests import fake_gpu

    if FOLDER not in backends.__path__:
        backends.__path__.append(FOLDER)
        backends.refresh()
    found = backends.names()
    saved = {name: getattr(torch.cuda, name) for name in _CUDA_NAMES}
    os.environ["FICCO_PROFILE"] = "h100"     # a device without a built-in profile
    try:
        fake_gpu.install("fakexpu", 8, device_type="xpu")
        for name in _CUDA_NAMES:
            setattr(torch.cuda, name, _NotCuda(name))
        backend = backends.get_backend()
        gen = torch.Generator().manual_seed(seed)
        k, n, m = 24, 20, 7
        shards = [torch.randn(m, k, generator=gen) for _ in range(world)]
        b = torch.randn(k, n, generator=gen)
        with ficco.config.scope(transport="dma"):
            outs = [ficco.all_gather_matmul(shards[rank], b, schedule=schedule)
                    for _ in range(2)]   # the first call and a warm one
        fake_gpu.device().synchronize()
        ran = api.last_run()
        provider, _ = ficco.symm_mem.provider_for("xpu")
        reference = torch.cat(shards).double() @ b.double()
        errors = [float((out.double() - reference).abs().max()) for out in outs]
        return {"names": found, "backend": type(backend).__name__, "name": backend.name,
                "device_type": backend.device_type, "ran": ran, "errors": errors,
                "provider": provider is backend.symm_provider(),
                "xpu_patched": torch.xpu.Stream is fake_gpu.FakeStream}
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        fake_gpu.uninstall()
        os.environ.pop("FICCO_PROFILE", None)
        ficco.shutdown()
