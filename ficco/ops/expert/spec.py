"""The op specs of expert parallelism: dispatch (``all_to_all_grouped_mm``) and combine
(``grouped_mm_all_to_all``). See :mod:`ficco.ops.expert.problem` for the layouts.

What differs from the other ops: the routing counts are data. ``prepare`` checks this rank's
counts (never communicating); :meth:`ExpertSpec.exchange` agrees on the whole matrix once per
call (after the runtime's agreement on shapes and settings) and completes the call: its exact
:class:`~ficco.ops.expert.problem.Layout` for the host tasks and workspaces, and the bucketed
:class:`~ficco.ops.expert.problem.ExpertProblem` for the decision and the (count-free) plan.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass

import torch

from ... import group as groups
from ...errors import InvalidArgumentError
from ...plan.buffers import Buffers
from ...plan.problem import dtype_name
from ...runtime.call import Call, backend_for, check_fits, check_like, check_tensor
from ...symm_mem import aligned
from ..base import OpSpec
from ..examples import generator
from . import routing
from .problem import COMBINE, DISPATCH, ExpertProblem, Layout
from .tasks import ExpertContext, context_of, exchange_task, gemm_task, grouped_mm_runs


@dataclass(kw_only=True)     # (its tensors follow Call's defaulted fields and have none)
class ExpertCall(Call[ExpertProblem]):
    inp: torch.Tensor                   # x (T, K) or h (R, K2)
    weights: list                       # L tensors (K, n)
    stacked: torch.Tensor | None = None  # (L, K, n) where torch._grouped_mm runs
    n: int = 0
    part: list                          # this rank's counts row (E,) or recv_counts (L, W)
    layout: Layout | None = None        # the agreed routing (after exchange)
    routing: list | None = None         # a matrix handed in (combine: a dispatch's)
    send_counts: list | None = None     # combine: the dispatch counts the caller passed
    return_received: bool = False

    def agreed_layout(self) -> Layout:
        """``layout``, which exchange() sets (prepare(), in a world of one) before the runtime
        sizes a workspace or makes buffers."""
        assert self.layout is not None, "an expert call's routing is agreed before it runs"
        return self.layout


class ExpertSpec(OpSpec[ExpertCall]):
    """What both expert-parallel ops share; subclasses say which way rows move."""

    exchanges = True    # the routing counts (exchange)

    # -- the call ---------------------------------------------------------------------------
    def explained(self, a, b, group, *, gather_dim, scatter_dim, reduce_op, counts, epilogue):
        if counts is None:
            raise InvalidArgumentError(f"explain(op={self.name!r}) needs counts= (the counts, or "
                                       f"the recv_counts for grouped_mm_all_to_all)")
        return self.local_view(self.prepare(a, counts, b, group))

    def prepare(self, inp, counts, w, group=None, *, routing=None, send_counts=None,
                return_received=False) -> ExpertCall:
        what = "x" if self.name == DISPATCH else "h"
        check_tensor(inp, what)
        if inp.dim() != 2:
            raise InvalidArgumentError(f"{what} must be 2-D (rows, K); got shape "
                                       f"{tuple(inp.shape)}")
        weights = _weights(w, inp, what, "w" if self.name == DISPATCH else "w2")
        big_l, k, n = len(weights), inp.shape[1], weights[0].shape[1]
        backend = backend_for(inp, what)
        group = groups.resolve(group)
        rank, world = groups.rank_world(group)
        part = self.check_part(counts, inp.shape[0], world, big_l, rank)
        check_fits(inp.shape[0] * (k + n) * inp.element_size(), inp.device, self.name)
        call = ExpertCall(self, ExpertProblem(k, max(n, 1), big_l, dtype_name(inp.dtype), world,
                                              rank, self.name),
                          group, backend, n == 0, inp=inp, weights=weights, n=n, part=part,
                          return_received=bool(return_received))
        if routing is not None:
            call.routing = self.check_routing(routing, call)
        if send_counts is not None:
            call.send_counts = self.check_send_counts(send_counts, call)
        if grouped_mm_runs(inp.dtype, k, max(n, 1), inp.device) and big_l > 1:
            call.stacked = _stack(w, weights)
        if world == 1:
            call.layout = self.layout_of(call, self.assemble([part], call))
        return call

    @abstractmethod
    def check_part(self, counts, rows: int, world: int, big_l: int, rank: int) -> list:
        """This rank's counts argument, checked against its ``rows`` (raises before any
        communication)."""

    def check_routing(self, matrix, call: ExpertCall) -> list:
        """A W x E matrix handed in: it must agree with this rank's own counts."""
        world, big_l = call.world, len(call.weights)
        rows = routing.as_int_list(matrix, "routing", (world, world * big_l))
        probe = self.layout_of(call, rows)
        mine = call.part if self.name == DISPATCH else probe.recv_counts(call.rank)
        theirs = rows[call.rank] if self.name == DISPATCH else call.part
        if mine != theirs or min(min(r) for r in rows) < 0:
            raise InvalidArgumentError(
                f"the routing handed to {self.name} does not match this rank's counts ({mine} "
                f"vs {theirs}); pass the routing of the dispatch these counts came from")
        return rows

    def check_send_counts(self, send_counts, call: ExpertCall) -> list:
        raise InvalidArgumentError(f"{self.name} takes no send_counts")

    def layout_of(self, call: ExpertCall, rows) -> Layout:
        return Layout(tuple(map(tuple, rows)), len(call.weights))

    def signature(self, call: ExpertCall) -> dict:
        # Counts differ per rank and per call: agreed by exchange(), not here.
        return {"op": self.name, "role": call.role, "k": call.problem.k, "n": call.n,
                "experts": call.problem.experts, "dtype": call.problem.dtype,
                "world": call.world, "backend": call.backend.target(),
                "routing": call.routing is not None, "send_counts": call.send_counts is not None}

    def exchange(self, call: ExpertCall, word: int) -> tuple[ExpertCall, int]:
        """Agree on the routing matrix (one bounded exchange, or none when it was handed in or
        recalled by every rank) and complete the call with its layout and problem; the call's
        word (its digest and number) gains the matrix."""
        rows = call.routing
        if rows is None:
            rows = self.assemble(routing.agree_counts(call, word, call.part), call)
        counts = tuple(map(tuple, rows))
        if self.name == DISPATCH:
            routing.remember(call.session, counts, len(call.weights))
        layout = Layout(counts, len(call.weights))
        problem = ExpertProblem.for_call(call.problem.k, call.problem.n, layout, call.problem.dtype,
                                         call.rank, self.name)
        return dataclasses.replace(call, layout=layout, problem=problem), \
            routing.folded(word, counts)

    def local_view(self, call: ExpertCall) -> ExpertCall:
        """``call`` completed from this rank's counts alone, as if every rank routed like this
        one: what ``explain`` decides on without communicating."""
        rows = call.routing or self.assemble([call.part] * call.world, call)
        layout = Layout(tuple(map(tuple, rows)), len(call.weights))
        problem = ExpertProblem.for_call(call.problem.k, call.problem.n, layout,
                                         call.problem.dtype, call.rank, self.name)
        return dataclasses.replace(call, layout=layout, problem=problem)

    @abstractmethod
    def assemble(self, parts: list, call: ExpertCall) -> list:
        """The W x E matrix from every rank's counts argument (rank order)."""

    # -- running ----------------------------------------------------------------------------
    def workspace_bytes(self, call: ExpertCall) -> int:
        rows, cols = self.shared_shape(call)
        return aligned(max(rows, 1) * cols * call.inp.element_size())

    @abstractmethod
    def shared_shape(self, call: ExpertCall) -> tuple[int, int]:
        """(rows, cols) of the symmetric buffer, the same on every rank (sized by the agreed
        counts: the most rows any rank publishes)."""

    @abstractmethod
    def context(self, call: ExpertCall, symm, wide: bool = False) -> ExpertContext:
        """The expert part of one run's buffers (``symm``: the workspace, or None for ccl;
        ``wide``: the plan accumulates bf16/fp16 products, so the output is float32)."""

    def buffers(self, call: ExpertCall, transport: str, symm, *, wide: bool = False,
                plan=None) -> Buffers:
        ctx = self.context(call, symm, wide)
        # shared is the symmetric buffer peers pull from: Buffers.peer knows it by these names
        # (a world of one has none with ccl: nothing travels, nothing reads it)
        partials = [ctx.shared] if self.name == COMBINE and ctx.shared is not None else []
        return Buffers(call.inp, call.weights, [ctx.out],
                       ctx.shared if self.name == DISPATCH else None, symm, call.group,
                       partials=partials, task_state=ctx)

    def poison(self, buffers: Buffers) -> None:
        ctx = context_of(buffers)
        for t in (ctx.out, ctx.landing, ctx.shared):
            if t is not None:
                t.fill_(float("nan"))

    def plain(self, call: ExpertCall):
        """The unoverlapped path: one all-to-all of the process group and one grouped GEMM
        (FICCO_DISABLE), or the grouped GEMM alone (one rank)."""
        buffers = self.buffers(call, "ccl", None)
        order = [exchange_task, gemm_task] if self.name == DISPATCH else [gemm_task, exchange_task]
        if call.world == 1:
            order = [gemm_task]
        from .plan_ops import Exchange, GroupedGemm  # plan ops name what the tasks do

        op_of = {exchange_task: Exchange("comm", None),
                 gemm_task: GroupedGemm("compute", tuple(range(call.world)), None)}
        for task in order:
            task(None, buffers, op_of[task])()
        return self.finish(call, context_of(buffers))

    def result(self, call: ExpertCall, buffers: Buffers, transport: str):
        return self.finish(call, context_of(buffers))

    @abstractmethod
    def finish(self, call: ExpertCall, ctx: ExpertContext):
        """The caller's result from a finished run's context."""


