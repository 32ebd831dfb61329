"""Schedules of ``matmul_all_reduce``: the GEMM's partial products summed over the ranks and
every rank given all of it (docs/all_reduce.md).

``serial`` (the GEMM, then the process group's all-reduce, or two-shot over symmetric memory),
``rs-ag-*`` (a reduce-scatter schedule of ``matmul_reduce_scatter`` overlapped with the GEMM,
then an all-gather pipelined behind it), ``chunked-{2,4,8}`` (each row chunk's all-reduce beside
the next chunk's GEMM) and ``one-shot``/``two-shot`` with copy-engine pulls or ``-sm`` loads
(small messages: decode).
"""
from __future__ import annotations

from ....schedules.common import OptionalSchedule, Schedule
from .chunked import CHUNK_COUNTS, Chunked
from .kernel import KERNEL_SCHEDULES
from .rs_ag import REGISTERED, RsAg
from .shots import OneShot, Serial, TwoShot
from .torch_kernels import TORCH_SCHEDULES

SCHEDULES: tuple[Schedule, ...] = (
    Serial(), *(RsAg(name) for name in REGISTERED), *(Chunked(c) for c in CHUNK_COUNTS),
    OneShot(), OneShot(loads=True), TwoShot(), TwoShot(loads=True))
#: need Triton (one kernel) or torch's symmetric-memory kernels (see ficco.schedules)
OPTIONAL: tuple[OptionalSchedule, ...] = (*KERNEL_SCHEDULES, *TORCH_SCHEDULES)

__all__ = ["OPTIONAL", "SCHEDULES", "Chunked", "OneShot", "RsAg", "Serial", "TwoShot"]
