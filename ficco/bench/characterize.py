"""``characterize``: measure one device's decomposition and contention losses (paper §IV,
Figs. 7-9) and write a profile JSON that ``FICCO_PROFILE`` accepts.

Everything runs through the active backend's queues (streams on GPUs, worker threads on CPU),
so the copies measured are the copies ficco makes (DMA on GPUs, ``cudaMemcpy2DAsync`` for 2D)::

    python -m ficco.bench characterize --quick            # CPU: seconds
    python -m ficco.bench characterize                    # one GPU: a few minutes
    FICCO_PROFILE=bench/results/characterize-.../profile.json python my_model.py

Measured:
- DIL: each GEMM whole vs. as 8 and 64 row (M) pieces and 8 and 64 column (K) pieces that
  accumulate, run back to back on the compute queue (Fig. 7).
- copy efficiency: bandwidth of 1D (contiguous) and 2D (rows of a column block) copies by
  size, as a fraction of the best 1D bandwidth seen, plus 2D efficiency by row width (Fig. 9).
- CIL: an 8-way M piece of each GEMM alone vs. beside copies saturating the copy queues, and
  a copy alone vs. beside back-to-back GEMMs (Fig. 8).
The profile starts from the built-in one for this target and replaces what was measured;
``sources`` in the JSON says which numbers came from where.
"""
from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import torch

from ..errors import InvalidArgumentError
from . import results
from .fit import fit_profile
from .timing import Timer, _backend, _cover
from .scenarios import Scenario, paper

DIL_WAYS = (8, 64)
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


def settings_for(args, device: torch.device) -> Settings:
    """``--quick``: a few tiny GEMMs and copies (CPU seconds). Otherwise the paper's GEMMs as
    one GPU of eight runs them, M divided by ``--scale``, and copies from 4 KiB to 256 MiB."""
    if args.quick:
        gemms = (Scenario("tall", 1024, 128, 256, "quick"),
                 Scenario("wide", 256, 128, 1024, "quick"),
                 Scenario("square", 512, 256, 512, "quick"))
        return Settings(gemms, tuple(2 ** p for p in range(12, 21, 2)), (64, 256, 1024, 4096),
                        1 << 20, 1 << 20, args.copy_queues or 2, 1, args.repeat or 3,
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
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU, CI)")
    parser.add_argument("--scale", type=int, default=4,
                        help="divide the paper GEMMs' M by this (default 4)")
    parser.add_argument("--only", default=None, help="comma list of paper GEMMs, e.g. g1,g2")
    parser.add_argument("--dtype", default=None,
                        help="GEMM dtype (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per point")
    parser.add_argument("--copy-queues", type=int, default=None,
                        help="copy queues kept busy in the CIL runs (default 7 on GPU)")
    parser.add_argument("--queues", default="auto",
                        choices=("auto", "backend", "torch", "torch-ce"),
                        help="time on ficco's backend queues; on torch.cuda streams (torch-ce: "
                             "copies hinted onto copy engines); auto (default): the backend, "
                             "else torch streams on a GPU")
    parser.add_argument("--copy-to", default="device", choices=("device", "host"),
                        help="copy destination: device (a copy inside the GPU, which CUDA runs "
                             "on the SMs) or host (pinned memory: surely a copy engine, at PCIe "
                             "speed; needs --queues torch on GPUs)")
    parser.add_argument("--base", default=None,
                        help="built-in profile to start from (default: detected for the target)")
    parser.add_argument("--name", default=None, help="name of the written profile")
    parser.add_argument("--out", default=None,
                        help="directory (default bench/results/characterize-<target>-<date>)")
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
    from ..problem import even_split

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
                out_records.append(dict(
                    schema=results.CHARACTERIZE_SCHEMA, kind="dil", gemm=g.name, M=g.big_m,
                    N=g.n, K=g.k, split=split, ways=ways, whole_s=whole_s, sharded_s=sharded_s,
                    dil=sharded_s / whole_s, flops_per_s=2 * g.big_m * g.n * g.k / whole_s))
        progress.update(1)
        del a, b, out
    return out_records


