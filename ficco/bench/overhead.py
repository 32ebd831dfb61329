"""``python -m ficco.bench overhead``: what one warm call costs the host, per op and schedule.

Null backend (the default): every op (``all_gather_matmul``, ``matmul_reduce_scatter``,
``matmul_all_reduce``, the expert pair ``all_to_all_grouped_mm`` / ``grouped_mm_all_to_all``
and the Ulysses pair ``matmul_all_to_all`` / ``all_to_all_matmul``), every schedule (the
optional gated ones included), at W = 2, 4 and 8, rank min(3, W-1); shapes in
:func:`problem_of`. ``--gpu``: the first two ops at W = 8 as
rank 0 of a pretend 8-rank group on one GPU.

- null backend (runs anywhere): every backend call returns at once, so what is timed is
  ficco's executor, compiler and barrier protocol. The null backend prepares copies as the
  GPU backends do (``copy_call_args``), so the bound-plan path is what runs, and it counts the
  runtime calls a GPU would get (``ops``: a batched copy submission counts once, a barrier
  program once; ``1-by-1``: the same without batched copies, ROCm's path).
- ``--gpu``: the real CUDA/ROCm backend. The "peers" are other allocations on this GPU and
  every barrier signals this rank's own pad (a loopback handle: the same driver calls as in a
  real group, and every barrier passes), so each copy moves real bytes. Eager host us per call
  and per op (median of 20, the GPU idle before each), the wall time to the GPU's end, the
  host time of a CUDA graph replay of the same call, and the result's error against float32.
- ``--compare REV``: also times the executor as it was at git revision REV (loaded from git
  into this process), interleaved with today's, so before/after come from one run.
- ``--gpu --profile SCHEDULE``: instead of the table, cProfile of ``--calls`` eager enqueues
  of one schedule on the GPU backend, the top functions by own time (where the rest goes).

``--out`` appends the printed tables to FILE (bench/results/enqueue-overhead-*.txt are the
sets the docs cite, see bench/results/README.md). Until this verb, the script was
``bench/enqueue_overhead.py`` (and the profile ``bench/gpu_enqueue_profile.py``).
"""
from __future__ import annotations

import cProfile
import math
import pstats
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

from .. import executor as current_executor
from .. import schedules
from ..backends.base import Backend
from ..backends.gpu.vendor import Copy2D, copy_call_args
from ..ops import of_collective as collective_ops
from ..ops.expert.problem import COMBINE, DISPATCH, ExpertProblem
from ..ops.ulysses.layout import ALL_TO_ALL_MATMUL, MATMUL_ALL_TO_ALL, UlyssesProblem
from ..plan.problem import ALL_GATHER, ALL_REDUCE, COLLECTIVES, REDUCE_SCATTER, Problem
from .cli import BenchUsageError

EXAMPLES = """examples:
  python -m ficco.bench overhead --calls 300                  # null backend, both ops
  python -m ficco.bench overhead --calls 300 --compare 3ab1b5e --out bench/runs/overhead.txt
  python -m ficco.bench overhead --gpu                         # the real backend on one GPU
  python -m ficco.bench overhead --gpu --profile hetero-unfused-1d --calls 20
"""
#: The repository root (``--compare`` reads the executor of a git revision from it).
ROOT = Path(__file__).resolve().parents[2]

WORLD, DTYPE = 8, torch.bfloat16
WORLDS = (2, 4, 8)
#: the ops timed: those whose calls are engine Problems (by collective), then the expert and
#: the Ulysses pairs
OPS = collective_ops(ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE) + (DISPATCH, COMBINE,
                                                               MATMUL_ALL_TO_ALL, ALL_TO_ALL_MATMUL)
#: the GPU table's ops (the loopback group pretends peers for these two)
GPU_OPS = collective_ops(ALL_GATHER, REDUCE_SCATTER)


