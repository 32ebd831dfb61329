"""The checks ``selftest`` runs on every rank of a live group, in order, each one bounded:

- ``schedule``: every schedule the selector can pick (``ficco.schedules.offered``) of every
  op ficco registers, on both transports, at each shape and dtype, against float64;
- ``fault``: a peer late inside FICCO_TIMEOUT (exact data on every rank), then a peer late
  past it (a ficco error on every rank, or NaN outputs whose group's next call raises:
  never data);
- ``graph``: one call captured into a CUDA graph and replayed on fresh inputs (GPUs);
- ``timing``: serial against the selector's pick at the user's shape (slowest rank, median);
  it fails when the pick takes more than :data:`TIMING_BAND` times serial's time.

After every check the ranks exchange its outcome through the group's store with their own
keys (never ficco's agreement sequence, which a failed call may have left mid-exchange on one
rank), and when any rank failed every rank calls ``ficco.shutdown()``, so the
next check starts in step on a clean group. A check that outlasts its bound ends the process
(:class:`Watch`): a hang is reported, never waited out.
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from . import cases

#: Shapes (rows per rank, K, n): tiny has uneven row chunks at every W tested; medium is a few
#: thousand rows on a GPU, small enough for the CPU backend in CI otherwise. K and n are
#: multiples of 16 everywhere: a GPU's fp8 GEMM takes no other.
SHAPES = {"gpu": {"tiny": (5, 32, 16), "medium": (512, 1024, 768)},
          "cpu": {"tiny": (5, 32, 16), "medium": (48, 96, 64)}}


#: The timing row fails when the selector's pick takes more than this times serial's time (the
#: slowest rank's medians): the default path must not cost more than the plain one beyond
#: noise.
TIMING_BAND = 1.25


@dataclass(frozen=True)
class Options:
    """What to check; one value on every rank."""

    shapes: tuple[str, ...] = ("tiny", "medium")
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float8")
    transports: tuple[str, ...] = ("dma", "ccl")
    ops: tuple[str, ...] = ()              # () = every op ficco registers
    optional: bool = False                 # also the optional schedules that can run here
    fault: bool = True
    graph: bool = True
    timing_shape: tuple[int, int, int] | None = None   # (M, N, K); None: no timing
    timeout_s: float = 20.0                # FICCO_TIMEOUT of the correctness calls
    fault_timeout_s: float = 2.0
    seed: int = 1234
    smoke: bool = False                    # only the default path (selector, transport) per op
    bound_s: float | None = None           # one check's bound (None: 3 x timeout + 60 s)
    timing_band: float = TIMING_BAND       # the pick may take this x serial's time, no more


@dataclass
class Row:
    """One check's outcome (one line, one JSON object)."""

    check: str
    name: str
    status: str = "ok"                     # ok | FAIL | skip
    error: float | None = None
    tolerance: float | None = None
    seconds: float | None = None
    detail: str = ""
    fields: dict = field(default_factory=dict)

    def line(self) -> str:
        err = f" err {self.error:.2e} (tol {self.tolerance:.0e})" \
            if self.error is not None and self.tolerance is not None else ""
        took = f" {self.seconds * 1e3:.2f} ms" if self.seconds is not None else ""
        extra = f"  {self.detail}" if self.detail else ""
        return f"{self.status:4s} {self.check:8s} {self.name}{err}{took}{extra}"

    def as_json(self) -> dict:
        out = {"check": self.check, "name": self.name, "status": self.status,
               "error": self.error, "tolerance": self.tolerance, "seconds": self.seconds,
               "detail": self.detail, **self.fields}
        if out["error"] is not None and out["error"] == float("inf"):
            out["error"] = "inf"
        return out


class Watch:
    """Ends this process with exit code 3 when one check outlasts ``bound_s`` (a hang in ficco
    or a peer that never comes): the line names the check; a hang is never waited out."""

    def __init__(self, rank: int, emit):
        self.rank, self.emit = rank, emit
        self._what, self._deadline = "", float("inf")
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="ficco-selftest-watch", daemon=True).start()

    def arm(self, what: str, bound_s: float) -> None:
        with self._lock:
            self._what, self._deadline = what, time.monotonic() + bound_s

    def disarm(self) -> None:
        with self._lock:
            self._deadline = float("inf")

    def _loop(self) -> None:
        while True:
            time.sleep(0.2)
            with self._lock:
                late = time.monotonic() > self._deadline
                what = self._what
            if late:
                self.emit(f"HANG rank {self.rank}: {what} did not finish within its bound; "
                          f"selftest ends (exit 3)")
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(3)


