"""What a collective of the process group costs: one bus-bandwidth curve per primitive.

NCCL and RCCL do not run every collective alike: on an 8x H100 NVSwitch node an all-gather
reaches about 360 GB/s of bus bandwidth where an all-to-all reaches less, and on the MI300X
mesh an all-to-all gets 40-48 GB/s out of each 64 GB/s link. So a profile carries, per
primitive, the curve ``nccl-tests`` prints (``ccl.busbw[kind]``: message size in bytes ->
bus bandwidth in bytes/s, measured on ``ccl.busbw_world`` GPUs of the profile's own
topology), and a collective is priced from it:

    time = size x factor / busbw(size)

with ``size`` and ``factor`` as nccl-tests defines them (its ``PERFORMANCE.md``):

=================  ==================================  ===================
kind               size (bytes)                        factor
=================  ==================================  ===================
``all_gather``     the gathered output, W blocks       (W - 1) / W
``reduce_scatter`` each rank's input, W blocks         (W - 1) / W
``all_to_all``     what each rank sends, W blocks      (W - 1) / W
``all_reduce``     each rank's buffer                  2 (W - 1) / W
=================  ==================================  ===================

The curve is interpolated linearly in log(size) x log(busbw); below its smallest size the
time stays that point's time (launch and protocol latency dominate) or, where the profile
gives ``ccl.small_latency_s[kind]`` (fitted to published small-message times), falls linearly
from that point's time to that latency at no bytes; above its largest the bandwidth stays
flat. Measured curves already hold the latency, so no separate latency is
added. A primitive without a curve may carry a latency-bandwidth law of its own
(``ccl.latency_bandwidth[kind]``: ``latency_s`` and ``efficiency``): compute-unit kernels that
store into peers over the links from their first bytes (RCCL's all-reduce, mori's all-to-all on
MI300X) take that latency plus the bytes over ``link x efficiency``, with no copy-size ramp,
since the copy curve is shaped after DMA copies, whose per-copy setup small messages do not
amortise:

    time = latency_s + moved bytes / (link x efficiency)

where moved bytes are what crosses this rank's links (a mesh: one peer's, each peer on its own
link; a switch: every peer's through the GPU's one link), twice a block for an all-reduce. Like
a curve, the law holds on the profile's own topology. Any other primitive, or another topology
(``FICCO_TOPOLOGY`` overrides), is priced by the physics the simulator always used:
``ccl.latency_s`` plus the bytes over ``link x ccl.efficiency x copy_fraction(bytes per peer)``,
an all-reduce as a reduce-scatter followed by an all-gather.

Example (MI300X, 8 GPUs, an all-to-all of 256 MiB per peer)::

    >>> from ficco.heuristics import profiles
    >>> mi = profiles.load("mi300x")
    >>> s = collective_seconds(mi, "all_to_all", 256 << 20, 7, world=8)
    >>> 40e9 < (256 << 20) / s < 48e9        # bytes per peer link per second
    True
"""
from __future__ import annotations

import bisect
import math

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


def bus_factor(kind: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``kind`` over ``world`` ranks.

    >>> bus_factor("all_reduce", 8), bus_factor("all_gather", 8)
    (1.75, 0.875)
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; known: {KINDS}")
    share = (world - 1) / world if world > 1 else 0.0
    return 2 * share if kind == "all_reduce" else share


def curve(profile, kind: str) -> list[tuple[float, float]]:
    """The profile's ``(size, busbw)`` points of ``kind``, sorted by size; empty without one."""
    table = (profile.ccl.get("busbw") or {}).get(kind) or {}
    return sorted((float(size), float(bw)) for size, bw in table.items() if float(bw) > 0)


def busbw_at(points: list[tuple[float, float]], size: float) -> float:
    """Bus bandwidth at ``size`` on a curve: log-log interpolation; below the first point the
    time (not the bandwidth) stays constant, above the last the bandwidth stays flat.

    >>> round(busbw_at([(1e6, 1e10), (1e8, 1e11)], 1e7) / 1e9, 1)
    31.6
    >>> busbw_at([(1e6, 1e10), (1e8, 1e11)], 5e5)     # half the bytes in the same time
    5000000000.0
    """
    sizes = [s for s, _ in points]
    if size <= sizes[0]:
        return points[0][1] * size / sizes[0]
    if size >= sizes[-1]:
        return points[-1][1]
    i = bisect.bisect_right(sizes, size)
    (s0, b0), (s1, b1) = points[i - 1], points[i]
    t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))