def problem_of(op: str, rank: int, world: int = WORLD):
    """The problem each op is timed on: bfloat16, the all-gather's 1024 rows per rank x K = 8192
    x n = 8192 (the GEMM of the GPU enqueue table in docs/gpu.md), the reduce-scatter and
    all-reduce its mirror (M = 8192, K = 1024 per rank), the expert ops 1024 rows per rank
    routed evenly to 2 experts per rank, K = n = 4096, the Ulysses pair an attention block's
    projections at hidden 4096: ``matmul_all_to_all`` 1024 tokens per rank times a 4096 x
    4096 weight, the product's columns scattered and its tokens gathered; ``all_to_all_matmul``
    8192 tokens x 4096/W columns per rank, tokens scattered, columns gathered (the GEMM's K)."""
    if op == MATMUL_ALL_TO_ALL:
        return UlyssesProblem((1024, 4096), 1, 0, 4096, 4096, "bfloat16", world, rank, op,
                              sizes=(1024,) * world)
    if op == ALL_TO_ALL_MATMUL:
        return UlyssesProblem((8192, 4096 // world), 0, 1, 4096, 4096, "bfloat16", world,
                              rank, op, sizes=(4096 // world,) * world)
    if COLLECTIVES.get(op) == ALL_GATHER:
        return Problem(m=1024, k=8192, ns=(8192,), dtype="bfloat16", world=world, rank=rank,
                       op=op)
    if op in (DISPATCH, COMBINE):
        counts = tuple(tuple(1024 // (2 * world) for _ in range(2 * world))
                       for _ in range(world))
        return ExpertProblem(4096, 4096, 2, "bfloat16", world, rank, op, counts)
    return Problem(m=8192, k=1024, ns=(8192,), dtype="bfloat16", world=world, rank=rank,
                   op=op)


def workspace_numel(p) -> int:
    if isinstance(p, UlyssesProblem):
        return max(p.max_send_numel(), 1)
    if isinstance(p, ExpertProblem):
        return 2 * sum(map(sum, p.counts)) * max(p.k, p.n)
    if p.all_reduces:
        return 2 * p.m * p.n_total * 2    # partials, then the float32 reduced rows
    return p.m * p.n_total if p.reduces else p.big_m * p.k


def schedule_names(op: str) -> list[str]:
    """Every schedule of ``op``, the optional (Triton) ones included: they plan anywhere."""
    return schedules.names(op=op) + schedules.optional_names(op=op)


class NullBackend(Backend):
    """Every call returns at once: only ficco's own host time remains. Copies are prepared
    (arguments computed, a no-op returned) the way the GPU backends prepare theirs.
    ``calls`` counts what would be runtime calls on a GPU: an event record or wait, a copy, a
    batched copy submission (once), a GEMM, a host task, a barrier program (one
    ``cuStreamBatchMemOp``) or signal write; ``finish`` joins each side queue (a record and a
    wait). ``batches``: whether it submits a queue's copies in one call (as CUDA >= 12.8)."""

    name = "null"
    compute_on_current = prepares_copies = reuses_plan_events = True

    def __init__(self, batches: bool = True):
        self.batches_copies = batches
        self.calls = 0
        self.prepared = 0

    def _count(self, queue=None):
        self.calls += 1

    @classmethod
    def unavailable_reason(cls):
        return None

    def target(self):
        return "null"

    def device(self):
        return torch.device("cpu")

    def queue(self, name):
        return name

    def new_event(self):
        return object()

    def plan_events(self, compiled, count):
        # as the GPU backends do: one set of events per compiled plan, reused every call
        events = self.__dict__.setdefault("_events", {})
        if id(compiled) not in events:
            events[id(compiled)] = (compiled, [object() for _ in range(count)])
        return events[id(compiled)][1]

    def record(self, event, queue):
        self.calls += 1

    def wait(self, event, queue):
        self.calls += 1

    def prepare_record(self, event):
        return self._count

    def prepare_wait(self, event):
        return self._count

    def copy(self, dst, src, queue):
        copy_call_args(dst, src)
        self.calls += 1

    def copy_2d(self, dst, src, queue):
        copy_call_args(dst, src, True)
        self.calls += 1

    def prepare_copy(self, dst, src, two_d=False):
        self.prepared += 1
        return self._count if copy_call_args(dst, src, two_d) is not None else _ignore

    def prepare_copies(self, pairs):
        self.prepared += len(pairs)
        args = [copy_call_args(dst, src, two_d) for dst, src, two_d in pairs]
        flat = sum(1 for a in args if a is not None and not isinstance(a, Copy2D))
        pitched = sum(1 for a in args if isinstance(a, Copy2D))
        calls = (min(flat, 1) + min(pitched, 1)) if self.batches_copies else flat + pitched

        def run(queue):
            self.calls += calls
        return run

    def gemm(self, a, b, out, accumulate, queue):
        self.calls += 1

    def gemm_current(self, a, b, out, accumulate):
        self.calls += 1

    def launch(self, queue, fn):
        self.calls += 1

    def launch_current(self, fn):
        self.calls += 1

    # The barrier itself is the real protocol (ficco.symm_mem.barrier: cached program, one
    # signal_batch call); only the primitives do nothing.
    def signal_write(self, queue, slot, value):
        self.calls += 1

    def signal_wait(self, queue, op, deadline):
        self.calls += 1

    def signal_batch(self, queue, ops, deadline):
        self.calls += 1

    def signal_now(self, ops, deadline):
        self.calls += 1

    def tensor_slot(self, t, index):
        return 0

    def finish(self, queues, timeout_s=None):
        self.calls += 2 * len({id(q) for q in queues if q != "compute"})

    def symm_provider(self):
        return None


def _ignore(queue):
    pass


class StubHandle:
    """A symmetric handle whose peers are plain (untouched, so unbacked) CPU tensors."""

    def __init__(self, rank: int, world: int, numel: int):
        self.rank, self.world, self.nbytes = rank, world, numel * 2
        self._data = [torch.empty(numel * 2, dtype=torch.uint8) for _ in range(world)]
        self._programs: dict = {}
        self.fault = None     # no group fault word (the gated GEMM's launch reads it)

    def slot(self, owner, channel, writer):
        return 0x1000 * owner + 4 * (channel * self.world + writer)   # an address, as on GPUs

    def get_buffer(self, rank, shape, dtype, offset=0):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self._data[rank][offset: offset + nbytes].view(dtype).view(tuple(shape))


class OldContract:
    """``backend`` as older executors called it (``--compare`` with such a
    revision): also through ``backend.barrier``, which the executor does not need (it
    runs the barrier protocol itself)."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def barrier(self, symm, channel, queue, timeout_s, step):
        from ..symm_mem.barrier import plan_barrier

        plan_barrier(self._backend, symm, channel, queue, timeout_s, step)


def load_executor(rev: str):
    """The executor (``ficco/executor/__init__.py``) as it was at git revision ``rev``, as a
    module of this process (its relative imports resolve against today's package; the
    executor's own code is REV's). A revision of the flat layout held it in ``ficco/executor.py``
    and its imports name the flat modules, so only a revision of today's layout loads."""
    path = "ficco/executor/__init__.py"
    try:
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"],
                                check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BenchUsageError(f"--compare {rev}: cannot read {path} at {rev} from git in {ROOT} "
                              f"({exc}); run from a git checkout, with a revision of the "
                              "folder layout") from None
    module = types.ModuleType(f"ficco.executor._at_{rev}")
    module.__package__ = "ficco.executor"
    module.__file__ = f"{rev}:{path}"
    sys.modules[module.__name__] = module   # dataclasses look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102 - our own git history
    return module


def operands(p, device="cpu"):
    """(a, bs) of one call of problem ``p`` (the expert ops: x or h, and the stacked weights)."""
    if isinstance(p, UlyssesProblem):
        a_shape = (*p.shape[:-1], p.k) if p.op == MATMUL_ALL_TO_ALL else p.shape
        return (torch.empty(a_shape, dtype=DTYPE, device=device),
                [torch.empty(p.k, p.n, dtype=DTYPE, device=device)])
    if isinstance(p, ExpertProblem):
        lay = p.layout
        rows = lay.send_rows(p.rank) if p.op == DISPATCH else lay.recv_rows(p.rank)
        a = torch.empty(rows, p.k, dtype=DTYPE, device=device)
        return a, [torch.empty(p.k, p.n, dtype=DTYPE, device=device)
                   for _ in range(p.experts)]
    return (torch.empty(p.m, p.k, dtype=DTYPE, device=device),
            [torch.empty(p.k, n, dtype=DTYPE, device=device) for n in p.ns])


def call_buffers(ex, plan, handle, a, bs, device):
    """This call's Buffers as ficco/runtime.py makes them: fresh outputs (and landing buffers),
    the workspace's from the handle."""
    p = plan.problem
    if isinstance(p, UlyssesProblem):
        return _ulysses_buffers(ex, plan, handle, a, bs, device)
    if isinstance(p, ExpertProblem):
        return _expert_buffers(ex, p, handle, a, bs, device)
    out_dtype = torch.float32 if plan.wide_outputs() else DTYPE   # as the runtime allocates
    if p.all_reduces:
        outs = [torch.empty(p.m, n, dtype=out_dtype, device=device) for n in p.ns]
        partial_at, reduced_at = 0, p.m * p.n_total * 2
        return ex.Buffers(
            a, bs, outs, None, handle, None,
            partials=[handle.get_buffer(p.rank, (p.m, p.ns[0]), DTYPE, partial_at)],
            recvs=[torch.empty(max(plan.rows_of("recv"), 1), p.ns[0], dtype=DTYPE,
                               device=device)],
            partial_offsets=(partial_at,),
            reduced=[handle.get_buffer(p.rank, (p.m, p.ns[0]), out_dtype, reduced_at)],
            reduced_offsets=(reduced_at,))
    outs = [torch.empty(p.block_rows if p.reduces else p.big_m, n, dtype=out_dtype,
                        device=device) for n in p.ns]
    if p.reduces:
        return ex.Buffers(a, bs, outs, None, handle, None,
                          partials=[handle.get_buffer(p.rank, (p.m, p.ns[0]), DTYPE)],
                          recvs=[torch.empty(p.world * p.block_rows, p.ns[0], dtype=DTYPE,
                                             device=device)],
                          partial_offsets=(0,))
    return ex.Buffers(a, bs, outs, handle.get_buffer(p.rank, (p.big_m, p.k), DTYPE), handle,
                      None)


def _ulysses_buffers(ex, plan, handle, a, bs, device):
    from ..ops.ulysses.tasks import UlyssesContext

    p = plan.problem
    out_dtype = torch.float32 if plan.wide_outputs() else DTYPE   # as the spec allocates
    staging = handle.get_buffer(p.rank, (max(p.max_send_numel(), 1),), DTYPE)
    landing = None
    if p.op != MATMUL_ALL_TO_ALL and p.world > 1:
        landing = torch.empty(p.recv_offset(p.world), dtype=DTYPE, device=device)
    ctx = UlyssesContext(p, a, bs[0], torch.empty(p.out_shape, dtype=out_dtype, device=device),
                         staging, landing)
    return ex.Buffers(a, bs, [ctx.out], staging, handle, None, task_state=ctx)


def _expert_buffers(ex, p, handle, a, bs, device):
    from ..ops.expert.problem import DISPATCH
    from ..ops.expert.tasks import ExpertContext

    lay, r = p.layout, p.rank
    if p.op == DISPATCH:
        shared = handle.get_buffer(r, (lay.max_send_rows, p.k), DTYPE)
        rows = lay.recv_rows(r)
        ctx = ExpertContext(DISPATCH, lay, r, a, bs, torch.empty(rows, p.n, dtype=DTYPE),
                            shared, torch.empty(rows, p.k, dtype=DTYPE), None)
        return ex.Buffers(a, bs, [ctx.out], shared, handle, None, task_state=ctx)
    shared = handle.get_buffer(r, (lay.max_recv_rows, p.n), DTYPE)
    ctx = ExpertContext(p.op, lay, r, a, bs, torch.empty(lay.send_rows(r), p.n, dtype=DTYPE),
                        shared, None, None)
    return ex.Buffers(a, bs, [ctx.out], None, handle, None, partials=[shared], task_state=ctx)


def make_call(ex, plan, backend, handle, a, bs, device):
    """One call as ficco/runtime/path.py makes it: fresh outputs (and landing buffers) each time,
    this rank's workspace buffers from the handle. Returns (call, outs); call() returns the
    host seconds of execute() alone."""
    outs_box = []

    def call() -> float:
        # The previous call's buffers are gone before this call allocates (as in the runtime:
        # the caller keeps only the result), so an allocator may hand the same blocks back.
        outs_box.clear()
        buffers = call_buffers(ex, plan, handle, a, bs, device)
        outs_box[:] = [buffers]
        t0 = time.perf_counter()
        ex.execute(plan, backend, buffers, timeout_s=60.0)
        return time.perf_counter() - t0

    return call, outs_box


# -- null backend -------------------------------------------------------------------------------
def calls_per_call(plan, batches: bool = True) -> int:
    """Runtime calls one warm call of ``plan`` makes on the null backend (see
    :class:`NullBackend`; ``batches``: copies of a queue in one submission)."""
    p = plan.problem
    handle = StubHandle(p.rank, p.world, workspace_numel(p))
    a, bs = operands(p)
    backend = NullBackend(batches)
    call, _ = make_call(current_executor, plan, backend, handle, a, bs, "cpu")
    call()
    before = backend.calls
    call()
    return backend.calls - before


def null_rows(op: str, calls: int, before, world: int = WORLD) -> list[str]:
    p = problem_of(op, rank=min(3, world - 1), world=world)
    rows = []
    for name in schedule_names(op):
        plan = schedules.get(name, op=op).plan(p, "dma", None)
        handle = StubHandle(p.rank, world, workspace_numel(p))
        a, bs = operands(p)
        runs: dict[str, tuple[Any, Any]] = {"now": (current_executor, NullBackend())}
        if before is not None:
            runs["before"] = (before, OldContract(NullBackend()))
        made = {k: make_call(ex, plan, be, handle, a, bs, "cpu")[0]
                for k, (ex, be) in runs.items()}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(5):
            for call in made.values():
                call()
        backend = runs["now"][1]
        calls0 = backend.calls
        rounds = 10
        for _ in range(rounds):   # interleaved: drift on a shared box hits both alike
            for k, call in made.items():
                times[k] += [call() for _ in range(max(1, calls // rounds))]
        ops = (backend.calls - calls0) // len(times["now"])
        now = statistics.median(times["now"]) * 1e6
        line = (f"{op:<22} {name:<22} {world:>2} {len(plan.ops):>5} {ops:>4} "
                f"{calls_per_call(plan, False):>8} {now:>9.1f} {now / ops:>7.2f}")
        if before is not None:
            old = statistics.median(times["before"]) * 1e6
            line += f" {old:>9.1f}"
        rows.append(line)
        print(line, flush=True)
    return rows


# -- real GPU -----------------------------------------------------------------------------------
class Loopback:
    """Rank 0 of a pretend group on one GPU whose barriers signal its own pad: slot ``[ch,
    writer]`` of a peer's pad is this rank's slot ``[ch, peer]``, so a barrier's writes set
    exactly the slots its waits wait for (the same driver calls as in a real group; every
    barrier passes, any number per call). Everything else is the real handle's."""

    def __init__(self, handle):
        self._handle, self._programs = handle, {}
        self.rank, self.world = handle.rank, handle.world

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def slot(self, owner, channel, writer):
        return self._handle.slot(self.rank, channel, writer if owner == self.rank else owner)


def gpu_rows(ops, before) -> list[str]:
    from ..symm_mem.device import single_gpu_group

    backend = _gpu_backend()
    dev = backend.device()
    rows = []
    for op in ops:
        p = problem_of(op, rank=0)
        nbytes = workspace_numel(p) * 2
        real = single_gpu_group(backend, WORLD, nbytes)
        handle = Loopback(real)
        try:
            for peer in range(1, WORLD):   # the peers' data: shards or partial products
                handle.get_buffer(peer, (p.m if p.reduces else p.big_m,
                                         p.n_total if p.reduces else p.k), DTYPE).normal_()
            a = torch.randn(p.m, p.k, device=dev).to(DTYPE)
            bs = [torch.randn(p.k, n, device=dev).to(DTYPE) for n in p.ns]
            for name in schedules.names(op=op):
                plan = schedules.get(name, op=op).plan(p, "dma", None)
                line = f"{op:<22} {name:<20} {len(plan.ops):>4}"
                line += _gpu_measure(current_executor, plan, backend, handle, a, bs, dev)
                if before is not None:
                    line += _gpu_measure(before, plan, OldContract(backend), handle, a, bs, dev)
                rows.append(line)
                print(line, flush=True)
        finally:
            backend.synchronize()
            real.close()
    return rows


def _gpu_measure(ex, plan, backend, handle, a, bs, dev) -> str:
    call, box = make_call(ex, plan, backend, handle, a, bs, dev)
    for _ in range(3):
        call()
    backend.synchronize()
    enqueue, wall = [], []
    for _ in range(20):
        backend.synchronize()
        t0 = time.perf_counter()
        enqueue.append(call())
        backend.synchronize()
        wall.append(time.perf_counter() - t0)
    err = _rel_err(plan.problem, box[0], handle, a, bs)
    replay = _graph_replay(call, box, plan.problem, handle, a, bs)
    us = statistics.median(enqueue) * 1e6
    return (f" {us:>9.1f} {us / len(plan.ops):>7.2f} {statistics.median(wall) * 1e3:>8.2f} "
            f"{err:>8.1e} {replay:>12}")


def _rel_err(p, buffers, handle, a, bs) -> float:
    b = bs[0].float()
    if p.reduces:
        row0, rows = p.block(p.rank)
        expect = (a.float() @ b)[row0: row0 + rows]
        for peer in range(1, WORLD):
            expect += handle.get_buffer(peer, (p.m, p.ns[0]), DTYPE)[row0: row0 + rows].float()
    else:
        full = torch.cat([a] + [handle.get_buffer(peer, (p.big_m, p.k), DTYPE)
                                [peer * p.m: (peer + 1) * p.m] for peer in range(1, WORLD)])
        expect = full.float() @ b
    got = buffers.outs[0].float()
    return float((got - expect).norm() / expect.norm())


def _graph_replay(call, box, p, handle, a, bs) -> str:
    """Host us of one replay of a CUDA graph of the call (and its error), or why none."""
    from .gpu_probes import capture_and_time_replays

    try:
        graph, times = capture_and_time_replays(call)
        captured = box[0]
        err = _rel_err(p, captured, handle, a, bs)
        del graph
        return f"{statistics.median(times) * 1e6:.1f} ({err:.0e})"
    except Exception as exc:  # noqa: BLE001 - printed; the eager numbers still count
        torch.cuda.synchronize()
        return f"n/a: {type(exc).__name__}: {str(exc)[:50]}"


def _gpu_backend():
    from ..backends import get_backend

    backend = get_backend()
    if backend.name not in ("cuda", "rocm"):
        raise BenchUsageError(f"--gpu needs a GPU backend (cuda or rocm); this process got "
                              f"{backend.name!r}")
    return backend


def gpu_profile(name: str, calls: int, op: str) -> None:
    """cProfile of ``calls`` eager enqueues of schedule ``name`` as rank 0 of the loopback
    group on one GPU: the top functions by own time."""
    from ..symm_mem.device import single_gpu_group

    backend = _gpu_backend()
    dev = backend.device()
    p = problem_of(op, rank=0)
    real = single_gpu_group(backend, WORLD, workspace_numel(p) * 2)
    handle = Loopback(real)
    a = torch.randn(p.m, p.k, device=dev).to(DTYPE)
    bs = [torch.randn(p.k, n, device=dev).to(DTYPE) for n in p.ns]
    plan = schedules.get(name, op=op).plan(p, "dma", None)
    call, _ = make_call(current_executor, plan, backend, handle, a, bs, dev)

    def synced():
        call()
        torch.cuda.synchronize()

    synced()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        synced()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    torch.cuda.synchronize()
    real.close()


def add_arguments(parser) -> None:
    parser.add_argument("--calls", type=int, default=200, help="timed calls per schedule")
    parser.add_argument("--op", choices=OPS, default=None, help="one op only (default all)")
    parser.add_argument("--world", type=int, choices=WORLDS, action="append", default=None,
                        help="group size (repeatable; default 2, 4 and 8; --gpu: 8)")
    parser.add_argument("--gpu", action="store_true", help="the real GPU backend instead")
    parser.add_argument("--compare", metavar="REV", default=None,
                        help="also time the executor as of git revision REV")
    parser.add_argument("--profile", metavar="SCHEDULE", default=None,
                        help="with --gpu: cProfile --calls enqueues of SCHEDULE instead")
    parser.add_argument("--label", default="", help="text appended to the table's title")
    parser.add_argument("--out", default=None, help="append the printed tables to this file")


def main(args) -> int:
    torch.set_num_threads(1)
    if args.profile:
        if not args.gpu:
            raise BenchUsageError("--profile profiles the GPU backend's enqueues: add --gpu")
        gpu_profile(args.profile, args.calls, args.op or OPS[0])
        return 0
    before = load_executor(args.compare) if args.compare else None
    cmp = f" vs the executor at {args.compare}" if args.compare else ""
    if args.gpu:
        ops: tuple[str, ...] = (args.op,) if args.op else GPU_OPS
        if any(op not in GPU_OPS for op in ops):
            raise BenchUsageError(f"--gpu times {' and '.join(GPU_OPS)} (its loopback group "
                                  f"pretends their peers); got --op {args.op}")
        head = (f"# eager host time per W={WORLD} call, real backend on one GPU (loopback "
                f"barriers), median of 20{cmp} {args.label}").rstrip()
        cols = f"{'us/call':>9} {'us/op':>7} {'wall ms':>8} {'rel err':>8} {'replay us':>12}"
        lines = [head, f"{'op':<22} {'schedule':<20} {'ops':>4} {cols}"]
        if before is not None:
            lines.append(f"# (the same columns again for {args.compare})")
    else:
        ops = (args.op,) if args.op else OPS
        head = (f"# host cost of one warm call, null backend, median of {args.calls} calls"
                f"{cmp} {args.label}").rstrip()
        legend = ("# plan: the plan's ops; ops: runtime calls per call on a GPU with batched "
                  "copy submission (CUDA >= 12.8); 1-by-1: without it (one call per copy, "
                  "ROCm); us/op = us/call / ops")
        lines = [head, legend,
                 f"{'op':<22} {'schedule':<22} {'W':>2} {'plan':>5} {'ops':>4} {'1-by-1':>8} "
                 f"{'us/call':>9} {'us/op':>7}" + (f" {'before':>9}" if before else "")]
    print("\n".join(lines), flush=True)
    if args.gpu:
        lines += gpu_rows(ops, before)
    else:
        for world in args.world or WORLDS:
            for op in ops:
                lines += null_rows(op, args.calls, before, world)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n".join(lines) + "\n\n")
    return 0
