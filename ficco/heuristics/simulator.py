"""A discrete-event simulator that times a :class:`~ficco.plan.Plan` on a device profile.

The same Plan the executor runs is replayed queue by queue: ops of one queue run in order, a
``Wait`` holds its queue until the matching ``Record`` has run, and a ``Barrier`` completes a
fixed latency after its queue reaches it (ranks are symmetric, so every peer arrives at the
same moment; rank 0's plan stands for all). Work is fluid: each running op has a fixed part
(latency, launch) and a bandwidth part whose speed changes whenever another op starts or ends.

Cost model (every number from :class:`~ficco.heuristics.profiles.Profile`):

- GEMM (DIL): priced as GEMM libraries run it (:mod:`ficco.heuristics.gemm`): the fastest of
  the profile's tile shapes, waves over the compute units with a fractional last wave, split-K
  only for too few tiles and a long K, a per-tile and a per-launch cost, and the HBM roofline.
  Small pieces waste compute units and short K wastes tiles: the DIL of decomposition.
- DMA copy: latency + bytes / (bandwidth x size-dependent efficiency, lower for narrow 2D
  rows). On a ``mesh`` each peer has its own link, so one busy peer uses 1 of W-1 links; on a
  ``switch`` all concurrent copies share the GPU's bandwidth; over ``pcie`` every GPU's copies
  also share the host's aggregate bandwidth with the other W-1 GPUs. At most
  ``copy_engines`` copies progress at once. Where the runtime runs 2-D copies as kernels
  (profile ``copy_2d_on_dma: false``; ROCm's ``hipMemcpy2DAsync`` ignores the NoCU kind), a
  2-D peer copy is a CU copy: same link, but it contends with the GEMM like a collective.
- GEMMs on two streams at once (PyTorch's Async-TP runs its chunk GEMMs on two) share the
  machine: each holds the fraction of compute units its first wave covers and, for the part
  of its time it is memory-bound, HBM; while the sums stay under one they run as fast as
  alone (small GEMMs filling each other's idle units), beyond that all slow alike.
- Contention (CIL, paper Fig. 8; :mod:`ficco.heuristics.contention`): while a GEMM runs beside
  ``c`` flowing copies it slows by ``1 + cil.dma_gemm x s(MT) x (c / copy_engines)^
  cil.gemm_copies_exp`` and each copy by ``1 + cil.dma_copy x s(MT)^copy_mt_power x (c /
  copy_engines)^cil.copy_copies_exp``: rates, applied only while both run, calibrated by
  replaying the paper's Fig. 8 experiments as they ran (``validate --fit-cil``). ``s(MT)``
  rises with the shard GEMM's memory traffic (a GEMM whose working set spills the last-level
  cache contends more); every piece of one GEMM is priced as exposed as the shard's GEMM.
  Collectives (``ccl``) run on compute units: they take ``ccl.compute_unit_fraction`` of the
  GEMM's CUs and use the larger ``ccl_*`` factors; a gather or scatter kernel (launched over a
  full grid) takes ``cil.cu_mem_unit_fraction``.
- Local copies: memory-bound moves (read + write). On a copy queue (a copy engine) a GEMM
  beside it slows as beside the full set of copy engines; on any other queue it is a kernel
  on the compute units (the paper's gathers and scatters) and contends like a collective.
- One hardware queue (profile ``hardware_queues`` 1: ``CUDA_DEVICE_MAX_CONNECTIONS=1``, as
  Megatron's sequence parallelism sets): every stream feeds one queue, so ops are dispatched
  in the host's issue order, an op whose stream is still busy holds back every op issued
  after it, a barrier blocks every queue until it passes, and copies run one at a time (the
  per-peer pulls serialise).
- Host launch: the host issues a warm call as the executor lowers the plan
  (:meth:`ficco.executor.compiler.CompiledPlan.issue_calls`): the entry record and waits, then
  one runtime call per coalesced step (waits that order nothing and records nobody waits for
  cost nothing, back-to-back copies of a queue are one batched submission where the profile's
  ``batched_copies`` says the runtime has one, else one call per copy), ``host_op_s`` each; an
  op cannot start before the call that issues it. Eager calls that make hundreds of runtime
  calls are launch bound when the GEMM is small (set ``host_op_s`` to 0 in a profile for
  CUDA-graph replays). Each profile states its ``host_op_s``, measured by ``bench
  characterize --parts enqueue`` or a labelled estimate. A plan the executor does not run
  (no compute queue, an op it does not know) is issued one call per plan op.

Ops are priced by ``op.kind``: kind ``"x"`` is priced by ``Simulation._price_x`` (a new op
kind adds one such method).

Example::

    >>> from ficco import schedules
    >>> from ficco.plan.problem import Problem
    >>> from ficco.heuristics import profiles, simulator
    >>> plan = schedules.get("serial").plan(Problem(4096, 8192, (8192,), "bfloat16", 8))
    >>> result = simulator.simulate(plan, profiles.load("mi300x"))
    >>> round(result.makespan_s * 1e3, 2) > 0
    True
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError
from ..plan import COMPUTE, GatedGemm, HostOp, Op, Plan, Record, Wait, item_bytes, op_label
from . import collectives, reductions
from . import gemm as gemm_cost

# Contention rates live in .contention; re-exported here for callers of simulator.*.
from .contention import dma_contention, mt_factor, shard_mt_factor
from .pieces import GatedPiece, lower_for_simulation
from .profiles import Profile

_EPS = 1e-12
#: Plan ops that only order queues: they take no time and are not drawn.
_EVENT_KINDS = ("record", "wait")


@dataclass(frozen=True)
class SimResult:
    """``makespan_s``: predicted time of the whole plan; ``rows``: one dict per work op with
    op_index, queue, start_s, end_s, kind and a short label (what :func:`draw_gantt` takes)."""

    makespan_s: float
    rows: list = field(default_factory=list)

    def busy_s(self, *kinds: str) -> float:
        """Summed duration of the ops of the given kinds, e.g. ``busy_s("gemm")``."""
        return sum(r["end_s"] - r["start_s"] for r in self.rows if r["kind"] in kinds)


@dataclass
class _Task:
    category: str            # gemm | dma | cu_copy | ccl | mem | cu_mem | sync
    fixed_s: float           # latency part, not slowed by anyone
    work_s: float            # bandwidth/compute part at solo speed
    resource: tuple = ()     # which link a dma copy uses
    demand: float = 0.0      # bytes/s this copy moves when alone
    mt_factor: float = 0.0   # s(MT) of a GEMM, in [0, 1)
    units: float = 1.0       # a GEMM: fraction of the compute units its first wave holds
    hbm: float = 0.0         # a GEMM: fraction of its time HBM is its bottleneck


def simulate(plan: Plan, profile: Profile, topology: str | None = None,
             wide_outputs: bool | None = None) -> SimResult:
    """Time ``plan`` on ``profile`` (``topology`` overrides the profile's). See module doc.
    ``wide_outputs=False`` prices a plan whose GEMMs add into the low-precision output
    itself (no float32 outputs, no cast pass), as the FiCCO paper's additive GEMMs did;
    ``None`` follows :meth:`Plan.wide_outputs` as the runtime does."""
    return Simulation(plan, profile, topology or profile.topology, wide_outputs).run()


class Simulation:
    def __init__(self, plan: Plan, profile: Profile, topology: str,
                 wide_outputs: bool | None = None):
        self.plan, self.profile, self.topology = plan, profile, topology
        #: the ops it times: the plan's, gated GEMMs split into pieces
        self.ops, origin = _lower_gated(plan)
        self.problem = plan.problem
        self.itemsize = self.problem.itemsize
        # bf16/fp16/fp8 partial sums accumulate in a float32 output, rounded once at the end.
        self.wide = plan.wide_outputs() if wide_outputs is None else wide_outputs
        self.out_itemsize = item_bytes(self.problem, "out", self.wide)
        self.link_bytes_per_s = profile.link_for(topology, self.problem.world)
        peers = max(self.problem.world - 1, 1)
        self.ingress_bytes_per_s = self.link_bytes_per_s * (peers if topology == "mesh" else 1)
        # A copy reaches its bandwidth once it outlasts its latency: on a slower link (PCIe
        # instead of the profile's own) the same efficiency comes at proportionally fewer bytes.
        native = profile.link_for(profile.topology, self.problem.world)
        self.size_scale = max(1.0, native / self.link_bytes_per_s)
        # The host makes runtime calls one after another (``host_op_s`` each): an op cannot
        # start on its queue before the call that issues it. A call of many small steps pays.
        calls = _issue_calls(plan, profile.batched_copies)
        self.issue_s = [calls[origin[i]] * profile.host_op_s for i in range(len(self.ops))]
        #: one hardware queue: ops dispatch in plan (issue) order; ``head`` is the next one
        self.one_queue = profile.hardware_queues == 1
        self.head = 0
        #: the last op started on each queue, and the ops that ran as DMA copies (a copy
        #: queued right behind one pays the engine's issue interval: ``_begin``)
        self.last_on_queue: dict[str, int] = {}
        self.dma_ops: set[int] = set()

    # -- event loop --------------------------------------------------------------------------
    def run(self) -> SimResult:
        ops = self.ops
        order: dict[str, list[int]] = {}
        for i, op in enumerate(ops):
            order.setdefault(op.queue, []).append(i)
        next_op = {q: 0 for q in order}
        recorded: set[int] = set()
        start, end = [0.0] * len(ops), [0.0] * len(ops)
        active: dict[int, _Task] = {}
        busy: set[str] = set()
        now = 0.0
        while True:
            self._issue(order, next_op, recorded, busy, active, start, end, now)
            # Ops the host has not enqueued yet (eager launch cost) hold their queue until then.
            not_issued = [self.issue_s[order[q][k]] for q, k in next_op.items()
                          if k < len(order[q]) and q not in busy
                          and self.issue_s[order[q][k]] > now + _EPS]
            if not active and not_issued:
                now = min(not_issued)
                continue
            if not active:
                stuck = {q: ops[order[q][k]] for q, k in next_op.items() if k < len(order[q])}
                if stuck:
                    raise InvalidArgumentError(
                        f"plan {self.plan.schedule!r} cannot finish: queues wait forever at "
                        f"{stuck}; every Wait needs a Record earlier on another queue")
                break
            rates = self._rates(active)
            left = {i: (t.fixed_s if t.fixed_s > 0 else t.work_s / rates[i])
                    for i, t in active.items()}
            step = min(list(left.values()) + [t - now for t in not_issued])
            now += step
            for i, task in list(active.items()):
                if left[i] <= step * (1 + 1e-9) + _EPS:
                    if task.fixed_s > 0:
                        task.fixed_s = 0.0
                    else:
                        task.work_s = 0.0
                elif task.fixed_s > 0:
                    task.fixed_s -= step
                else:
                    task.work_s -= step * rates[i]
                if task.fixed_s <= 0 and task.work_s <= 0:
                    end[i] = now
                    del active[i]
                    busy.discard(ops[i].queue)
        rows = [{"op_index": i, "queue": op.queue, "start_s": start[i], "end_s": end[i],
                 "kind": op.kind, "label": op_label(op, self.problem.rank)}
                for i, op in enumerate(ops) if op.kind not in _EVENT_KINDS]
        makespan = max(end, default=0.0)
        cast_s = self._round_once_s()
        if cast_s:
            rows.append({"op_index": len(ops), "queue": COMPUTE, "start_s": makespan,
                         "end_s": makespan + cast_s, "kind": "cast",
                         "label": "round float32 outputs once"})
        return SimResult(makespan + cast_s, rows)

    def _round_once_s(self) -> float:
        """A plan with float32 outputs (:meth:`Plan.wide_outputs`) ends with one cast pass
        on the compute queue after its last op (a ``cast`` row, not a plan op): read 4 bytes,
        write ``itemsize`` per output element."""
        if not self.wide or self.out_itemsize == self.problem.out_itemsize:
            return 0.0
        elements = self.problem.output_elements
        dil = self.profile.dil
        bandwidth = self.profile.hbm_bytes_per_s * dil["memory_efficiency"]
        return dil["launch_s"] + elements * (self.out_itemsize + self.problem.out_itemsize) \
            / bandwidth

    def _issue(self, order, next_op, recorded, busy, active, start, end, now):
        """Start every op whose queue is free and whose waits are satisfied."""
        if self.one_queue:
            self._issue_in_order(next_op, recorded, busy, active, start, end, now)
            return
        progressed = True
        while progressed:
            progressed = False
            for queue, indices in order.items():
                while queue not in busy and next_op[queue] < len(indices):
                    i = indices[next_op[queue]]
                    op = self.ops[i]
                    if self.issue_s[i] > now + _EPS:
                        break
                    if isinstance(op, Wait) and op.event not in recorded:
                        break
                    next_op[queue] += 1
                    progressed = True
                    start[i] = end[i] = now
                    if isinstance(op, Record):
                        recorded.add(op.event)
                    elif not isinstance(op, Wait):
                        active[i] = self._begin(i, end, now)
                        busy.add(queue)
                    self.last_on_queue[queue] = i

    def _issue_in_order(self, next_op, recorded, busy, active, start, end, now):
        """One hardware queue: the next op in issue order starts once the host issued it, its
        own stream is free and, if it is a Wait, its event was recorded; no op passes an
        earlier barrier that has not ended (its wait sits at the head of the one queue)."""
        ops = self.ops
        while self.head < len(ops):
            i = self.head
            op = ops[i]
            if self.issue_s[i] > now + _EPS or op.queue in busy:
                return
            if isinstance(op, Wait) and op.event not in recorded:
                return
            if any(ops[j].kind == "barrier" for j in active):
                return
            self.head += 1
            next_op[op.queue] += 1
            start[i] = end[i] = now
            if isinstance(op, Record):
                recorded.add(op.event)
            elif not isinstance(op, Wait):
                active[i] = self._begin(i, end, now)
                busy.add(op.queue)
            self.last_on_queue[op.queue] = i

    def _begin(self, i: int, end: list[float], now: float) -> _Task:
        """The task of op ``i``, starting at ``now``. A DMA copy queued right behind another
        DMA copy on its queue (that copy ended now, nothing between them on the queue, and
        the host had issued this one by then) pays the engine's pipelined issue interval
        (:meth:`Profile.queued_copy_s`) instead of the copy latency: the engine moves on to a
        queued copy without a completion round trip."""
        task = self._task(self.ops[i])
        if task.category == "dma":
            prev = self.last_on_queue.get(self.ops[i].queue)
            if (task.fixed_s > 0 and prev in self.dma_ops and abs(end[prev] - now) <= _EPS
                    and self.issue_s[i] <= end[prev] + _EPS):
                task.fixed_s -= self.profile.copy_latency_s - self.profile.queued_copy_s()
            self.dma_ops.add(i)
        return task

    # -- rates -------------------------------------------------------------------------------
    def _rates(self, active: dict[int, _Task]) -> dict[int, float]:
        """Speed of every running op (1 = as fast as when alone) given who else runs."""
        prof, cil = self.profile, self.profile.cil
        flowing = {i: t for i, t in active.items() if t.fixed_s <= 0}
        # Peer copies: on copy engines ("dma") or, where the runtime runs them as kernels
        # (ROCm's 2-D copies), on compute units ("cu_copy"); both cross the same links.
        copies = [t for t in flowing.values() if t.category in ("dma", "cu_copy")]
        engine_copies = sum(t.category == "dma" for t in copies)
        # Only copy_engines DMA copies move at once (one, through one hardware queue); the
        # engines are then shared over the links.
        engines = 1 if self.one_queue else prof.copy_engines
        engine_share = min(1.0, engines / engine_copies) if engine_copies else 1.0
        demand_by_link: dict[tuple, float] = {}
        for t in copies:
            demand_by_link[t.resource] = demand_by_link.get(t.resource, 0.0) \
                + t.demand * (engine_share if t.category == "dma" else 1.0)
        link_cap = self.link_bytes_per_s
        share = {link: min(1.0, link_cap / d) if d > 0 else 1.0
                 for link, d in demand_by_link.items()}
        gemm_mt = max((t.mt_factor for t in flowing.values() if t.category == "gemm"), default=None)
        # GEMMs on several streams share the machine: together they hold at most all compute
        # units and all of HBM; past that every one of them slows alike (processor sharing)
        gemms = [t for t in flowing.values() if t.category == "gemm"]
        machine = max(1.0, sum(t.units for t in gemms), sum(t.hbm for t in gemms)) \
            if len(gemms) > 1 else 1.0
        # Kernels that move data on compute units (a collective, a CU copy, a gather or
        # scatter kernel) take CUs from the GEMM and contend more than DMA engines (paper
        # Fig. 3d and Fig. 8: core-driven communication against DMA).
        cu_running = any(t.category in ("ccl", "cu_copy", "cu_mem") for t in flowing.values())
        # A collective runs a few channels (``ccl.compute_unit_fraction`` of the CUs); a
        # gather or scatter kernel is launched over a full grid, and the dispatcher hands it
        # CUs as the GEMM's workgroups retire (``cil.cu_mem_unit_fraction``).
        cu_taken = prof.ccl["compute_unit_fraction"]
        if any(t.category == "cu_mem" for t in flowing.values()):
            cu_taken = max(cu_taken, cil["cu_mem_unit_fraction"])
        # A local copy on a copy engine beside the GEMM takes HBM bandwidth from it: priced
        # like the full set of copy engines streaming.
        mem_running = any(t.category == "mem" for t in flowing.values())
        rates = {}
        for i, t in active.items():
            rate = 1.0   # latency phases and barriers are never slowed
            if t.fixed_s > 0:
                pass
            elif t.category in ("dma", "cu_copy"):
                rate = share[t.resource] * (engine_share if t.category == "dma" else 1.0)
                if gemm_mt is not None:
                    slowdown = dma_contention(prof, gemm_mt, len(copies))[1]
                    if t.category == "cu_copy":
                        slowdown = max(slowdown, 1 + cil["ccl_copy"] * gemm_mt)
                    rate /= slowdown
            elif t.category == "ccl" and gemm_mt is not None:
                rate /= 1 + cil["ccl_copy"] * gemm_mt
            elif t.category == "gemm":
                slowdown = dma_contention(prof, t.mt_factor, len(copies))[0] if copies else 1.0
                if mem_running:
                    slowdown += dma_contention(prof, t.mt_factor, prof.copy_engines)[0] - 1
                if cu_running:
                    slowdown += cil["ccl_gemm"] * t.mt_factor
                    slowdown /= 1 - cu_taken
                rate = 1 / (slowdown * machine)
            elif t.category in ("mem", "cu_mem"):
                slowdown = dma_contention(prof, 1.0, len(copies))[0]
                if gemm_mt is not None:
                    slowdown += dma_contention(prof, gemm_mt, prof.copy_engines)[1] - 1
                rate = 1 / slowdown
            rates[i] = rate
        return rates

    # -- solo costs, one method per op kind -------------------------------------------------
    def _task(self, op) -> _Task:
        if isinstance(op, HostOp):    # an op family's own work: it prices itself
            return op.price(self, op, _Task, mt_factor)
        price = getattr(self, f"_price_{op.kind}", None)
        if price is None:
            raise InvalidArgumentError(
                f"simulator does not know op kind {op.kind!r} ({type(op).__name__}); give "
                f"ficco.heuristics.simulator.Simulation a _price_{op.kind} method")
        return price(op)

    def _price_gemm(self, op) -> _Task:
        p = self.problem
        n = p.ns[op.b]
        block_rows = [block.rows for block in op.a]
        out_itemsize = self._bytes(op.out[0], 1)
        if p.scaling:   # torch._scaled_mm is not batched: one launch per block
            costs = [gemm_cost.gemm_cost(self.profile, p.dtype, [rows], n, op.kc, self.itemsize,
                                         op.accumulate, out_itemsize) for rows in block_rows]
        else:
            costs = [gemm_cost.gemm_cost(self.profile, p.dtype, block_rows, n, op.kc,
                                         self.itemsize, op.accumulate, out_itemsize)]
        seconds = sum(c.seconds for c in costs)
        if seconds == 0:
            return _Task("gemm", 0.0, 0.0)
        launch_s = self.profile.dil["launch_s"]
        busy = sum(max(c.compute_s, c.memory_s) for c in costs)
        return _Task("gemm", launch_s, seconds - launch_s, mt_factor=self._problem_mt_factor(n),
                     units=max(c.units for c in costs),
                     hbm=sum(c.memory_s for c in costs) / busy if busy else 0.0)

    def _price_gated_gemm(self, op) -> _Task:
        """A piece of a gated GEMM (:func:`_lower_gated`): its share of ONE full-size GEMM at
        ``dil["gated_gemm_efficiency"]`` of the library GEMM's speed (0.9 until measured), so
        no piece pays decomposition loss; the first piece pays the launch."""
        p = self.problem
        n = p.ns[op.b]
        whole = gemm_cost.gemm_seconds(self.profile, p.dtype, [p.big_m], n, p.k, self.itemsize)
        launch_s = self.profile.dil["launch_s"]
        share = op.rows * op.kc / max(p.big_m * p.k, 1)
        seconds = (whole - launch_s) * share / self.profile.dil.get("gated_gemm_efficiency", 0.9)
        return _Task("gemm", launch_s if op.first else 0.0, seconds,
                     mt_factor=self._problem_mt_factor(n))

    def _problem_mt_factor(self, n: int) -> float:
        return shard_mt_factor(self.profile, self.problem, n)

    def _price_copy_1d(self, op) -> _Task:
        """A peer copy on a copy engine (``dma``), or on compute units (``cu_copy``) when it is
        2-D and the profile says 2-D copies are not DMA (``copy_2d_on_dma``: ROCm's
        hipMemcpy2DAsync runs a kernel). A local move on a copy queue is a copy engine's
        (``mem``); on any other queue (the paper's gathers and scatters) a kernel (``cu_mem``)."""
        peer = op.src.peer if op.src.peer is not None else op.dst.peer
        nbytes = self._bytes(op.src)
        if peer is None or peer == self.problem.rank:
            return self._memory_move(nbytes, on_copy_engine=op.queue.startswith("copy"))
        task = self._dma(peer, nbytes, self._bytes(op.src, op.src.cols) if op.two_d else None)
        if op.two_d and not self.profile.copy_2d_on_dma:
            task.category = "cu_copy"
        return task

    _price_copy_2d = _price_copy_1d

    def _bytes(self, block, elements: int | None = None) -> int:
        """Bytes of ``block`` (or of ``elements`` of its elements) in its buffer's dtype: fp8
        rows, float32 row scales, partials and outputs in theirs (:func:`item_bytes`)."""
        count = block.numel if elements is None else elements
        return count * item_bytes(self.problem, block.buf, self.wide)

    def _price_all_gather(self, op) -> _Task:
        return self.collective("all_gather", self._bytes(op.src), len(op.dsts) - 1)

    def _price_reduce(self, op) -> _Task:
        """``Reduce`` (reduce-scatter's partial sums): memory-bound on the compute engines,
        reading every source (and the destination when accumulating) and writing it once;
        slowed like any memory-bound op while copies stream beside it. One that reads peers'
        memory (the all-reduce's ``-sm`` loads) is priced over the links
        (:mod:`ficco.heuristics.reductions`)."""
        rank = self.problem.rank
        if any(s.peer is not None and s.peer != rank for s in op.srcs):
            return reductions.price_remote_reduce(self, op, _Task)
        dil = self.profile.dil
        nbytes = sum(map(self._bytes, op.srcs)) + self._bytes(op.dst) * (
            2 if op.accumulate else 1)
        bandwidth = self.profile.hbm_bytes_per_s * dil["memory_efficiency"]
        return _Task("mem", dil["launch_s"] if op.dst.numel else 0.0, nbytes / bandwidth)

    def _price_all_to_all(self, op) -> _Task:
        sizes = [self._bytes(b) for b in op.dsts if b is not None]
        return self.collective("all_to_all", max(sizes, default=0), len(sizes))

    def _price_reduce_scatter(self, op) -> _Task:
        # W-1 peers' pieces of this rank's block cross the links; the collective's own
        # reduction runs on the compute units it holds.
        block = op.dst.numel * item_bytes(self.problem, "partial") if op.dst is not None else 0
        return self.collective("reduce_scatter", block, self.problem.world - 1)

    def _price_all_reduce(self, op) -> _Task:
        """The process group's all-reduce (NCCL/RCCL): :mod:`ficco.heuristics.reductions`."""
        return reductions.price_all_reduce(self, op, _Task)

    def _price_send_recv(self, op) -> _Task:
        block = op.recv if op.recv is not None else op.send
        return self.collective("all_to_all", self._bytes(block) if block else 0, 1)

    def _price_barrier(self, op) -> _Task:
        world = self.problem.world
        return _Task("sync", self.profile.barrier_latency_s if world > 1 else 0.0, 0.0)

    def _dma(self, peer: int, nbytes: int, row_bytes: int | None) -> _Task:
        prof = self.profile
        if nbytes == 0:
            return _Task("dma", 0.0, 0.0, ("link", peer), 0.0)
        fraction = prof.copy_fraction(nbytes * self.size_scale)
        if row_bytes is not None:
            fraction *= row_bytes / (row_bytes + prof.copy_2d_half_row_bytes)
        bandwidth = self.link_bytes_per_s
        if prof.copy_engine_bytes_per_s:
            bandwidth = min(bandwidth, prof.copy_engine_bytes_per_s)
        demand = bandwidth * fraction
        link = ("link", peer) if self.topology == "mesh" else ("gpu",)
        # a copy past one SDMA packet's byte count is several packets, each after the
        # first paying the engine's per-packet cost (Profile.copy_packet_overhead_s)
        fixed = prof.copy_latency_s + prof.copy_packet_overhead_s(nbytes)
        return _Task("dma", fixed, nbytes / demand, link, demand)

    def _memory_move(self, nbytes: int, on_copy_engine: bool = True) -> _Task:
        """A memory-bound local move (read + write): on a copy engine, or a kernel on the
        compute units (which a GEMM beside it feels like a collective's kernel)."""
        dil = self.profile.dil
        bandwidth = self.profile.hbm_bytes_per_s * dil["memory_efficiency"]
        return _Task("mem" if on_copy_engine else "cu_mem", dil["launch_s"] if nbytes else 0.0,
                     2 * nbytes / bandwidth)

    def collective(self, kind: str, bytes_per_peer: int, peers: int) -> _Task:
        """A collective ``kind`` (:data:`ficco.heuristics.collectives.KINDS`: all_gather,
        reduce_scatter, all_to_all, all_reduce) on compute units, this rank exchanging
        ``bytes_per_peer`` with each of ``peers`` ranks (all_reduce: its buffer is W blocks of
        ``bytes_per_peer``), priced by the profile's bus-bandwidth curve of that primitive
        (:func:`ficco.heuristics.collectives.collective_seconds`). The task a plan op of that
        collective's kind returns from its ``_price_<kind>`` method."""
        if bytes_per_peer == 0 or peers <= 0:
            return _Task("ccl", 0.0, 0.0)
        seconds = collectives.collective_seconds(
            self.profile, kind, bytes_per_peer, peers, world=self.problem.world,
            topology=self.topology, link_bytes_per_s=self.link_bytes_per_s,
            size_scale=self.size_scale)
        # the launch latency is never slowed by contention; the rest is bandwidth
        fixed = min(collectives.latency_seconds(self.profile, kind, self.topology), seconds / 2)
        return _Task("ccl", fixed, seconds - fixed)


def _issue_calls(plan: Plan, batched: bool) -> Sequence[int]:
    """Per plan op, the runtime calls the host has made once it issued it (see the module
    doc); one per plan op for a plan the executor does not run (no compute queue: a
    benchmark's replay of copies alone) or cannot lower (an op it does not know)."""
    from ..executor.compiler import compile_plan

    if COMPUTE in plan.queues:
        try:
            return compile_plan(plan).issue_calls(batched)[0]
        except InvalidArgumentError:
            pass
    return range(1, len(plan.ops) + 1)


def _lower_gated(plan: Plan) -> tuple[tuple[Op | GatedPiece, ...], Sequence[int]]:
    """(ops, origin): the plan's ops with gated GEMMs split into pieces gated on their flags'
    Signals, and per op the index of the op the host enqueued for it (see
    :mod:`ficco.heuristics.pieces`)."""
    if not any(isinstance(op, GatedGemm) for op in plan.ops):
        return plan.ops, range(len(plan.ops))
    return lower_for_simulation(plan)


def ideal_speedup(serial: SimResult) -> float:
    """The paper's ideal: the serial run with its GEMM and its all-gather perfectly overlapped
    (no decomposition or contention loss), as a speedup over serial. The all-gather counts
    from time 0, with its publish and barrier, since a schedule may start the local GEMM at
    once. Balanced GEMM and communication approach 2x.

    >>> ideal_speedup(SimResult(2.0, [
    ...     {"kind": "copy_1d", "label": "peer 1 c0", "start_s": 0.0, "end_s": 1.0},
    ...     {"kind": "gemm", "label": "gemm", "start_s": 1.0, "end_s": 2.0}]))
    2.0
    """
    gemm_s = serial.busy_s("gemm")
    comm = [r for r in serial.rows
            if r["kind"] in ("all_gather", "send_recv") or r["label"].startswith("peer ")]
    comm_s = max((r["end_s"] for r in comm), default=0.0)
    return serial.makespan_s / max(serial.makespan_s - min(gemm_s, comm_s), _EPS)
