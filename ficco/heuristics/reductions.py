"""Prices of a plan's reductions for the simulator (``matmul_all_reduce`` plans them):

- **the process group's all-reduce** (:class:`~ficco.plan.AllReduce`, NCCL/RCCL), from the
  profile's numbers, whichever it carries (no name check: a calibrated or new profile prices it
  the same way), first match wins:

  1. an ``all_reduce`` bus-bandwidth curve measured on as many ranks as the call has
     (``ccl.busbw_world``), for a message from the curve's first size on: the curve itself
     (:func:`ficco.heuristics.collectives.collective_seconds`), which carries that rank
     count's latency and fill (h100, h200 at 8 GPUs, 2 MiB and up: NVLS). Below its first
     size a curve only holds that size's time, which a smaller message does not take;
  2. a latency-bandwidth law of its own (``ccl.latency_bandwidth["all_reduce"]``,
     :func:`ficco.heuristics.collectives.law`): compute-unit kernels that stream into peers
     from their first bytes, so its latency plus the bus volume, ``2 (W-1)/W`` of the message
     per rank (nccl-tests' ``busbw = algbw * 2 (W-1)/W``), over the links it crosses at the
     law's efficiency, with no copy-size ramp (mi300x, mi325x: RCCL's all-reduce);
  3. otherwise a latency, then the bus volume at the peak bus bandwidth scaled by the
     profile's copy-efficiency curve at the per-rank piece (``S/W``: small messages do not
     fill the links). The latency is ``ccl.all_reduce_latency_s`` (``None``: two collective
     latencies, ``2 x ccl.latency_s``, a reduce-scatter then an all-gather), the peak the
     plateau (largest size) of its ``all_reduce`` curve, or without one the link it crosses
     (every link of a mesh) at ``ccl.efficiency``;
- **a kernel that reads peers' symmetric memory with loads** (a :class:`~ficco.plan.Reduce`
  whose sources name peers: the ``-sm`` schedules): the remote bytes over this GPU's ingress
  (the W-1 links of a mesh, the GPU's link into a switch) at the collective efficiency, beside
  the local bytes over HBM; it runs on compute units, so it contends with the GEMM as a
  collective does.

The h100 numbers (h200: the same NVSwitch and links, the same numbers, not measured): the
``all_reduce`` curve is NCCL's NVLS all-reduce as nccl-tests measured it on 8x H100 (Azure's
benchmarking guide: 172, 362, 466 GB/s busbw at 8 MiB, 64 MiB, 1 GiB; published.csv N1-N3)
up to the ~480 GB/s peak NCCL's maintainer gives (github.com/NVIDIA/nccl-tests/issues/212),
with the all-gather's bus bandwidth at 2 MiB: a small NVLS all-reduce runs at about the
all-gather's (N1: 172 against 169 at 8 MiB). On 8 GPUs from 2 MiB on the curve prices it.
On other rank counts the curve's latency does not carry, nor below 2 MiB its time, and rule 3
prices it: latency 12 us (``all_reduce_latency_s``), fitted (with the 480 GB/s peak) to vLLM's
published PyNccl all-reduce times on H100, TP = 4, bf16 (m, 8192), m = 32-256 (0.5-4 MB):
github.com/vllm-project/vllm/pull/24111 (17-37 us) and /pull/24532 (21-39 us, a later run of
the same benchmark: the two runs differ by up to 24% themselves). It is within 13% of all
twelve points (median 9%); :func:`check_published` holds it there. Reading the measured
8-GPU curve at those 4-GPU calls instead (at ``bytes x 8``, as the other primitives are read)
gives -25% to +2% (median 6%): within the first run's 9%, up to 25% fast against the second.

The loads need no number of their own: priced with the profile's link, ``ccl.efficiency`` and
HBM, a one-shot reduction by loads is within 9% of vLLM's one-stage custom all-reduce on H100,
TP = 4, 0.5-4 MB (10-38 us, vllm/pull/24111), also held by :func:`check_published`.

Example::

    >>> from ficco.heuristics import profiles
    >>> round(collective_seconds(profiles.load("h100"), 4 << 20, 4) * 1e6)    # 4 MiB on 4 GPUs; vLLM: 37-39
    34
"""
from __future__ import annotations

import math

from ..plan import item_bytes
from . import collectives

