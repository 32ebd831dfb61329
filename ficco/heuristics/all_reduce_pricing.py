"""Prices of the all-reduce's own pieces for the simulator (``matmul_all_reduce``), kept apart
from the other collectives' pricing:

- **the process group's all-reduce** (:class:`~ficco.plan.AllReduce`, NCCL/RCCL): a latency,
  then the bus volume of a bandwidth-optimal all-reduce, ``2 (W-1)/W`` of the message per
  rank (nccl-tests' definition: ``busbw = algbw * 2 (W-1)/W``), at the profile's all-reduce
  bus bandwidth scaled by its copy-efficiency curve at the per-rank piece (``S/W``: small
  messages do not fill the links);
- **a kernel that reads peers' symmetric memory with loads** (a :class:`~ficco.plan.Reduce`
  whose sources name peers: the ``-sm`` schedules): the remote bytes over this GPU's ingress
  (the W-1 links of a mesh, the GPU's link into a switch) at the collective efficiency, beside
  the local bytes over HBM; it runs on compute units, so it contends with the GEMM as a
  collective does.

Bus bandwidth and latency of the all-reduce, per built-in profile (:data:`PUBLISHED`; other
profiles derive both from their ``ccl`` block and links: ``efficiency`` x ingress, and
``latency_s``):

- h100, h200 (NVSwitch, NVLink SHARP): peak bus bandwidth 480 GB/s on 8 GPUs with NVLink
  SHARP, NCCL's default all-reduce there (370 GB/s with ``NCCL_ALGO=Ring``): NCCL's maintainer
  in github.com/NVIDIA/nccl-tests/issues/212. Latency 12 us: fitted (with that bandwidth)
  to vLLM's published PyNccl all-reduce times on H100, TP = 4, bf16 (m, 8192), m = 32-256
  (0.5-4 MB): github.com/vllm-project/vllm/pull/24111 (17-37 us) and /pull/24532 (21-39 us,
  a later run of the same benchmark: the two runs differ by up to 24% themselves). The
  model is within 13% of all twelve points (median 9%); :func:`check_published` holds it
  there. H200 has the same NVSwitch and links: the same numbers, not measured.

Example::

    >>> from ficco.heuristics import profiles
    >>> round(collective_seconds(profiles.load("h100"), 4 << 20, 4) * 1e6)    # 4 MiB on 4 GPUs; vLLM: 37-39
    34
"""
from __future__ import annotations

#: profile name -> (all-reduce bus bandwidth at large messages, latency), with the sources above
PUBLISHED = {"h100": (480e9, 12e-6), "h200": (480e9, 12e-6)}

#: published all-reduce times: (source, profile, world, message bytes, seconds)
_VLLM_24111 = "github.com/vllm-project/vllm/pull/24111 (H100, TP=4, PyNccl, bf16 (m, 8192))"
_VLLM_24532 = "github.com/vllm-project/vllm/pull/24532 (H100, TP=4, PyNccl, bf16 (m, 8192))"
POINTS = [(_VLLM_24111, "h100", 4, int(mb * (1 << 20)), us * 1e-6)
          for mb, us in ((0.5, 17), (1, 19), (1.5, 22), (2, 26), (3, 31), (4, 37))] + \
         [(_VLLM_24532, "h100", 4, int(mb * (1 << 20)), us * 1e-6)
          for mb, us in ((0.5, 21), (1, 23), (1.5, 25), (2, 28), (3, 33), (4, 39))]


def _ingress(profile, world: int, topology: str | None = None) -> float:
    """Bytes/s this GPU can receive at once: every link of a mesh, the GPU's own elsewhere."""
    topology = topology or profile.topology
    link = profile.link_for(topology, world)
    return link * (max(world - 1, 1) if topology == "mesh" else 1)


def bus_bandwidth(profile, world: int, topology: str | None = None) -> tuple[float, float]:
    """(bus bandwidth at large messages, latency) of the process group's all-reduce."""
    topology = topology or profile.topology
    if profile.name in PUBLISHED and topology == profile.topology:
        return PUBLISHED[profile.name]
    return profile.ccl["efficiency"] * _ingress(profile, world, topology), \
        profile.ccl["latency_s"]


def collective_seconds(profile, nbytes: int, world: int, topology: str | None = None) -> float:
    """Seconds of an all-reduce of ``nbytes`` per rank over ``world`` ranks, alone."""
    latency_s, work_s = collective_parts(profile, nbytes, world, topology)
    return latency_s + work_s


def collective_parts(profile, nbytes: int, world: int,
                     topology: str | None = None) -> tuple[float, float]:
    """(latency, bandwidth part) of an all-reduce of ``nbytes`` per rank, alone."""
    if nbytes <= 0 or world <= 1:
        return 0.0, 0.0
    busbw, latency_s = bus_bandwidth(profile, world, topology)
    ramp = profile.copy_fraction(nbytes / world)
    return latency_s, 2 * (world - 1) / world * nbytes / (busbw * ramp)


def check_published(load) -> list[tuple[str, int, float, float, float]]:
    """(source, bytes, published s, predicted s, relative error) of every point in
    :data:`POINTS`; ``load`` loads a profile by name.

    >>> from ficco.heuristics import profiles
    >>> max(abs(row[-1]) for row in check_published(profiles.load)) < 0.15
    True
    """
    rows = []
    for source, name, world, nbytes, seconds in POINTS:
        predicted = collective_seconds(load(name), nbytes, world)
        rows.append((source, nbytes, seconds, predicted, predicted / seconds - 1))
    return rows


def price_all_reduce(sim, op, task):
    """The simulator task of an :class:`~ficco.plan.AllReduce` (a collective on compute
    units: it takes some of the GEMM's, as every collective does)."""
    nbytes = sim._bytes(op.src)
    latency_s, work_s = collective_parts(sim.profile, nbytes, sim.problem.world, sim.topology)
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
    link_s = remote / (prof.ccl["efficiency"] * _ingress(prof, p.world, sim.topology))
    memory_s = local / (prof.hbm_bytes_per_s * prof.dil["memory_efficiency"])
    return task("ccl", prof.dil["launch_s"], max(link_s, memory_s))