class Runner:
    """The checks of one rank; ``emit(line)`` prints (rank 0's lines are the report)."""

    def __init__(self, rank: int, world: int, group, options: Options, emit, on_row=None):
        import ficco
        from ficco.backends import get_backend

        self.rank, self.world, self.group, self.opt = rank, world, group, options
        self.emit = emit if rank == 0 else (lambda line: None)
        self.device = get_backend().device()
        self.gpu = self.backend.name in ("cuda", "rocm")
        self.shapes = SHAPES["gpu" if self.gpu else "cpu"]
        self.rows: list[Row] = []
        self.on_row = on_row if rank == 0 else None   # each recorded row, as it is recorded
        self.watch = Watch(rank, emit)
        self._round = 0
        self._ficco = ficco

    @property
    def backend(self):
        """The active backend (looked up: ``ficco.shutdown()`` after a failed check closes it
        and the next call makes a new one)."""
        from ficco.backends import get_backend

        return get_backend()

    # -- keeping the ranks in step ---------------------------------------------------------
    def agree(self, ok: bool, what: str) -> list[bool]:
        """Every rank's ``ok`` for check ``what``, through the store under selftest's own
        keys; a rank missing past the bound is a hang (the watch ends the process)."""
        import pickle

        import torch.distributed as dist

        if self.world == 1:
            return [ok]
        self._round += 1
        store = dist.distributed_c10d._get_default_store()
        keys = [f"ficco-selftest/{self._round}/{r}" for r in range(self.world)]
        store.set(keys[self.rank], pickle.dumps(bool(ok)))  # type: ignore[arg-type]
        self.watch.arm(f"the outcome exchange of {what}", self.bound_s())
        pause = 0.0005
        while not store.check(keys):
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        self.watch.disarm()
        return [pickle.loads(store.get(k)) for k in keys]

    def bound_s(self) -> float:
        """How long one check may take: a failed call waits up to FICCO_TIMEOUT a few times
        (agreement, barriers, the next call), a first call compiles and allocates."""
        return self.opt.bound_s or 3 * self.opt.timeout_s + 60

    def settle(self, oks: list[bool]) -> None:
        """After a check some rank failed: every rank resets ficco and moves to a new group of
        the same ranks (a failed ``ccl`` call leaves its group refusing calls: one of its
        collectives may still be pending), so the next check starts clean and in step."""
        if all(oks):
            return
        import torch.distributed as dist

        try:
            self.backend.synchronize()
        except Exception:  # noqa: BLE001, S110 - the failure is reported already
            pass
        self._ficco.shutdown()
        self.group = dist.new_group(list(range(self.world)))

    def record(self, row: Row) -> None:
        oks = self.agree(row.status != "FAIL", f"{row.check} {row.name}")
        if row.status != "FAIL" and not all(oks):
            row.detail = (row.detail + " " if row.detail else "") + \
                f"(failed on rank(s) {[r for r, ok in enumerate(oks) if not ok]})"
            row.status = "FAIL"
        self.rows.append(row)
        self.emit(row.line())
        if self.on_row is not None:
            self.on_row(row.as_json())
        self.settle(oks)

    # -- schedules -------------------------------------------------------------------------
    def fp8_dtype(self):
        """The fp8 type this device multiplies (``torch._scaled_mm`` answers), else None."""
        kinds = [k for k in self.backend.fp8_forms()      # its e4m3 form (fnuz on MI300)
                 if k in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)]
        if torch.float8_e4m3fn not in kinds:
            kinds.append(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32, device=self.device)
        for kind in kinds:
            try:
                a = torch.ones(16, 16, device=self.device).to(kind)
                torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                return kind
            except Exception:  # noqa: BLE001, S112 - this device lacks it: the next, or none
                continue
        return None

    def schedules(self):
        """(op, transport, schedule) of every check, in order."""
        from ficco import ops, schedules

        target = self.backend.target()
        for op in self.opt.ops or tuple(ops.names()):
            if self.opt.smoke:       # what a user's call gets: the selector's pick, transport auto
                yield op, "auto", None
                continue
            for transport in self.opt.transports:
                names = schedules.offered(target, transport, op)
                if self.opt.optional:
                    names += [n for n in schedules.optional_names(op) if n not in names
                              and schedules.why_not_here(n, target, transport, op) is None]
                for name in names:
                    yield op, transport, name

    def run_schedules(self) -> None:
        from ficco import schedules

        fp8 = self.fp8_dtype() if "float8" in self.opt.dtypes else None
        if "float8" in self.opt.dtypes and fp8 is None:
            self.record(Row("schedule", "float8", "skip",
                            detail=f"torch._scaled_mm does not run on {self.device}"))
        plan = list(self.schedules())
        for shape_name in self.opt.shapes:
            for dtype in self.opt.dtypes:
                if dtype == "float8" and fp8 is None:
                    continue
                for op in dict.fromkeys(op for op, _, _ in plan):
                    if dtype == "float8" and not cases.scaled(op):
                        continue
                    case = cases.build(op, self.rank, self.world, self.shapes[shape_name],
                                       dtype, self.opt.seed, self.device, fp8)
                    optional = schedules.optional_names(op)
                    for _, transport, name in (p for p in plan if p[0] == op):
                        if dtype == "float8" and name in optional:
                            continue    # the gated kernel multiplies plain operands only
                        self.one_schedule(op, transport, name, shape_name, dtype, case)

    def one_schedule(self, op, transport, name, shape_name, dtype, case) -> None:
        fn = cases.op_function(op)
        tol = cases.TOLERANCE[dtype]
        label = f"{op} {name or 'default'} {transport} {dtype} {shape_name}"
        fields = {"op": op, "schedule": name, "transport": transport, "dtype": dtype,
                  "shape": list(self.shapes[shape_name])}
        self.watch.arm(label, self.bound_s())
        try:
            with self._ficco.config.scope(transport=transport, timeout=self.opt.timeout_s):
                start = time.perf_counter()
                out = fn(*case.args, self.group, schedule=name, **case.kwargs)
                self.backend.synchronize()
                seconds = time.perf_counter() - start
            out = out[0] if isinstance(out, tuple) else out
            err = cases.row_error(out, case.ref, case.scale)
            if name is None:     # the default path: say what it picked
                from ficco.runtime import path as runtime

                fields["picked"] = list(runtime.last_run() or ())
                label += f" (picked {' over '.join(fields['picked']) or 'the plain path'})"
            if err > tol:       # the call returned, and its numbers are wrong
                fields["wrong"] = True
            row = Row("schedule", label, "ok" if err <= tol else "FAIL", err, tol, seconds,
                      fields=fields)
        except Exception as exc:  # noqa: BLE001 - one schedule's failure is a row
            row = Row("schedule", label, "FAIL", float("inf"), tol,
                      detail=f"{type(exc).__name__}: {str(exc)[:300]}", fields=fields)
        self.watch.disarm()
        self.record(row)

    # -- faults ------------------------------------------------------------------------------
    def run_faults(self) -> None:
        """A peer late inside the timeout (exact data), then past it (an error or NaN and an
        error at the next call on every rank, never data), over dma, where ficco's own
        barriers, watchdog and fences act."""
        import torch.distributed as dist

        t = self.opt.fault_timeout_s
        op, name = "all_gather_matmul", "ring"
        for late, label in ((0.25 * t, "a peer late inside FICCO_TIMEOUT"),
                            (2.5 * t, "a peer late past FICCO_TIMEOUT")):
            case = cases.build(op, self.rank, self.world, self.shapes["tiny"], "float32",
                               self.opt.seed + 7, self.device)
            self.warm(op, name, case)
            self.watch.arm(label, self.bound_s() + 4 * t)
            dist.barrier(self.group)
            if self.rank == self.world - 1:
                time.sleep(late)
            outcome = self.late_call(op, name, case, t)
            self.watch.disarm()
            inside = late < t
            ok = outcome == "exact" if inside else outcome in ("raised", "NaN, next raised")
            fields = {"late_s": late, "timeout_s": t, "outcome": outcome}
            if outcome == "data":       # numbers that are not the product, no error
                fields["wrong"] = True
            self.record(Row("fault", f"{label} ({late:.1f}s late, FICCO_TIMEOUT {t:.1f}s)",
                            "ok" if ok else "FAIL", detail=f"this rank: {outcome}",
                            fields=fields))
            self._ficco.shutdown()      # the past-deadline case leaves the group failed
            dist.barrier(self.group)

    def warm(self, op, name, case) -> None:
        with self._ficco.config.scope(transport="dma", timeout=self.opt.timeout_s):
            cases.op_function(op)(*case.args, self.group, schedule=name, **case.kwargs)
        self.backend.synchronize()

    def late_call(self, op, name, case, timeout_s) -> str:
        from ficco.errors import FiccoError

        fn = cases.op_function(op)
        try:
            with self._ficco.config.scope(transport="dma", timeout=timeout_s):
                out = fn(*case.args, self.group, schedule=name, **case.kwargs)
                self.backend.synchronize()
        except FiccoError:
            return "raised"
        if cases.row_error(out, case.ref, case.scale) <= cases.TOLERANCE["float32"]:
            return "exact"
        if not bool(out.isnan().all()):
            return "data"
        try:     # GPUs: the call returned before its barrier expired; the next one raises
            with self._ficco.config.scope(transport="dma", timeout=timeout_s):
                fn(*case.args, self.group, schedule=name, **case.kwargs)
                self.backend.synchronize()
        except FiccoError:
            return "NaN, next raised"
        return "NaN, next returned"

    # -- graph capture -------------------------------------------------------------------------
    def run_graph(self) -> None:
        op, name = "all_gather_matmul", "uniform-fused-1d"
        if self.backend.name != "cuda":
            why = "HIP cannot capture stream memory operations (refused by design)" \
                if self.backend.name == "rocm" else f"no CUDA graphs on the {self.backend.name} " \
                "backend"
            self.record(Row("graph", f"{op} {name} dma capture/replay", "skip", detail=why))
            return
        case = cases.build(op, self.rank, self.world, self.shapes["tiny"], "float32",
                           self.opt.seed + 11, self.device)
        label = f"{op} {name} dma capture/replay"
        self.watch.arm(label, self.bound_s())
        try:
            a, b = case.args[0].clone(), case.args[1].clone()
            self.warm(op, name, cases.Case((a, b), {}, case.ref, case.scale))
            graph = torch.cuda.CUDAGraph()
            with self._ficco.config.scope(transport="dma", timeout=self.opt.timeout_s), \
                    torch.cuda.graph(graph):
                out = self._ficco.all_gather_matmul(a, b, self.group, schedule=name)
            worst = 0.0
            for i in range(2):
                fresh = cases.build(op, self.rank, self.world, self.shapes["tiny"], "float32",
                                    self.opt.seed + 12 + i, self.device)
                a.copy_(fresh.args[0])
                b.copy_(fresh.args[1])
                graph.replay()
                torch.cuda.synchronize()
                worst = max(worst, cases.row_error(out, fresh.ref, fresh.scale))
            tol = cases.TOLERANCE["float32"]
            row = Row("graph", label, "ok" if worst <= tol else "FAIL", worst, tol)
        except Exception as exc:  # noqa: BLE001 - reported as the check's failure
            row = Row("graph", label, "FAIL", detail=f"{type(exc).__name__}: {exc}"[:300])
        self.watch.disarm()
        self.record(row)

    # -- timing --------------------------------------------------------------------------------
    def run_timing(self) -> None:
        """Serial and the selector's pick at the user's (M, N, K), per op that takes it."""
        from ficco.runtime import path as runtime
        from ficco.runtime.agreement import max_over_ranks

        assert self.opt.timing_shape is not None
        big_m, n, k = self.opt.timing_shape
        m = max(1, big_m // self.world)
        for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
            if not hasattr(self._ficco, op) or (self.opt.ops and op not in self.opt.ops):
                continue
            shape = (m, k, n) if op == "all_gather_matmul" else (m, max(1, k // self.world), n)
            case = cases.build(op, self.rank, self.world, shape, "bfloat16" if self.gpu
                               else "float32", self.opt.seed + 21, self.device)
            fn = cases.op_function(op)
            label = f"{op} M={big_m} N={n} K={k}"
            self.watch.arm(label, 2 * self.bound_s())
            times: dict[str, float] = {}
            ran: dict[str, tuple] = {}
            try:
                for schedule in ("serial", None):
                    with self._ficco.config.scope(timeout=self.opt.timeout_s):
                        for _ in range(2):
                            fn(*case.args, self.group, schedule=schedule)
                        self.backend.synchronize()
                        ran[schedule or "pick"] = tuple(runtime.last_run() or ("plain", "-"))
                        samples = []
                        for _ in range(5):
                            start = time.perf_counter()
                            fn(*case.args, self.group, schedule=schedule)
                            self.backend.synchronize()
                            samples.append(time.perf_counter() - start)
                    times[schedule or "pick"] = max_over_ranks(
                        self.group, self.rank, self.world, statistics.median(samples),
                        what="selftest timing")
                pick, serial = ran["pick"], ran["serial"]
                ratio = times["pick"] / times["serial"]
                band = self.opt.timing_band
                detail = (f"serial over {serial[1]} {times['serial'] * 1e3:.3f} ms, pick "
                          f"{pick[0]} over {pick[1]} {times['pick'] * 1e3:.3f} ms "
                          f"({ratio:.2f}x serial's time; the band is {band:.2f}x)")
                row = Row("timing", label, "ok" if ratio <= band else "FAIL",
                          seconds=times["pick"], detail=detail,
                          fields={"serial_s": times["serial"], "serial_transport": serial[1],
                                  "pick": list(pick), "pick_s": times["pick"],
                                  "pick_over_serial": ratio, "band": band})
            except Exception as exc:  # noqa: BLE001 - reported as the check's failure
                row = Row("timing", label, "FAIL", detail=f"{type(exc).__name__}: {exc}"[:300])
            self.watch.disarm()
            self.record(row)
