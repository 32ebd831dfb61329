"""Symmetric memory for GPU ranks: raw device allocations viewed as tensors, a handle whose
signal pads back the stream-ordered barriers, and the providers: our own over IPC handles
(any number of processes per GPU, how the GPU tests run) and torch's ``_symmetric_memory``
(one rank per GPU). Vendor calls come through the backend's :class:`~ficco.backends.gpu.Vendor`.
"""
from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from .. import config
from ..errors import FiccoError, InvalidArgumentError
from ..symm_mem import SIGNAL_CHANNELS, Provider, SymmHandle, aligned

if TYPE_CHECKING:
    from .gpu import GpuBackend

#: channels of the plans' stream-ordered barriers (constant flags, safe to capture in graphs)
PLAN_CHANNELS = (0, 1)
#: barrier channel used by SymmHandle.close(); plans use the low channels
CLOSE_CHANNEL = SIGNAL_CHANNELS - 1
#: how long close() waits for peers before it leaks its allocation rather than free it early
CLOSE_TIMEOUT_S = 10.0


# -- raw device memory as tensors ----------------------------------------------------------------
class _DeviceSpan:
    """A raw device range exposed through the CUDA Array Interface, which ``torch.as_tensor``
    wraps without copying (supported public path; no stream sync requested)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3,
                                         "strides": None, "stream": None}


def tensor_at(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` on ``device`` viewing memory this process did not get from
    torch (our own allocation or a peer's IPC mapping). The caller keeps the memory alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    try:
        return torch.as_tensor(_DeviceSpan(address, nbytes), device=device)
    except (TypeError, RuntimeError):
        # Builds without CUDA-Array-Interface import (seen on some ROCm wheels): wrap the
        # pointer in a storage directly.
        storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
        return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


# -- symmetric memory ----------------------------------------------------------------------------
def _group_of(group):
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


class GpuSymmHandle(SymmHandle):
    """One symmetric allocation: per rank a uint8 span of ``nbytes`` data followed by the int32
    ``(SIGNAL_CHANNELS, world)`` signal pad. ``spans[p]`` views rank p's whole allocation."""

    def __init__(self, backend: "GpuBackend", rank: int, world: int, nbytes: int,
                 spans: list[torch.Tensor], release: Callable[[], None]):
        self.backend, self.rank, self.world, self.nbytes = backend, rank, world, nbytes
        self._spans = spans
        self._release = release
        start, count = aligned(nbytes), SIGNAL_CHANNELS * world * 4
        self._pads = [s[start:start + count].view(torch.int32).view(SIGNAL_CHANNELS, world)
                      for s in spans]
        self._generation = [0] * SIGNAL_CHANNELS
        self._closed = False

    def get_buffer(self, rank, shape, dtype, offset=0):
        numel = self._check_fits(shape, dtype, offset)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise InvalidArgumentError(f"get_buffer offset {offset} is not a multiple of the "
                                       f"{dtype} item size {itemsize}")
        raw = self._spans[rank][offset: offset + numel * itemsize]
        return raw.view(dtype).view(tuple(shape))

    def signal_pad(self, rank):
        return self._pads[rank]

    def slot_address(self, owner: int, channel: int, writer: int) -> int:
        """Device address of ``owner``'s pad slot ``[channel, writer]``."""
        return self._pads[owner][channel, writer].data_ptr()

    def next_generation(self, channel: int) -> int:
        if not 0 <= channel < SIGNAL_CHANNELS:
            raise InvalidArgumentError(f"barrier channel {channel} is outside [0, "
                                       f"{SIGNAL_CHANNELS})")
        self._generation[channel] += 1
        return self._generation[channel]

    def barrier(self, channel=2, timeout_s=None, step=None, *, timeout=None):
        timeout_s = timeout if timeout is not None else timeout_s
        if channel in PLAN_CHANNELS:
            raise InvalidArgumentError(
                f"barrier channels {PLAN_CHANNELS} belong to ficco's plans (flag scheme); use a "
                f"channel in [2, {SIGNAL_CHANNELS - 1}) for host barriers")
        timeout_s = config.timeout_s() if timeout_s is None else timeout_s
        self.backend.host_barrier(self, channel, timeout_s, -1 if step is None else step)

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            # Peers may still be reading this rank's memory: drain our own work, then wait
            # until every peer drained theirs before anything is unmapped or freed.
            torch.cuda.synchronize(self.backend.device())
            if self.world > 1:
                self.backend.host_barrier(self, CLOSE_CHANNEL, CLOSE_TIMEOUT_S, -1)
        except FiccoError:
            # A peer is gone or stuck: freeing now could corrupt its reads. Leak until exit,
            # when the driver reclaims everything.
            self._spans = self._pads = []
            return
        self._spans = self._pads = []
        self._release()


def pad_bytes(world: int) -> int:
    return aligned(SIGNAL_CHANNELS * world * 4)


