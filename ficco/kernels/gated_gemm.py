"""One signal-gated Triton GEMM, ``c = a_gathered @ b``, for NVIDIA and AMD (and the Triton
interpreter on CPU).

The rows of the gathered A arrive in pieces, each copied by a copy engine that then raises a
local int32 *arrival flag*. The kernel's programs walk output tiles in arrival order and wait
for a piece's flag (an acquire read) before loading its rows, so the whole GEMM is ONE launch
whose tiles start as their rows land: no per-chunk GEMMs (no decomposition loss), and no
compute units spent on communication (the copy engines move the bytes)::

    segments (rows of C, in arrival order)   parts (K ranges accumulated into each tile)
    own shard   rows [r*m, (r+1)*m)          (0, K, no flag)          read from the input
    1d: chunk c of peer q                    (0, K, flag(q, c))
    2d: shard of peer q                      (k_c, kc_c, flag(q, c)) for every chunk c

    program(pid):  segment, tile = arrival_order[pid]
                   acc = 0 (fp32)
                   for part in segment.parts:
                       spin until flags[part.flag] != 0 (acquire) or halt raised,
                            at most timeout_s by the device clock
                       acc += A[tile rows, part K] @ B[part K, tile cols]
                   C[tile] = round(acc), or NaN if a wait gave up   # rounded once

A wait is bounded in *time*, never by a count of polls at a guessed rate (which gives up
while a peer is still inside FICCO_TIMEOUT): each wait reads the device clock
(``%globaltimer`` on NVIDIA, the realtime counter on AMD, the host clock in the interpreter)
and ends ``timeout_s`` after it began. One that ends without its flag records ``1 + flag`` in
the error word, raises the ``halt`` word (the group's error word on GPUs:
:data:`~ficco.symm_mem.fault.KERNEL`), so every other tile stops, the call's fence turns its
outputs into NaN and the group's next call raises; and every tile that was not computed is
written as NaN, so C never keeps an earlier call's values (also in a replayed graph, which
has no fence). :func:`check_error` turns the error word into
:class:`~ficco.errors.CommTimeoutError` naming the piece. A kernel never spins forever.

Example (interpreter on CPU, all flags already raised)::

    >>> import torch
    >>> from ficco.kernels.gated_gemm import Segment, gated_gemm
    >>> a = torch.randn(6, 8); b = torch.randn(8, 5); c = torch.empty(6, 5)
    >>> segs = (Segment(0, 2, ((0, 8, -1),)), Segment(2, 4, ((0, 4, 0), (4, 4, 1))))
    >>> flags = torch.ones(2, dtype=torch.int32)
    >>> err = gated_gemm(a[:2], a, b, c, segs, flags, local_row0=0, device_kind="cpu")
    >>> int(err[0]), torch.allclose(c, a @ b, atol=1e-5)
    (0, True)
"""
import functools
from dataclasses import dataclass

import torch

# Triton is an optional extra: only the gated schedules' launch, the kernel benchmark and the
# tests import this module, after ficco.kernels.unavailable_reason() found Triton.
import triton
import triton.language as tl

from ..errors import CommTimeoutError, InvalidArgumentError
from ..symm_mem.fault import KERNEL
from . import configs

# The kernel reads read_clock, TRACE_WORDS and the word builtins as globals.
from .trace import (
    TRACE_OFF,
    TRACE_WORDS,
    clock_mode,
    read_clock,
    ticks_per_s,
    trace_supported,
    wait_clock,
)
from .words import load_word, store_word

#: the word value a gated GEMM that gave up writes into the group's error word
GAVE_UP = tl.constexpr(KERNEL)
#: elements of the vectors a compiled program's polls are made of (the kernel's ``POLL``): at
#: least the threads of any config (8 warps of 64 on AMD), so no element is held by two
#: threads and the reduction that decides a poll spans every warp. The interpreter runs a
#: program as one thread: there ``POLL`` is 1 (a 1024-element poll made its launches 2.3x
#: slower)
POLL = 1024
#: the combine function of those reductions: tl.max is a jit helper, which a kernel built
#: with InterpretedFunction cannot call; tl.reduce with Triton's own max combine runs in
#: both (the interpreter reduces it with numpy)
BIGGER = tl.standard._elementwise_max


@dataclass(frozen=True)
class Segment:
    """Rows ``[row0, row0+rows)`` of C (and of the gathered A) and the K ``parts`` accumulated
    into them in order: ``(k0, kc, flag)``, ``flag`` -1 when the part needs no wait."""

    row0: int
    rows: int
    parts: tuple[tuple[int, int, int], ...]