#: published all-reduce times: (source, kind, profile, world, message bytes, seconds); kind
#: "nccl": the process group's all-reduce; "loads": vLLM's one-stage custom all-reduce, one
#: kernel that reads every peer's buffer (what a one-shot's ``-sm`` reduction is), its two
#: flag barriers inside (so the reduction alone is held to it)
_VLLM_24111 = "github.com/vllm-project/vllm/pull/24111 (H100, TP=4, bf16 (m, 8192))"
_VLLM_24532 = "github.com/vllm-project/vllm/pull/24532 (H100, TP=4, bf16 (m, 8192))"
_SIZES_MB = (0.5, 1, 1.5, 2, 3, 4)
POINTS = [(source, kind, "h100", 4, int(mb * (1 << 20)), us * 1e-6)
          for source, kind, times in (
              (_VLLM_24111, "nccl", (17, 19, 22, 26, 31, 37)),      # PyNccl
              (_VLLM_24532, "nccl", (21, 23, 25, 28, 33, 39)),      # PyNccl, a later run
              (_VLLM_24111, "loads", (10, 15, 19, 22, 30, 38)))     # ca_1stage
          for mb, us in zip(_SIZES_MB, times)]


def _ingress(profile, world: int, topology: str | None = None) -> float:
    """Bytes/s this GPU can receive at once: every link of a mesh, the GPU's own elsewhere."""
    topology = topology or profile.topology
    link = profile.link_for(topology, world)
    return link * (max(world - 1, 1) if topology == "mesh" else 1)


def collective_seconds(profile, nbytes: int, world: int, topology: str | None = None) -> float:
    """Seconds of an all-reduce of ``nbytes`` per rank over ``world`` ranks, alone."""
    latency_s, work_s = collective_parts(profile, nbytes, world, topology)
    return latency_s + work_s


def latency_seconds(profile, topology: str | None = None) -> float:
    """The all-reduce's latency on ``profile``: its law's (``ccl.latency_bandwidth``), else
    ``ccl.all_reduce_latency_s``, else two collective latencies (a reduce-scatter then an
    all-gather).

    >>> from ficco.heuristics import profiles
    >>> latency_seconds(profiles.load("h100")), latency_seconds(profiles.load("mi300x"))
    (1.2e-05, 5.4e-05)
    """
    rule = collectives.law(profile, "all_reduce", topology)
    if rule:
        return rule[0]
    given = profile.ccl.get("all_reduce_latency_s")
    return float(given) if given is not None else 2 * profile.ccl["latency_s"]


def peak_busbw(profile, world: int, topology: str | None = None) -> float:
    """The all-reduce's peak bus bandwidth: the plateau of the profile's ``all_reduce`` curve
    on its own topology, else the links it crosses (a mesh's W-1, a switch's one) at
    ``ccl.efficiency``."""
    topology = topology or profile.topology
    points = collectives.curve(profile, "all_reduce") if topology == profile.topology else []
    if points:
        return points[-1][1]
    return _ingress(profile, world, topology) * profile.ccl["efficiency"]


def collective_parts(profile, nbytes: int, world: int, topology: str | None = None,
                     size_scale: float = 1.0) -> tuple[float, float]:
    """(latency, bandwidth part) of an all-reduce of ``nbytes`` per rank, alone; the copy
    curve is read at the per-rank piece times ``size_scale`` (a slower link than the
    profile's own fills at fewer bytes, as for every collective)."""
    if nbytes <= 0 or world <= 1:
        return 0.0, 0.0
    topology = topology or profile.topology
    bus_bytes = 2 * (world - 1) / world * nbytes
    points = collectives.curve(profile, "all_reduce") if topology == profile.topology else []
    below = collectives.small_latency(profile, "all_reduce") is not None
    if (points and (nbytes >= points[0][0] or below)
            and world == int(profile.ccl.get("busbw_world") or profile.gpus_per_node)):
        # 1: the curve measured on this many ranks and sizes, its latency and fill included
        seconds = collectives.collective_seconds(profile, "all_reduce", nbytes / world,
                                                 world - 1, world=world, topology=topology)
        fixed = min(latency_seconds(profile, topology), seconds / 2)
        return fixed, seconds - fixed
    rule = collectives.law(profile, "all_reduce", topology)
    if rule:            # 2: compute-unit kernels at their own latency and efficiency
        return rule[0], bus_bytes / (_ingress(profile, world, topology) * rule[1])
    ramp = profile.copy_fraction(nbytes / world * size_scale)
    work_s = bus_bytes / (peak_busbw(profile, world, topology) * ramp)
    return latency_seconds(profile, topology), work_s