def _weights(w, inp: torch.Tensor, what: str, name: str) -> list:
    """``w`` (L, K, n) or a list of L (K, n) tensors as a list, checked against ``inp``."""
    if isinstance(w, torch.Tensor):
        if w.dim() != 3:
            raise InvalidArgumentError(f"{name} must be (L, K, n) or a list of L (K, n) tensors; "
                                       f"got shape {tuple(w.shape)}")
        if w.shape[0] == 0:
            raise InvalidArgumentError(f"{name} has shape {tuple(w.shape)}: no local experts; "
                                       f"every rank holds at least one (L >= 1)")
        weights = list(w.unbind(0))
    elif isinstance(w, (list, tuple)) and w:
        weights = list(w)
    else:
        raise InvalidArgumentError(f"{name} must be (L, K, n) or a non-empty list of (K, n) "
                                   f"tensors; got {type(w).__name__}")
    k = inp.shape[1]
    if k == 0:
        raise InvalidArgumentError(f"{what} has K=0 columns: {tuple(inp.shape)}")
    n = None
    for l, wl in enumerate(weights):
        label = f"{name}[{l}]"
        if not isinstance(wl, torch.Tensor) or wl.dim() != 2:
            raise InvalidArgumentError(f"{label} must be a 2-D (K, n) tensor; got "
                                       f"{tuple(wl.shape) if isinstance(wl, torch.Tensor) else type(wl).__name__}")
        if wl.shape[0] != k:
            raise InvalidArgumentError(f"{label} has {wl.shape[0]} rows but {what} has K={k} "
                                       f"columns ({what} {tuple(inp.shape)}); they must match")
        if n is not None and wl.shape[1] != n:
            raise InvalidArgumentError(f"{label} has {wl.shape[1]} columns but {name}[0] has "
                                       f"{n}; every expert's weight must have the same shape")
        n = wl.shape[1]
        check_like(wl, inp, label, what)
    return weights


def _stack(w, weights: list) -> torch.Tensor:
    if isinstance(w, torch.Tensor) and w.is_contiguous():
        return w
    return torch.stack(weights).contiguous()


#: local experts per rank in the expert ops' examples
EXAMPLE_EXPERTS = 2


def example_routing(world: int, m: int, seed: int) -> list:
    """Every rank's rows per global expert (some zero), about ``m`` rows per rank: the
    routing of the expert ops' examples."""
    gen = generator(seed)
    counts = []
    for _ in range(world):
        rows = int(torch.randint(max(0, m - 2), m + 3, (1,), generator=gen))
        picks = torch.randint(0, world * EXAMPLE_EXPERTS, (rows,), generator=gen)
        counts.append(torch.bincount(picks, minlength=world * EXAMPLE_EXPERTS).tolist())
    return counts
