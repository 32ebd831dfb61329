"""The public entry points: ``all_gather_matmul`` and ``explain``.

Data flows one way: arguments -> :class:`Call` (validated, canonical) -> Decision (selector) ->
Plan (schedule, cached) -> executor on the active backend -> outputs in the caller's layout.
"""
from __future__ import annotations

import atexit
import dataclasses
import socket
import statistics
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import config, schedules
from .backends import close_all, get_backend
from .errors import InvalidArgumentError, MismatchError
from .executor import Buffers, execute
from .problem import Problem, dtype_name

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class Call:
    """One validated call in canonical form."""

    problem: Problem
    a: torch.Tensor                 # m x K, this rank's shard with gather_dim moved first
    bs: list[torch.Tensor]
    b_is_list: bool
    moved_shape: tuple[int, ...]    # a_shard.movedim(gather_dim, 0).shape
    gather_dim: int
    group: object
    backend: object


# -- validation --------------------------------------------------------------------------------
def _resolve_group(group):
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            return _resolve_process_group(group)
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds here
            raise InvalidArgumentError(f"group name {group!r} names no process group: {exc}") from None
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    raise InvalidArgumentError(
        f"group must be a torch.distributed ProcessGroup, a group name or None; got "
        f"{type(group).__name__}")


def _prepare(a_shard, b, group, gather_dim) -> Call:
    if not isinstance(a_shard, torch.Tensor):
        raise InvalidArgumentError(f"a_shard must be a torch.Tensor; got {type(a_shard).__name__}")
    if a_shard.dim() < 2:
        raise InvalidArgumentError(
            f"a_shard must have at least 2 dims (rows..., K); got shape {tuple(a_shard.shape)}")
    nd = a_shard.dim()
    if not isinstance(gather_dim, int) or not -nd <= gather_dim < nd:
        raise InvalidArgumentError(f"gather_dim={gather_dim!r} is out of range for a_shard of "
                                   f"{nd} dims; use 0 … {nd - 2}")
    gather_dim %= nd
    if gather_dim == nd - 1:
        raise InvalidArgumentError(
            f"gather_dim={gather_dim} is the last (K) dimension of a_shard {tuple(a_shard.shape)}; "
            f"ficco gathers along a row dimension (0 … {nd - 2})")
    b_is_list = isinstance(b, (list, tuple))
    bs = list(b) if b_is_list else [b]
    if not bs:
        raise InvalidArgumentError("b is an empty list; pass a (K, n) tensor or a list of them")
    k = a_shard.shape[-1]
    for j, bj in enumerate(bs):
        name = f"b[{j}]" if b_is_list else "b"
        if not isinstance(bj, torch.Tensor) or bj.dim() != 2:
            raise InvalidArgumentError(
                f"{name} must be a 2-D (K, n) tensor; got "
                f"{tuple(bj.shape) if isinstance(bj, torch.Tensor) else type(bj).__name__}")
        if bj.shape[0] != k:
            raise InvalidArgumentError(
                f"{name} has {bj.shape[0]} rows but a_shard has K={k} columns "
                f"(a_shard {tuple(a_shard.shape)}, {name} {tuple(bj.shape)}); they must match")
        if bj.shape[1] == 0:
            raise InvalidArgumentError(f"{name} has no columns: {tuple(bj.shape)}")
        if bj.dtype != a_shard.dtype:
            raise InvalidArgumentError(f"{name} is {bj.dtype} but a_shard is {a_shard.dtype}; "
                                       f"cast one so both match")
        if bj.device != a_shard.device:
            raise InvalidArgumentError(f"{name} is on {bj.device} but a_shard is on "
                                       f"{a_shard.device}; move them to one device")
    if a_shard.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(f"a_shard dtype {a_shard.dtype} is not supported; use one of "
                                   f"{[dtype_name(d) for d in SUPPORTED_DTYPES]}")
    if k == 0:
        raise InvalidArgumentError(f"a_shard has K=0 columns: {tuple(a_shard.shape)}")
    backend = get_backend()
    if a_shard.device.type != backend.device().type:
        raise InvalidArgumentError(
            f"a_shard is on {a_shard.device} but the active backend {backend.name!r} runs on "
            f"{backend.device().type}; move the tensors or set FICCO_BACKEND")
    group = _resolve_group(group)
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    moved = a_shard.movedim(gather_dim, 0)
    m = moved.numel() // k
    problem = Problem(m=m, k=k, ns=tuple(int(bj.shape[1]) for bj in bs),
                      dtype=dtype_name(a_shard.dtype), world=world, rank=rank)
    return Call(problem, moved.reshape(m, k), bs, b_is_list, tuple(moved.shape), gather_dim,
                group, backend)


