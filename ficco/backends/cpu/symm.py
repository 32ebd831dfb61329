"""Symmetric memory for CPU ranks on one host: one shared-memory file per rank.

Each rank creates its file in /dev/shm, maps it, and unlinks it at once, keeping only the open
descriptor; peers map it through ``/proc/<pid>/fd/<fd>``. So no file outlives the call that
made it, whether the rank exits, raises or is killed. A file is laid out as
``[signal pad: SIGNAL_CHANNELS x world int32][data: nbytes]``.
"""
from __future__ import annotations

import mmap
import os
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from ...errors import CommTimeoutError, FiccoError
from ...symm_mem import SIGNAL_CHANNELS, Provider, SymmHandle, aligned

SHM_DIR = "/dev/shm"


def _map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class CpuSymmHandle(SymmHandle):
    def __init__(self, nbytes: int, group, abort=None):
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.nbytes = nbytes
        self._abort = abort
        self._pad_bytes = aligned(SIGNAL_CHANNELS * self.world * 4)
        total = self._pad_bytes + nbytes
        name = os.path.join(SHM_DIR, f"ficco-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self._fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(name)  # from here on only descriptors keep it alive: nothing can leak
        os.ftruncate(self._fd, total)
        where = (os.getpid(), self._fd)
        if self.world > 1:
            wheres = [None] * self.world
            dist.all_gather_object(wheres, where, group=group)
        else:
            wheres = [where]
        self._maps: list[mmap.mmap] = []
        try:
            for peer, (pid, fd) in enumerate(wheres):
                path = f"/proc/self/fd/{fd}" if peer == self.rank else f"/proc/{pid}/fd/{fd}"
                self._maps.append(_map(path, total))
        except OSError as exc:
            self.close()
            raise FiccoError(
                f"rank {self.rank} could not map the shared memory of rank {peer} "
                f"(pid {pid}): {exc}. CPU symmetric memory needs all ranks on one host under "
                f"one user; use FICCO_TRANSPORT=ccl otherwise") from None
        if self.world > 1:
            dist.barrier(group=group)  # every rank mapped every file before anyone writes
        self._pads_np = [np.frombuffer(m, dtype=np.int32, count=SIGNAL_CHANNELS * self.world)
                         .reshape(SIGNAL_CHANNELS, self.world) for m in self._maps]
        self._data = [torch.frombuffer(m, dtype=torch.uint8, offset=self._pad_bytes, count=nbytes)
                      if nbytes else torch.empty(0, dtype=torch.uint8) for m in self._maps]
        self._generation = [0] * SIGNAL_CHANNELS

    def get_buffer(self, rank, shape, dtype, offset=0):
        numel = self._check_fits(shape, dtype, offset)
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = self._data[rank][offset: offset + numel * itemsize]
        return raw.view(dtype).view(tuple(shape))

    def signal_pad(self, rank):
        return torch.from_numpy(self._pads_np[rank])

    def barrier(self, channel=2, timeout_s=None, step=None, *, timeout=None):
        timeout_s = timeout if timeout is not None else timeout_s
        from ... import config

        timeout_s = config.timeout_s() if timeout_s is None else timeout_s
        generation = self._generation[channel] + 1
        self._generation[channel] = generation
        for pad in self._pads_np:
            pad[channel, self.rank] = generation
        mine = self._pads_np[self.rank][channel]
        deadline = time.monotonic() + timeout_s
        nap = 2e-5
        while (mine < generation).any():
            if self._abort is not None and self._abort.is_set():
                raise FiccoError(f"rank {self.rank}: barrier {channel} abandoned, another queue failed")
            if time.monotonic() > deadline:
                late = [p for p in range(self.world) if mine[p] < generation]
                where = f" at step {step}" if step is not None else ""
                raise CommTimeoutError(
                    f"rank {self.rank}{where}: barrier channel {channel} (generation "
                    f"{generation}) waited {timeout_s:.1f}s for rank(s) {late}; they are dead, "
                    f"stuck, or called with other arguments. Raise FICCO_TIMEOUT if they are "
                    f"only slow")
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def close(self):
        self._data = []
        self._pads_np = []
        for m in getattr(self, "_maps", []):
            try:
                m.close()
            except BufferError:
                pass  # a tensor view still exists; the mapping goes when it does
        self._maps = []
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None


class CpuSymmProvider(Provider):
    def __init__(self, abort=None):
        self._abort = abort

    def allocate(self, nbytes, group, device):
        return CpuSymmHandle(nbytes, group, self._abort)