def loads_seconds(profile, nbytes: int, world: int, topology: str | None = None) -> float:
    """Seconds of a one-shot reduction by loads of ``nbytes`` per rank (W-1 peers' buffers read
    over the links, this rank's own and the output over HBM), alone."""
    return _loads(profile, (world - 1) * nbytes, 2 * nbytes, world, topology)


def _loads(profile, remote: int, local: int, world: int, topology: str | None) -> float:
    link_s = remote / (profile.ccl["efficiency"] * _ingress(profile, world, topology))
    memory_s = local / (profile.hbm_bytes_per_s * profile.dil["memory_efficiency"])
    return profile.dil["launch_s"] + max(link_s, memory_s)


def kernel_fixed_seconds(profile, barriers: int) -> float:
    """The fixed cost of one launch of the one-kernel all-reduce with ``barriers`` flag
    barriers inside: the profile's kernel launch, then a flag round trip per barrier
    (``ccl.kernel_flag_s``, else a fifth of the plan barrier's latency: a store and a poll of
    peer memory from a running kernel, no stream memory operation)."""
    flag_s = profile.ccl.get("kernel_flag_s")
    if flag_s is None:
        flag_s = profile.barrier_latency_s / 5
    return profile.dil["launch_s"] + barriers * float(flag_s)


def shot_kernel_seconds(profile, nbytes: int, world: int, two_shot: bool = False,
                        topology: str | None = None, out_bytes: int | None = None) -> float:
    """Seconds of the one-kernel all-reduce of ``nbytes`` per rank, alone: its fixed cost
    (:func:`kernel_fixed_seconds`) and its reads of peers' memory over this GPU's ingress
    beside its HBM traffic. One-shot reads the W-1 peers' whole partials; two-shot reads
    (W-1)/W of them for its piece, then (W-1)/W of the output from the peers' pieces."""
    if nbytes <= 0 or world <= 1:
        return 0.0
    return kernel_fixed_seconds(profile, 3 if two_shot else 2) + \
        _kernel_work(profile, nbytes, world, two_shot, topology, out_bytes)


def _kernel_work(profile, nbytes, world, two_shot, topology, out_bytes=None) -> float:
    out_bytes = nbytes if out_bytes is None else out_bytes
    if two_shot:
        remote = (world - 1) * nbytes / world + (world - 1) * out_bytes / world
        local = nbytes / world + 2 * out_bytes
    else:
        remote, local = (world - 1) * nbytes, nbytes + out_bytes
    link_s = remote / (profile.ccl["efficiency"] * _ingress(profile, world, topology))
    memory_s = local / (profile.hbm_bytes_per_s * profile.dil["memory_efficiency"])
    return max(link_s, memory_s)


def price_shot_kernel(sim, op, task):
    """The simulator task of a one-kernel all-reduce launch (``one-shot-kernel``,
    ``two-shot-kernel``): one kernel's fixed cost, its barriers inside, then its loads; on
    compute units, so it contends with a GEMM as a collective does."""
    p = sim.problem
    n = p.ns[op.b]
    nbytes = p.m * n * item_bytes(p, "partial")
    out_bytes = p.m * n * item_bytes(p, "out", sim.wide)
    if not nbytes or p.world <= 1:
        return task("ccl", 0.0, 0.0)
    return task("ccl", kernel_fixed_seconds(sim.profile, op.barriers),
                _kernel_work(sim.profile, nbytes, p.world, op.two_shot, sim.topology,
                             out_bytes))


def torch_kernel_seconds(profile, nbytes: int, world: int, variant: str = "one-shot",
                         topology: str | None = None, copy_in: bool = False) -> float:
    """Seconds of torch's ``symm_mem`` all-reduce ``variant`` of ``nbytes`` per rank, alone:
    the one-kernel all-reduce's price (one-shot: two barriers; two-shot and multimem: three,
    multimem's reads and writes through the switch's multicast at the same link rate) plus
    one more launch (torch's kernel takes its pointers from a host-side table per call), and
    with ``copy_in`` the copy of the partial into torch's buffer."""
    if nbytes <= 0 or world <= 1:
        return 0.0
    two_shot = variant != "one-shot"
    moved = 2 * nbytes / (profile.hbm_bytes_per_s * profile.dil["memory_efficiency"]) \
        if copy_in else 0.0
    return shot_kernel_seconds(profile, nbytes, world, two_shot, topology) + \
        profile.dil["launch_s"] + moved