# -- cross-rank agreement ----------------------------------------------------------------------
_agreed: dict = {}     # agreement key -> whether all ranks share a host


def _group_id(group) -> str:
    return "single" if group is None else getattr(group, "group_name", str(id(group)))


def _agree(call: Call, forced: str | None, transport: str) -> bool:
    """First call of a new problem on a group: check that every rank called with the same
    shapes, dtypes and settings (raises MismatchError on every rank otherwise). Returns whether
    all ranks share this host."""
    key = (_group_id(call.group), call.problem.key(), call.moved_shape[1:], call.gather_dim,
           forced, transport)
    if key in _agreed:
        return _agreed[key]
    mine = {"m": call.problem.m, "k": call.problem.k, "ns": call.problem.ns,
            "dtype": call.problem.dtype, "gather_dim": call.gather_dim,
            "shard_shape": call.moved_shape, "schedule": forced, "transport": transport,
            "backend": call.backend.target()}
    world = call.problem.world
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, socket.gethostname()), group=call.group)
    differ = sorted({f for info, _ in everyone for f in info if info[f] != mine[f]} |
                    {f for info, _ in everyone for f in mine if info[f] != everyone[0][0][f]})
    if differ:
        detail = "; ".join(f"rank {r}: " + ", ".join(f"{f}={info[f]}" for f in differ)
                           for r, (info, _) in enumerate(everyone))
        raise MismatchError(f"ranks of one group called all_gather_matmul with different "
                            f"{', '.join(differ)} ({detail}); every rank must pass the same "
                            f"shapes, dtypes and settings")
    same_host = len({host for _, host in everyone}) == 1
    _agreed[key] = same_host
    return same_host


# -- decisions, plans, workspaces ----------------------------------------------------------------
def _resolve_transport(call: Call, forced: str | None, transport: str | None) -> str:
    setting = transport or config.transport()
    if setting not in ("auto", "dma", "ccl"):
        raise InvalidArgumentError(f"transport must be auto, dma or ccl; got {setting!r}")
    if call.problem.world == 1:
        return "dma"
    same_host = _agree(call, forced, setting)
    if setting != "auto":
        return setting
    return "dma" if same_host else "ccl"


def _forced(schedule: str | None) -> tuple[str | None, str | None]:
    if schedule is not None:
        schedules.get(schedule)  # unknown names raise here, before any communication
        return schedule, "argument"
    env = config.schedule()
    return (env, "FICCO_SCHEDULE") if env else (None, None)


def _decide(call: Call, schedule: str | None, transport: str | None = None, selector=None):
    from .heuristics import choose

    forced, forced_by = _forced(schedule)
    resolved = _resolve_transport(call, forced, transport)

    def decide(via: str):
        return choose(call.problem, transport=via, target=call.backend.target(),
                      selector=selector, forced=forced, forced_by=forced_by,
                      measure=lambda name: _measure(call, name, via),
                      agree=lambda flag: _all_ranks(call, flag))

    decision = decide(resolved)
    if (decision.selector == "model" and resolved == "dma" and call.problem.world > 1
            and (transport or config.transport()) == "auto"):
        # With the transport left to ficco, the model also weighs the process group's
        # collectives: few ops, so for small GEMMs they beat a plan of many DMA copies whose
        # launches alone outlast the work.
        alternative = decide("ccl")
        dma_s, ccl_s = min(decision.scores.values()), min(alternative.scores.values())
        if ccl_s < dma_s:
            decision = dataclasses.replace(
                alternative, reason=f"{alternative.reason}; ccl predicted faster than dma "
                                    f"({ccl_s * 1e3:.3f} vs {dma_s * 1e3:.3f} ms)")
    return decision


def _all_ranks(call: Call, flag: bool) -> bool:
    """Collective: True when ``flag`` is True on every rank of the call's group."""
    if call.group is None:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=call.backend.device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=call.group)
    return bool(value.item())