class IpcSymmProvider(Provider):
    """Symmetric memory over IPC handles: each rank allocates ``nbytes`` + its signal pad with
    the vendor allocator, the handles travel through ``all_gather_object``, every rank maps
    every peer. Works for any number of processes per GPU (how the GPU tests run)."""

    def __init__(self, backend: "GpuBackend"):
        self.backend = backend

    def allocate(self, nbytes, group, device):
        group = _group_of(group)
        rank = dist.get_rank(group) if group is not None else 0
        world = dist.get_world_size(group) if group is not None else 1
        vendor = self.backend.vendor
        total = aligned(nbytes) + pad_bytes(world)
        local = vendor.malloc(total)
        spans: list[torch.Tensor] = []
        opened: list[int] = []

        def release():
            for address in opened:
                vendor.ipc_close(address)
            vendor.free(local)

        try:
            local_span = tensor_at(local, total, device)
            local_span[aligned(nbytes):].zero_()
            torch.cuda.synchronize(device)  # pads are zero before any peer can write them
            where = (socket.gethostname(), vendor.ipc_export(local))
            everyone = [where]
            if world > 1:
                everyone = [None] * world
                dist.all_gather_object(everyone, where, group=group)
            hosts = {host for host, _ in everyone}
            if len(hosts) > 1:
                raise InvalidArgumentError(
                    f"symmetric memory over IPC needs every rank on one host; the group spans "
                    f"{sorted(hosts)}. Set FICCO_TRANSPORT=ccl for multi-host groups")
            for peer, (_, handle) in enumerate(everyone):
                if peer == rank:
                    spans.append(local_span)
                    continue
                address = vendor.ipc_open(handle)
                opened.append(address)
                spans.append(tensor_at(address, total, device))
        except BaseException:
            release()
            raise
        if world > 1:
            dist.barrier(group=group)  # every rank mapped every peer before anyone signals
        return GpuSymmHandle(self.backend, rank, world, nbytes, spans, release)


class TorchSymmProvider(Provider):
    """torch's ``_symmetric_memory`` (one rank per GPU, CUDA; ROCm where torch supports it).
    The signal pad is carved out of the same allocation so barriers work as with IPC."""

    def __init__(self, backend: "GpuBackend"):
        self.backend = backend

    def allocate(self, nbytes, group, device):
        from torch.distributed import _symmetric_memory as torch_symm

        group = _group_of(group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        total = aligned(nbytes) + pad_bytes(world)
        local = torch_symm.empty(total, dtype=torch.uint8, device=device)
        local[aligned(nbytes):].zero_()
        torch.cuda.synchronize(device)
        handle = torch_symm.rendezvous(local, group)
        spans = [local if p == rank else handle.get_buffer(p, (total,), torch.uint8)
                 for p in range(world)]
        dist.barrier(group=group)
        keep = [local, handle]  # torch frees the allocation once these are dropped
        return GpuSymmHandle(self.backend, rank, world, nbytes, spans, release=keep.clear)


class AutoSymmProvider(Provider):
    """Which symmetric memory a GPU group gets, by ``FICCO_SYMM``:

    - ``ipc`` (default): our provider over IPC handles. It is the one verified on hardware
      (several ranks sharing an H100), and CUDA IPC with lazy peer access is the standard way
      for one-rank-per-GPU processes of a node too.
    - ``auto``: torch's ``_symmetric_memory`` when every rank has its own GPU on one host
      (its intended setting), IPC otherwise. Not yet run on a multi-GPU node, hence opt-in.
    - ``torch``: torch's provider always (fails where torch cannot serve the group).
    """

    def __init__(self, backend: "GpuBackend"):
        self.ipc = IpcSymmProvider(backend)
        self.torch = TorchSymmProvider(backend)

    def allocate(self, nbytes, group, device):
        group = _group_of(group)
        world = dist.get_world_size(group) if group is not None else 1
        choice = config.get("FICCO_SYMM")
        if choice == "torch":
            return self.torch.allocate(nbytes, group, device)
        if choice == "ipc" or world == 1 or not _torch_symm_usable():
            return self.ipc.allocate(nbytes, group, device)
        props = torch.cuda.get_device_properties(device)
        placement = (socket.gethostname(), str(getattr(props, "uuid", "")) or props.name +
                     str(getattr(props, "pci_bus_id", device.index)))
        everyone = [None] * world
        dist.all_gather_object(everyone, placement, group=group)
        if len(set(everyone)) == world and len({host for host, _ in everyone}) == 1:
            return self.torch.allocate(nbytes, group, device)
        return self.ipc.allocate(nbytes, group, device)


def _torch_symm_usable() -> bool:
    try:
        from torch.distributed import _symmetric_memory as torch_symm
    except ImportError:
        return False
    return hasattr(torch_symm, "empty") and hasattr(torch_symm, "rendezvous")
