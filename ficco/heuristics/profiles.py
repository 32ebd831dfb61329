"""Device profiles: the numbers the simulator and the ``paper`` selector need, as data.

A profile is one JSON file. Built-in ones live in ``ficco/heuristics/profiles/<name>.json``;
``bench characterize`` writes the same schema from measurements, and ``FICCO_PROFILE`` takes
either a built-in name or a path to such a file.

JSON schema (every key at top level; units in the names)::

    {
      "name": "mi300x",                        # str
      "peak_flops": {"bfloat16": 1.3074e15,    # dense FLOP/s per torch dtype name
                     "float16": ..., "float32": ..., "float64": ...,
                     "float8_e4m3fnuz": 2.6149e15, ...},   # fp8: the forms the device runs
      "hbm_bytes_per_s": 5.3e12,               # device memory bandwidth
      "hbm_capacity_bytes": 1.92e11,           # device memory size
      "compute_units": 304,                    # CUs (AMD) or SMs (NVIDIA)
      "copy_engines": 7,                       # DMA copies that truly run at once
      "copy_engine_bytes_per_s": 6.4e10,       # what one DMA copy can move at most
      "topology": "mesh",                      # "mesh" | "switch" | "pcie"
      "gpus_per_node": 8,
      "link_bytes_per_s": 6.4e10,              # mesh: per link per direction;
                                               # switch: per GPU per direction
      "pcie_bytes_per_s": 6.4e10,              # per GPU per direction, for topology "pcie"
      "copy_latency_s": 1e-05,                 # fixed cost of one DMA copy
      "copy_packet_bytes": 1073741823,         # most bytes one copy command (SDMA packet)
                                               # carries; a larger copy is split (null: no cap)
      "copy_packet_s": 3e-06,                  # cost of each packet after a copy's first
      "copy_queued_s": 3e-06,                  # a copy queued right behind another on its
                                               # copy queue pays this, not copy_latency_s
                                               # (the engine's issue interval; null: none)
      "llc_bytes": 268435456,                  # last-level cache size (0: none modelled)
      "llc_bytes_per_s": 1.72e13,              # its bandwidth (null: none modelled); split-K
                                               # partial sums that fit move at this rate
      "copy_efficiency": {"65536": 0.3, ...},  # copy size in bytes -> fraction of bandwidth
      "copy_2d_half_row_bytes": 256,           # 2D copy row width at which efficiency halves
      "copy_2d_on_dma": true,                  # false: the runtime runs 2-D peer copies as
                                               # kernels on compute units (ROCm)
      "barrier_latency_s": 1e-05,              # cross-rank barrier over symmetric memory
      "host_op_s": 6e-06,                      # host time of one runtime call (eager);
                                               # `bench characterize --parts enqueue`
      "batched_copies": false,                 # true: the runtime submits a queue's copies
                                               # in one call (CUDA >= 12.8); prices host time
      "hardware_queues": null,                 # 1: one queue for all streams (set from
                                               # CUDA_DEVICE_MAX_CONNECTIONS=1 by resolve())
      "pcie_aggregate_bytes_per_s": 7.9e10,    # all GPUs' peer traffic through the host, total
      "dil": {"tiles": [[256, 256, 1.0], ...], # the GEMM library's tiles: (m, n, sustained
                                               # fraction); the fastest is used (heuristics/gemm.py)
              "tile_m": 256, "tile_n": 256,    # the tile when "tiles" is empty
              "tile_k_overhead": 256,          # per-tile prologue/epilogue, in K elements
              "gemm_efficiency": 0.7,          # fraction of peak a full machine sustains
              "partial_wave_speedup": 1.25,    # how much faster a partial last wave's tiles run
              "split_k_below_waves": 0.5,      # split-K only below this many waves of tiles
              "split_k_min_k": 1024,           # ... and while each K part keeps this many
              "split_k_max": 64,               # ... in at most this many parts
              "split_k_rule": "best",          # or "hipblaslt_auto": hipBLASLt's autoGSU
              "depth_u": 64,                   # ... its K step per iteration
              "split_k_workspace_bytes": 79691776,  # ... float32 partials must fit here
              "memory_efficiency": 0.8,        # fraction of HBM bandwidth a copy kernel gets
              "l2_bytes_per_s_per_unit": null, # L2 -> one compute unit (a DeepGEMM block's
                                               # operand feed, heuristics/gemm.py)
              "launch_s": 5e-06},              # fixed cost of one kernel
      "cil": {"dma_gemm": 0.2,                 # GEMM slowdown rate beside copy_engines copies
                                               # (x s(MT)), while both run
              "dma_copy": 0.25,                # copy slowdown rate beside a GEMM (x s(MT))
              "gemm_copies_exp": 0.25,         # GEMM slowdown ~ (copies / copy_engines)^exp
              "copy_copies_exp": 0.7,          # copy slowdown ~ (copies / copy_engines)^exp
              "ccl_gemm": 0.35, "ccl_copy": 0.3,   # the same with collectives on compute units
              "mt_half_bytes": 2e9,            # GEMM memory traffic at which s(MT) is 1/2
              "mt_exp": 1.0,                   # steepness of s(MT) = MT^e / (MT^e + half^e)
              "copy_mt_power": 1.0,            # copies feel s(MT)^power of the GEMM beside them
              "cu_mem_unit_fraction": 0.5},    # share of CUs a gather/scatter kernel takes
      "ccl": {"efficiency": 0.8,               # fraction of link bandwidth a collective reaches
              "latency_s": 2e-05,
              "all_reduce_latency_s": null,    # the all-reduce's (null: 2 x latency_s;
                                               # heuristics/reductions.py)
              "compute_unit_fraction": 0.1},   # share of CUs a collective kernel occupies
      "sources": {"peak_flops": "...", ...}    # where every number comes from
    }

Only ``name``, ``peak_flops``, ``hbm_bytes_per_s``, ``compute_units``, ``topology`` and
``link_bytes_per_s`` are required; the rest default to the values of :data:`DEFAULTS`.

Example::

    >>> from ficco.heuristics import profiles
    >>> p = profiles.load("mi300x")
    >>> p.topology, p.link_bytes_per_s
    ('mesh', 64000000000.0)
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal, TypedDict

from .. import logs
from ..errors import ConfigError
from . import sku

PROFILE_DIR = Path(__file__).with_name("profiles")
_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
#: dtypes priced at another's peak when a profile does not list them (Profile.flops)
_SIBLINGS = {"float16": ("bfloat16",), "bfloat16": ("float16",),
             **{f: tuple(g for g in _FP8 if g != f) for f in _FP8}}
TOPOLOGIES = ("mesh", "switch", "pcie")
REQUIRED = ("name", "peak_flops", "hbm_bytes_per_s", "compute_units", "topology",
            "link_bytes_per_s")


class _Defaults(TypedDict):
    """The types of :data:`DEFAULTS` (each key's type is the Profile field's)."""

    hbm_capacity_bytes: float
    copy_engines: int
    copy_engine_bytes_per_s: float | None
    gpus_per_node: int
    pcie_bytes_per_s: float
    copy_latency_s: float
    copy_packet_bytes: int | None
    copy_packet_s: float
    copy_queued_s: float | None
    llc_bytes: float
    copy_efficiency: dict[str, float]
    copy_2d_half_row_bytes: float
    copy_2d_on_dma: bool
    barrier_latency_s: float
    host_op_s: float
    pcie_aggregate_bytes_per_s: float
    dil: dict[str, object]
    cil: dict[str, float]
    ccl: dict[str, float]


DEFAULTS: _Defaults = {
    "hbm_capacity_bytes": 80e9,
    "copy_engines": 8,
    "copy_engine_bytes_per_s": None,     # None: as fast as the link
    "gpus_per_node": 8,
    "pcie_bytes_per_s": 32e9,
    "copy_latency_s": 10e-6,
    # A copy longer than one copy command carries is split into several; each after the
    # first costs copy_packet_s (None / 0.0: no cap, no cost; only where a source gives them).
    "copy_packet_bytes": None,
    "copy_packet_s": 0.0,
    # A copy queued right behind another on the same copy queue (no completion wait between)
    # pays the engine's issue interval instead of copy_latency_s (None: every copy pays the
    # full round trip; only where a source measures the interval).
    "copy_queued_s": None,
    "llc_bytes": 0.0,
    "copy_efficiency": {"4096": 0.05, "65536": 0.3, "1048576": 0.75, "16777216": 0.92,
                        "268435456": 0.97},
    "copy_2d_half_row_bytes": 256.0,
    "copy_2d_on_dma": True,
    "barrier_latency_s": 10e-6,
    # Host time to enqueue one plan op (eager calls). Every built-in profile states its own,
    # measured (`bench characterize --parts enqueue`) or a labelled estimate (see its sources).
    "host_op_s": 6e-6,
    # The whole box's GPU-to-GPU bandwidth through PCIe and the host: an 8-GPU NCCL
    # all-gather without NVLink reached 7.32 GB/s bus bandwidth into each GPU
    # (github.com/NVIDIA/nccl/issues/644, 256 MiB); with ccl.efficiency 0.8 and the copy
    # curve that is ~79 GB/s for all eight together (bench/validation/published.csv, E5).
    "pcie_aggregate_bytes_per_s": 79e9,
    "dil": {"tiles": [], "tile_m": 256, "tile_n": 256, "tile_k_overhead": 256,
            "gemm_efficiency": 0.7, "partial_wave_speedup": 1.25, "split_k_below_waves": 0.5,
            "split_k_min_k": 1024, "split_k_max": 64, "memory_efficiency": 0.8, "launch_s": 5e-6},
    "cil": {"dma_gemm": 0.2, "dma_copy": 0.25, "gemm_copies_exp": 0.25, "copy_copies_exp": 0.7,
            "ccl_gemm": 0.35, "ccl_copy": 0.3, "mt_half_bytes": 2e9, "mt_exp": 1.0,
            "copy_mt_power": 1.0, "cu_mem_unit_fraction": 0.5},
    "ccl": {"efficiency": 0.8, "latency_s": 20e-6, "compute_unit_fraction": 0.1},
}
_NESTED: tuple[Literal["dil", "cil", "ccl"], ...] = ("dil", "cil", "ccl")

log = logs.log


@dataclass(frozen=True)
class Profile:
    """One device's numbers; see the module docstring for the JSON schema and units. Frozen
    (``dataclasses.replace`` makes a changed copy) and hashed by its :meth:`fingerprint`,
    computed once, so caches key on a profile at the cost of a dictionary lookup. Its nested
    dicts are read-only by convention: a profile in use is never edited in place.
    """

    name: str
    peak_flops: dict
    hbm_bytes_per_s: float
    compute_units: int
    topology: str
    link_bytes_per_s: float
    hbm_capacity_bytes: float = DEFAULTS["hbm_capacity_bytes"]
    copy_engines: int = DEFAULTS["copy_engines"]
    copy_engine_bytes_per_s: float | None = None
    gpus_per_node: int = DEFAULTS["gpus_per_node"]
    pcie_bytes_per_s: float = DEFAULTS["pcie_bytes_per_s"]
    pcie_aggregate_bytes_per_s: float = DEFAULTS["pcie_aggregate_bytes_per_s"]
    copy_latency_s: float = DEFAULTS["copy_latency_s"]
    copy_packet_bytes: int | None = DEFAULTS["copy_packet_bytes"]
    copy_packet_s: float = DEFAULTS["copy_packet_s"]
    copy_queued_s: float | None = DEFAULTS["copy_queued_s"]
    llc_bytes: float = DEFAULTS["llc_bytes"]
    llc_bytes_per_s: float | None = None
    copy_efficiency: dict = field(default_factory=lambda: dict(DEFAULTS["copy_efficiency"]))
    copy_2d_half_row_bytes: float = DEFAULTS["copy_2d_half_row_bytes"]
    copy_2d_on_dma: bool = DEFAULTS["copy_2d_on_dma"]
    barrier_latency_s: float = DEFAULTS["barrier_latency_s"]
    host_op_s: float = DEFAULTS["host_op_s"]
    #: hardware queues a rank's streams share; 1 (CUDA_DEVICE_MAX_CONNECTIONS=1) makes the
    #: simulator dispatch in issue order, a barrier block every queue, copies run one at a
    #: time; None: one per stream (the simulator's queues are independent)
    hardware_queues: int | None = None
    #: whether the runtime submits a queue's copies in one call (``cudaMemcpyBatchAsync``,
    #: CUDA >= 12.8): the simulator counts the host's runtime calls as that backend issues
    #: them (False: one call per copy, as ROCm and older CUDA)
    batched_copies: bool = False
    dil: dict = field(default_factory=lambda: dict(DEFAULTS["dil"]))
    cil: dict = field(default_factory=lambda: dict(DEFAULTS["cil"]))
    ccl: dict = field(default_factory=lambda: dict(DEFAULTS["ccl"]))
    sources: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"profile {self.name!r}: topology {self.topology!r} is not one of "
                              f"{TOPOLOGIES}")
        for key in _NESTED:   # a characterised profile may give only some of the keys
            object.__setattr__(self, key, {**DEFAULTS[key], **getattr(self, key)})
        curve = {str(int(float(k))): float(v) for k, v in self.copy_efficiency.items()}
        if not curve:
            raise ConfigError(f"profile {self.name!r}: copy_efficiency needs at least one "
                              f"size -> fraction point")
        bad = {k: v for k, v in curve.items() if not 0 < v <= 1}
        if bad:
            # A noisy measurement must not give negative or infinite copy times.
            log.warning("ficco: profile %r has copy_efficiency fractions outside (0, 1]: %s; "
                        "clamping them", self.name, bad)
            curve = {k: min(max(v, 1e-3), 1.0) for k, v in curve.items()}
        object.__setattr__(self, "copy_efficiency", curve)
        for name in ("hbm_bytes_per_s", "link_bytes_per_s", "compute_units"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"profile {self.name!r}: {name} must be positive, "
                                  f"got {getattr(self, name)!r}")
        if self.copy_packet_bytes is not None and not self.copy_packet_bytes >= 1:
            raise ConfigError(f"profile {self.name!r}: copy_packet_bytes must be at least 1 "
                              f"(or null: no cap), got {self.copy_packet_bytes!r}")
        if not self.copy_packet_s >= 0:
            raise ConfigError(f"profile {self.name!r}: copy_packet_s must be >= 0, "
                              f"got {self.copy_packet_s!r}")
        if self.copy_queued_s is not None and not 0 <= self.copy_queued_s <= self.copy_latency_s:
            raise ConfigError(f"profile {self.name!r}: copy_queued_s must be between 0 and "
                              f"copy_latency_s (or null), got {self.copy_queued_s!r}")

    # -- derived numbers ---------------------------------------------------------------------
    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for ``dtype``; float16 falls back to bfloat16 and back, an fp8
        form to the device's other fp8 forms (same matrix-unit rate: E4M3 and E5M2 alike, and
        the fnuz forms of MI300X stand in for the OCP ones there, so fp8 problems price on
        every fp8 device).

        >>> load("mi300x").flops("float8_e4m3fn") == load("mi300x").flops("float8_e4m3fnuz")
        True
        """
        for name in (dtype, *_SIBLINGS.get(dtype, ())):
            if name in self.peak_flops:
                return float(self.peak_flops[name])
        raise ConfigError(f"profile {self.name!r} has no peak_flops for {dtype!r}; it has "
                          f"{sorted(self.peak_flops)}; add it to the profile JSON")

    def ridge_flops_per_byte(self, dtype: str) -> float:
        """The machine's op-to-byte ratio: peak FLOP/s over HBM bytes/s."""
        return self.flops(dtype) / self.hbm_bytes_per_s

    def copy_fraction(self, size_bytes: float) -> float:
        """Fraction of link bandwidth one copy of ``size_bytes`` reaches: the
        ``copy_efficiency`` curve, interpolated linearly in log(size), flat at both ends."""
        points = sorted((int(k), v) for k, v in self.copy_efficiency.items())
        sizes = [s for s, _ in points]
        if size_bytes <= sizes[0]:
            return points[0][1]
        if size_bytes >= sizes[-1]:
            return points[-1][1]
        i = bisect.bisect_right(sizes, size_bytes)
        (s0, f0), (s1, f1) = points[i - 1], points[i]
        t = (math.log(size_bytes) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return f0 + t * (f1 - f0)

    def queued_copy_s(self) -> float:
        """What a copy queued right behind another on its copy queue pays instead of
        ``copy_latency_s``: the engine's pipelined issue interval ``copy_queued_s`` where the
        profile gives one, else the full round trip.

        >>> load("mi355x").queued_copy_s(), load("mi300x").queued_copy_s()
        (3e-06, 1e-05)
        """
        return self.copy_latency_s if self.copy_queued_s is None else self.copy_queued_s

    def copy_packet_overhead_s(self, nbytes: float) -> float:
        """What one copy of ``nbytes`` pays beyond ``copy_latency_s`` for being split into
        copy commands of at most ``copy_packet_bytes``: ``copy_packet_s`` per command after
        the first (0 without a cap).

        >>> mi = load("mi355x")
        >>> mi.copy_packet_overhead_s(2**20), mi.copy_packet_overhead_s(3 * mi.copy_packet_bytes)
        (0.0, 6e-06)
        """
        if not self.copy_packet_bytes or nbytes <= self.copy_packet_bytes:
            return 0.0
        return (math.ceil(nbytes / self.copy_packet_bytes) - 1) * self.copy_packet_s

    def link_for(self, topology: str, world: int | None = None) -> float:
        """Bandwidth per link (mesh) or per GPU (switch, pcie) when the profile is used with
        ``topology``: an override converts mesh links to a GPU total and back. Over PCIe the
        ``world`` GPUs moving data at once share the host's aggregate bandwidth.

        >>> load("h100").link_for("pcie", world=8) / 1e9
        9.875
        """
        peers = max(self.gpus_per_node - 1, 1)
        if topology == "pcie":
            sharing = world or self.gpus_per_node
            return min(self.pcie_bytes_per_s, self.pcie_aggregate_bytes_per_s / sharing)
        if topology == self.topology:
            return self.link_bytes_per_s
        if topology == "switch":
            return self.link_bytes_per_s * (peers if self.topology == "mesh" else 1)
        return (self.pcie_bytes_per_s if self.topology == "pcie" else self.link_bytes_per_s) / peers

    # -- JSON --------------------------------------------------------------------------------
    def to_json(self, path) -> None:
        """Write this profile as JSON (atomically) so ``FICCO_PROFILE=path`` reads it back."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict, origin: str = "profile") -> Profile:
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ConfigError(f"{origin}: missing required profile keys {missing}; required: "
                              f"{list(REQUIRED)}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{origin}: unknown profile keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    def fingerprint(self) -> str:
        """A stable string naming these exact numbers (for decision caches), made once.

        >>> load("h100").fingerprint() == replace(load("h100")).fingerprint()
        True
        """
        text = self.__dict__.get("_fingerprint")
        if text is None:
            text = json.dumps(asdict(self), sort_keys=True)
            object.__setattr__(self, "_fingerprint", text)
        return text

    def __hash__(self) -> int:
        return hash(self.fingerprint())


def builtin_names() -> list[str]:
    """Names of the profiles shipped with ficco, e.g. ``['a100', 'b200', 'cpu', …]``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


_loaded: dict[tuple, Profile] = {}


def load(name_or_path: str | os.PathLike) -> Profile:
    """A built-in profile by name (``"mi300x"``) or a profile JSON file by path.

    >>> load("h100").topology
    'switch'
    """
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".json") or os.sep in text or path.is_file()):
        path = PROFILE_DIR / f"{text.lower()}.json"
        if not path.is_file():
            raise ConfigError(f"unknown profile {text!r}; built-in profiles: "
                              f"{', '.join(builtin_names())}, or give a JSON file path")
    try:
        key = (str(path.resolve()), path.stat().st_mtime_ns)   # a rewritten file is re-read
    except OSError:
        key = None
    if key in _loaded:
        return _loaded[key]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"profile file {str(path)!r} does not exist; give a built-in name "
                          f"({', '.join(builtin_names())}) or an existing JSON path") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"profile file {str(path)!r} is not valid JSON: {exc}") from None
    except OSError as exc:   # a directory, no permission
        raise ConfigError(f"profile file {str(path)!r} cannot be read ({exc.strerror}); give "
                          f"a readable JSON file or a built-in name") from None
    if not isinstance(data, dict):
        raise ConfigError(f"profile file {str(path)!r} holds a JSON {type(data).__name__}, "
                          f"not an object of profile keys")
    profile = Profile.from_dict(data, origin=str(path))
    if key is not None:
        _loaded[key] = profile
    return profile


