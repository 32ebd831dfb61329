"""GPU symmetric handles over raw device memory: the data spans of every rank and their signal
pads, viewed as tensors, and slot addresses precomputed as plain ints (a barrier costs no
tensor indexing). Providers (:mod:`.ipc`, :mod:`.torch_symm`) make them; nothing here imports
a backend module, so ``backends.gpu`` → ``symm_mem`` is one-way.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ..errors import BackendCallError, FiccoError, InvalidArgumentError
from .barrier import SIGNAL_CHANNELS
from .fault import host_pad_fault, private_fault
from .handle import SymmHandle, aligned

#: host barrier channel used by close(); plans use channels 0 and 1
CLOSE_CHANNEL = SIGNAL_CHANNELS - 1
#: how long close() waits for peers before it leaks its allocation rather than free it early
CLOSE_TIMEOUT_S = 10.0


class _DeviceSpan:
    """A raw device range exposed through the CUDA Array Interface, which ``torch.as_tensor``
    wraps without copying (supported public path; no stream sync requested)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3,
                                         "strides": None, "stream": None}


def wrap_interface(address, nbytes, device):
    if device.type == "cpu":
        # Host memory (the CPU stand-in of a GPU in tests/fake_gpu.py): a view through a
        # ctypes array of the address, never a copy.
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address),
                                dtype=torch.uint8)
    return torch.as_tensor(_DeviceSpan(address, nbytes), device=device)


