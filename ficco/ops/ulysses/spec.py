"""What both Ulysses op specs share (:mod:`.matmul_all_to_all`, :mod:`.all_to_all_matmul`).

The ranks' tensors may differ in their length along ``gather_dim`` only (uneven sequence
shards, or uneven heads). Every rank's length is this call's data: a peer's may change from
one call to the next while this rank's call stays the same, so the lengths are exchanged at
every call (:meth:`UlyssesSpec.exchange`, one bounded exchange right after the agreement, as
the expert ops' routing counts are) and fold into the call's word, so ranks that hold
different lengths fail the plan's call check. The chunks along ``scatter_dim`` follow
:func:`~ficco.plan.problem.even_split` (longer first).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import group as groups
from ...backends import get_backend
from ...errors import InvalidArgumentError
from ...plan import HostOp
from ...plan.buffers import Buffers
from ...plan.epilogue import wide_dtype
from ...plan.problem import dtype_name, even_split
from ...runtime import agreement
from ...runtime.call import (
    FORWARD,
    Call,
    backend_for,
    check_fits,
    check_like,
    check_tensor,
    key_of,
    known,
    normalize_dim,
    remember,
)
from ...symm_mem import aligned
from ..base import OpSpec
from .layout import MATMUL_ALL_TO_ALL, UlyssesProblem, with_dim
from .schedules import SCHEDULES
from .tasks import UlyssesContext, context_of


@dataclass(kw_only=True)
class UlyssesCall(Call[UlyssesProblem]):
    a: torch.Tensor
    b: torch.Tensor


def check_arguments(op: str, a, b, scatter_dim, gather_dim) -> tuple[int, int, tuple]:
    """The one check of the pair's tensors and dims, for the eager path and the fake kernel
    alike: ``(scatter, gather, the shape that travels)``, dims normalised (``matmul_all_to_all``:
    dims of the product ``a @ b``; ``all_to_all_matmul``: of ``a``).

    >>> import torch
    >>> check_arguments("all_to_all_matmul", torch.randn(4, 6, 8), torch.randn(8, 3), -2, 0)
    (1, 0, (4, 6, 8))
    """
    check_tensor(a, "a")
    if not isinstance(b, torch.Tensor) or b.dim() != 2:
        raise InvalidArgumentError(
            f"b must be a 2-D (K, n) tensor; got "
            f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    check_like(b, a, "b", "a")
    nd = a.dim()
    scatter = normalize_dim(scatter_dim, nd, "scatter_dim")
    gather = normalize_dim(gather_dim, nd, "gather_dim")
    if scatter == gather:
        raise InvalidArgumentError(
            f"scatter_dim and gather_dim are both dim {scatter}; the all-to-all splits one dim "
            f"and concatenates along another")
    if op == MATMUL_ALL_TO_ALL:
        if b.shape[0] != a.shape[-1]:
            raise InvalidArgumentError(
                f"b has {b.shape[0]} rows but a has K={a.shape[-1]} columns (a "
                f"{tuple(a.shape)}, b {tuple(b.shape)}); they must match")
        return scatter, gather, (*a.shape[:-1], b.shape[1])
    if gather != nd - 1 and scatter != nd - 1 and b.shape[0] != a.shape[-1]:
        raise InvalidArgumentError(
            f"b has {b.shape[0]} rows but a has K={a.shape[-1]} columns (a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}); they must match")
    return scatter, gather, tuple(a.shape)


class UlyssesSpec(OpSpec[UlyssesCall]):
    """Both ops of the pair; subclasses say which comes first, the GEMM or the all-to-all."""

    # -- the call ---------------------------------------------------------------------------
    def prepare(self, a, b, group=None, *, scatter_dim, gather_dim,  # type: ignore[override]
                role: str = FORWARD) -> UlyssesCall:
        key = backend = None
        if type(scatter_dim) is int and type(gather_dim) is int:
            group, backend = groups.resolve(group), get_backend()
            key = key_of(self.name, a, b, group, backend, (scatter_dim, gather_dim))
            # A warm call: checked and derived when the key was new (the key names the op).
            seen = known(key, group, backend)
            if isinstance(seen, UlyssesCall):
                warm = seen.clone(group=group, a=a, b=b, role=role)
                assert isinstance(warm, UlyssesCall)
                return warm
        scatter, gather, shape = check_arguments(self.name, a, b, scatter_dim, gather_dim)
        backend = backend_for(a, "a", backend)
        group = groups.resolve(group)
        rank, world = groups.rank_world(group)
        nd = len(shape)
        if self.name != MATMUL_ALL_TO_ALL and scatter == nd - 1:
            length = even_length(shape[scatter], world, rank)
            if b.shape[0] != length:
                raise InvalidArgumentError(
                    f"b has {b.shape[0]} rows but this rank's chunk of a's last dim (K="
                    f"{shape[-1]} split over {world} ranks) has {length}; they must match")
        check_fits((a.numel() + 2 * _numel(shape)) * a.element_size() * 2, a.device, self.name)
        problem = UlyssesProblem(shape, scatter, gather, b.shape[0], b.shape[1],
                                 dtype_name(a.dtype), world, rank, self.name)
        call = UlyssesCall(self, problem, group, backend, role=role, a=a, b=b)
        if key is not None:
            remember(key, call, a=None, b=None)
        return call

    def explained(self, a, b, group, *, gather_dim, scatter_dim, reduce_op, counts, epilogue):
        """The call ``ficco.explain(a, b, op=..., scatter_dim=..., gather_dim=...)`` decides on:
        local, so it assumes every rank's length along ``gather_dim`` is this rank's."""
        call = self.prepare(a, b, group, scatter_dim=scatter_dim, gather_dim=gather_dim)
        p = call.problem
        local = call.clone(problem=dataclasses.replace(p, sizes=(p.shape[p.gather],) * p.world))
        assert isinstance(local, UlyssesCall)
        return local

    def signature(self, call: UlyssesCall) -> dict:
        p = call.problem
        nd = len(p.shape)
        # k and n where they are every rank's alike (else the shape or the lengths hold them)
        shared_k = p.op == MATMUL_ALL_TO_ALL or (p.gather != nd - 1 and p.scatter != nd - 1)
        return {"op": self.name, "role": call.role, "shape": with_dim(p.shape, p.gather, 0),
                "scatter_dim": p.scatter, "gather_dim": p.gather,
                "k": p.k if shared_k else -1,
                "n": p.n if p.op != MATMUL_ALL_TO_ALL else -1, "dtype": p.dtype,
                "world": p.world, "backend": call.target}

    exchanges = True

    def exchange(self, call: UlyssesCall, word: int) -> tuple[UlyssesCall, int]:
        """Every rank's length along ``gather_dim`` for this call (one bounded exchange), the
        call completed with them (its plan, buffers and workspace are sized by them; the
        caller reads them off its call) and its word with them folded in."""
        p = call.problem
        if p.world == 1:
            return call, word
        sizes = tuple(int(x) for x in agreement.exchange_call_data(
            call.group, call.rank, call.world, word, p.shape[p.gather],
            agreement.summary(self.signature(call)), what=f"{self.name} lengths exchange"))
        problem = dataclasses.replace(p, sizes=sizes)
        check_agreed(problem)
        call.problem = problem       # (this call's own: a warm call is the template's clone)
        return call, agreement.digest({"call": word, "lengths": sizes})

    def agreed_problem(self, call: UlyssesCall, per_rank: tuple) -> UlyssesProblem:
        """The call's problem, completed with every rank's length by :meth:`exchange`."""
        return call.problem

    # -- running ----------------------------------------------------------------------------
    def workspace_bytes(self, call: UlyssesCall) -> int:
        p = call.problem
        return aligned(max(p.max_send_numel(), 1) * p.itemsize)

    def context(self, call: UlyssesCall, transport: str, symm, wide: bool) -> UlyssesContext:
        p, a = call.problem, call.a
        dtype = wide_dtype(a.dtype) if wide else a.dtype
        out = torch.empty(p.out_shape, dtype=dtype, device=a.device)
        if symm is not None:
            staging = symm.get_buffer(p.rank, (max(p.max_send_numel(), 1),), a.dtype, 0)
        elif p.op == MATMUL_ALL_TO_ALL:
            staging = a.new_empty(p.send_numel())
        else:
            staging = a.new_empty(0)       # ccl sends a's chunks as they are
        landing = None
        if p.op != MATMUL_ALL_TO_ALL and p.world > 1:
            landing = a.new_empty(p.recv_offset(p.world))
        return UlyssesContext(p, a, call.b, out, staging, landing)

    def buffers(self, call: UlyssesCall, transport: str, symm, *, wide: bool = False,
                plan=None) -> Buffers:
        ctx = self.context(call, transport, symm, wide)
        return Buffers(call.a, [call.b], [ctx.out], ctx.staging if symm is not None else None,
                       symm, call.group, task_state=ctx)

    def poison(self, buffers: Buffers) -> None:
        ctx = context_of(buffers)
        for t in (ctx.out, ctx.landing, ctx.staging):
            if t is not None and t.is_floating_point():
                t.fill_(float("nan"))

    def plain(self, call: UlyssesCall):
        """The unoverlapped path (FICCO_DISABLE, one rank): every rank's length by one
        all-gather, one ``all_to_all_single`` and the whole GEMM."""
        p = call.problem
        if p.world > 1 and not p.sizes:
            mine = torch.tensor([p.shape[p.gather]], dtype=torch.int64)
            every = [torch.zeros(1, dtype=torch.int64) for _ in range(p.world)]
            dist.all_gather(every, mine, group=call.group)
            p = dataclasses.replace(p, sizes=tuple(int(t) for t in every))
            check_agreed(p)
            clone = call.clone(problem=p)
            assert isinstance(clone, UlyssesCall)
            call = clone
        ctx = self.context(call, "ccl", None, wide=p.accumulates and p.itemsize < 4)
        buffers = Buffers(call.a, [call.b], [ctx.out], None, None, call.group, task_state=ctx)
        schedule = SCHEDULES[self.name][0]          # serial, over ccl
        for op in schedule.plan(p, "ccl").ops:
            if isinstance(op, HostOp):
                op.host_task(None, buffers, op)()
        return self.result(call, buffers, "ccl")

    def result(self, call: UlyssesCall, buffers: Buffers, transport: str):
        out = context_of(buffers).out
        return out if out.dtype == call.a.dtype else out.to(call.a.dtype)


def all_to_all(ts: list, scatter: int, gather: int, rank: int) -> torch.Tensor:
    """What ``rank`` receives from the all-to-all of every rank's ``ts``, written out with
    plain torch (the references' all-to-all): chunk ``rank`` (``even_split``, longer first)
    of each along ``scatter``, concatenated along ``gather`` in rank order."""
    pieces = []
    for t in ts:
        start, length = even_split(t.shape[scatter], len(ts))[rank]
        pieces.append(t.narrow(scatter, start, length))
    return torch.cat(pieces, dim=gather)


def even_length(total: int, world: int, rank: int) -> int:
    base, extra = divmod(total, world)
    return base + (1 if rank < extra else 0)


def check_agreed(p: UlyssesProblem) -> None:
    """What only every rank's lengths tell (the same on every rank: every rank raises alike):
    ``all_to_all_matmul`` gathering along K needs ``b``'s rows to be the gathered K."""
    if p.accumulates and p.k != sum(p.all_sizes):
        raise InvalidArgumentError(
            f"b has {p.k} rows but the gathered K (every rank's last dim of a: "
            f"{list(p.all_sizes)}) is {sum(p.all_sizes)}; they must match")


def _numel(shape: tuple) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