def detect(target: str, device_name: str | None = None) -> str:
    """The built-in profile name for a backend target, refined by the device where one
    architecture covers several parts (:mod:`ficco.heuristics.sku`: sm_90 is an H100 SXM,
    PCIe, H800, H20 or H200; gfx942 an MI300X or MI325X). ``device_name`` stands for the
    device when given; else this process's device is read (none: the reference part).

    >>> detect("rocm:gfx942"), detect("cuda:sm_90", "NVIDIA H200")
    ('mi300x', 'h200')
    """
    props = sku.local_props(target) if device_name is None else sku.DeviceProps(target,
                                                                                device_name)
    return sku.sku_of(props).profile


def cache_root() -> Path:
    """Where ficco keeps what it learns on this machine: ``FICCO_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/ficco`` (``~/.cache/ficco``, the user's own): ``auto/``, ``tune/`` and
    ``profiles/<sku>.json`` (:mod:`ficco.heuristics.cache`)."""
    from .. import config

    return Path(config.cache_dir() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ficco"))


def calibrated_path(sku_id: str) -> Path:
    """The calibrated profile of SKU ``sku_id`` (:attr:`ficco.heuristics.sku.Sku.id`), as
    ``bench characterize --quick`` writes it."""
    return cache_root() / "profiles" / f"{sku_id}.json"


def in_force(target: str = "cpu") -> tuple[Profile, str]:
    """(profile, where it comes from) for ``target`` without ``FICCO_PROFILE``: the profile
    calibrated on this SKU when the cache holds one, else the SKU's built-in profile.

    >>> in_force("rocm:gfx942")[0].name   # doctest: +SKIP
    'mi300x'
    """
    from .cache import trusted, warn_once

    part = sku.sku_of(sku.local_props(target))
    path = calibrated_path(part.id)
    if path.exists():
        why = trusted(path) or trusted(path.parent)
        if why:          # another user's numbers would price this user's calls
            warn_once(path, why, "the built-in profile prices instead")
        else:
            try:
                return load(path), f"calibrated for {part.id} ({path})"
            except ConfigError as exc:   # the cache is optional: the built-in profile prices
                warn_once(path, f"is not a usable profile ({exc})",
                          "the built-in profile prices instead")
    return load(part.profile), f"built-in for {part.id} ({part.reason})"


def resolve(target: str = "cpu") -> Profile:
    """The profile in force: ``FICCO_PROFILE`` (name or path) if set, else :func:`in_force`
    (a profile ``bench characterize --quick`` calibrated on this SKU, else the SKU's built-in
    one). On a target whose backend runs 2-D copies on compute units (ROCm:
    ``RocmBackend.copy_2d_on_dma``) the profile says so whatever its file says, so the
    ``model`` selector never prices ``*-2d`` schedules' copies as DMA there; likewise its
    ``hardware_queues`` follow ``CUDA_DEVICE_MAX_CONNECTIONS`` (ROCm: ``GPU_MAX_HW_QUEUES``).

    >>> resolve("rocm:gfx942").copy_2d_on_dma
    False
    """
    from .. import config

    explicit = config.profile()
    profile = load(explicit) if explicit else in_force(target)[0]
    if profile.copy_2d_on_dma and not target_copies_2d_on_dma(target):
        profile = replace(profile, copy_2d_on_dma=False)
    queues = config.hardware_queues(target.split(":")[0])
    if queues is not None and queues != profile.hardware_queues:
        # CUDA_DEVICE_MAX_CONNECTIONS / GPU_MAX_HW_QUEUES, as the process runs
        profile = replace(profile, hardware_queues=queues)
    return profile


def identity(target: str = "cpu") -> str:
    """A short name of the profile :func:`resolve` gives, which changes when a calibrated
    profile appears or changes: ranks that would price with different profiles disagree on
    it (the runtime agrees it like a setting). ``FICCO_PROFILE``'s value when set."""
    from .. import config

    explicit = config.profile()
    if explicit:
        return explicit
    profile, origin = in_force(target)
    if origin.startswith("built-in"):
        return profile.name
    return f"{profile.name}@{hashlib.sha1(profile.fingerprint().encode()).hexdigest()[:12]}"


def target_copies_2d_on_dma(target: str) -> bool:
    """Whether the backend of ``target`` ("rocm:gfx942", "cuda:sm_90", "cpu") runs 2-D peer
    copies on DMA engines: its backend class's ``copy_2d_on_dma`` (True when it cannot be
    imported here).

    >>> target_copies_2d_on_dma("rocm:gfx942"), target_copies_2d_on_dma("cuda:sm_90")
    (False, True)
    """
    from ..backends import backend_class
    from ..errors import BackendUnavailableError

    vendor = target.split(":")[0]
    try:
        return backend_class(vendor).copy_2d_on_dma
    except BackendUnavailableError:
        return True