def price_torch_kernel(sim, op, task):
    """torch's ``symm_mem`` all-reduce (``torch-*``): :func:`torch_kernel_seconds`, with the
    copy of the partial into torch's buffer (ficco's workspace is not torch's unless
    FICCO_SYMM says so); on compute units."""
    p = sim.problem
    nbytes = p.m * p.ns[op.b] * item_bytes(p, "partial")
    if not nbytes or p.world <= 1:
        return task("ccl", 0.0, 0.0)
    seconds = torch_kernel_seconds(sim.profile, nbytes, p.world, op.variant, sim.topology,
                                   copy_in=True)
    fixed = kernel_fixed_seconds(sim.profile, 2 if op.variant == "one-shot" else 3) + \
        sim.profile.dil["launch_s"]
    return task("ccl", fixed, seconds - fixed)


#: what each schedule's all-reduce runs, and the validate predictor its published times use
#: (``shapes`` beyond size and world)
_KERNELS: dict[str, tuple[str, str, dict]] = {
    "one-shot-kernel": ("ficco's one-kernel all-reduce, one-shot (ficco/kernels/all_reduce.py)",
                        "kernel_all_reduce_us", {"shots": "one"}),
    "two-shot-kernel": ("ficco's one-kernel all-reduce, two-shot (ficco/kernels/all_reduce.py)",
                        "kernel_all_reduce_us", {"shots": "two"}),
    "torch-one-shot": ("torch.ops.symm_mem.one_shot_all_reduce_out", "torch_all_reduce_us",
                       {"variant": "one-shot"}),
    "torch-two-shot": ("torch.ops.symm_mem.two_shot_all_reduce_out", "torch_all_reduce_us",
                       {"variant": "two-shot"}),
    "torch-multimem": ("torch.ops.symm_mem.multimem_all_reduce_", "torch_all_reduce_us",
                       {"variant": "multimem"}),
}
_CCL: tuple[str, str, dict] = ("the process group's all-reduce (NCCL/RCCL)", "all_reduce_us", {})


def kernel_of(schedule: str, transport: str) -> tuple[str, str, dict] | None:
    """(what the all-reduce of ``schedule`` over ``transport`` runs, the validate quantity of
    its published times, its shapes) or None for a copy-engine or loads plan, priced by the
    simulator's copy and barrier model (no publication times that mechanism).

    >>> kernel_of("serial", "ccl")[0], kernel_of("one-shot-kernel", "dma")[1]
    ("the process group's all-reduce (NCCL/RCCL)", 'kernel_all_reduce_us')
    """
    if schedule in _KERNELS:
        return _KERNELS[schedule]
    if transport == "ccl" and (schedule == "serial" or schedule.startswith("chunked")):
        return _CCL
    return None


def published_rows() -> list[dict]:
    """The ``decode`` rows of ``python -m ficco.bench validate``'s table (package data)."""
    import csv
    from importlib import resources

    table = resources.files("ficco") / "bench" / "validation" / "published.csv"
    text = table.read_text(encoding="utf-8")
    return [r for r in csv.DictReader(text.splitlines()) if r["family"] == "decode"]


def priced_against(problem, decision) -> tuple[str, ...]:
    """What ``explain`` adds for an all-reduce: the kernel the pick runs, its price alone at
    this message size, and the published time nearest in size on the same hardware and rank
    count that the price is held against (``validate``'s row); the one-kernel all-reduce's
    price beside it when the pick is something else.

    >>> from ficco.heuristics.decision import Decision
    >>> from ficco.plan.problem import Problem
    >>> p = Problem(4, 512, (4096,), "bfloat16", 8, op="matmul_all_reduce")
    >>> d = Decision("serial", "ccl", "model", {"profile": "h100"})
    >>> lines = priced_against(p, d)
    >>> lines[0]
    "serial runs the process group's all-reduce (NCCL/RCCL): 32 KB per rank on 8 ranks, 22.3 us alone (h100)"
    >>> lines[1].startswith("published 22.65 us at 32 KB"), lines[1].endswith("(validate row W2, fit)")
    (True, True)
    """
    from . import profiles

    name = str(decision.inputs.get("profile") or "")
    if problem.world <= 1 or not name:
        return ()
    try:
        prof = profiles.load(name)
    except Exception:  # noqa: BLE001 - a profile explain cannot load prices nothing here
        return ()
    nbytes = problem.m * problem.ns[0] * item_bytes(problem, "partial")
    world = problem.world
    lines = []
    chosen = kernel_of(decision.schedule, decision.transport)
    if chosen is None:
        lines.append(f"{decision.schedule} over {decision.transport} runs copy-engine pulls or "
                     f"loads between plan barriers, priced by the simulator's copy and barrier "
                     f"model (no publication times that mechanism)")
    else:
        lines += _priced(decision.schedule, "runs", chosen, prof, name, nbytes, world)
    if decision.schedule not in _KERNELS:
        lines += _priced("one-shot-kernel", "would run", _KERNELS["one-shot-kernel"], prof,
                         name, nbytes, world)
    return tuple(lines)


