"""``characterize``: measure one device's decomposition and contention losses (paper §IV,
Figs. 7-9) and write a profile JSON that ``FICCO_PROFILE`` accepts.

Everything runs through the active backend's queues (streams on GPUs, worker threads on CPU),
so the copies measured are the copies ficco makes (DMA on GPUs, ``cudaMemcpy2DAsync`` for 2D)::

    python -m ficco.bench characterize                    # CPU: quick sizes, seconds
    python -m ficco.bench characterize                    # one GPU: Table I sizes, minutes
    FICCO_PROFILE=bench/runs/characterize-.../profile.json python my_model.py

Measured:
- DIL: each GEMM whole vs. as 8 and 64 row (M) pieces and 8 and 64 column (K) pieces that
  accumulate, run back to back on the compute queue (Fig. 7).
- copy efficiency: bandwidth of 1D (contiguous) and 2D (rows of a column block) copies by
  size, as a fraction of the best 1D bandwidth seen, plus 2D efficiency by row width (Fig. 9).
- CIL: an 8-way M piece of each GEMM alone vs. beside copies saturating the copy queues, and
  a copy alone vs. beside back-to-back GEMMs (Fig. 8).
- ``--parts enqueue``: the host time to enqueue a W = 8 plan per schedule, fitted into the
  profile's ``host_op_s`` (CPU: :mod:`ficco.bench.enqueue`, the real CPU backend; GPU:
  :mod:`ficco.bench.gpu_probes`, which also times the graph replay).
- GPU only (``--parts paths``, :mod:`ficco.bench.gpu_probes`): which device activity each copy
  path produces.
The profile starts from the built-in one for this target and replaces what was measured;
``sources`` in the JSON says which numbers came from where.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..errors import InvalidArgumentError
from . import calibrate, results
from .cli import progress_bar, require_plots, run_dir
from .fit import fit_profile, gemm_rates
from .scenarios import Scenario, paper
from .timing import Timer, backend_for_characterize, noise_repeats

EXAMPLES = """\
  python -m ficco.bench characterize                 # sizes that fit the device (CPU: quick)
  CUDA_VISIBLE_DEVICES=0 python -m ficco.bench characterize --only g1,g2,g14
  python -m ficco.bench characterize --parts copy,dil,cil,paths,enqueue   # GPU extras
  python -m ficco.bench characterize --refit bench/runs/characterize-cpu-<date>"""

DIL_WAYS = (8, 64)
PARTS = ("copy", "dil", "cil", "gemm", "ccl", "peer", "enqueue")
GPU_PARTS = ("paths",)
#: What ``--quick`` measures when ``--parts`` is not given: everything the model prices.
QUICK_PARTS = "copy,dil,cil,gemm,ccl,peer"
ROW_WIDTH_2D = 2048          # bytes per row of a 2D copy in the by-size curve (K/8 of bf16 K=8192)


@dataclasses.dataclass(frozen=True)
class Settings:
    gemms: tuple[Scenario, ...]
    copy_sizes: tuple[int, ...]
    widths_2d: tuple[int, ...]
    width_probe_bytes: int
    noise_copy_bytes: int
    copy_queues: int
    warmup: int
    repeat: int
    copy_to_host: bool = False


def size_for(args, device: torch.device) -> str:
    """``quick`` or ``full``: ``--size`` (``--quick`` = quick); ``auto`` is quick on a CPU,
    where Table I GEMMs at M/4 take many minutes and gigabytes, and full on a GPU."""
    if args.quick:
        return "quick"
    if args.size != "auto":
        return args.size
    return "quick" if device.type == "cpu" else "full"


def settings_for(args, device: torch.device) -> Settings:
    """``quick``: a few tiny GEMMs and copies (CPU seconds). ``full``: the paper's GEMMs as
    one GPU of eight runs them, M divided by ``--scale``, and copies from 4 KiB to 256 MiB."""
    if size_for(args, device) == "quick" and device.type == "cpu":
        gemms: tuple[Scenario, ...] = (Scenario("tall", 1024, 128, 256, "quick"),
                                       Scenario("wide", 256, 128, 1024, "quick"),
                                       Scenario("square", 512, 256, 512, "quick"))
        return Settings(gemms, tuple(2 ** p for p in range(12, 21, 2)), (64, 256, 1024, 4096),
                        1 << 20, 1 << 20, args.copy_queues or 2, 1, args.repeat or 3,
                        args.copy_to == "host")
    if size_for(args, device) == "quick":
        # a GPU in under a minute: two Table I GEMMs at 1/16 of M, copies 4 KiB - 256 MiB
        gemms = tuple(Scenario(g.name, g.big_m, g.local_n(8), g.k, "paper")
                      for g in paper(16) if g.name in ("g2", "g14"))
        return Settings(gemms, tuple(2 ** p for p in range(12, 29, 4)), (256, 2048, 8192),
                        16 << 20, 64 << 20, args.copy_queues or 7, 1, args.repeat or 3,
                        args.copy_to == "host")
    if args.scale <= 0:
        raise InvalidArgumentError(f"--scale must be positive; got {args.scale}")
    # each GPU's GEMM on an 8-GPU node: M x N/8 x K (the Table I reading of ficco.heuristics)
    gemms = tuple(Scenario(g.name, g.big_m, g.local_n(8), g.k, "paper") for g in paper(args.scale))
    if args.only:
        keep = set(args.only.split(","))
        gemms = tuple(g for g in gemms if g.name in keep)
    queues = args.copy_queues or (7 if device.type != "cpu" else 2)
    return Settings(gemms, tuple(2 ** p for p in range(12, 29, 2)),
                    (64, 128, 256, 512, 1024, 2048, 4096, 8192), 16 << 20, 64 << 20, queues,
                    2, args.repeat or 5, args.copy_to == "host")


def add_arguments(parser) -> None:
    parser.add_argument("--size", default="auto", choices=("auto", "quick", "full"),
                        help="quick: tiny GEMMs and copies (seconds); full: Table I GEMMs and "
                             "copies up to 256 MiB (minutes on a GPU); auto: quick on CPU, "
                             "full on a GPU")
    parser.add_argument("--quick", action="store_true",
                        help=f"calibrate this machine in about a minute: --size quick and "
                             f"(unless --parts is given) --parts {QUICK_PARTS}")
    parser.add_argument("--parts", default=None,
                        help="what to measure (default copy,dil,cil): copy, dil, cil, gemm "
                             "(GEMM rate per dtype), ccl (each collective's bus bandwidth over "
                             "every device; CPU: two gloo ranks), peer (copy-engine bandwidth "
                             "to each peer GPU), enqueue (host time per W=8 plan op: the "
                             "profile's host_op_s); on a GPU also paths (copy paths and their "
                             "device activities)")
    parser.add_argument("--no-install", action="store_true",
                        help="do not install the profile as this machine's calibrated one "
                             "(<cache>/profiles/<sku>.json, used without settings from then on)")
    parser.add_argument("--scale", type=int, default=4,
                        help="full size: divide the paper GEMMs' M by this")
    parser.add_argument("--only", default=None, help="comma list of paper GEMMs, e.g. g1,g2")
    parser.add_argument("--dtype", default=None,
                        help="GEMM dtype (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="timed runs per point (default 3 quick, 5 full)")
    parser.add_argument("--copy-queues", type=int, default=None,
                        help="copy queues kept busy in the CIL runs (default 7 on a GPU, one "
                             "per peer of an 8-GPU node; 2 on CPU)")
    parser.add_argument("--copy-to", default="device", choices=("device", "host"),
                        help="copy destination: device (a copy inside the GPU, which CUDA runs "
                             "on the SMs) or host (pinned memory, torch's copy_ on the "
                             "backend's queue: surely a copy engine, at PCIe speed)")
    parser.add_argument("--base", default=None,
                        help="built-in profile to start from (default: detected for the target)")
    parser.add_argument("--name", default=None, help="name of the written profile")
    parser.add_argument("--out", default=None,
                        help="directory (default bench/runs/characterize-<target>-<date>)")
    parser.add_argument("--no-plots", action="store_true",
                        help="write the profile and records only (no matplotlib needed)")
    parser.add_argument("--refit", default=None, metavar="DIR",
                        help="measure nothing: refit DIR/characterize.jsonl into a profile and "
                             "plots (written to --out, default DIR)")


# -- measurements -----------------------------------------------------------------------------
def _operands(g: Scenario, dtype: torch.dtype, device):
    a = torch.randn(g.big_m, g.k, device=device).to(dtype)
    b = torch.randn(g.k, g.n, device=device).to(dtype)
    out = torch.empty(g.big_m, g.n, device=device, dtype=dtype)
    return a, b, out


def _rows_gemm(backend, a, b, out, ways: int):
    pieces = [(r0, r0 + n) for r0, n in _split(a.shape[0], ways)]
    return lambda q: [backend.gemm(a[r0:r1], b, out[r0:r1], False, q) for r0, r1 in pieces]


def _cols_gemm(backend, a, b, out, ways: int):
    pieces = [(k0, k0 + n) for k0, n in _split(a.shape[1], ways)]
    return lambda q: [backend.gemm(a[:, k0:k1], b[k0:k1], out, i > 0, q)
                      for i, (k0, k1) in enumerate(pieces)]


def _split(total: int, parts: int):
    from ..plan.problem import even_split

    return [(s, n) for s, n in even_split(total, parts) if n > 0]


def measure_dil(timer: Timer, st: Settings, dtype: torch.dtype, device, progress) -> list[dict]:
    out_records = []
    backend = timer.backend
    for g in st.gemms:
        a, b, out = _operands(g, dtype, device)
        whole_s = timer.alone(timer.compute, lambda q: backend.gemm(a, b, out, False, q),
                              st.warmup, st.repeat)
        for split, build in (("row", _rows_gemm), ("col", _cols_gemm)):
            for ways in DIL_WAYS:
                sharded_s = timer.alone(timer.compute, build(backend, a, b, out, ways),
                                        st.warmup, st.repeat)
                out_records.append({
                    "schema": results.CHARACTERIZE_SCHEMA, "kind": "dil", "gemm": g.name, "M": g.big_m,
                    "N": g.n, "K": g.k, "split": split, "ways": ways, "whole_s": whole_s, "sharded_s": sharded_s,
                    "dil": sharded_s / whole_s, "flops_per_s": 2 * g.big_m * g.n * g.k / whole_s})
        progress.dil(g)
        a = b = out = None   # freed before the next GEMM's operands are made
    return out_records


def _copy_pair(nbytes: int, width: int | None, device, to_host: bool = False):
    """(dst, src) byte views: contiguous for 1D; for 2D, ``width``-byte rows of a block 8x as
    wide (a column chunk of an 8-way split), so each row is strided. ``to_host``: the
    destination is pinned host memory, so a GPU moves it with a copy engine for sure."""
    where = {"device": "cpu", "pin_memory": True} if to_host and device.type != "cpu" \
        else {"device": device}
    if width is None:
        return (torch.empty(nbytes, dtype=torch.uint8, **where),
                torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device))
    rows = max(1, nbytes // width)
    src = torch.randint(0, 255, (rows, 8 * width), dtype=torch.uint8, device=device)
    dst = torch.empty(rows, 8 * width, dtype=torch.uint8, **where)
    return dst[:, :width], src[:, :width]


def _mover(backend, st: Settings, two_d: bool):
    """The copy measured: the backend's DMA copy (1D or 2D), or for ``--copy-to host`` torch's
    ``copy_`` into pinned memory issued on the backend's queue (a copy engine on a GPU)."""
    if st.copy_to_host:
        return lambda dst, src, q: backend.launch(q, lambda: dst.copy_(src, non_blocking=True))
    return backend.copy_2d if two_d else backend.copy