def small_latency(profile, kind: str) -> float | None:
    """``ccl.small_latency_s[kind]``: the time of a message of no bytes, fitted to published
    small-message times (docs/heuristics.md names each source), which extends ``kind``'s curve
    below its first measured size; None: below it the time stays that point's.

    >>> from ficco.heuristics import profiles
    >>> small_latency(profiles.load("h100"), "all_reduce")
    2.2e-05
    """
    given = (profile.ccl.get("small_latency_s") or {}).get(kind)
    return None if given is None else float(given)


def law(profile, kind: str, topology: str | None = None) -> tuple[float, float] | None:
    """``(latency_s, efficiency)`` of ``kind``'s latency-bandwidth law on ``topology`` (the
    profile's own by default), or None where the profile gives none or the topology is another.

    >>> from ficco.heuristics import profiles
    >>> law(profiles.load("mi300x"), "all_to_all"), law(profiles.load("h100"), "all_to_all")
    ((2e-05, 0.67), None)
    """
    if (topology or profile.topology) != profile.topology:
        return None
    given = (profile.ccl.get("latency_bandwidth") or {}).get(kind)
    return (float(given["latency_s"]), float(given["efficiency"])) if given else None


def latency_seconds(profile, kind: str, topology: str | None = None) -> float:
    """The fixed part of one collective ``kind``: its law's latency, else ``ccl.latency_s``."""
    rule = law(profile, kind, topology)
    return rule[0] if rule else float(profile.ccl["latency_s"])


def collective_seconds(profile, kind: str, bytes_per_peer: float, peers: int, *, world: int,
                       topology: str | None = None, link_bytes_per_s: float | None = None,
                       size_scale: float = 1.0) -> float:
    """Seconds of one collective ``kind`` in which this rank exchanges ``bytes_per_peer`` with
    each of ``peers`` ranks of a ``world``-rank group (all-reduce: ``bytes_per_peer`` is one
    rank's block, its buffer is ``world`` of them).

    With a curve for ``kind`` on the profile's own topology, the curve prices it (module doc);
    ``peers`` below ``world - 1`` (a ring step of an all-to-all) uses as many links on a mesh
    (same time) and moves fewer bytes through a switch. Otherwise the physics fallback, on
    ``link_bytes_per_s`` (the simulator's link for the topology in force) with the copy
    curve read at ``bytes_per_peer x size_scale``; a primitive with a law of its own
    (:func:`law`) takes its latency and the bytes at its efficiency, without the copy curve.

    >>> from ficco.heuristics import profiles
    >>> h = profiles.load("h100")
    >>> ag = collective_seconds(h, "all_gather", 16 << 20, 7, world=8)
    >>> ar = collective_seconds(h, "all_reduce", 16 << 20, 7, world=8)
    >>> ar > ag
    True
    """
    if bytes_per_peer <= 0 or peers <= 0 or world <= 1:
        return 0.0
    topology = topology or profile.topology
    moved = bytes_per_peer * (2 if kind == "all_reduce" else 1)
    points = curve(profile, kind) if topology == profile.topology else []
    if points:
        # the curve was measured on `reference` ranks; read it at the same bytes per peer
        reference = int(profile.ccl.get("busbw_world") or profile.gpus_per_node)
        size = bytes_per_peer * reference
        bandwidth = busbw_at(points, size)
        # busbw is the rate into one rank: on a mesh spread over its reference - 1 links
        # (each peer has its own, so fewer peers take as long), through a switch shared
        lanes = reference - 1 if topology == "mesh" else peers
        seconds = moved * lanes / bandwidth
        small = small_latency(profile, kind)
        if small is not None and size < points[0][0]:
            # below the first measured size (where the curve keeps that size's time): from
            # the latency fitted to published small-message times straight up to it
            seconds = small + (seconds - small) * size / points[0][0]
        return seconds
    link = link_bytes_per_s or profile.link_for(topology, world)
    volume = moved * (1 if topology == "mesh" else peers)
    rule = law(profile, kind, topology)
    if rule:
        return rule[0] + volume / (link * rule[1])
    bandwidth = link * profile.ccl["efficiency"] * profile.copy_fraction(bytes_per_peer * size_scale)
    rounds = 2 if kind == "all_reduce" else 1          # reduce-scatter, then all-gather
    return rounds * profile.ccl["latency_s"] + volume / bandwidth