def _seconds(quantity: str, shapes: dict, prof, nbytes: int, world: int) -> float:
    if quantity == "all_reduce_us":
        return collective_seconds(prof, nbytes, world)
    if quantity == "torch_all_reduce_us":
        return torch_kernel_seconds(prof, nbytes, world, shapes["variant"])
    return shot_kernel_seconds(prof, nbytes, world, shapes["shots"] == "two")


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1024:.0f} KB" if nbytes < 1 << 20 else f"{nbytes / (1 << 20):.2g} MB"


def _priced(schedule, verb, kernel, prof, name, nbytes, world) -> list[str]:
    what, quantity, shapes = kernel
    seconds = _seconds(quantity, shapes, prof, nbytes, world)
    lines = [(f"{schedule} {verb} {what}: {_kb(nbytes)} per rank on {world} ranks, "
              f"{seconds * 1e6:.1f} us alone ({name})")]
    rows = []
    for r in published_rows():
        got = dict(item.split("=", 1) for item in r["shapes"].split())
        same = all(got.get(k, "best" if k == "shots" else None) in (v, "best")
                   for k, v in shapes.items())
        if r["profile"] == name and r["quantity"] == quantity and same \
                and int(got.get("world", 8)) == world:
            rows.append((abs(math.log(int(got["size"]) / max(nbytes, 1))), r, int(got["size"])))
    if not rows:
        lines.append(f"no published time of it on {name} at {world} ranks "
                     f"(python -m ficco.bench validate lists what is held)")
        return lines
    _, row, size = min(rows, key=lambda item: item[0])
    lines.append(f"published {row['published']} us at {_kb(size)}: {row['source'].split(' (')[0]} "
                 f"(validate row {row['id']}, {row['role']})")
    return lines


def check_published(load) -> list[tuple[str, str, int, float, float, float]]:
    """(source, kind, bytes, published s, predicted s, relative error) of every point in
    :data:`POINTS`; ``load`` loads a profile by name.

    >>> from ficco.heuristics import profiles
    >>> max(abs(row[-1]) for row in check_published(profiles.load)) < 0.15
    True
    """
    rows = []
    for source, kind, name, world, nbytes, seconds in POINTS:
        price = collective_seconds if kind == "nccl" else loads_seconds
        predicted = price(load(name), nbytes, world)
        rows.append((source, kind, nbytes, seconds, predicted, predicted / seconds - 1))
    return rows


def price_all_reduce(sim, op, task):
    """The simulator task of an :class:`~ficco.plan.AllReduce` (a collective on compute
    units: it takes some of the GEMM's, as every collective does)."""
    nbytes, world = sim._bytes(op.src), sim.problem.world
    latency_s, work_s = collective_parts(sim.profile, nbytes, world, sim.topology,
                                         sim.size_scale)
    if not nbytes or world <= 1:
        return task("ccl", 0.0, 0.0)
    return task("ccl", latency_s, work_s)


def price_remote_reduce(sim, op, task):
    """A Reduce whose sources include peers' symmetric memory (``-sm``): its remote bytes
    over this GPU's ingress at the collective efficiency, its local bytes (the destination,
    local sources) over HBM, whichever is longer; a kernel on compute units."""
    p, prof = sim.problem, sim.profile
    rank = p.rank
    remote = sum(sim._bytes(s) for s in op.srcs if s.peer is not None and s.peer != rank)
    local = sum(sim._bytes(s) for s in op.srcs if s.peer is None or s.peer == rank) \
        + sim._bytes(op.dst) * (2 if op.accumulate else 1)
    launch_s = prof.dil["launch_s"]
    return task("ccl", launch_s, _loads(prof, remote, local, p.world, sim.topology) - launch_s)
