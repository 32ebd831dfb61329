"""``torch-one-shot``, ``torch-two-shot`` and ``torch-multimem`` for ``matmul_all_reduce``: the
GEMM, then torch's own symmetric-memory all-reduce kernel (``torch.ops.symm_mem``:
``one_shot_all_reduce_out``, ``two_shot_all_reduce_out``, ``multimem_all_reduce_``, the last
on NVLink SHARP switches only). They are what a serving engine would otherwise call, so
``auto`` may measure ficco's schedules against them behind the same op and results::

    copy0    |bar|                                   |bar|
    compute  |== G ==|copy in|torch kernel: flag, wait, sum, (flag, wait)|

torch's kernels need their input in torch's own symmetric memory, rendezvoused with the
group: the workspace itself when ``FICCO_SYMM`` chose torch's provider, else one buffer of
their own per (group, shape, dtype), rendezvoused at the first call of that key (collective:
every rank makes it at the same call) and filled from the partial by one copy. A plan
barrier beside the GEMM and one after the kernel keep the workspace and that buffer from
being rewritten by the next call while a peer may still read them.

They run where torch's kernels do: CUDA (``multimem`` on sm_90+ with multicast support), with
the op in the installed torch; never on CPU. Nothing here ran on a GPU yet: selectors are
offered them only on targets in :data:`VERIFIED_TARGETS` (empty), forcing one runs it.

>>> from ficco.plan.problem import Problem
>>> dict(TorchShot("one-shot").plan(Problem(8, 16, (32,), "bfloat16", 4, op="matmul_all_reduce")).count())
{'barrier': 2, 'gemm': 1, 'torch_all_reduce': 1}
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from ....errors import FiccoError, InvalidArgumentError
from ....heuristics import reductions
from ....plan import COMPUTE, HostOp, Plan
from ....plan.problem import Problem
from ....schedules.common import avg_scale, barrier
from . import common

#: torch's op of each variant (``torch.ops.symm_mem.<op>``), and whether it writes an output
#: (``_out``) or reduces its input in place
OPS = {"one-shot": ("one_shot_all_reduce_out", True),
       "two-shot": ("two_shot_all_reduce_out", True),
       "multimem": ("multimem_all_reduce_", False)}
#: targets where a lent GPU ran these schedules' tests and timed them (docs/kernels.md)
VERIFIED_TARGETS: tuple[str, ...] = ()


def torch_reason(variant: str, target: str) -> str | None:
    """None when torch's ``variant`` all-reduce can run on backend ``target``, else why not."""
    name, _ = OPS[variant]
    kind, _, arch = target.partition(":")
    if kind != "cuda":
        return (f"torch's symm_mem.{name} runs on CUDA GPUs only (torch's symmetric-memory "
                f"kernels); this is {target}")
    if not hasattr(torch.ops.symm_mem, name):
        return f"this torch ({torch.__version__}) has no torch.ops.symm_mem.{name}"
    digits = "".join(ch for ch in arch if ch.isdigit())
    if variant == "multimem" and digits and int(digits) < 90:
        return f"multimem all-reduce needs NVLink SHARP (sm_90+ behind NVSwitch); this is {arch}"
    return None


@dataclass(frozen=True)
class TorchAllReduce(HostOp):
    """torch's ``variant`` all-reduce of output ``b``: its partial into torch's symmetric
    memory, the kernel, the result into ``out[b]`` (times ``scale`` for ``avg``)."""

    queue: str
    b: int
    variant: str = "one-shot"
    scale: float | None = None
    step: int = 1
    kind: ClassVar[str] = "torch_all_reduce"

    @staticmethod
    def price(sim, op, task, mt_factor):   # type: ignore[override]
        """torch's symmetric-memory all-reduce: :mod:`ficco.heuristics.reductions`."""
        return reductions.price_torch_kernel(sim, op, task)

    @staticmethod
    def host_task(views, buffers, op):   # type: ignore[override]
        return torch_task(buffers, op)


#: each group's own torch symmetric buffers by (shape, dtype, device): keyed by the group
#: object (weakly), so a new group of the same name never meets an old group's buffers
_own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_own_lock = threading.Lock()


