"""Symmetric memory for CPU ranks on one host: one shared-memory file per rank.

Each rank creates its file in /dev/shm, maps it, and unlinks it at once, keeping only the open
descriptor; peers map it through ``/proc/<pid>/fd/<fd>``. So no file outlives the call that
made it, whether the rank exits, raises or is killed. A file is laid out as
``[signal pad: SIGNAL_CHANNELS x world int32][data: nbytes]``.

A slot is ``(pad, index)``: the peer's pad as a flat int32 numpy array over the mapping and
the index of ``[channel, writer]`` in it. The CPU backend's ``signal_write`` /
``signal_wait`` store and poll it, so CPU ranks run the very barrier protocol GPUs run.

Mappings are never unmapped by :meth:`CpuSymmHandle.close`: every tensor and array viewing one
keeps its ``mmap`` object alive, so a tensor from ``ficco.symm_mem.empty`` stays readable
after ``ficco.shutdown()`` and a queue still holding a view can never touch unmapped memory.
The mapping goes when its last view does.
"""
from __future__ import annotations

import errno
import mmap
import os
import uuid

import numpy as np
import torch
import torch.distributed as dist

from .agree import exchange_or_fail
from .barrier import SIGNAL_CHANNELS
from .handle import Provider, SymmHandle, aligned

SHM_DIR = "/dev/shm"


def shm_free_bytes() -> int:
    """Bytes free in /dev/shm (for this user)."""
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def _room_failure(total: int, world: int) -> str | None:
    """Why /dev/shm cannot take ``world`` files of ``total`` bytes (the ranks of this host),
    or None. Checked by every rank before any rank takes space (then reserved up front,
    :func:`_reserve`): a tmpfs file only takes memory as its pages are first written, and a
    write that finds /dev/shm full kills the process with SIGBUS (a container's default
    64 MB /dev/shm is enough to hit it)."""
    free = shm_free_bytes()
    return None if world * total <= free else _no_room(free, total, world)


def _no_room(free: int, total: int, world: int) -> str:
    return (f"/dev/shm has {_mib(free)} free, and the dma workspace needs {_mib(total)} per "
            f"rank ({_mib(world * total)} for the {world} ranks of this host). Give /dev/shm "
            f"more room (docker run --shm-size=..., or mount -o remount,size=... /dev/shm) or "
            f"use FICCO_TRANSPORT=ccl, which needs no shared memory")


def _reserve(fd: int, total: int, world: int) -> str | None:
    """Take this rank's ``total`` bytes of /dev/shm now (its pages allocated, so no later
    write can find the space gone); why not, or None."""
    if total == 0:
        return None
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            return _no_room(shm_free_bytes(), total, world)
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):   # no fallocate: checked only
            return f"could not reserve {_mib(total)} of /dev/shm: {exc}"
    return None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def map_file(path: str, nbytes: int) -> mmap.mmap:
    """``nbytes`` of the shared file at ``path``, mapped read-write."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class CpuSymmHandle(SymmHandle):
    def __init__(self, backend, nbytes: int, group):
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self._init_signals(backend)
        self.nbytes = nbytes
        self._fd = None
        self._pad_bytes = aligned(SIGNAL_CHANNELS * self.world * 4)
        total = self._pad_bytes + nbytes
        where, failure = None, None
        try:
            name = os.path.join(SHM_DIR, f"ficco-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(name)  # from here on only descriptors keep it alive: nothing can leak
            os.ftruncate(self._fd, total)
            failure = _room_failure(total, self.world)
            where = (os.getpid(), self._fd)
        except OSError as exc:
            failure = f"could not create its /dev/shm file: {exc}"
        wheres = exchange_or_fail(group, self.rank, self.world, where, failure,
                                  "allocate CPU symmetric memory", on_failure=self.close,
                                  nbytes=nbytes)
        maps: list[mmap.mmap] = []
        # Every rank checked the room before any took it; now each takes its own, before it
        # maps anything (a peer's check may have raced with another job's use of /dev/shm).
        assert self._fd is not None   # (else the exchange above raised)
        failure = _reserve(self._fd, total, self.world)
        try:
            for peer, (pid, fd) in enumerate(() if failure else wheres):
                path = f"/proc/self/fd/{fd}" if peer == self.rank else f"/proc/{pid}/fd/{fd}"
                maps.append(map_file(path, total))
        except OSError as exc:
            failure = (f"could not map the shared memory of rank {peer} (pid {pid}): {exc}. CPU "
                       f"symmetric memory needs all ranks on one host under one user; use "
                       f"FICCO_TRANSPORT=ccl otherwise")
        # Every rank mapped every file before anyone writes; a failure raises on every rank.
        exchange_or_fail(group, self.rank, self.world, True, failure, "map CPU symmetric memory",
                         on_failure=self.close)
        self._pads = [np.frombuffer(m, dtype=np.int32, count=SIGNAL_CHANNELS * self.world)
                      for m in maps]
        self._data = [torch.frombuffer(m, dtype=torch.uint8, offset=self._pad_bytes, count=nbytes)
                      if nbytes else torch.empty(0, dtype=torch.uint8) for m in maps]

    def get_buffer(self, rank, shape, dtype, offset=0):
        numel = self._check_fits(shape, dtype, offset)
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = self._data[rank][offset: offset + numel * itemsize]
        return raw.view(dtype).view(tuple(shape))

    def signal_pad(self, rank):
        return torch.from_numpy(self._pads[rank].reshape(SIGNAL_CHANNELS, self.world))

    def slot(self, owner, channel, writer):
        return (self._pads[owner], channel * self.world + writer)

    def pad_address(self, owner):
        return int(self._pads[owner].ctypes.data)

    def close(self):
        # Drop references only (see the module docstring): views keep their mapping alive.
        self._data = []
        self._pads = []
        self._programs = {}
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class CpuSymmProvider(Provider):
    def __init__(self, backend):
        self.backend = backend

    def allocate(self, nbytes, group, device):
        return CpuSymmHandle(self.backend, nbytes, group)
