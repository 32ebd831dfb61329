"""The gated GEMM's per-tile trace: clocks the kernel reads and what the host makes of them.

Off by default: the kernel's ``TRACE`` constexpr is 0 and no trace code is compiled in. On,
every program (one output tile) writes TRACE_WORDS int64 to a buffer from
:func:`trace_buffer`: when it started, saw its first and last awaited flag, and ended, and
which tile it was; :func:`read_trace` decodes them. The clock per backend is
:func:`clock_mode`'s (docs/kernels.md, "Per-tile trace")::

    >>> clock_mode("rocm:gfx942") == TRACE_MEMREALTIME, ticks_per_s(TRACE_GLOBALTIMER)
    (True, 1000000000.0)
"""
from __future__ import annotations

import functools
import time

import torch
import triton.language as tl  # optional extra: imported only with the kernel

from . import configs

# -- per-tile trace (off by default) ---------------------------------------------------------------
#: ``TRACE`` values (a constexpr of the kernel: 0 compiles no tracing code at all).
TRACE_OFF, TRACE_GLOBALTIMER, TRACE_MEMREALTIME, TRACE_RDNA3, TRACE_RDNA4, TRACE_COUNTER, \
    TRACE_HOST_NS = range(7)
#: int64 words per program in the trace buffer, after its word 0 (the interpreter's counter):
#: start, first flag seen, last flag seen, end, segment, row offset in the segment, first
#: column, BLOCK_M * 65536 + BLOCK_N, ok (0: a wait timed out).
TRACE_WORDS = tl.constexpr(9)

# Clock reads as inline assembly, is_pure=False so they are neither merged nor hoisted.
# NVIDIA: %globaltimer, nanoseconds. AMD CDNA (gfx9): s_memrealtime, the constant "REFCLK"
# counter (100 MHz on MI200/MI300; the host reads hipDeviceAttributeWallClockRate) - an SMEM
# instruction, so its result is ready only after lgkmcnt(0) (Triton 3.9's own
# extra.hip.memrealtime waits on vmcnt). RDNA3/4 have no s_memrealtime: the realtime message.
_CLOCK_ASM = {
    TRACE_GLOBALTIMER: ("mov.u64 $0, %globaltimer;", "=l"),
    TRACE_MEMREALTIME: ("s_memrealtime $0\n\ts_waitcnt lgkmcnt(0)", "=s"),
    TRACE_RDNA3: ("s_sendmsg_rtn_b64 $0, sendmsg(MSG_RTN_GET_REALTIME)\n\ts_waitcnt lgkmcnt(0)",
                  "=s"),
    TRACE_RDNA4: ("s_sendmsg_rtn_b64 $0, sendmsg(MSG_RTN_GET_REALTIME)\n\ts_wait_kmcnt 0", "=s"),
}


def read_clock(mode, counter, _semantic=None):
    """One int64 timestamp of kind ``mode`` (a constexpr). Marked a Triton builtin (below)
    rather than written as a jit helper: the compiler calls it with its ``_semantic``, the
    interpreter as plain Python (where tl.* are patched and ``_semantic`` is None); a jit
    helper cannot be called from a kernel built with InterpretedFunction. (Not
    ``tl.core.extern``: its wrapper refuses a call without ``_semantic``.)
    Interpreter only: ``TRACE_COUNTER`` takes the next number of ``counter`` (an order, no
    time), ``TRACE_HOST_NS`` reads the host's monotonic clock, the one the CPU backend's
    events use (the interpreter runs the program on the host, so that IS when it got there)."""
    mode = tl.core._unwrap_if_constexpr(mode)
    if mode == TRACE_COUNTER:
        return tl.atomic_add(counter, 1, _semantic=_semantic)
    if mode == TRACE_HOST_NS:
        if _semantic is not None and not _interpreting(_semantic):
            raise ValueError("TRACE_HOST_NS exists in the interpreter only")
        return tl.full((), time.perf_counter_ns(), tl.int64, _semantic=_semantic)
    asm, constraint = _CLOCK_ASM[mode]
    return tl.inline_asm_elementwise(asm, constraint, [], dtype=tl.int64, is_pure=False, pack=1,
                                     _semantic=_semantic)


setattr(read_clock, tl.core.TRITON_BUILTIN, True)


@functools.cache
def trace_supported() -> bool:
    """Whether this Triton calls builtins with ``_semantic`` (as :func:`read_clock` expects);
    older ones (3.2, 3.3) pass ``_builder``. Tracing off never compiles ``read_clock`` in."""
    import inspect

    return "_semantic" in inspect.signature(tl.atomic_add).parameters


