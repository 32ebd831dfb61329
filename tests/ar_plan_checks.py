"""The symbolic plan checker (tests/plan_checks.py) for ``matmul_all_reduce``: the same six
rules, with the all-reduce's buffers.

A product cell carries the set of ranks whose partials it sums, as for the reduce-scatter;
here every rank's ``out`` must end, in every cell, as row i of ``sum over all W ranks of
a_q @ b_j`` (absolute rows: ``out`` and ``reduced`` are ``M x n``), each rank's partial added
once, scaled once for ``avg``. Copies either pull a peer's ``partial`` rows into ``recv`` (any
place: the reductions then check what they add), or move a ``reduced`` rectangle (this rank's
or a peer's) to the same place of ``out``; a one-source Reduce without a scale is a copy made
by a kernel (the ``-sm`` schedules' loads).

Usage::

    check_ar_plans([schedule.plan(replace(problem, rank=r), "dma") for r in range(world)])
"""
from __future__ import annotations

from ficco.plan import AllGather, Copy, Plan, Reduce

from .plan_checks import (
    INITS,
    _Checker,
    check_plans,
)


class _ArChecker(_Checker):
    REDUCE_INTO = ("out", "reduced")
    GEMM_INTO = ("partial", "reduced", "out")

    def first_row(self, rank: int, buf: str) -> int:
        return 0     # every buffer of the all-reduce holds all M rows

    def run_copy(self, rank: int, op: Copy, node: int) -> None:
        src, dst = op.src, op.dst
        if (src.rows, src.cols) != (dst.rows, dst.cols) \
                or op.two_d != (src.cols != self.p.ns[src.index]):
            self.fail(f"{self.label(node)}: a copy moves same-shape rectangles, 2-D exactly "
                      f"when they are narrower than the buffer ({op})")
        pull = src.buf == "partial" and src.peer not in (None, rank) and dst.buf == "recv"
        place = src.buf == "reduced" and dst.buf == "out" and dst.peer is None \
            and (src.row0, src.col0) == (dst.row0, dst.col0)
        if not (pull or place):
            self.fail(f"{self.label(node)}: a copy pulls a peer's partial into recv or moves "
                      f"reduced rows to the same rows of out; got {src} -> {dst}")
        value = self.read(rank, src, node).copy()
        self.write(rank, dst, node, value, init=True, received=src.peer not in (None, rank))

    def run_reduce(self, rank: int, op: Reduce, node: int) -> None:
        label = self.label(node)
        if len(op.srcs) == 1 and op.srcs[0].buf == "reduced":
            src = op.srcs[0]   # a copy made by a kernel: reduced rows to the same rows of out
            if op.accumulate or op.scale is not None or (op.dst.buf, src.row0, src.col0) != (
                    "out", op.dst.row0, op.dst.col0):
                self.fail(f"{label}: a one-source Reduce moves reduced rows to the same rows "
                          f"of out; got {src} -> {op.dst}")
            self.write(rank, op.dst, node, self.read(rank, src, node).copy(), init=True,
                       received=src.peer not in (None, rank))
            return
        super().run_reduce(rank, op, node)

    def run_all_gather(self, heads: list[tuple[AllGather, int]]) -> None:
        """Rank q's ``src`` lands in every rank's ``dsts[q]`` (one-shot's partials into
        ``recv``, two-shot's reduced pieces into ``out``)."""
        shapes = {tuple((d.rows, d.cols) for d in op.dsts) for op, _ in heads}
        if len(shapes) != 1:
            self.fail(f"ranks disagree on an all-gather's destinations: {sorted(shapes)}")
        values = [self.read(r, op.src, node).copy() for r, (op, node) in enumerate(heads)]
        for r, (op, node) in enumerate(heads):
            for q, d in enumerate(op.dsts):
                if (d.rows, d.cols) != (heads[q][0].src.rows, heads[q][0].src.cols):
                    self.fail(f"{self.label(node)}: destination {q} is {d}, rank {q} sends "
                              f"{heads[q][0].src}")
                self.write(r, d, node, values[q], init=True, received=q != r)

    def check_results(self) -> None:
        p = self.p
        wide = {plan.wide_outputs() for plan in self.plans}
        if len(wide) != 1:
            self.fail("ranks' plans disagree on float32 outputs: the reduced rows they move "
                      "would differ in dtype")
        for r, bufs in enumerate(self.buffers):
            for j in range(len(p.ns)):
                v = bufs[("out", j)].cells
                if not (v[..., INITS] >= 1).all():
                    self.fail(f"rank {r}: out[{j}] has cells nothing wrote")
                self.check_sums(r, j, v, 0)
        self.check_closing_barrier()


def check_ar_plans(plans: list[Plan]) -> None:
    """:func:`tests.plan_checks.check_plans` for ``matmul_all_reduce`` plans.

    >>> from ficco import schedules
    >>> from ficco.plan.problem import Problem
    >>> p = [Problem(5, 4, (3,), "float32", 2, r, op="matmul_all_reduce") for r in (0, 1)]
    >>> check_ar_plans([schedules.get("two-shot", op=q.op).plan(q) for q in p])
    """
    check_plans(plans, _ArChecker)
