"""torch's ``_symmetric_memory`` as a GPU provider, and the ``FICCO_SYMM`` choice between it and
ours (:mod:`.ipc`)."""
from __future__ import annotations

import socket

import torch

from .. import config
from ..group import rank_world, resolve
from .agree import exchange_or_fail
from .barrier import SIGNAL_CHANNELS
from .device import GpuSymmHandle, device_identity, pad_bytes, sharers
from .handle import Provider, aligned
from .host_pads import HostPads
from .host_pads import wanted as host_pads_wanted
from .ipc import IpcSymmProvider


class TorchSymmProvider(Provider):
    """torch's ``_symmetric_memory`` (one rank per GPU, CUDA; ROCm where torch supports it).
    Signal pads are host-mapped (:mod:`.host_pads`) as with IPC, or with
    ``FICCO_SIGNAL_PADS=device`` carved out of the same allocation."""

    def __init__(self, backend):
        self.backend = backend

    def allocate(self, nbytes, group, device):
        from torch.distributed import _symmetric_memory as torch_symm

        group = resolve(group)
        rank, world = rank_world(group)
        on_host = host_pads_wanted(self.backend.vendor.name)
        total = aligned(nbytes) + (0 if on_host else pad_bytes(world))
        local = handle = placement = None
        failure = None
        try:
            placement = (socket.gethostname(),
                         device_identity(device, self.backend.device_module()))
            local = torch_symm.empty(total, dtype=torch.uint8, device=device)
            if not on_host:
                local[aligned(nbytes):].zero_()
            self.backend.device_module().synchronize(device)  # pads zero before peers write
        except Exception as exc:  # noqa: BLE001 - exchange_or_fail reports it everywhere
            failure = f"{type(exc).__name__}: {exc}"
        # torch's rendezvous is a collective of its own, bounded only by the group's timeout:
        # every rank enters it only once every rank allocated (a bounded store exchange).
        placements = exchange_or_fail(group, rank, world, placement, failure,
                                      "allocate torch symmetric memory", nbytes=nbytes)
        keep = [local]  # torch frees the allocation once these are dropped
        whole = []
        try:
            handle = torch_symm.rendezvous(local, group)
            keep.append(handle)
            whole = [local if p == rank else handle.get_buffer(p, (total,), torch.uint8)
                     for p in range(world)]
        except Exception as exc:  # noqa: BLE001 - exchange_or_fail reports it everywhere
            failure = f"rendezvous: {type(exc).__name__}: {exc}"
        # Every rank mapped every peer before anyone signals (was a raw dist.barrier).
        exchange_or_fail(group, rank, world, True, failure, "map torch symmetric memory",
                         on_failure=keep.clear)
        spans = [w[: aligned(nbytes)] for w in whole]
        # Host pads: the signal slots, or with device pads the error words alone.
        try:
            host = HostPads(self.backend.vendor, group, rank, world)   # collective
        except BaseException:
            keep.clear()
            raise

        def release(peers_done=True):
            host.close()
            keep.clear()
        if on_host:
            pads = [torch.from_numpy(a[: host.count]).view(SIGNAL_CHANNELS, world)
                    for a in host.arrays]
            made = GpuSymmHandle(self.backend, rank, world, nbytes, spans, pads, release, host)
        else:
            pads = [w[aligned(nbytes): aligned(nbytes) + SIGNAL_CHANNELS * world * 4]
                    .view(torch.int32).view(SIGNAL_CHANNELS, world) for w in whole]
            made = GpuSymmHandle(self.backend, rank, world, nbytes, spans, pads, release,
                                 words=host)
        made.device_sharers = sharers([tuple(p) for p in placements], rank)
        return made


class AutoSymmProvider(Provider):
    """Which symmetric memory a GPU group gets, by ``FICCO_SYMM``:

    - ``ipc`` (default): our provider over IPC handles. It is the one verified on hardware
      (several ranks sharing an H100), and CUDA IPC with lazy peer access is the standard way
      for one-rank-per-GPU processes of a node too.
    - ``auto``: torch's ``_symmetric_memory`` when every rank has its own GPU on one host
      (its intended setting), IPC otherwise. Not yet run on a multi-GPU node, hence opt-in.
    - ``torch``: torch's provider always (fails where torch cannot serve the group).
    """

    def __init__(self, backend):
        self.backend = backend
        self.ipc = IpcSymmProvider(backend)
        self.torch = TorchSymmProvider(backend)

    def allocate(self, nbytes, group, device):
        group = resolve(group)
        rank, world = rank_world(group)
        choice = config.get("FICCO_SYMM")
        if choice == "torch":
            return self.torch.allocate(nbytes, group, device)
        if choice == "ipc" or world == 1 or not _torch_symm_usable():
            return self.ipc.allocate(nbytes, group, device)
        placement, failure = None, None
        try:
            placement = (socket.gethostname(),
                         device_identity(device, self.backend.device_module()))
        except Exception as exc:  # noqa: BLE001 - exchange_or_fail reports it everywhere
            failure = f"{type(exc).__name__}: {exc}"
        # Bounded by FICCO_TIMEOUT and naming absent ranks (was a raw all_gather_object).
        everyone = exchange_or_fail(group, rank, world, placement, failure,
                                    "choose a symmetric memory provider (FICCO_SYMM=auto)")
        if len(set(everyone)) == world and len({host for host, _ in everyone}) == 1:
            return self.torch.allocate(nbytes, group, device)
        return self.ipc.allocate(nbytes, group, device)


def _torch_symm_usable() -> bool:
    try:
        from torch.distributed import _symmetric_memory as torch_symm
    except ImportError:
        return False
    return hasattr(torch_symm, "empty") and hasattr(torch_symm, "rendezvous")