@functools.lru_cache(maxsize=256)
def tables(segments: tuple[Segment, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The int32 segment table ``(row0, rows, first part, parts)`` and part table
    ``(k0, kc, flag)`` the kernel walks (cached: a plan's segments never change, and a copy
    to the device per launch would cost more than the lookup)."""
    seg_rows: list[tuple[int, int, int, int]] = []
    part_rows: list[tuple[int, int, int]] = []
    for s in segments:
        seg_rows.append((s.row0, s.rows, len(part_rows), len(s.parts)))
        part_rows.extend(s.parts)
    seg = torch.tensor(seg_rows or [(0, 0, 0, 0)], dtype=torch.int32)
    part = torch.tensor(part_rows or [(0, 0, -1)], dtype=torch.int32)
    return seg.to(device), part.to(device)


def _kernel_body(a_local, a_gathered, b, c, seg_table, part_table, flags, err, halt, trace,
                 N, K_total, M_total, local_row0, local_rows, num_segs, wait_ticks,
                 stride_al, stride_ag, stride_bk, stride_bn, stride_cm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr, CLOCK: tl.constexpr,
                 AMD: tl.constexpr, TRACE: tl.constexpr = 0, POLL: tl.constexpr = 1024):
    # Persistent: the grid is at most the device's SMs/CUs minus a reserve (launch.py), and
    # each program walks tiles pid, pid + grid, ... of the arrival-ordered tile list, so
    # tiles waiting for data never hold every compute unit.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N   # not tl.cdiv: a jit helper the interpreter cannot call
    num_tiles = 0
    for s in range(num_segs):
        num_tiles += (tl.load(seg_table + s * 4 + 1) + BLOCK_M - 1) // BLOCK_M
    num_tiles = num_tiles * tiles_n
    for tile in range(pid, num_tiles, programs):
        if TRACE != 0:   # constexpr: with tracing off none of this is compiled in
            t_start = read_clock(TRACE, trace)
            t_first = t_start
            t_last = t_start
            flags_seen = 0   # (not ``waited``: that is the wait's clock, reset per flag)
        tile_m = tile // tiles_n
        tile_n = tile % tiles_n
        # Which segment holds M-tile ``tile_m``: segments are few (<= W*W+1), walk them.
        seg = 0
        first_tile = 0
        seen = 0
        for s in range(num_segs):
            tiles_s = (tl.load(seg_table + s * 4 + 1) + BLOCK_M - 1) // BLOCK_M
            hit = (tile_m >= seen) & (tile_m < seen + tiles_s)
            seg = tl.where(hit, s, seg)
            first_tile = tl.where(hit, seen, first_tile)
            seen += tiles_s
        row0 = tl.load(seg_table + seg * 4)
        rows = tl.load(seg_table + seg * 4 + 1)
        part0 = tl.load(seg_table + seg * 4 + 2)
        parts = tl.load(seg_table + seg * 4 + 3)
        offs_m = (tile_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < rows
        mask_n = offs_n < N
        # This rank's own rows come straight from the caller's input: they wait for nothing.
        if (row0 >= local_row0) & (row0 < local_row0 + local_rows):
            a_rows = a_local + (row0 - local_row0 + offs_m).to(tl.int64) * stride_al
        else:
            a_rows = a_gathered + (row0 + offs_m).to(tl.int64) * stride_ag
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)   # tl.zeros is a jit helper too
        # Every decision below that a branch around the CTA's barriers takes (the K loop's
        # dots synchronise the CTA, and so do the broadcasts inside the wait loop) is made
        # once per program, uniform over its threads: one thread (the holder of element 0
        # of the poll vectors) reads the halt word, the flag and the clock, and a block-wide
        # reduction hands its outcome to every thread. Per-thread reads (each thread's own
        # load of the word, its own %globaltimer) let warps leave the loop at different
        # iterations and meet different barrier instances (a hang, or tiles read
        # half-written); one reader is also one host-memory read per poll, not one per warp.
        lane0 = tl.arange(0, POLL) == 0
        at0 = tl.arange(0, POLL) * 0
        # Once the group failed (halt raised) no tile is computed: it is written as NaN.
        # The halt word is the group's error word (host memory a host thread raises when
        # the group failed): read from memory at every poll (words.py).
        raised = load_word(halt + at0, AMD, lane0) != 0
        ok = 1 - tl.reduce(tl.where(lane0 & raised, 1, 0), 0, BIGGER)
        for p in range(part0, part0 + parts):
            k0 = tl.load(part_table + p * 3)
            kc = tl.load(part_table + p * 3 + 1)
            flag = tl.load(part_table + p * 3 + 2)
            if (flag >= 0) & (ok != 0):
                began = read_clock(CLOCK, trace)
                # state: 1 the flag arrived, 2 the group failed (halt), 4 the wait ran out
                state = 0
                while state == 0:
                    # Acquire: the rows the copy engine wrote before raising the flag are
                    # visible (to the other threads through the reduction's CTA barrier).
                    got = tl.atomic_add(flags + flag + at0, 0, mask=lane0, sem="acquire")
                    stop = load_word(halt + at0, AMD, lane0)
                    late = read_clock(CLOCK, trace) - began >= wait_ticks
                    outcome = tl.where(got != 0, 1, 0) | tl.where(stop != 0, 2, 0) | \
                        tl.where(late, 4, 0)
                    state = tl.reduce(tl.where(lane0, outcome, 0), 0, BIGGER)
                if (state & 1) == 0:
                    tl.atomic_cas(err, 0, flag + 1)
                    ok = 0
                    if (state & 2) == 0:
                        # This wait ran out: raise the group's word, so the other tiles stop,
                        # the fence poisons the call and its next call raises.
                        store_word(halt, GAVE_UP)
                if TRACE != 0:   # when this tile saw its (first, latest) flag
                    t_last = read_clock(TRACE, trace)
                    t_first = tl.where(flags_seen == 0, t_last, t_first)
                    flags_seen = 1
            if ok != 0:
                for k in range(k0, k0 + kc, BLOCK_K):
                    offs_k = k + tl.arange(0, BLOCK_K)
                    mask_k = offs_k < k0 + kc
                    a_tile = tl.load(a_rows[:, None] + offs_k[None, :],
                                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    # Both offsets in int64: B is the caller's weight as given, and for a
                    # column-major ``w.t()`` offs_n * stride_bn passes 2**31 once N*K does.
                    b_tile = tl.load(b + offs_k[:, None].to(tl.int64) * stride_bk
                                     + offs_n[None, :].to(tl.int64) * stride_bn,
                                     mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                    if UPCAST:
                        # The interpreter keeps bf16 as raw uint16 and its dot multiplies those
                        # integers (triton 3.9): multiply exact fp32 copies instead.
                        acc = tl.dot(a_tile.to(tl.float32), b_tile.to(tl.float32), acc,
                                     input_precision="ieee")
                    elif IEEE:
                        acc = tl.dot(a_tile, b_tile, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(a_tile, b_tile, acc)
        # A tile that was not computed is NaN, never what C held before (an earlier call's).
        acc = tl.where(ok != 0, acc, float("nan"))
        c_ptrs = c + (row0 + offs_m)[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
        if TRACE != 0:
            t_end = read_clock(TRACE, trace)
            rec = trace + 1 + tile * TRACE_WORDS   # (int32: tiles * 9 stays far below 2**31)
            tl.store(rec + 0, t_start)
            tl.store(rec + 1, t_first)
            tl.store(rec + 2, t_last)
            tl.store(rec + 3, t_end)
            # tl.cast is seg.to: seg starts as a Python int and is a tensor once tl.where set it
            tl.store(rec + 4, tl.cast(seg, tl.int64))
            tl.store(rec + 5, ((tile_m - first_tile) * BLOCK_M).to(tl.int64))
            tl.store(rec + 6, (tile_n * BLOCK_N).to(tl.int64))
            tl.store(rec + 7, BLOCK_M * 65536 + BLOCK_N)
            tl.store(rec + 8, ok)


@functools.cache
def _compiled(device_kind: str, family: str):
    """The kernel for one device kind: the interpreter on CPU, else triton.jit wrapped in the
    autotuner with this family's configs (one Autotuner per family, so its per-key cache is
    keyed by shape, dtype and target)."""
    if device_kind == "cpu":
        # Built directly (not through TRITON_INTERPRET): ficco's CPU backend runs the kernel in
        # the interpreter whatever the environment says, and GPU kernels stay compiled.
        from . import interpreted

        return interpreted(_kernel_body), configs.INTERPRETER
    jitted = triton.jit(_kernel_body)
    # cache_results: the winner per key also goes to Triton's on-disk cache (keyed by the
    # kernel source, key values, dtypes and the GPU target), so a restart does not re-time.
    # num_segs tells 1d (1 + (W-1) x chunks row segments) from 2d (W segments, K parts) and W.
    tuner = triton.autotune(configs.for_family(family),
                            key=["N", "K_total", "M_total", "num_segs"], cache_results=True)
    return tuner(jitted), None


def gated_gemm(a_local: torch.Tensor, a_gathered: torch.Tensor, b: torch.Tensor,
               c: torch.Tensor, segments: tuple[Segment, ...], flags: torch.Tensor, *,
               local_row0: int, err: torch.Tensor | None = None,
               halt: torch.Tensor | None = None, timeout_s: float = 300.0,
               family: str = "cpu", device_kind: str | None = None,
               trace: torch.Tensor | None = None, trace_mode: int = TRACE_OFF,
               max_programs: int | None = None) -> torch.Tensor:
    """Launch the gated GEMM on the current stream: ``c[rows of s] = A[rows of s] @ b`` for
    every segment, A's rows read from ``a_local`` (this rank's shard, rows ``[local_row0,
    local_row0 + a_local.shape[0])``) or ``a_gathered``. Returns the error word (int32, 0
    when every wait succeeded); pass it to :func:`check_error` once the kernel finished.
    ``flags`` is int32, one word per flag index named in ``segments``. A nonzero ``halt``
    word (int32, written by another thread or process) ends every wait at once: the host's
    deadline or abort; each wait also ends ``timeout_s`` after it began, by the device's
    clock, and then raises ``halt`` itself. ``max_programs`` caps the
    grid (a persistent kernel: each program walks tiles in arrival order); GPU launches pass
    :func:`~ficco.kernels.configs.resident_programs` of the device, so waiting tiles never
    hold every SM/CU.

    ``trace`` (from :func:`~ficco.kernels.trace.trace_buffer`) with ``trace_mode``
    (:func:`~ficco.kernels.trace.clock_mode`) records per program when it started, saw its
    flags and ended; :func:`~ficco.kernels.trace.read_trace` decodes it. Off by
    default, and then not compiled in (``TRACE`` is a constexpr).
    """
    _check_operands(a_local, a_gathered, b, c, flags)
    device_kind = device_kind or c.device.type
    kernel, fixed = _compiled(device_kind, family)
    seg, part = tables(tuple(segments), c.device)
    err = torch.zeros(1, dtype=torch.int32, device=c.device) if err is None else err
    n, k_total = b.shape[1], b.shape[0]
    clock = wait_clock(device_kind, family)
    wait_ticks = max(1, int(timeout_s * (ticks_per_s(clock, c.device.index or 0) or 1e9)))
    amd = family == "amd" and device_kind != "cpu"
    halt = torch.zeros(1, dtype=torch.int32, device=c.device) if halt is None else halt
    if (trace is None) != (trace_mode == TRACE_OFF):
        raise InvalidArgumentError("gated_gemm: pass trace and trace_mode together")
    if trace is not None and not trace_supported():
        raise InvalidArgumentError(
            f"the per-tile trace needs a Triton whose builtins take _semantic (3.4 or newer); "
            f"this is {triton.__version__}. The kernel itself runs untraced")
    untraced = _no_trace(c.device)
    trace = untraced if trace is None else trace
    args = (a_local, a_gathered, b, c, seg, part, flags, err, halt, trace, n, k_total,
            a_gathered.shape[0],
            local_row0, a_local.shape[0], len(segments), wait_ticks, a_local.stride(0),
            a_gathered.stride(0), b.stride(0), b.stride(1), c.stride(0))

    def grid(meta):
        tiles_m = sum(triton.cdiv(s.rows, meta["BLOCK_M"]) for s in segments)
        tiles = tiles_m * triton.cdiv(n, meta["BLOCK_N"])
        return (max(1, min(tiles, max_programs or tiles)),)

    ieee = c.dtype == torch.float32 or a_gathered.dtype == torch.float32
    if fixed is not None:
        kernel[grid(fixed)](*args, **fixed, IEEE=ieee, UPCAST=True, CLOCK=clock, AMD=amd,
                            TRACE=trace_mode, POLL=1)
        return err
    key = (family, n, k_total, a_gathered.shape[0], len(segments), c.dtype, c.device)
    if key not in _tuned:
        # The autotuner times every config by running it: do that once per key with all flags
        # preset (and a scratch error word), so no timing includes a wait for a copy. Its C
        # writes are overwritten by the real launch below, on the same stream.
        preset = torch.ones_like(flags)
        kernel[grid](*args[:6], preset, torch.zeros_like(err), args[8], untraced, *args[10:],
                     IEEE=ieee, UPCAST=False, CLOCK=clock, AMD=amd, TRACE=TRACE_OFF)
        _tuned.add(key)
    kernel[grid](*args, IEEE=ieee, UPCAST=False, CLOCK=clock, AMD=amd, TRACE=trace_mode)
    return err


@functools.lru_cache(maxsize=16)
def _no_trace(device) -> torch.Tensor:
    """The one-word stand-in for ``trace`` when tracing is off (the kernel never touches it)."""
    return torch.zeros(1, dtype=torch.int64, device=device)


_tuned: set = set()


def _check_operands(a_local, a_gathered, b, c, flags) -> None:
    if a_local.stride(-1) != 1 or a_gathered.stride(-1) != 1 or c.stride(-1) != 1:
        raise InvalidArgumentError("gated_gemm needs row-major A and C (unit column stride)")
    if flags.dtype != torch.int32:
        raise InvalidArgumentError(f"gated_gemm flags must be int32; got {flags.dtype}")
    if b.shape[0] != a_gathered.shape[1] or c.shape[1] != b.shape[1]:
        raise InvalidArgumentError(
            f"gated_gemm shapes do not chain: A {tuple(a_gathered.shape)}, B {tuple(b.shape)}, "
            f"C {tuple(c.shape)}")


def check_error(err: torch.Tensor, describe=None, timeout_s: float | None = None) -> None:
    """Raise :class:`CommTimeoutError` when the kernel recorded a wait that timed out.
    ``describe(flag) -> str`` names the piece (e.g. "chunk 1 of peer 2").

    >>> check_error(torch.zeros(1, dtype=torch.int32))     # nothing recorded: returns
    """
    code = int(err.reshape(-1)[0])
    if code == 0:
        return
    flag = code - 1
    what = describe(flag) if describe is not None else f"arrival flag {flag}"
    budget = f" (about {timeout_s:.1f}s)" if timeout_s is not None else ""
    raise CommTimeoutError(
        f"gated GEMM: {what} never arrived: its flag stayed 0 past the wait's deadline{budget}; "
        f"the copy that should raise it is stuck or its peer is dead. Raise FICCO_TIMEOUT if "
        f"the peer is only slow")


def compile_offline(target: str, dtype: str = "bf16", block=(128, 128, 64), num_warps: int = 8,
                    num_stages: int = 3, trace_mode: int = TRACE_OFF, **options) -> dict:
    """Compile the kernel for ``target`` ("cuda:sm_90", "rocm:gfx942", ...) without a device
    (Triton ships its own LLVM, ptxas and lld) and return the assembly by stage, e.g.
    ``{"ptx": ..., "cubin": ...}``: proof off-GPU that the compiled path builds, and what the
    flag poll lowers to (an acquire load), and with ``trace_mode`` that the clock reads build.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kind, _, arch = target.partition(":")
    if kind == "cuda":
        gpu = GPUTarget("cuda", int(arch.removeprefix("sm_")), 32)
    elif kind in ("rocm", "hip"):
        gpu = GPUTarget("hip", arch, 64)
    else:
        raise InvalidArgumentError(f"compile_offline needs a cuda:sm_XX or rocm:gfxXXX target; "
                                   f"got {target!r}")
    jitted = triton.jit(_kernel_body)
    pointers = {"a_local": f"*{dtype}", "a_gathered": f"*{dtype}", "b": f"*{dtype}",
                "c": f"*{dtype}", "seg_table": "*i32", "part_table": "*i32", "flags": "*i32",
                "err": "*i32", "halt": "*i32", "trace": "*i64"}
    constexprs = {"BLOCK_M": block[0], "BLOCK_N": block[1], "BLOCK_K": block[2],
                  "IEEE": dtype == "fp32", "UPCAST": False, "CLOCK": clock_mode(target),
                  "AMD": kind != "cuda", "TRACE": trace_mode, "POLL": POLL}
    pointers["wait_ticks"] = "i64"
    signature = {name: pointers.get(name, "constexpr" if name in constexprs else "i32")
                 for name in jitted.arg_names}
    kernel = triton.compile(ASTSource(fn=jitted, signature=signature, constexprs=constexprs),
                            target=gpu, options={"num_warps": num_warps,
                                                 "num_stages": num_stages, **options})
    return dict(kernel.asm)
