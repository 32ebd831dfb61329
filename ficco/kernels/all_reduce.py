"""One-kernel all-reduce over ficco's symmetric memory: ``one-shot`` and ``two-shot``, for
NVIDIA and AMD (and Triton's interpreter on CPU).

Each rank's GEMM has written its partial product into its ``partial`` buffer of the symmetric
workspace. ONE launch then does the whole all-reduce, its cross-rank barriers included, on
the plan's flag protocol (:mod:`ficco.symm_mem.barrier`: slot ``[channel, writer]`` of
``owner``'s signal pad, the call's flag written, awaited exactly, cleared)::

    one-shot (channels c, 1-c)              two-shot (channels c, 1-c, c)
    program 0: flag -> every peer's pad c   program 0: flag -> every peer's pad c
    all: wait pad c == flag (all peers)     all: wait pad c == flag
    out = sum_q partial_q (rank order)      reduced[mine] = out[mine] = sum_q partial_q[mine]
                                            last program: clear pad c, flag -> peers' pad 1-c
                                            all: wait pad 1-c == flag
                                            out[q's piece] = reduced_q[q's piece], q != me
    last program: clear pad c,              last program: clear pad 1-c,
      flag -> peers' pad 1-c, wait, clear     flag -> peers' pad c, wait, clear

Every rank sums the W partials in rank order 0, 1, ..., W-1 in float32 (float64 for float64)
and rounds once, so every rank holds the same bits (two-shot: each element is summed once,
by the owner of its piece, and copied by the others). "The last program" is the one whose
increment of a per-launch counter completes it: it alone clears and signals, after every
program of this rank finished reading, so no program waits for another program (the grid
needs no co-residency for one-shot; two-shot's programs wait for the last one's signal, so its
grid is at most the resident programs, as the gated GEMM's).

Waits are bounded by the device clock from the launch's start (FICCO_TIMEOUT for the whole
kernel) and every exit decision is CTA-uniform: each thread of a program reads one lane of a
``LANES``-wide vector (the W slots, the halt word, its own clock) and the decisions are
block-wide reductions of those lanes, so all warps leave a wait at the same iteration with the
same outcome. A wait that gives up (its time ran out, a peer's slot holds another call's flag,
or the halt word rose) records the reason in the error word, raises the halt word (on GPUs the
group's error word, :data:`~ficco.symm_mem.fault.KERNEL`) unless it was already raised, and the
output is written as NaN: never a partial or stale result. Flags are written with release and
read back with acquire atomics at system scope (the pads may be host memory or a peer GPU's).

Example (interpreter on CPU, a world of one: no peer to wait for)::

    >>> import torch
    >>> from ficco.kernels.all_reduce import shot_all_reduce
    >>> part = torch.randn(4, 6); out = torch.empty(4, 6); pad = torch.zeros(8, 1, dtype=torch.int32)
    >>> err = shot_all_reduce([part], [out], [pad], out, rank=0, flag=7, device_kind="cpu")
    >>> int(err[0]), torch.equal(out, part), int(pad.abs().sum())
    (0, True, 0)
"""
from __future__ import annotations

import functools

import torch

# Triton is an optional extra: only the one-kernel schedules' launch and the tests import this
# module, after ficco.kernels.unavailable_reason() found Triton.
import triton
import triton.language as tl

from ..errors import CommTimeoutError, InvalidArgumentError, MismatchError
from ..plan.problem import even_split
from ..symm_mem.barrier import SIGNAL_CHANNELS
from ..symm_mem.fault import KERNEL

# The kernel reads read_clock and the word builtins as globals.
from .trace import read_clock, ticks_per_s, wait_clock
from .words import load_word, store_word

