"""GPU signal pads in host memory (``FICCO_SIGNAL_PADS=host``): each rank's pad is a /dev/shm
file (as on the CPU backend), every rank maps every pad and registers each mapping with the
GPU driver as mapped, portable host memory; stream memory operations use the device pointers
the driver gives for them.

Why: a barrier's watchdog must release a stream stuck in a wait whose peer never came. With
pads in device memory the release is a stream write (and the read for the error message a
device-to-host copy), which queues behind the stuck wait whenever the rescue stream shares the
stuck stream's hardware queue: always with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron's
sequence parallelism), by chance with 8 connections or ROCm's few hardware queues. Here the
watchdog reads and writes the slot with plain host loads and stores. It is also memory HIP
documents as coherent for polled flags.

Each pad ends with one more int32, the rank's *error word* for this group
(:mod:`.fault`): kernels read it, and peers raise it when they give up on the group.

``FICCO_SIGNAL_PADS=auto`` (the default) and ``host`` both put pads here, on CUDA and ROCm.
``device`` keeps them in device memory where the user asks (lower flag
latency; the watchdog then releases through a stream it never waits for) and is refused
where a stream rescue is certain to queue behind the stuck wait (one hardware queue).
"""
from __future__ import annotations

import mmap
import os
import uuid

import numpy as np

from .agree import exchange_or_fail
from .barrier import SIGNAL_CHANNELS

SHM_DIR = "/dev/shm"


def wanted(vendor_name: str) -> bool:
    """Whether this process puts its GPU signal pads in host memory (``FICCO_SIGNAL_PADS``):
    yes for ``auto`` and ``host``; ``device`` is refused with one hardware queue.

    >>> import os; os.environ["FICCO_SIGNAL_PADS"] = "auto"
    >>> wanted("cuda"), wanted("rocm")
    (True, True)
    >>> os.environ["FICCO_SIGNAL_PADS"] = "device"; wanted("cuda")
    False
    >>> os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"; wanted("cuda")
    Traceback (most recent call last):
    ficco.errors.ConfigError: FICCO_SIGNAL_PADS=device cannot be used with CUDA_DEVICE_MAX_...
    >>> del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"], os.environ["FICCO_SIGNAL_PADS"]
    """
    from .. import config
    from ..errors import ConfigError

    setting = config.get("FICCO_SIGNAL_PADS")
    if setting != "device":
        return True
    if config.hardware_queues(vendor_name) == 1:
        knob = {"cuda": "CUDA_DEVICE_MAX_CONNECTIONS"}.get(vendor_name, "GPU_MAX_HW_QUEUES")
        raise ConfigError(
            f"FICCO_SIGNAL_PADS=device cannot be used with {knob}=1: every stream then shares "
            f"one hardware queue, so the barrier watchdog could never release a stream stuck "
            f"on a dead peer (its rescue would queue behind the stuck wait). Use "
            f"FICCO_SIGNAL_PADS=auto (host-mapped pads)")
    return False


class HostPads:
    """Rank ``rank``'s view of the ``world`` host pads of one handle; ``device[p]`` is the
    device address of pad ``p``, ``arrays[p]`` its int32 host view (flat: ``count =
    SIGNAL_CHANNELS * world`` slots, then the error word at ``word_index``)."""

    def __init__(self, vendor, group, rank: int, world: int):
        self.vendor, self.rank, self.world = vendor, rank, world
        self.count = SIGNAL_CHANNELS * world
        self.word_index = self.count
        words = self.count + 1
        nbytes = max(mmap.PAGESIZE, words * 4)
        self._registered: list[int] = []
        self._fd = None
        where, failure = None, None
        try:
            name = os.path.join(SHM_DIR, f"ficco-pad-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(name)   # only descriptors keep it: nothing outlives the processes
            os.ftruncate(self._fd, nbytes)
            where = (os.getpid(), self._fd)
        except OSError as exc:
            failure = f"could not create its host signal pad: {exc}"
        wheres = exchange_or_fail(group, rank, world, where, failure, "create host signal pads",
                                  on_failure=self._close_fd)
        self.arrays, self.device, failure = [], [], None
        try:
            for peer, (pid, fd) in enumerate(wheres):
                path = f"/proc/self/fd/{fd}" if peer == rank else f"/proc/{pid}/fd/{fd}"
                handle = os.open(path, os.O_RDWR)
                try:
                    mapping = mmap.mmap(handle, nbytes, mmap.MAP_SHARED,
                                        mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(handle)
                array = np.frombuffer(mapping, dtype=np.int32, count=words)
                host = array.ctypes.data
                vendor.host_register(host, nbytes)
                self._registered.append(host)
                self.arrays.append(array)
                self.device.append(vendor.host_device_pointer(host))
        except Exception as exc:  # noqa: BLE001 - exchange_or_fail reports it everywhere
            failure = f"mapping the host pad of rank {peer}: {type(exc).__name__}: {exc}"
        exchange_or_fail(group, rank, world, True, failure, "map host signal pads",
                         on_failure=self.close)
        self._ends = [(base, base + words * 4, p) for p, base in enumerate(self.device)]

    def _locate(self, slot: int) -> tuple[np.ndarray, int]:
        for start, end, p in self._ends:
            if start <= slot < end:
                return self.arrays[p], (slot - start) // 4
        raise KeyError(f"{slot:#x} is no slot of these host pads")

    def read(self, slot: int) -> int:
        """The int32 at device address ``slot``, read by the host (no stream involved)."""
        array, index = self._locate(slot)
        return int(array[index])

    def write(self, slot: int, value: int) -> None:
        array, index = self._locate(slot)
        array[index] = value

    def _close_fd(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        for host in self._registered:
            try:
                self.vendor.host_unregister(host)
            except Exception:  # noqa: BLE001, S110 - teardown goes on; the mapping stays valid
                pass
        self._registered = []
        self._close_fd()
        # The mappings are dropped with the arrays (numpy keeps each mmap alive while used).
        self.arrays = []