_plans: dict = {}


def plan_for(name: str, transport: str, problem: Problem):
    """The (cached) Plan of schedule ``name`` for ``problem``."""
    engines = config.copy_engines()
    key = (name, transport, problem, engines)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = schedules.get(name).plan(problem, transport, engines)
    return plan


_workspaces: dict = {}
_lock = threading.Lock()


def _workspace(call: Call, nbytes: int):
    """The per-(group, backend) symmetric workspace, grown on demand (collective: every rank
    grows at the same call because every rank agreed on the same problem)."""
    key = (_group_id(call.group), call.backend.name)
    with _lock:
        handle = _workspaces.get(key)
        if handle is not None and handle.nbytes >= nbytes:
            return handle
        if handle is not None:
            handle.close()
        grown = max(nbytes, 2 * handle.nbytes if handle is not None else 0)
        first = handle is None
        handle = _workspaces[key] = call.backend.symm_provider().allocate(
            grown, call.group, call.backend.device())
    if first and call.group is not None:
        # Destroying the group (and dropping it) releases its workspace, not only shutdown().
        weakref.finalize(call.group, _release_workspace, key)
    return handle


def _release_workspace(key) -> None:
    with _lock:
        handle = _workspaces.pop(key, None)
    if handle is not None:
        handle.close()


def _drop_workspace(call: Call) -> None:
    _release_workspace((_group_id(call.group), call.backend.name))


def _restore(call: Call, canon: torch.Tensor) -> torch.Tensor:
    """Canonical ``(M, x)`` back to the caller's layout: gathered dim at ``gather_dim``."""
    lead = (call.problem.world * call.moved_shape[0], *call.moved_shape[1:-1])
    return canon.view(*lead, canon.shape[-1]).movedim(0, call.gather_dim)


_last = threading.local()


def last_run() -> tuple[str, str] | None:
    """(schedule, transport) of this thread's last multi-rank call, for tests and logs."""
    return getattr(_last, "run", None)


def _execute(call: Call, name: str, transport: str, trace: bool = False):
    p = call.problem
    dev = call.a.device
    if p.world == 1:
        outs = [call.a @ bj for bj in call.bs]
        return outs, call.a, None, None
    plan = plan_for(name, transport, p)
    _last.run = (name, transport)
    outs = [torch.empty(p.big_m, n, dtype=call.a.dtype, device=dev) for n in p.ns]
    symm = None
    if transport == "dma":
        symm = _workspace(call, p.big_m * p.k * p.itemsize)
        gathered = symm.get_buffer(p.rank, (p.big_m, p.k), call.a.dtype)
    else:
        gathered = torch.empty(p.big_m, p.k, dtype=call.a.dtype, device=dev)
    if config.get("FICCO_POISON"):
        for t in (*outs, gathered):
            t.fill_(float("nan"))
    buffers = Buffers(call.a, call.bs, outs, gathered, symm, call.group)
    try:
        rows = execute(plan, call.backend, buffers, timeout_s=config.timeout_s(), trace=trace)
    except BaseException:
        # The barrier generations of this workspace may now differ across ranks.
        _drop_workspace(call)
        raise
    return outs, gathered, plan, rows


def _measure(call: Call, name: str, transport: str, warmup: int = 2, repeat: int = 5) -> float:
    """Median seconds of schedule ``name`` on this call, slowest rank (identical everywhere)."""
    for _ in range(warmup):
        _execute(call, name, transport)
    times = []
    for _ in range(repeat):
        call.backend.synchronize()
        start = time.perf_counter()
        _execute(call, name, transport)
        call.backend.synchronize()
        times.append(time.perf_counter() - start)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64,
                         device=call.backend.device())
    if call.group is not None:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=call.group)
    return float(worst.item())


def _finish(call: Call, outs, gathered, return_gathered: bool, owned_gathered: bool):
    results = [_restore(call, o) for o in outs]
    out = results if call.b_is_list else results[0]
    if not return_gathered:
        return out
    if call.problem.world == 1:
        return call.a.view(call.moved_shape).movedim(0, call.gather_dim), out
    # The symmetric workspace is reused by the next call: hand the caller its own copy.
    gathered = gathered if owned_gathered else gathered.clone()
    return _restore(call, gathered), out