GAVE_UP = tl.constexpr(KERNEL)
#: error word codes (``err[0]``); ``err[1]`` the barrier (0 first, 1 second, 2 third), ``err[2]``
#: a bit per peer whose slot was not met, ``err[3]`` a foreign flag seen
OK, TIMED_OUT, FOREIGN, HALTED = 0, 1, 2, 3
_TIMED_OUT, _FOREIGN, _HALTED = tl.constexpr(TIMED_OUT), tl.constexpr(FOREIGN), tl.constexpr(HALTED)
# Reductions named by their combine functions (tl.max/min/sum are jit helpers, which a kernel
# built for the interpreter cannot call; the interpreter maps these to numpy).
_MAX, _MIN, _SUM = (tl.standard._elementwise_max, tl.standard._elementwise_min,
                    tl.standard._sum_combine)
#: elements per program per step, and the lanes each wait is read by (32 x num_warps)
BLOCK, LANES, NUM_WARPS = 1024, 128, 4


def _shot_body(partials, reduceds, pads, part_local, out, err, halt, counters, pieces,
               numel, rank, flag, wait_ticks, scale,
               WORLD: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
               TWO_SHOT: tl.constexpr, FIRST: tl.constexpr, SCALED: tl.constexpr,
               WIDE: tl.constexpr, CLOCK: tl.constexpr, AMD: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, LANES)
    lane_peer = lanes % WORLD
    real_lane = lanes < WORLD
    nowhere = lanes * 0
    acc_ty = tl.float64 if WIDE else tl.float32
    part_ty = part_local.dtype.element_ty
    own_pad = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    # One clock for every wait of the launch: the whole kernel is bounded by FICCO_TIMEOUT.
    began = tl.reduce(tl.full((LANES,), read_clock(CLOCK, counters), tl.int64), 0, _MAX)
    ok = 1

    # -- barrier 1 (channel FIRST): every rank's partial is written ------------------------
    if pid == 0:
        for q in tl.static_range(WORLD):
            peer_pad = tl.load(pads + q).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_pad + FIRST * WORLD + rank, flag, sem="release", scope="sys")
    slots = own_pad + FIRST * WORLD + lane_peer
    seen = load_word(slots, AMD)
    arrived = tl.reduce(tl.where(seen == flag, 1, 0), 0, _MIN)
    stop = 0
    foreign = 0
    waited = began - began
    while (arrived == 0) & (stop == 0) & (foreign == 0) & (waited < wait_ticks):
        seen = load_word(slots, AMD)
        arrived = tl.reduce(tl.where(seen == flag, 1, 0), 0, _MIN)
        foreign = tl.reduce(tl.where((seen != 0) & (seen != flag), 1, 0), 0, _MAX)
        stop = tl.reduce(load_word(halt + nowhere, AMD), 0, _MAX)
        waited = tl.reduce(tl.full((LANES,), read_clock(CLOCK, counters), tl.int64), 0, _MAX) - began
    if arrived == 0:
        ok = 0
        code = tl.where(stop != 0, _HALTED, tl.where(foreign != 0, _FOREIGN, _TIMED_OUT))
        if tl.atomic_cas(err, 0, code) == 0:
            tl.atomic_xchg(err + 1, 0)
            tl.atomic_xchg(err + 2, tl.reduce(tl.where(real_lane & (seen != flag),
                                                    1 << lane_peer, 0), 0, _SUM))
            tl.atomic_xchg(err + 3, tl.reduce(tl.where(real_lane & (seen != flag), seen, 0), 0, _MAX))
        if stop == 0:
            store_word(halt, GAVE_UP)
    else:
        # Acquire what each peer released with its flag (the values read back are the flags,
        # checked so that no compiler drops the reads).
        held = 0
        for q in tl.static_range(WORLD):
            held += tl.where(tl.atomic_add(own_pad + FIRST * WORLD + q, 0, sem="acquire",
                                           scope="sys") == flag, 1, 0)
        ok = tl.where(held == WORLD, ok, 0)

    # -- the sums -------------------------------------------------------------------------
    if TWO_SHOT:
        mine0 = tl.load(pieces + 2 * rank)
        mine_n = tl.load(pieces + 2 * rank + 1)
        red_local = tl.load(reduceds + rank).to(tl.pointer_type(out.dtype.element_ty))
    else:
        mine0 = 0
        mine_n = numel
        red_local = out
    for start in range(pid * BLOCK, mine_n, programs * BLOCK):
        offs = mine0 + start + tl.arange(0, BLOCK)
        mask = offs < mine0 + mine_n
        acc = tl.full((BLOCK,), 0.0, acc_ty)
        for q in tl.static_range(WORLD):
            src = tl.load(partials + q).to(tl.pointer_type(part_ty))
            acc += tl.load(src + offs, mask=mask & (tl.full((BLOCK,), ok, tl.int32) != 0), other=0.0).to(acc_ty)
        if SCALED:
            acc = acc * scale
        acc = tl.where(ok != 0, acc, float("nan"))
        value = acc.to(out.dtype.element_ty)
        if TWO_SHOT:
            tl.store(red_local + offs, value, mask=mask, cache_modifier=".wt")
        tl.store(out + offs, value, mask=mask)

    if TWO_SHOT:
        # -- barrier 2 (channel 1-FIRST): every piece is reduced -------------------------
        if tl.atomic_add(counters, 1, sem="acq_rel") == programs - 1:
            for q in tl.static_range(WORLD):
                tl.atomic_xchg(own_pad + FIRST * WORLD + q, 0)
            # Once a wait gave up (here or in the group) no flag goes out: a peer still to
            # come must not pass on it and return what this rank no longer vouches for.
            if tl.reduce(load_word(halt + nowhere, AMD), 0, _MAX) == 0:
                for q in tl.static_range(WORLD):
                    peer_pad = tl.load(pads + q).to(tl.pointer_type(tl.int32))
                    tl.atomic_xchg(peer_pad + (1 - FIRST) * WORLD + rank, flag,
                                   sem="release", scope="sys")
        slots = own_pad + (1 - FIRST) * WORLD + lane_peer
        seen = load_word(slots, AMD)
        arrived = tl.reduce(tl.where(seen == flag, 1, 0), 0, _MIN)
        stop = tl.reduce(load_word(halt + nowhere, AMD), 0, _MAX)
        foreign = 0
        waited = began - began
        while (arrived == 0) & (stop == 0) & (foreign == 0) & (waited < wait_ticks):
            seen = load_word(slots, AMD)
            arrived = tl.reduce(tl.where(seen == flag, 1, 0), 0, _MIN)
            foreign = tl.reduce(tl.where((seen != 0) & (seen != flag), 1, 0), 0, _MAX)
            stop = tl.reduce(load_word(halt + nowhere, AMD), 0, _MAX)
            waited = tl.reduce(tl.full((LANES,), read_clock(CLOCK, counters), tl.int64), 0, _MAX) - began
        if arrived == 0:
            ok = 0
            code = tl.where(stop != 0, _HALTED, tl.where(foreign != 0, _FOREIGN, _TIMED_OUT))
            if tl.atomic_cas(err, 0, code) == 0:
                tl.atomic_xchg(err + 1, 1)
                tl.atomic_xchg(err + 2, tl.reduce(tl.where(real_lane & (seen != flag),
                                                        1 << lane_peer, 0), 0, _SUM))
                tl.atomic_xchg(err + 3, tl.reduce(tl.where(real_lane & (seen != flag), seen, 0), 0, _MAX))
            if stop == 0:
                store_word(halt, GAVE_UP)
        else:
            held = 0
            for q in tl.static_range(WORLD):
                held += tl.where(tl.atomic_add(own_pad + (1 - FIRST) * WORLD + q, 0,
                                               sem="acquire", scope="sys") == flag, 1, 0)
            ok = tl.where(held == WORLD, ok, 0)
        # -- the peers' pieces -------------------------------------------------------------
        for q in tl.static_range(WORLD):
            if q != rank:
                piece0 = tl.load(pieces + 2 * q)
                piece_n = tl.load(pieces + 2 * q + 1)
                src = tl.load(reduceds + q).to(tl.pointer_type(out.dtype.element_ty))
                for start in range(pid * BLOCK, piece_n, programs * BLOCK):
                    offs = piece0 + start + tl.arange(0, BLOCK)
                    mask = offs < piece0 + piece_n
                    value = tl.load(src + offs, mask=mask & (tl.full((BLOCK,), ok, tl.int32) != 0), other=0.0)
                    value = tl.where(ok != 0, value, float("nan"))
                    tl.store(out + offs, value.to(out.dtype.element_ty), mask=mask)

    # -- the closing barrier (channel FIRST again for two-shot, 1-FIRST for one-shot) --------
    LAST: tl.constexpr = FIRST if TWO_SHOT else 1 - FIRST
    STAGE: tl.constexpr = 2 if TWO_SHOT else 1
    if tl.atomic_add(counters + STAGE - 1, 1, sem="acq_rel") == programs - 1:
        for q in tl.static_range(WORLD):   # no program reads the previous channel any more
            tl.atomic_xchg(own_pad + (1 - LAST) * WORLD + q, 0)
        if tl.reduce(load_word(halt + nowhere, AMD), 0, _MAX) == 0:   # (as above)
            for q in tl.static_range(WORLD):
                peer_pad = tl.load(pads + q).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer_pad + LAST * WORLD + rank, flag, sem="release",
                               scope="sys")
        slots = own_pad + LAST * WORLD + lane_peer
        seen = load_word(slots, AMD)
        arrived = tl.reduce(tl.where(seen == flag, 1, 0), 0, _MIN)
        stop = tl.reduce(load_word(halt + nowhere, AMD), 0, _MAX)
        foreign = 0
        waited = began - began
        while (arrived == 0) & (stop == 0) & (foreign == 0) & (waited < wait_ticks):
            seen = load_word(slots, AMD)
            arrived = tl.reduce(tl.where(seen == flag, 1, 0), 0, _MIN)
            foreign = tl.reduce(tl.where((seen != 0) & (seen != flag), 1, 0), 0, _MAX)
            stop = tl.reduce(load_word(halt + nowhere, AMD), 0, _MAX)
            waited = tl.reduce(tl.full((LANES,), read_clock(CLOCK, counters), tl.int64), 0, _MAX) - began
        if arrived == 0:
            code = tl.where(stop != 0, _HALTED, tl.where(foreign != 0, _FOREIGN, _TIMED_OUT))
            if tl.atomic_cas(err, 0, code) == 0:
                tl.atomic_xchg(err + 1, STAGE)
                tl.atomic_xchg(err + 2, tl.reduce(tl.where(real_lane & (seen != flag),
                                                        1 << lane_peer, 0), 0, _SUM))
                tl.atomic_xchg(err + 3, tl.reduce(tl.where(real_lane & (seen != flag), seen, 0), 0, _MAX))
            if stop == 0:
                store_word(halt, GAVE_UP)
        else:
            for q in tl.static_range(WORLD):
                tl.atomic_xchg(own_pad + LAST * WORLD + q, 0)
        # Any give-up of this launch (or of the group): the whole output is NaN, whatever
        # programs finished first wrote (a replayed graph has no fence to do it).
        if tl.reduce(load_word(halt + nowhere, AMD), 0, _MAX) != 0:
            nan = tl.full((BLOCK,), float("nan"), tl.float32).to(out.dtype.element_ty)
            for at in range(0, numel, BLOCK):
                spots = at + tl.arange(0, BLOCK)
                tl.store(out + spots, nan, mask=spots < numel)