def symmetric_input(partial: torch.Tensor, group) -> torch.Tensor:
    """``partial`` itself when it lives in torch's symmetric memory (FICCO_SYMM chose torch),
    else this group's own torch buffer shaped like it (allocated and rendezvoused at first
    use: collective) holding a copy of it."""
    from torch.distributed import _symmetric_memory as torch_symm

    if torch_symm.is_symm_mem_tensor(partial):
        return partial
    key = (tuple(partial.shape), partial.dtype, partial.device)
    with _own_lock:
        bufs = _own.setdefault(group, {})
        buf = bufs.get(key)
        if buf is None:
            buf = torch_symm.empty(tuple(partial.shape), dtype=partial.dtype,
                                   device=partial.device)
            torch_symm.rendezvous(buf, group.group_name)
            bufs[key] = buf
    buf.copy_(partial)
    return buf


def torch_op(name: str):
    """``torch.ops.symm_mem.<name>`` (looked up when a call runs it)."""
    return getattr(torch.ops.symm_mem, name)


def torch_task(buffers, op):
    """The host function that runs ``op`` on the compute queue (the current stream)."""
    name, writes_out = OPS[op.variant]
    j, group = op.b, buffers.group

    def run() -> None:
        out = buffers.outs[j]
        if out.numel() == 0:
            return
        kernel = torch_op(name)
        source = symmetric_input(buffers.partials[j], group)
        try:
            if writes_out and out.dtype == source.dtype:
                kernel(source, "sum", group.group_name, out)
            elif writes_out:   # wide outputs (a bias): torch's kernel keeps the input's dtype
                out.copy_(kernel(source, "sum", group.group_name, torch.empty_like(source)))
            else:
                out.copy_(kernel(source, "sum", group.group_name))
        except RuntimeError as exc:
            raise FiccoError(f"torch.ops.symm_mem.{name} refused output {j} "
                             f"({tuple(source.shape)}, {source.dtype}): {exc}") from exc
        if op.scale is not None:
            out.mul_(op.scale)
    return run


@dataclass(frozen=True)
class TorchShot:
    variant: str = "one-shot"
    op = "matmul_all_reduce"
    plain_operands_only = False   # it sums what a library GEMM made, epilogue included

    def __post_init__(self):
        if self.variant not in OPS:
            raise InvalidArgumentError(f"torch all-reduce variant {self.variant!r}; one of "
                                       f"{', '.join(OPS)}")

    @property
    def name(self) -> str:
        return f"torch-{self.variant}"

    def unavailable_reason(self, target: str, transport: str = "dma") -> str | None:
        if transport != "dma":
            return f"{self.name} runs torch's symmetric-memory kernel: transport dma, not " \
                   f"{transport}"
        return torch_reason(self.variant, target)

    def selectable_reason(self, target: str, transport: str = "dma") -> str | None:
        reason = self.unavailable_reason(target, transport)
        if reason is None and not target.startswith(VERIFIED_TARGETS):
            reason = (f"{self.name} has not been run on {target} yet (docs/kernels.md), so "
                      f"selectors do not offer it there; force schedule={self.name!r} to run it")
        return reason

    def plan(self, problem: Problem, transport: str = "dma",
             copy_engines: int | None = None) -> Plan:
        builder, whole = common.begin(self.name, problem, transport, copy_engines)
        if whole:
            return builder.build()
        if transport != "dma":
            raise InvalidArgumentError(self.unavailable_reason("any", transport))
        p = problem
        ready = barrier(builder, step=0)           # beside the GEMM: channel 0
        gemms = common.gemms(builder, 0, p.m, "partial")
        kernels = [builder.add(TorchAllReduce(COMPUTE, j, self.variant, avg_scale(p)),
                               after=gemms + [ready]) for j in range(len(p.ns)) if p.m]
        common.close(builder, "dma", kernels or [ready])     # channel 1: no reader is left
        return builder.build()


TORCH_SCHEDULES = tuple(TorchShot(v) for v in OPS)