# -- public ------------------------------------------------------------------------------------
def all_gather_matmul(a_shard, b, group=None, *, gather_dim=0, schedule=None,
                      return_gathered=False):
    """``all_gather(a_shard, gather_dim) @ b``, with the all-gather hidden behind the GEMM.

    ``b`` is a ``(K, n)`` tensor or a list of them (one gather feeds several GEMMs); the output
    has the shape of the plain expression (a list when ``b`` is a list). ``schedule`` forces a
    schedule by name (see ``ficco.schedules.names()``); None lets the selector choose.
    ``return_gathered=True`` returns ``(gathered_a, outputs)``.

    >>> import torch, ficco
    >>> a = torch.randn(4, 8); w = torch.randn(8, 3)
    >>> torch.allclose(ficco.all_gather_matmul(a, w), a @ w)   # world size 1: a plain matmul
    True
    """
    call = _prepare(a_shard, b, group, gather_dim)
    if config.disabled():
        return _plain(call, return_gathered)
    if call.problem.world == 1:
        forced, _ = _forced(schedule)
        outs, gathered, _, _ = _execute(call, forced or "serial", "dma")
        return _finish(call, outs, gathered, return_gathered, owned_gathered=True)
    decision = _decide(call, schedule)
    outs, gathered, _, _ = _execute(call, decision.schedule, decision.transport)
    return _finish(call, outs, gathered, return_gathered, decision.transport == "ccl")


def traced_all_gather_matmul(a_shard, b, group=None, *, schedule, transport=None,
                             gather_dim=0):
    """Run one call with a forced schedule and return ``(output, plan, rows)``, rows being this
    rank's measured per-op ``{op_index, queue, kind, label, start_s, end_s}`` (for timelines)."""
    call = _prepare(a_shard, b, group, gather_dim)
    transport = _resolve_transport(call, schedule, transport)
    outs, gathered, plan, rows = _execute(call, schedules.get(schedule).name, transport, trace=True)
    return _finish(call, outs, gathered, False, False), plan, rows or []


def explain(a_shard, b, group=None, *, gather_dim=0, schedule=None):
    """The Decision ``all_gather_matmul`` would take for these arguments: schedule, transport,
    the selector that chose, its inputs and every candidate's score. Moves no tensor data
    (the ``tune`` selector measures on first sight of a problem, as the real call would)."""
    call = _prepare(a_shard, b, group, gather_dim)
    return _decide(call, schedule)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out`` (W*rows, ...) <- every rank's ``inp`` (rows, ...), stacked along dim 0."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _plain(call: Call, return_gathered: bool):
    """FICCO_DISABLE=1: the unoverlapped all_gather + matmul ficco replaces."""
    p = call.problem
    gathered = torch.empty(p.big_m, p.k, dtype=call.a.dtype, device=call.a.device)
    if p.world > 1:
        all_gather_flat(gathered, call.a.contiguous(), call.group)
    else:
        gathered.copy_(call.a)
    outs = [gathered @ bj for bj in call.bs]
    return _finish(call, outs, gathered, return_gathered, owned_gathered=True)


_symmetric_allocations: list = []


def allocate_symmetric(shape, dtype, device, group):
    """Back end of ``ficco.symm_mem.empty``: a symmetric allocation holding one tensor."""
    from .symm_mem import aligned, register_local

    backend = get_backend()
    group = _resolve_group(group)
    rank = dist.get_rank(group) if group is not None else 0
    nbytes = aligned(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
    handle = backend.symm_provider().allocate(nbytes, group, torch.device(device or backend.device()))
    tensor = handle.get_buffer(rank, tuple(shape), dtype)
    register_local(handle, tensor)
    _symmetric_allocations.append(handle)
    return handle, tensor


def shutdown() -> None:
    """Release workspaces, symmetric allocations, queues and cached plans. Safe to call twice;
    runs at interpreter exit."""
    with _lock:
        handles = list(_workspaces.values()) + _symmetric_allocations
        _workspaces.clear()
        _symmetric_allocations.clear()
    for handle in handles:
        handle.close()
    _plans.clear()
    _agreed.clear()
    close_all()


atexit.register(shutdown)