def wrap_storage(address, nbytes, device):
    storage = torch._C._construct_storage_from_data_pointer(address, device, nbytes)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def tensor_at(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` on ``device`` viewing memory this process did not get from
    torch (our own allocation or a peer's IPC mapping). The caller keeps the memory alive.

    Each way of wrapping is checked to be a *view*: torch builds that infer the device from a
    peer-mapped pointer make ``as_tensor(..., device=local)`` an implicit device-to-device
    copy, and flags written into a copy never reach the peer (every barrier would time out,
    pulls would read a stale snapshot)."""
    device = torch.device(device)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    seen = []
    for wrap in (wrap_interface, wrap_storage):
        try:
            t = wrap(address, nbytes, device)
        except (TypeError, RuntimeError, AttributeError) as exc:
            seen.append(f"{wrap.__name__}: {type(exc).__name__}: {exc}")
            continue
        if is_view_of(t, address, device):
            return t
        seen.append(f"{wrap.__name__}: made a copy at {t.data_ptr():#x} on {t.device}")
    raise BackendCallError(
        f"cannot view device memory {address:#x} (+{nbytes} bytes) on {device} without a copy "
        f"with this torch {torch.__version__}: {'; '.join(seen)}")


def device_identity(device, device_module) -> str:
    """What names ``device`` (of torch's ``device_module``, the backend's) the same in every
    process that uses it, however CUDA_VISIBLE_DEVICES numbers it: its UUID, else its name and
    PCI location."""
    props = device_module.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid
    pci = ":".join(str(getattr(props, f"pci_{part}_id", "?")) for part in ("domain", "bus",
                                                                           "device"))
    index = device if isinstance(device, int) else torch.device(device).index
    return f"{props.name}@{pci}/{index}"


def sharers(placements: list, rank: int) -> int:
    """How many ranks of a group are on this rank's device (``placements``: every rank's
    (host, :func:`device_identity`)).

    >>> sharers([("a", "g0"), ("a", "g0"), ("a", "g1"), ("b", "g0")], 0)
    2
    """
    return sum(1 for place in placements if place == placements[rank])


def is_view_of(t: torch.Tensor, address: int, device: torch.device) -> bool:
    """True when ``t`` starts at ``address`` on exactly ``device`` (index included)."""
    index = device.index if device.index is not None else t.device.index
    return t.data_ptr() == address and t.device.type == device.type and t.device.index == index


class GpuSymmHandle(SymmHandle):
    """One symmetric allocation: per rank a uint8 data span of ``nbytes`` (``spans[p]``) and an
    int32 ``(SIGNAL_CHANNELS, world)`` signal pad (``pads[p]``, separate signal memory or
    carved from the same allocation, as the provider chose)."""

    def __init__(self, backend, rank: int, world: int, nbytes: int, spans: list[torch.Tensor],
                 pads: list[torch.Tensor], release: Callable[[bool], None], host_pads=None,
                 words=None):
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self._init_signals(backend)
        self._spans, self._pads = spans, pads
        self._release = release
        #: :class:`~ficco.symm_mem.host_pads.HostPads` when the pads live in host memory (then
        #: ``pads`` are host tensors and slots are the driver's device pointers to them)
        self.host_pads = host_pads
        self._pad_base = list(host_pads.device) if host_pads is not None else \
            [int(p.data_ptr()) for p in pads]
        #: this group's error slot and error word on this rank (:mod:`.fault`). The words
        #: live in host pads every rank maps (``words``: device signal pads get them too),
        #: so a rank that gives up reaches its peers' words; only a pretend
        #: group of one process (:func:`single_gpu_group`) keeps a private word.
        words = words if words is not None else host_pads
        self.fault = host_pad_fault(rank, backend.device(), words, tensor_at) \
            if words is not None else private_fault(rank, backend.device(), tensor_at)
        self._closed = False
        #: set when a barrier on this handle was captured into a graph (the runtime must keep
        #: the memory alive as long as such a graph may replay)
        self.captured = False
        #: every "peer" is memory of this process (:func:`single_gpu_group`): no close barrier
        self.local_peers = False
        #: ranks of this group on this rank's GPU (the provider sets it)
        self.device_sharers = 1

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

    def view_problems(self) -> list[str]:
        """Each rank's data span and signal pad that is not a view of the memory barriers and
        pulls use (a copy would swallow flags and serve stale pulls); [] when all are. Data
        spans and device pads live on this rank's GPU; host pads (the default) are host
        tensors over the mappings whose device pointers the slots hold (checked as GPU tensors at the slot address, every
        host pad would read as a copy)."""
        device, problems = self.backend.device(), []
        for p in range(self.world):
            span = self._spans[p]
            if not is_view_of(span, span.data_ptr(), device):
                problems.append(f"rank {p}'s data span is on {span.device}, not {device}")
            pad = self._pads[p]
            if self.host_pads is not None:
                host = self.host_pads.arrays[p].ctypes.data
                if not is_view_of(pad, host, pad.device) or pad.device.type != "cpu":
                    problems.append(f"rank {p}'s host pad is not a view of its mapping")
                if self.host_pads.device[p] != self.slot(p, 0, 0):
                    problems.append(f"rank {p}'s slots are not its host pad's device pointer")
            elif not is_view_of(pad, self.slot(p, 0, 0), device):
                problems.append(f"rank {p}'s device pad is a copy at {pad.data_ptr():#x} on "
                                f"{pad.device}, not a view of {self.slot(p, 0, 0):#x}")
        return problems

    def slot(self, owner, channel, writer):
        return self._pad_base[owner] + (channel * self.world + writer) * 4

    def close(self):
        """Drain this rank's work, wait until every peer drained theirs (host barrier), then
        release: imports are closed first and this rank's own export is freed only after
        every peer closed its imports of it (the provider's release does that second step)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.backend.device_module().synchronize(self.backend.device())
            if self.world > 1 and not self.local_peers:
                self.barrier(CLOSE_CHANNEL, CLOSE_TIMEOUT_S)
            peers_done = True
        except FiccoError:
            # A peer is gone or stuck: freeing now could corrupt its reads. Close our imports
            # but leak our export until exit, when the driver reclaims everything.
            peers_done = False
        self._spans = self._pads = []
        self._programs = {}
        self._release(peers_done)


def pad_bytes(world: int) -> int:
    return aligned(SIGNAL_CHANNELS * world * 4)


def single_gpu_group(backend, world: int, nbytes: int, pad_value: int = 0) -> GpuSymmHandle:
    """Rank 0 of a pretend ``world``-rank group on this one GPU, for tests and enqueue
    measurements: every "peer" is another allocation of this process, pads are filled with
    ``pad_value`` (``1 << 30`` makes every barrier pass). ``close()`` frees it all."""
    dev, vendor = backend.device(), backend.vendor
    data = [vendor.malloc(aligned(nbytes)) for _ in range(world)]
    pads = [vendor.malloc_signal(pad_bytes(world)) for _ in range(world)]
    spans = [tensor_at(a, aligned(nbytes), dev) for a in data]
    pad_views = [tensor_at(a, pad_bytes(world), dev)[: SIGNAL_CHANNELS * world * 4]
                 .view(torch.int32).view(SIGNAL_CHANNELS, world) for a in pads]
    for pad in pad_views:
        pad.fill_(pad_value)
    backend.device_module().synchronize(dev)

    def release(peers_done=True):
        for a in data:
            vendor.free(a)
        for a in pads:
            vendor.free_signal(a)

    handle = GpuSymmHandle(backend, 0, world, nbytes, spans, pad_views, release)
    handle.local_peers = True
    return handle