@functools.cache
def _compiled(device_kind: str):
    """The kernel for one device kind: the interpreter on CPU (one launch at a time in this
    process, :func:`ficco.kernels.interpreted`), else triton.jit."""
    if device_kind == "cpu":
        from . import interpreted

        return interpreted(_shot_body)
    return triton.jit(_shot_body)


def _addresses(items, device) -> torch.Tensor:
    """int64 addresses of tensors (their data) or of plain ints (addresses already)."""
    return torch.tensor([t if isinstance(t, int) else t.data_ptr() for t in items],
                        dtype=torch.int64, device=device)


def pieces_table(rows: int, cols: int, world: int, device) -> torch.Tensor:
    """(first element, elements) of every rank's piece of a ``rows x cols`` row-major buffer:
    the all-reduce's ``even_split`` of its rows (longer pieces first), as int64."""
    return torch.tensor([[r0 * cols, n * cols] for r0, n in even_split(rows, world)],
                        dtype=torch.int64, device=device).reshape(-1)


def shot_all_reduce(partials, reduceds, pads, out, *, rank: int, flag: int,
                    two_shot: bool = False, first_channel: int = 0,
                    scale: float | None = None, halt: torch.Tensor | None = None,
                    timeout_s: float = 300.0, family: str = "cpu",
                    device_kind: str | None = None, max_programs: int | None = None,
                    tables=None) -> torch.Tensor:
    """Launch the one-kernel all-reduce on the current stream: ``out = scale * sum over ranks
    of partials[q]`` (every rank's partial in rank order). ``partials[q]``, ``reduceds[q]``
    (two-shot: where rank q's reduced piece lives; in ``out``'s dtype) and ``pads[q]`` (rank
    q's int32 signal pad, ``(SIGNAL_CHANNELS, W)``) are rank q's memory as this rank maps it.
    The barriers use ``flag`` (the call's, nonzero) on channels ``first_channel``,
    ``1 - first_channel`` (and ``first_channel`` again for two-shot). ``halt``: a nonzero
    word ends every wait (the group's error word on GPUs); each launch's waits end
    ``timeout_s`` after it started, by the device clock. ``tables``: the address tables and
    the pieces, as :func:`tables_for` made them (cached by the caller). Returns the error word
    (int32[4]); :func:`check_error` raises what it records."""
    world = len(partials)
    if not 0 < flag < 2 ** 31:
        raise InvalidArgumentError(f"a call flag is in [1, 2**31); got {flag}")
    if first_channel not in (0, 1):
        raise InvalidArgumentError(f"first_channel is 0 or 1; got {first_channel}")
    if not out.is_contiguous() or any(not p.is_contiguous() or p.numel() != out.numel()
                                      for p in partials):
        raise InvalidArgumentError("shot_all_reduce needs contiguous partials shaped like out")
    if world > 31:
        raise InvalidArgumentError(f"shot_all_reduce runs groups of up to 31 ranks; got {world}")
    device_kind = device_kind or out.device.type
    kernel = _compiled(device_kind)
    if tables is None:
        tables = tables_for(partials, reduceds, pads, out)
    partial_at, reduced_at, pad_at, pieces = tables
    if pad_at.numel() != world:
        raise InvalidArgumentError(f"shot_all_reduce: {pad_at.numel()} pads for {world} ranks")
    err = torch.zeros(4, dtype=torch.int32, device=out.device)
    counters = torch.zeros(2, dtype=torch.int32, device=out.device)
    halt = torch.zeros(1, dtype=torch.int32, device=out.device) if halt is None else halt
    clock = wait_clock(device_kind, family)
    wait_ticks = max(1, int(timeout_s * (ticks_per_s(clock, out.device.index or 0) or 1e9)))
    numel = out.numel()
    steps = triton.cdiv(max(numel // world if two_shot else numel, 1), BLOCK)
    programs = 1 if device_kind == "cpu" else max(1, min(steps, max_programs or steps))
    wide = out.dtype == torch.float64
    kernel[(programs,)](partial_at, reduced_at, pad_at, partials[rank], out, err, halt,
                        counters, pieces, numel, rank, flag, wait_ticks,
                        1.0 if scale is None else float(scale),
                        WORLD=world, LANES=LANES, BLOCK=BLOCK, TWO_SHOT=two_shot,
                        FIRST=first_channel, SCALED=scale is not None, WIDE=wide, CLOCK=clock,
                        AMD=family == "amd" and device_kind != "cpu", num_warps=NUM_WARPS)
    return err


def tables_for(partials, reduceds, pads, out):
    """The int64 tables the kernel walks: every rank's partial, reduced and pad address, and
    the pieces (two-shot), on ``out``'s device (a caller caches them per workspace).
    ``pads``: tensors or addresses."""
    device = out.device
    rows = out.shape[0] if out.dim() == 2 else out.numel()
    cols = out.shape[1] if out.dim() == 2 else 1
    return (_addresses(partials, device), _addresses(reduceds or partials, device),
            _addresses(pads, device), pieces_table(rows, cols, len(partials), device))


def check_error(err: torch.Tensor, rank: int, timeout_s: float | None = None) -> None:
    """Raise what the launch's error word ``err`` records (nothing when it is 0):
    :class:`CommTimeoutError` naming the barrier and the late peers, or
    :class:`MismatchError` when a peer's slot held another call's flag.

    >>> check_error(torch.zeros(4, dtype=torch.int32), rank=0)
    """
    code, stage, late, seen = (int(x) for x in err.reshape(-1)[:4].tolist())
    if code == OK:
        return
    peers = [q for q in range(31) if late >> q & 1]
    which = ("first (every partial written)", "second", "closing")[min(stage, 2)]
    if code == FOREIGN:
        raise MismatchError(
            f"rank {rank}: the one-kernel all-reduce's {which} barrier found rank(s) {peers} "
            f"in a different call (flag {seen} in their slot): other shapes, dtypes, settings "
            f"or op. Nothing this call computed is returned; every rank must make the same "
            f"calls in the same order")
    budget = f" {timeout_s:.1f}s" if timeout_s is not None else ""
    if code == HALTED:
        raise CommTimeoutError(
            f"rank {rank}: the one-kernel all-reduce's {which} barrier was released by its "
            f"group's failure (a wait of this group gave up) while rank(s) {peers} had not "
            f"arrived; its output is NaN and the call returns nothing")
    raise CommTimeoutError(
        f"rank {rank}: the one-kernel all-reduce's {which} barrier waited{budget} "
        f"(FICCO_TIMEOUT, by the device clock) for rank(s) {peers}, whose slots never held "
        f"this call's flag; they are dead, stuck or late. Its output is NaN and the call "
        f"returns nothing. Raise FICCO_TIMEOUT if they are only slow")


__all__ = ["SIGNAL_CHANNELS", "check_error", "pieces_table", "shot_all_reduce", "tables_for"]


def compile_offline(target: str, dtype: str = "bf16", out_dtype: str | None = None,
                    world: int = 8, two_shot: bool = False, **options) -> dict:
    """Compile the kernel for ``target`` ("cuda:sm_90", "rocm:gfx942", ...) without a device
    (Triton ships its own LLVM and assemblers) and return its assembly by stage (``"ptx"``,
    ``"amdgcn"``, ...): proof off-GPU that the compiled path builds, and what its flag
    writes, polls and decisions lower to."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .trace import clock_mode

    kind, _, arch = target.partition(":")
    if kind == "cuda":
        gpu = GPUTarget("cuda", int(arch.removeprefix("sm_")), 32)
    elif kind in ("rocm", "hip"):
        gpu = GPUTarget("hip", arch, 64)
    else:
        raise InvalidArgumentError(f"compile_offline needs a cuda:sm_XX or rocm:gfxXXX target; "
                                   f"got {target!r}")
    jitted = triton.jit(_shot_body)
    out_dtype = out_dtype or dtype
    types = {"partials": "*i64", "reduceds": "*i64", "pads": "*i64", "part_local": f"*{dtype}",
             "out": f"*{out_dtype}", "err": "*i32", "halt": "*i32", "counters": "*i32",
             "pieces": "*i64", "numel": "i32", "rank": "i32", "flag": "i32",
             "wait_ticks": "i64", "scale": "fp32"}
    lanes = LANES if kind == "cuda" else 2 * LANES     # 32 x warps, 64 x waves
    constexprs = {"WORLD": world, "LANES": lanes, "BLOCK": BLOCK, "TWO_SHOT": two_shot,
                  "FIRST": 0, "SCALED": True, "WIDE": out_dtype == "fp64",
                  "CLOCK": clock_mode(target), "AMD": kind != "cuda"}
    signature = {name: types.get(name, "constexpr") for name in jitted.arg_names}
    kernel = triton.compile(ASTSource(fn=jitted, signature=signature, constexprs=constexprs),
                            target=gpu, options={"num_warps": NUM_WARPS, **options})
    return dict(kernel.asm)
