"""Our GPU symmetric memory over IPC handles: each rank allocates its data span and, separately,
its signal pad (``vendor.malloc_signal``: memory the vendor documents for polled flags), the
handles travel through ``all_gather_object``, every rank maps every peer. Works for any number
of processes per GPU (how the GPU tests run) and one process per GPU alike.

The pads are host-mapped memory (:mod:`.host_pads`) unless ``FICCO_SIGNAL_PADS=device``; the
groups' error words are in host pads either way.

Every local step ends in an exchange of (result, failure) (:func:`.agree.exchange_or_fail`), so
a rank that fails to allocate or map makes every rank raise instead of leaving them in a
collective.
Teardown closes this rank's imports first and frees its exports only after every peer said it
closed its imports too (the cudaIpc contract: an export must outlive the peers' imports).
"""
from __future__ import annotations

import socket
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..group import rank_world, resolve
from .agree import exchange_or_fail
from .barrier import SIGNAL_CHANNELS
from .device import GpuSymmHandle, device_identity, pad_bytes, sharers, tensor_at
from .handle import Provider, aligned
from .host_pads import HostPads
from .host_pads import wanted as host_pads_wanted


class IpcSymmProvider(Provider):
    """Symmetric memory over the vendor's IPC handles (see the module docstring)."""

    def __init__(self, backend):
        self.backend = backend

    def allocate(self, nbytes: int, group: Any, device: torch.device) -> GpuSymmHandle:
        group = resolve(group)
        rank, world = rank_world(group)
        vendor = self.backend.vendor
        device = torch.device(device)
        own: list[tuple[str, int]] = []       # ("data" | "pad", address) this rank allocated
        opened: list[int] = []

        def release(peers_done: bool = False):
            for address in opened:
                vendor.ipc_close(address)
            opened.clear()
            if world > 1 and not peers_done:
                return   # a peer may still hold an import of ours: leak until exit
            if world > 1:
                # Every peer closed its imports of our exports before anything is freed.
                try:
                    exchange_or_fail(group, rank, world, True, None, "release symmetric memory")
                except Exception:   # noqa: BLE001 - the group is gone: leak rather than free
                    return
            for kind, address in own:
                (vendor.free_signal if kind == "pad" else vendor.free)(address)
            own.clear()

        on_host = host_pads_wanted(vendor.name)
        where, failure = None, None
        try:
            data = vendor.malloc(aligned(nbytes))
            own.append(("data", data))
            data_span = tensor_at(data, aligned(nbytes), device)
            pad_handle = None
            if not on_host:
                pad = vendor.malloc_signal(pad_bytes(world))
                own.append(("pad", pad))
                pad_span = tensor_at(pad, pad_bytes(world), device)
                pad_span.zero_()
                pad_handle = vendor.ipc_export(pad)
            dm = self.backend.device_module()
            dm.synchronize(device)  # pads are zero before any peer can write them
            where = (socket.gethostname(), vendor.ipc_export(data), pad_handle, on_host,
                     device_identity(device, dm))
        except Exception as exc:  # noqa: BLE001 - exchange_or_fail reports it everywhere
            failure = f"{type(exc).__name__}: {exc}"
        everyone = exchange_or_fail(group, rank, world, where, failure,
                                    "allocate GPU symmetric memory",
                                    on_failure=lambda: release(True), nbytes=nbytes)
        hosts = sorted({host for host, *_ in everyone})
        pads_where = {("host" if h else "device") for _, _, _, h, _ in everyone}
        placements = [(host, gpu) for host, _, _, _, gpu in everyone]
        if len(pads_where) > 1:
            release(True)
            raise InvalidArgumentError(
                "ranks disagree on where GPU signal pads live (host on some, device on "
                "others): set FICCO_SIGNAL_PADS, or CUDA_DEVICE_MAX_CONNECTIONS (which "
                "FICCO_SIGNAL_PADS=auto follows), alike on every rank")
        if len(hosts) > 1:
            release(True)
            raise InvalidArgumentError(
                f"symmetric memory over IPC needs every rank on one host; the group spans "
                f"{hosts}. Set FICCO_TRANSPORT=ccl for multi-host groups")
        spans, pads, failure = [], [], None
        try:
            for peer, (_, data_handle, pad_handle, _, _) in enumerate(everyone):
                if peer == rank:
                    spans.append(data_span)
                    if not on_host:
                        pads.append(pad_span)
                    continue
                address = vendor.ipc_open(data_handle)
                opened.append(address)
                spans.append(tensor_at(address, aligned(nbytes), device))
                if not on_host:
                    address = vendor.ipc_open(pad_handle)
                    opened.append(address)
                    pads.append(tensor_at(address, pad_bytes(world), device))
        except Exception as exc:  # noqa: BLE001 - exchange_or_fail reports it everywhere
            failure = f"mapping rank {peer}: {type(exc).__name__}: {exc}"
        # Every rank mapped every peer before anyone signals; a failure raises everywhere.
        exchange_or_fail(group, rank, world, True, failure, "map GPU symmetric memory",
                         on_failure=lambda: release(True))
        # Host pads hold the signal slots (the default) or, with device pads, only the error
        # words, which peers must reach either way.
        try:
            host = HostPads(vendor, group, rank, world)   # collective: raises everywhere
        except BaseException:
            release(True)
            raise
        def release_all(peers_done: bool = False):
            host.close()
            release(peers_done)

        if on_host:
            pads = [torch.from_numpy(a[: host.count]).view(SIGNAL_CHANNELS, world)
                    for a in host.arrays]
            handle = GpuSymmHandle(self.backend, rank, world, nbytes, spans, pads, release_all,
                                   host)
        else:
            pads = [p[: SIGNAL_CHANNELS * world * 4].view(torch.int32)
                    .view(SIGNAL_CHANNELS, world) for p in pads]
            handle = GpuSymmHandle(self.backend, rank, world, nbytes, spans, pads, release_all,
                                   words=host)
        handle.device_sharers = sharers(placements, rank)
        return handle