class Work:
    """Estimated seconds of each measured point, from the base profile's peak FLOP/s and
    memory bandwidth, so the bar and its ETA move with the work rather than the point count
    (one Table I GEMM costs as much as thousands of small copies)."""

    def __init__(self, st: Settings, profile, dtype: str, bar):
        self.st, self.bar = st, bar
        self.flops_per_s = 0.5 * profile.flops(dtype)
        self.bytes_per_s = 0.5 * profile.hbm_bytes_per_s
        self.latency_s = profile.copy_latency_s
        self.element = torch.empty(0, dtype=getattr(torch, dtype)).element_size()

    def _gemm_s(self, g: Scenario, rows: int) -> float:
        flops_s = 2 * rows * g.n * g.k / self.flops_per_s
        return max(flops_s, (rows * g.k + g.k * g.n + rows * g.n) * self.element / self.bytes_per_s)

    def _copy_s(self, nbytes: int) -> float:
        return self.latency_s + 2 * nbytes / self.bytes_per_s

    def dil_s(self, g: Scenario) -> float:
        # the whole GEMM and four splits of it, each warmed up and repeated
        return 5 * (self.st.warmup + self.st.repeat) * self._gemm_s(g, g.big_m)

    def copy_s(self, nbytes: int) -> float:
        return (self.st.warmup + self.st.repeat) * self._copy_s(nbytes)

    def cil_s(self, g: Scenario) -> float:
        piece_s = self._gemm_s(g, max(1, g.big_m // 8))
        noise_s = self._copy_s(self.st.noise_copy_bytes)
        return (self.st.warmup + self.st.repeat) * piece_s \
            + 2 * self.st.repeat * 2.5 * max(piece_s, noise_s)

    def total_s(self, parts) -> float:
        st, total = self.st, 0.0
        if "copy" in parts:
            total += sum(self.copy_s(n) for n in st.copy_sizes) * 2 \
                + self.copy_s(st.width_probe_bytes) * len(st.widths_2d)
        if "dil" in parts:
            total += sum(self.dil_s(g) for g in st.gemms)
        if "cil" in parts:
            total += sum(self.cil_s(g) for g in st.gemms)
        return total

    def dil(self, g):
        self.bar.update(self.dil_s(g))

    def copy(self, nbytes):
        self.bar.update(self.copy_s(nbytes))

    def cil(self, g):
        self.bar.update(self.cil_s(g))


def measure_copies(timer: Timer, st: Settings, device, progress) -> list[dict]:
    backend, q = timer.backend, timer.copies[0]
    recs = []
    for shape in ("1d", "2d"):
        for nbytes in st.copy_sizes:
            width = None if shape == "1d" else min(ROW_WIDTH_2D, nbytes)
            dst, src = _copy_pair(nbytes, width, device, st.copy_to_host)
            move = _mover(backend, st, two_d=width is not None)
            seconds = timer.alone(q, lambda qq: move(dst, src, qq), st.warmup, st.repeat)
            recs.append({"schema": results.CHARACTERIZE_SCHEMA, "kind": "copy", "shape": shape,
                             "bytes": dst.numel(), "width_bytes": width or nbytes, "time_s": seconds,
                             "bytes_per_s": dst.numel() / seconds})
            progress.copy(nbytes)
    best = max(r["bytes_per_s"] for r in recs if r["shape"] == "1d")
    for r in recs:
        r["efficiency"] = r["bytes_per_s"] / best
    flat_dst, flat_src = _copy_pair(st.width_probe_bytes, None, device, st.copy_to_host)
    flat, two_d = _mover(backend, st, two_d=False), _mover(backend, st, two_d=True)
    flat_s = timer.alone(q, lambda qq: flat(flat_dst, flat_src, qq), st.warmup, st.repeat)
    for width in st.widths_2d:
        dst, src = _copy_pair(st.width_probe_bytes, width, device, st.copy_to_host)
        seconds = timer.alone(q, lambda qq: two_d(dst, src, qq), st.warmup, st.repeat)
        recs.append({"schema": results.CHARACTERIZE_SCHEMA, "kind": "copy_width", "shape": "2d",
                         "bytes": dst.numel(), "width_bytes": width, "time_s": seconds,
                         "bytes_per_s": dst.numel() / seconds,
                         "ratio_to_1d": (dst.numel() / seconds) / (flat_dst.numel() / flat_s)})
        progress.copy(st.width_probe_bytes)
    return recs


def measure_cil(timer: Timer, st: Settings, dtype: torch.dtype, device, progress) -> list[dict]:
    backend = timer.backend
    noise_dst, noise_src = _copy_pair(st.noise_copy_bytes, None, device, st.copy_to_host)
    move = _mover(backend, st, two_d=False)
    noise_copy = lambda q: move(noise_dst, noise_src, q)
    copy_s = timer.alone(timer.copies[0], noise_copy, st.warmup, st.repeat)
    recs = []
    for g in st.gemms:
        piece = Scenario(g.name, max(1, g.big_m // 8), g.n, g.k)
        a, b, out = _operands(piece, dtype, device)
        gemm = lambda q: backend.gemm(a, b, out, False, q)
        mt = (piece.big_m * piece.k + piece.k * piece.n + piece.big_m * piece.n) * a.element_size()
        gemm_alone = timer.alone(timer.compute, gemm, st.warmup, st.repeat)
        gemm_beside = timer.beside(timer.compute, gemm, timer.copies, noise_copy,
                                   noise_repeats(gemm_alone, copy_s), st.repeat)
        copy_beside = timer.beside(timer.copies[0], noise_copy, [timer.compute], gemm,
                                   noise_repeats(copy_s, gemm_alone), st.repeat)
        common = {"schema": results.CHARACTERIZE_SCHEMA, "kind": "cil", "gemm": g.name,
                      "M": piece.big_m, "N": piece.n, "K": piece.k, "mt_bytes": mt,
                      "copy_bytes": st.noise_copy_bytes, "copy_queues": len(timer.copies)}
        recs.append(dict(common, victim="gemm", alone_s=gemm_alone, beside_s=gemm_beside,
                         cil=gemm_beside / gemm_alone))
        recs.append(dict(common, victim="copy", alone_s=copy_s, beside_s=copy_beside,
                         cil=copy_beside / copy_s))
        progress.cil(g)
        a = b = out = None   # freed before the next GEMM's operands are made
    return recs


def main(args) -> int:
    require_plots("characterize", not args.no_plots, "--no-plots")
    if args.refit:
        return refit(args)
    from ..heuristics import profiles

    chosen = args.parts or (QUICK_PARTS if args.quick else "copy,dil,cil")
    parts = [p for p in chosen.split(",") if p]
    unknown = [p for p in parts if p not in PARTS + GPU_PARTS]
    if unknown or not parts:
        raise InvalidArgumentError(f"--parts {chosen!r}: use a comma list of "
                                   f"{', '.join(PARTS + GPU_PARTS)}")
    backend = backend_for_characterize()
    device = backend.device()
    gpu_parts = [p for p in parts if p in GPU_PARTS]
    if gpu_parts and device.type == "cpu":
        raise InvalidArgumentError(f"--parts {','.join(gpu_parts)} measure a GPU; the active "
                                   f"backend runs on cpu")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise InvalidArgumentError(f"--dtype {dtype!r}; use float32, bfloat16, float16 or float64")
    st = settings_for(args, device)
    target = backend.target()
    env = results.environment(1, target, device)
    env["env_queues"] = f"ficco {target} backend" \
        + (", copies to pinned host memory" if st.copy_to_host else "")
    timer = Timer(backend, st.copy_queues)
    base = profiles.load(args.base or profiles.detect(
        target, env["env_device"] if device.type != "cpu" else None))
    torch.manual_seed(0)
    size = size_for(args, device)
    print(f"characterize: {size} sizes ({len(st.gemms)} GEMMs, {len(st.copy_sizes)} copy sizes) "
          f"on {env['env_device']}, parts {','.join(parts)}"
          + ("; --size full for Table I GEMMs" if size == "quick" else ""))
    recs = []
    with progress_bar("characterize", 1.0, "point", weighted=True) as bar:
        work = Work(st, base, dtype, bar)
        bar.total = work.total_s(parts) or 1.0
        if "copy" in parts:
            recs += measure_copies(timer, st, device, work)
        if "dil" in parts:
            recs += measure_dil(timer, st, getattr(torch, dtype), device, work)
        if "cil" in parts:
            recs += measure_cil(timer, st, getattr(torch, dtype), device, work)
        if "gemm" in parts:
            recs += calibrate.measure_gemm_rates(timer, device, st.warmup, st.repeat)
        if "peer" in parts:
            recs += calibrate.measure_peer_copies(st.noise_copy_bytes, st.repeat)
        if "ccl" in parts:
            recs += calibrate.measure_collectives(device.type, size == "quick", st.repeat)
        if "paths" in gpu_parts:
            from . import gpu_probes

            recs += gpu_probes.measure_copy_paths(backend, size == "quick")
        if "enqueue" in parts:
            if device.type == "cpu":
                from .enqueue import measure_cpu_enqueue

                recs += measure_cpu_enqueue(size == "quick")
            else:
                from . import gpu_probes

                recs += gpu_probes.measure_enqueue(backend, size == "quick")
    for r in recs:
        r["env"] = env
        r.setdefault("dtype", dtype)
    return _write(args, recs, run_dir("characterize", target, args.out))


def refit(args) -> int:
    """``--refit DIR``: fit the profile and draw the plots again from DIR/characterize.jsonl
    (after a change to the fits, or with another ``--base``), measuring nothing."""
    recs = results.read_jsonl(Path(args.refit) / "characterize.jsonl")
    if not recs:
        raise InvalidArgumentError(f"{args.refit}/characterize.jsonl holds no records")
    return _write(args, recs, Path(args.out or args.refit))


def _write(args, recs: list[dict], out_dir: Path) -> int:
    from ..heuristics import profiles

    if not getattr(args, "no_plots", False):
        from . import plots

    env = recs[0]["env"]
    target = env["env_backend"]
    gpu = target.startswith(("cuda", "rocm"))
    dtype = next((r["dtype"] for r in recs if "dtype" in r), None) \
        or args.dtype or ("bfloat16" if gpu else "float32")
    base = profiles.load(args.base or profiles.detect(target, env["env_device"] if gpu else None))
    profile = fit_profile(base, recs, dtype, args.name or f"{base.name}-measured",
                          f"{env['env_device']} ({env.get('env_queues', '?')}), "
                          f"{env['env_time'][:10]}")
    profile.to_json(out_dir / "profile.json")
    results.write_jsonl(out_dir / "characterize.jsonl", recs)
    installed = None
    if not getattr(args, "no_install", False) and not args.refit:
        installed = install(profile, target)
    pngs = []
    drawers = () if getattr(args, "no_plots", False) else (
        ("dil", plots.plot_dil, "dil.png"), ("copy", plots.plot_copy_efficiency,
                                             "copy_efficiency.png"),
        ("cil", plots.plot_cil, "cil.png"))
    for kind, draw, name in drawers:
        kept = [r for r in recs if r["kind"] == kind]
        if kept:
            pngs.append(draw(kept, out_dir / name))
    print(summary(recs, profile))
    print(f"wrote {out_dir / 'profile.json'}, {out_dir / 'characterize.jsonl'}, "
          + ", ".join(str(p) for p in pngs))
    if installed is not None:
        print(f"installed as this machine's calibrated profile: {installed} (used without "
              f"settings from the next process on; FICCO_PROFILE still overrides)")
    else:
        print(f"use it with: FICCO_PROFILE={out_dir / 'profile.json'}")
    return 0


def install(profile, target: str):
    """Write ``profile`` where :func:`ficco.heuristics.profiles.resolve` finds it for this
    device's SKU (:mod:`ficco.heuristics.sku`), and return that path."""
    from ..heuristics import profiles, sku

    path = profiles.calibrated_path(sku.sku_of(sku.local_props(target)).id)
    profile.to_json(path)
    return path


def summary(recs: list[dict], profile) -> str:
    """A few lines for the terminal: geomean DIL per variant, CIL, copy numbers."""
    from .plots import geomean

    lines = [(f"profile {profile.name}: gemm_efficiency {profile.dil['gemm_efficiency']}, "
             f"copy_latency_s {profile.copy_latency_s:.2e}, "
             f"copy_2d_half_row_bytes {profile.copy_2d_half_row_bytes:.0f}, "
             f"cil dma_gemm {profile.cil['dma_gemm']} dma_copy {profile.cil['dma_copy']}")]
    kinds = {r["kind"] for r in recs}
    for split in ("row", "col") if "dil" in kinds else ():
        for ways in DIL_WAYS:
            vals = [r["dil"] for r in recs if r["kind"] == "dil" and r["split"] == split
                    and r["ways"] == ways]
            lines.append(f"DIL {split} {ways}-way: geomean {geomean(vals):.3f}x "
                         f"over {len(vals)} GEMMs")
    for victim in ("gemm", "copy") if "cil" in kinds else ():
        vals = [r["cil"] for r in recs if r["kind"] == "cil" and r["victim"] == victim]
        lines.append(f"CIL {victim}: geomean {geomean(vals):.3f}x")
    if "copy" in kinds:
        best = max(r["bytes_per_s"] for r in recs if r["kind"] == "copy")
        lines.append(f"best 1D copy bandwidth {best / 1e9:.1f} GB/s")
    for dtype, rate in sorted(gemm_rates(recs, profile.name).items()):
        if any(r["kind"] == "gemm_rate" and r["dtype"] == dtype for r in recs):
            lines.append(f"GEMM {dtype}: best {rate / 1e12:.2f} TFLOP/s")
    for kind, curve in sorted(profile.ccl.get("busbw", {}).items()) if "ccl" in kinds else ():
        points = ", ".join(f"{int(size) >> 10} KiB {bw / 1e9:.1f}" for size, bw in curve.items())
        lines.append(f"{kind} busbw GB/s over {profile.ccl['busbw_world']} ranks: {points}")
    if any(r["kind"] == "enqueue" for r in recs):
        lines.append(f"host_op_s {profile.host_op_s * 1e6:.2f} us per plan op (eager enqueue)")
    return "\n".join(lines)
