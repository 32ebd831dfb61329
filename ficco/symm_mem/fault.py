"""One group's failure state on GPUs: its error slot and its error word.

An eager GPU call returns before its barriers ran. When the barrier watchdog has to release a
stuck barrier (a peer dead, stuck, late or in another call), the error must reach *that
group's* next call, and the outputs of every call of that group still queued must become NaN;
no other group may notice. So both belong to the group's workspace (its symmetric handle), not
to the backend:

- ``error``: the one exception the group's next call raises (the first reported wins);
- the *error word*: one int32 that kernels read (the fence ending each call, the gated GEMM's
  halt), raised by a host store **before** any barrier of the group is released, lowered in
  stream order once the host raised the error.

With host-mapped signal pads (the default) the word is one more int32 of this rank's own pad,
so peers reach it too: a rank that gives up on the group (its barrier expired) raises every
peer's word with the value ``gave_up(rank)``. A late peer then poisons whatever it computes
after that and its next call raises, instead of passing a barrier on flags the giver-up left
behind and pulling rows it has already overwritten with its next call's.
With device signal pads the words are host pads all the same (in private pinned memory
peers could not reach them, and a late peer would return data built from rows of the
giver-up's next call); only a pretend group inside one process keeps a private word.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from ..errors import CommTimeoutError, FiccoError

#: word values: 0 = fine, OWN = this rank's watchdog released a barrier, gave_up(p) = rank p did,
#: KERNEL = a gated GEMM of this rank gave up waiting for its data (the kernel raised it)
OWN = 1
KERNEL = -1


def gave_up(rank: int) -> int:
    """The word value a rank that gave up on the group writes into its peers' words.

    >>> gave_up(0), gave_up(5)
    (2, 7)
    """
    return 2 + rank


class GroupFault:
    """The error slot and error word of one rank's view of one group (see the module doc).

    ``word`` is a one-element int32 array this process reads and writes with host loads and
    stores; ``word_device`` the same memory as a tensor kernels read (a CUDA/HIP view of host
    memory); ``address`` its device address (for a stream-ordered lowering); ``peer_words``
    the other ranks' words (host pads only).

    >>> import numpy as np
    >>> f = GroupFault(0, np.zeros(1, np.int32), None, 0, [np.zeros(1, np.int32)])
    >>> f.failed(), f.report(CommTimeoutError("late")), f.failed(), int(f.word[0])
    (False, None, True, 1)
    >>> f.give_up(); int(f.peer_words[0][0])
    2
    >>> type(f.take()).__name__, f.take()
    ('CommTimeoutError', None)
    """

    def __init__(self, rank: int, word, word_device, address: int, peer_words=()):
        self.rank = rank
        self.word, self.word_device, self.address = word, word_device, address
        self.peer_words = list(peer_words)
        self.error: FiccoError | None = None
        self._lock = threading.Lock()
        #: gated GEMM launches still to report: (done event, check) where check() returns the
        #: launch's error or None (:mod:`ficco.kernels.launch`)
        self.gated: list = []
        #: what owns the word's memory where ``word`` is only a view of it (pinned host memory)
        self._keep: object = None

    def failed(self) -> bool:
        """Whether this group failed on this rank: an error is pending or the word is raised
        (by this rank's watchdog or by a peer that gave up). A host load, no stream."""
        return self.error is not None or int(self.word[0]) != 0

    def report(self, error: FiccoError) -> None:
        """Record ``error`` (the first one wins) and raise the word, before any release."""
        with self._lock:
            if self.error is None:
                self.error = error
        if int(self.word[0]) == 0:
            self.word[0] = OWN

    def give_up(self) -> None:
        """Raise every peer's word (host pads): whatever they compute from now on is NaN and
        their next call raises (a host store per peer, no stream)."""
        for word in self.peer_words:
            word[0] = gave_up(self.rank)

    def take(self) -> FiccoError | None:
        """The error this group's next call must raise now (None: nothing failed), consumed.
        A word raised by a peer without an error of this rank's becomes the error saying so.
        The caller lowers the word in stream order (after the fences already queued)."""
        with self._lock:
            error, self.error = self.error, None
        value = int(self.word[0])
        if error is None and value >= gave_up(0):
            peer = value - gave_up(0)
            error = CommTimeoutError(
                f"rank {self.rank}: rank {peer} gave up on this group (one of its barriers "
                f"passed FICCO_TIMEOUT, waiting for this rank or another); what this rank "
                f"computed since is NaN. Call ficco.shutdown() on every rank, then call again")
        elif error is None and value == KERNEL:
            error = CommTimeoutError(
                f"rank {self.rank}: a kernel of this group (a gated GEMM or the one-kernel "
                f"all-reduce) waited FICCO_TIMEOUT for a peer that never arrived and gave up; "
                f"its call's outputs are NaN. Call "
                f"ficco.shutdown() on every rank, then call again (raise FICCO_TIMEOUT if the "
                f"peer is only slow)")
        return error

    def kernel_gave_up(self) -> bool:
        """Whether a gated GEMM of this rank raised the word (and nothing else did first)."""
        return self.error is None and int(self.word[0]) == KERNEL

    def gated_error(self) -> FiccoError | None:
        """The error of the first finished gated GEMM launch of this group that gave up
        (None: none did); finished launches are forgotten."""
        done = [entry for entry in self.gated if entry[0].query()]
        self.gated = [entry for entry in self.gated if entry not in done]
        for _, check in done:
            error = check()
            if error is not None:
                return error
        return None

    def given_up_by(self) -> int | None:
        """The peer whose give-up raised this rank's word, if one did."""
        value = int(self.word[0])
        return value - gave_up(0) if value >= gave_up(0) else None

    def lower(self) -> None:
        """Lower the word from the host (no stream: nothing of this group is queued)."""
        self.word[0] = 0


def private_fault(rank: int, device: torch.device, view) -> GroupFault:
    """A fault whose word is private pinned host memory (device signal pads): ``view(address,
    nbytes, device)`` makes the kernels' tensor of it."""
    host = torch.zeros(1, dtype=torch.int32, pin_memory=device.type != "cpu")
    device_view = host if device.type == "cpu" else view(host.data_ptr(), 4, device).view(
        torch.int32)
    fault = GroupFault(rank, host.numpy(), device_view, host.data_ptr())
    fault._keep = host     # the numpy view does not own the pinned memory
    return fault


def host_pad_fault(rank: int, device: torch.device, pads: Any, view) -> GroupFault:
    """A fault whose word is the last int32 of each rank's host pad (:class:`HostPads`):
    peers reach this rank's word, and this rank theirs."""
    index = pads.word_index
    address = pads.device[rank] + 4 * index
    device_view = view(address, 4, device).view(torch.int32)
    words = [pads.arrays[p][index: index + 1] for p in range(pads.world)]
    return GroupFault(rank, words[rank], device_view, address,
                      [w for p, w in enumerate(words) if p != rank])