def _copy_pair(nbytes: int, width: int | None, device, to_host: bool = False):
    """(dst, src) byte views: contiguous for 1D; for 2D, ``width``-byte rows of a block 8x as
    wide (a column chunk of an 8-way split), so each row is strided. ``to_host``: the
    destination is pinned host memory, so a GPU moves it with a copy engine for sure."""
    where = dict(device="cpu", pin_memory=True) if to_host and device.type != "cpu" \
        else dict(device=device)
    if width is None:
        return (torch.empty(nbytes, dtype=torch.uint8, **where),
                torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device))
    rows = max(1, nbytes // width)
    src = torch.randint(0, 255, (rows, 8 * width), dtype=torch.uint8, device=device)
    dst = torch.empty(rows, 8 * width, dtype=torch.uint8, **where)
    return dst[:, :width], src[:, :width]


def measure_copies(timer: Timer, st: Settings, device, progress) -> list[dict]:
    backend, q = timer.backend, timer.copies[0]
    recs = []
    for shape in ("1d", "2d"):
        for nbytes in st.copy_sizes:
            width = None if shape == "1d" else min(ROW_WIDTH_2D, nbytes)
            dst, src = _copy_pair(nbytes, width, device, st.copy_to_host)
            move = backend.copy if width is None else backend.copy_2d
            seconds = timer.alone(q, lambda qq: move(dst, src, qq), st.warmup, st.repeat)
            recs.append(dict(schema=results.CHARACTERIZE_SCHEMA, kind="copy", shape=shape,
                             bytes=dst.numel(), width_bytes=width or nbytes, time_s=seconds,
                             bytes_per_s=dst.numel() / seconds))
            progress.update(1)
    best = max(r["bytes_per_s"] for r in recs if r["shape"] == "1d")
    for r in recs:
        r["efficiency"] = r["bytes_per_s"] / best
    flat_dst, flat_src = _copy_pair(st.width_probe_bytes, None, device, st.copy_to_host)
    flat_s = timer.alone(q, lambda qq: backend.copy(flat_dst, flat_src, qq), st.warmup, st.repeat)
    for width in st.widths_2d:
        dst, src = _copy_pair(st.width_probe_bytes, width, device, st.copy_to_host)
        seconds = timer.alone(q, lambda qq: backend.copy_2d(dst, src, qq), st.warmup, st.repeat)
        recs.append(dict(schema=results.CHARACTERIZE_SCHEMA, kind="copy_width", shape="2d",
                         bytes=dst.numel(), width_bytes=width, time_s=seconds,
                         bytes_per_s=dst.numel() / seconds,
                         ratio_to_1d=(dst.numel() / seconds) / (flat_dst.numel() / flat_s)))
        progress.update(1)
    return recs


def measure_cil(timer: Timer, st: Settings, dtype: torch.dtype, device, progress) -> list[dict]:
    backend = timer.backend
    noise_dst, noise_src = _copy_pair(st.noise_copy_bytes, None, device, st.copy_to_host)
    noise_copy = lambda q: backend.copy(noise_dst, noise_src, q)  # noqa: E731
    copy_s = timer.alone(timer.copies[0], noise_copy, st.warmup, st.repeat)
    recs = []
    for g in st.gemms:
        piece = Scenario(g.name, max(1, g.big_m // 8), g.n, g.k)
        a, b, out = _operands(piece, dtype, device)
        gemm = lambda q: backend.gemm(a, b, out, False, q)  # noqa: E731
        mt = (piece.big_m * piece.k + piece.k * piece.n + piece.big_m * piece.n) * a.element_size()
        gemm_alone = timer.alone(timer.compute, gemm, st.warmup, st.repeat)
        gemm_beside = timer.beside(timer.compute, gemm, timer.copies, noise_copy,
                                   _cover(gemm_alone, copy_s), st.repeat)
        copy_beside = timer.beside(timer.copies[0], noise_copy, [timer.compute], gemm,
                                   _cover(copy_s, gemm_alone), st.repeat)
        common = dict(schema=results.CHARACTERIZE_SCHEMA, kind="cil", gemm=g.name,
                      M=piece.big_m, N=piece.n, K=piece.k, mt_bytes=mt,
                      copy_bytes=st.noise_copy_bytes, copy_queues=len(timer.copies))
        recs.append(dict(common, victim="gemm", alone_s=gemm_alone, beside_s=gemm_beside,
                         cil=gemm_beside / gemm_alone))
        recs.append(dict(common, victim="copy", alone_s=copy_s, beside_s=copy_beside,
                         cil=copy_beside / copy_s))
        progress.update(1)
        del a, b, out
    return recs


def main(args) -> int:
    if args.refit:
        return refit(args)
    from tqdm import tqdm

    backend = _backend(args.queues)
    device = backend.device()
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise InvalidArgumentError(f"--dtype {dtype!r}; use float32, bfloat16, float16 or float64")
    st = settings_for(args, device)
    target = backend.target()
    env = results.environment(1, target, device)
    env["env_queues"] = getattr(backend, "name", "?") \
        + (", copies to host" if st.copy_to_host else "")
    timer = Timer(backend, st.copy_queues)
    steps = 2 * len(st.gemms) + 2 * len(st.copy_sizes) + len(st.widths_2d)
    torch.manual_seed(0)
    with tqdm(total=steps, desc="characterize", unit="point", dynamic_ncols=True) as progress:
        recs = measure_copies(timer, st, device, progress)
        recs += measure_dil(timer, st, getattr(torch, dtype), device, progress)
        recs += measure_cil(timer, st, getattr(torch, dtype), device, progress)
    for r in recs:
        r["env"] = env
        r["dtype"] = dtype
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    safe_target = "".join(c if c.isalnum() or c in "_." else "-" for c in target)
    out_dir = Path(args.out or Path("bench") / "results" / f"characterize-{safe_target}-{stamp}")
    return _write(args, recs, out_dir)


def refit(args) -> int:
    """``--refit DIR``: fit the profile and draw the plots again from DIR/characterize.jsonl
    (after a change to the fits, or with another ``--base``), measuring nothing."""
    recs = results.read_jsonl(Path(args.refit) / "characterize.jsonl")
    if not recs:
        raise InvalidArgumentError(f"{args.refit}/characterize.jsonl holds no records")
    return _write(args, recs, Path(args.out or args.refit))


def _write(args, recs: list[dict], out_dir: Path) -> int:
    from ..heuristics import profiles
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
    pngs = [plots.plot_dil([r for r in recs if r["kind"] == "dil"], out_dir / "dil.png"),
            plots.plot_copy_efficiency([r for r in recs if r["kind"] == "copy"],
                                       out_dir / "copy_efficiency.png"),
            plots.plot_cil([r for r in recs if r["kind"] == "cil"], out_dir / "cil.png")]
    print(summary(recs, profile))
    print(f"wrote {out_dir / 'profile.json'}, {out_dir / 'characterize.jsonl'}, "
          + ", ".join(str(p) for p in pngs))
    print(f"use it with: FICCO_PROFILE={out_dir / 'profile.json'}")
    return 0


def summary(recs: list[dict], profile) -> str:
    """A few lines for the terminal: geomean DIL per variant, CIL, copy numbers."""
    from .plots import geomean

    lines = [f"profile {profile.name}: gemm_efficiency {profile.dil['gemm_efficiency']}, "
             f"copy_latency_s {profile.copy_latency_s:.2e}, "
             f"copy_2d_half_row_bytes {profile.copy_2d_half_row_bytes:.0f}, "
             f"cil dma_gemm {profile.cil['dma_gemm']} dma_copy {profile.cil['dma_copy']}"]
    for split in ("row", "col"):
        for ways in DIL_WAYS:
            vals = [r["dil"] for r in recs if r["kind"] == "dil" and r["split"] == split
                    and r["ways"] == ways]
            lines.append(f"DIL {split} {ways}-way: geomean {geomean(vals):.3f}x "
                         f"over {len(vals)} GEMMs")
    for victim in ("gemm", "copy"):
        vals = [r["cil"] for r in recs if r["kind"] == "cil" and r["victim"] == victim]
        lines.append(f"CIL {victim}: geomean {geomean(vals):.3f}x")
    best = max((r["bytes_per_s"] for r in recs if r["kind"] == "copy"), default=0)
    lines.append(f"best 1D copy bandwidth {best / 1e9:.1f} GB/s")
    return "\n".join(lines)