def _interpreting(semantic) -> bool:
    return type(semantic).__module__.startswith("triton.runtime.interpreter")



def clock_mode(target: str) -> int:
    """The trace clock of backend ``target``: %globaltimer on NVIDIA, the realtime counter
    on AMD, the host's clock in the interpreter ("cpu").

    >>> clock_mode("cuda:sm_90") == TRACE_GLOBALTIMER, clock_mode("cpu") == TRACE_HOST_NS
    (True, True)
    """
    kind, _, arch = target.partition(":")
    if kind == "cuda":
        return TRACE_GLOBALTIMER
    if kind in ("rocm", "hip"):
        return TRACE_RDNA4 if arch.startswith("gfx12") else \
            TRACE_RDNA3 if arch.startswith("gfx11") else TRACE_MEMREALTIME
    return TRACE_HOST_NS


def wait_clock(device_kind: str, family: str) -> int:
    """The clock the gated GEMM's waits are timed by (always compiled in, trace or not): the
    host's in the interpreter (``device_kind`` "cpu", the fake GPU included), else the
    target's (:func:`clock_mode` of the current device for AMD, whose RDNA parts differ).

    >>> wait_clock("cpu", "nvidia") == TRACE_HOST_NS, wait_clock("cuda", "nvidia")
    (True, 1)
    """
    if device_kind == "cpu":
        return TRACE_HOST_NS
    if family == "nvidia":
        return TRACE_GLOBALTIMER
    return clock_mode(configs.current_target())


def trace_buffer(segments, n: int, family: str, device) -> torch.Tensor:
    """A trace buffer for a launch over ``segments`` with ``n`` columns: word 0 the
    interpreter's counter (0), then TRACE_WORDS int64 per program, -1 where no program wrote
    (sized for the autotuner's smallest tiles: the winning config is known only after)."""
    words = int(TRACE_WORDS)
    programs = max(sum(-(-s.rows // bm) for s in segments) * -(-n // bn)
                   for bm, bn in configs.block_shapes(family))
    buf = torch.full((1 + words * programs,), -1, dtype=torch.int64, device=device)
    buf[0] = 0
    return buf


def ticks_per_s(mode: int, device_index: int = 0) -> float | None:
    """Clock rate of trace ``mode`` (None for the order counter: no time). AMD's realtime
    counter runs at the device's wall clock rate (100 MHz on MI200/MI300)."""
    if mode in (TRACE_GLOBALTIMER, TRACE_HOST_NS):
        return 1e9
    if mode == TRACE_COUNTER:
        return None
    try:
        from hip import hip

        status, khz = hip.hipDeviceGetAttribute(
            hip.hipDeviceAttribute_t.hipDeviceAttributeWallClockRate, device_index)
        if status == hip.hipError_t.hipSuccess and khz > 0:
            return khz * 1e3
    except Exception:  # noqa: BLE001, S110 - no hip-python: the documented CDNA rate
        pass
    return 1e8


def read_trace(trace: torch.Tensor, segments, n: int, mode: int,
               rate: float | None = None, origin: int | None = None) -> list[dict]:
    """One dict per traced program (tile), in program order: ``row0``/``rows`` and
    ``col0``/``cols`` of C, the ``flags`` its parts waited for, ``start``, ``first_seen``,
    ``last_seen`` (when its first and last awaited flag was seen; = start for tiles that wait
    for nothing), ``end``, in seconds from the earliest start (raw ticks for the counter),
    and ``ok`` (0: a wait timed out). ``origin`` (raw ticks, e.g. the host clock at the
    launch) replaces the earliest start as time zero. Call after the kernel finished."""
    words = int(TRACE_WORDS)
    raw = trace[1:].reshape(-1, words).cpu().tolist()
    rate = rate if rate is not None else ticks_per_s(mode)
    rows = [r for r in raw if r[0] != -1]
    origin = min((r[0] for r in rows), default=0) if origin is None else origin
    scale = 1.0 if rate is None else 1.0 / rate
    out = []
    for t0, t1, t2, t3, seg, row_off, col0, block, ok in rows:
        s = segments[seg]
        bm, bn = divmod(block, 65536)
        out.append({"segment": seg, "row0": s.row0 + row_off,
                    "rows": min(bm, s.rows - row_off), "col0": col0, "cols": min(bn, n - col0),
                    "flags": tuple(f for _, _, f in s.parts if f >= 0),
                    "start": (t0 - origin) * scale, "first_seen": (t1 - origin) * scale,
                    "last_seen": (t2 - origin) * scale, "end": (t3 - origin) * scale,
                    "ok": ok})
    return out

