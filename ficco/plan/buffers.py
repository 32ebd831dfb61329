"""The tensors one call's plan refers to (:class:`Buffers`): made by the op spec
(:mod:`ficco.ops`), read by the compiler when it binds a plan's views (:mod:`ficco.executor.compiler`)
and by the executor's host tasks (:mod:`ficco.executor`). It sits below all three, so none of
them imports another for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidArgumentError


@dataclass
class Buffers:
    """The tensors one call's plan refers to. ``a`` is the caller's A operand in canonical
    ``m x K`` form. All-gather: ``gathered`` is this rank's ``M x K`` buffer. Reduce-scatter
    and all-reduce: ``partials[j]`` this rank's ``M x n_j`` partial products (at byte
    ``partial_offsets[j]`` of the workspace with ``dma``) and ``recvs[j]`` the landing buffer
    of the peers' partials; all-reduce: ``reduced[j]`` (``M x n_j``, at ``reduced_offsets[j]``)
    the sums this rank reduced, which peers pull. ``symm`` is the symmetric handle whose
    buffers hold every peer's ``gathered``, ``partials`` or ``reduced`` (None with ``ccl``); ``group`` the process group ``ccl`` collectives run on.
    fp8 and epilogues (:mod:`ficco.plan.epilogue`): ``a_scale`` (the canonical input's, ``m x 1``
    row-wise or one element), ``gathered_scale`` (row-wise all-gather: ``M x 1`` at byte
    ``gathered_scale_offset`` of the workspace with ``dma``), ``b_scales`` and ``biases``
    (``1 x n_j`` or None) per b; ``wide``: the outputs are float32 partial sums the op rounds
    once. ``task_state``: what an op family's host tasks read besides these fields, for families
    whose sizes are data (expert parallelism: the call's routing and rows, which its host tasks
    size their work from at launch, :class:`ficco.ops.expert.tasks.ExpertContext`).

    Every host task is called ``task(views, buffers, args)`` and reads the fields it needs."""

    a: torch.Tensor
    bs: list[torch.Tensor]
    outs: list[torch.Tensor]
    gathered: torch.Tensor | None = None
    symm: Any = None
    group: Any = None
    partials: list[torch.Tensor] = field(default_factory=list)
    recvs: list[torch.Tensor] = field(default_factory=list)
    partial_offsets: tuple[int, ...] = ()
    reduced: list[torch.Tensor] = field(default_factory=list)
    reduced_offsets: tuple[int, ...] = ()
    flags: torch.Tensor | None = None   # arrival flags of gated plans (execute() zeroes them)
    a_scale: torch.Tensor | None = None
    gathered_scale: torch.Tensor | None = None
    gathered_scale_offset: int = 0
    b_scales: tuple = ()
    biases: tuple = ()
    wide: bool = False
    task_state: Any = None
    _peers: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def peer(self, peer: int, buf: str = "gathered", index: int = 0) -> torch.Tensor:
        """Rank ``peer``'s copy of a symmetric buffer, through the symmetric handle."""
        if self.symm is None:
            raise InvalidArgumentError(f"plan reads peer {peer}'s buffer but the call has "
                                       f"no symmetric memory (transport ccl)")
        key = (buf, index, peer)
        if key not in self._peers:
            mine, offset = self.local(buf, index), 0
            if buf == "partial":
                offset = self.partial_offsets[index] if self.partial_offsets else 0
            elif buf == "reduced":
                offset = self.reduced_offsets[index]
            elif buf == "gathered_scale":
                offset = self.gathered_scale_offset
            self._peers[key] = self.symm.get_buffer(peer, tuple(mine.shape), mine.dtype, offset)
        return self._peers[key]

    def local(self, buf: str, index: int = 0) -> torch.Tensor:
        """This rank's copy of symmetric buffer ``buf``."""
        if buf == "gathered_scale":
            if self.gathered_scale is None:
                raise InvalidArgumentError(
                    "plan reads the gathered rows' fp8 scales but the call has none")
            return self.gathered_scale
        if buf == "reduced":
            return self.reduced[index]
        if buf != "gathered":
            return self.partials[index]
        if self.gathered is None:
            raise InvalidArgumentError("plan reads the gathered buffer but the call has none")
        return self.gathered
