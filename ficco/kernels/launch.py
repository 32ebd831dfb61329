"""What the executor calls for the gated schedules' two plan ops: raising an arrival flag on a
copy queue (``Signal``) and launching the gated GEMM on the compute queue (``GatedGemm``).

Flags are one int32 word per (peer, chunk) of this call, zeroed on the compute queue before
any side queue starts (the executor allocates them), so a call never sees the previous call's
flags. A flag is raised *stream-ordered* after its copy: on GPUs with a stream memory write
(``cuStreamWriteValue32`` / ``hipStreamWriteValue32``, no compute unit involved), on CPU by the
copy queue's worker thread right after the copy.

Errors: on the CPU backend the kernel runs synchronously on the compute worker, so a timed-out
wait raises :class:`~ficco.errors.CommTimeoutError` at once and the call fails. On GPUs the
launch is asynchronous: the kernel polls the group's error word as its halt (so once the
group failed, every queued or running launch of it stops waiting at once),
its own error is copied to host memory behind it and raised by the group's next call, as GPU
barrier timeouts are; the kernel never spins past its budget. The grid is persistent and at
most :func:`~ficco.kernels.configs.resident_programs` of the device.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import ClassVar

import torch

from ..plan import describe_flag
from ..symm_mem.barrier import WRITE, SignalOp


def raise_flag(backend, queue, flags: torch.Tensor, index: int) -> None:
    """Enqueue ``flags[index] = 1`` on ``queue`` after the work already there, through the
    backend's ``signal_write`` (the barrier protocol's primitive) at the backend's slot for
    that word."""
    backend.signal_write(queue, backend.tensor_slot(flags, index), 1)


def raise_flags(backend, queue, flags: torch.Tensor, indices: tuple) -> None:
    """:func:`raise_flag` of every index in ``indices``, in order, as one barrier program
    (``signal_batch``: one ``cuStreamBatchMemOp`` on CUDA)."""
    slot = backend.tensor_slot
    backend.signal_batch(queue, tuple(SignalOp(WRITE, slot(flags, i), 1, -1) for i in indices),
                         None)


class TileTrace:
    """Per-tile timestamps of the gated GEMM launches made inside a ``with`` block on this
    thread (``bench timeline`` uses it; off otherwise, and then the kernel has no trace
    code). After the call finished, :meth:`tiles` gives one list of
    :func:`~ficco.kernels.trace.read_trace` dicts per launch, each with the launch's
    ``b``::

        with TileTrace() as tiles:
            out, plan, rows = ficco.api.traced_all_gather_matmul(a, b, schedule="gated-1d")
        for launch in tiles.tiles(): ...
    """

    _local = threading.local()

    def __init__(self) -> None:
        self.launches: list = []   # dicts: b, segments, n, trace, mode, device, origin

    def __enter__(self):
        self._saved = getattr(TileTrace._local, "sink", None)
        TileTrace._local.sink = self
        return self

    def __exit__(self, *exc):
        TileTrace._local.sink = self._saved

    @staticmethod
    def active():
        return getattr(TileTrace._local, "sink", None)

    def tiles(self) -> list[list[dict]]:
        from .trace import read_trace, ticks_per_s

        out = []
        for launch in self.launches:
            tiles = read_trace(launch["trace"], launch["segments"], launch["n"], launch["mode"],
                               ticks_per_s(launch["mode"], launch["device"]),
                               origin=launch["origin"])
            for t in tiles:
                t["b"] = launch["b"]
            out.append(tiles)
        return out


def gated_task(backend, problem, op, a_local, gathered, b, out, flags, timeout_s: float,
               symm=None, lane=None):
    """The host function that launches ``op`` (a :class:`~ficco.plan.GatedGemm`) when the
    compute queue runs it: at once on GPUs (the launch is stream-ordered), in order on the CPU
    worker (which then runs the interpreter). ``symm``: the call's workspace; on GPUs its
    group fault gives the halt word and takes the launch's error. ``lane``: the session's
    queues, whose cancel halts the kernel's waits (CPU)."""
    from . import configs
    from .gated_gemm import Segment, check_error, gated_gemm
    from .trace import TRACE_OFF, clock_mode, trace_buffer, trace_supported

    segments = tuple(Segment(*s) for s in op.segments)
    local_row0 = problem.shard_row0(problem.rank)
    family = configs.family(backend.target())
    trace: torch.Tensor | None = None    # the per-tile trace, in clock mode ``mode``
    mode = TRACE_OFF
    traced_launch: dict = {}
    sink = TileTrace.active()   # read here, on the caller's thread (run() may run elsewhere)
    if sink is not None and out.numel() and trace_supported():   # else: no marks drawn
        mode = clock_mode(backend.target())
        trace = trace_buffer(segments, out.shape[1], family, out.device)
        traced_launch = {"b": op.b, "segments": segments, "n": out.shape[1], "trace": trace,
                         "mode": mode, "device": out.device.index or 0, "origin": None}
        sink.launches.append(traced_launch)

    def describe(flag: int) -> str:
        return describe_flag(problem, flag)

    fault = symm.fault if symm is not None else None
    # The call's deadline, from when the host enqueued it: the kernel now launches after the
    # copies are queued, and the CPU interpreter may start it late (the GIL), but the call's
    # other waits count from enqueue too.
    expires = time.monotonic() + timeout_s

    def run() -> None:
        if out.numel() == 0:
            return
        a = a_local if a_local.stride(-1) == 1 else a_local.contiguous()
        if fault is None:     # the CPU backend: synchronous, a host thread holds the halt
            if trace is not None:   # the host clock the tiles read: times count from this launch
                traced_launch["origin"] = time.perf_counter_ns()
            halt = torch.zeros(1, dtype=torch.int32)
            with _Watch(halt, lambda: backend.cancelled(lane), expires) as watch:
                err = gated_gemm(a, gathered, b, out, segments, flags,
                                 local_row0=local_row0, halt=halt, timeout_s=timeout_s,
                                 family=family, trace=trace, trace_mode=mode)
            check_error(err, describe, timeout_s)
            # A halt raised while tiles were still to start left them NaN with no wait run
            # out (every flag had arrived): the launch must fail, not hand NaN rows back.
            watch.check(timeout_s)
            return
        err = gated_gemm(a, gathered, b, out, segments, flags, local_row0=local_row0,
                         halt=fault.word_device, timeout_s=timeout_s, family=family,
                         max_programs=_resident(backend.device_module(), out.device,
                                                symm.device_sharers), trace=trace,
                         trace_mode=mode)
        dm = backend.device_module()
        if dm.is_current_stream_capturing():
            # Captured: nothing to check from here (an entry bound to a captured event and
            # to a word only a replay writes would mislead the next eager call). A replay
            # that gives up raises the group's word and writes NaN tiles itself, which the
            # group's next eager call raises.
            return
        word = torch.empty(1, dtype=torch.int32, pin_memory=out.device.type != "cpu")
        word.copy_(err, non_blocking=True)
        done = dm.Event()
        done.record()
        fault.gated.append((done, lambda: _error(word, describe, timeout_s)))
    return run


def _error(word, describe, timeout_s):
    from ..errors import CommTimeoutError
    from .gated_gemm import check_error

    try:
        check_error(word, describe, timeout_s)
    except CommTimeoutError as exc:
        return exc
    return None


def _resident(device_module, device, sharers: int) -> int:
    """:func:`~ficco.kernels.configs.resident_programs` of ``device`` (of torch's
    ``device_module``) shared by ``sharers`` ranks of the call's group (the device's units
    looked up once)."""
    index = device.index or 0
    units = _resident_cache.get(index)
    if units is None:
        units = _resident_cache[index] = \
            device_module.get_device_properties(index).multi_processor_count
    from . import configs

    return configs.resident_programs(units, sharers)


_resident_cache: dict = {}


class _Watch:
    """CPU only: while the interpreted kernel runs, a thread raises its ``halt`` word at the
    call's deadline or when another queue of this rank failed (``backend.cancelled()``), so
    a wait ends on time and never outlives a failed call; the poll budget stays as backstop.
    ``answer``: the call's first wait is in this kernel (``handle.first_wait``, as a plan
    barrier's): once the kernel ran a moment the thread answers a peer's first-call agreement
    exchange now and then (:func:`ficco.runtime.agreement.answer`); the MismatchError that
    raises halts the kernel and is the launch's error (:attr:`error`)."""

    def __init__(self, halt: torch.Tensor, cancelled, expires: float, answer=None):
        self.halt, self.cancelled, self.expires = halt, cancelled, expires
        self.answer = answer
        self.done = threading.Event()
        self.why: str | None = None     # set with the halt: what raised it
        self.error: BaseException | None = None    # what the answer raised

    def _loop(self, deadline: float) -> None:
        from ..symm_mem.barrier import ANSWER_AFTER_S, ANSWER_EVERY_S

        answer_at = time.monotonic() + ANSWER_AFTER_S
        while not self.done.wait(0.01):
            now = time.monotonic()
            late = now > deadline
            if late or self.cancelled():
                self.why = "its call's deadline passed" if late else \
                    "another queue of its call failed"
                self.halt.fill_(1)
                return
            if self.answer is not None and now >= answer_at:
                answer_at = now + ANSWER_EVERY_S
                try:
                    self.answer()
                except BaseException as exc:  # noqa: BLE001 - the launch raises it
                    self.error, self.why = exc, "a peer makes another call"
                    self.halt.fill_(1)
                    return

    def check(self, timeout_s: float) -> None:
        """Raise when the halt was raised during the launch: the answer's MismatchError, or
        (tiles that started after it were written as NaN, none of their waits ran out, so
        the kernel's error word is 0) a CommTimeoutError."""
        if self.error is not None:
            raise self.error
        if self.why is not None:
            from ..errors import CommTimeoutError

            raise CommTimeoutError(
                f"gated GEMM: {self.why} (FICCO_TIMEOUT {timeout_s:.3g}s, counted from when "
                f"the call enqueued it) before all its tiles were computed; the rest are NaN "
                f"and the call returns nothing. Raise FICCO_TIMEOUT if the GEMM is only slow")

    def __enter__(self):
        self.thread = threading.Thread(target=self._loop, name="ficco-gated-watch",
                                       args=(self.expires,), daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


# -- the one-kernel all-reduce ----------------------------------------------------------------
_shot_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shot_task(buffers, op):
    """The host function that launches ``op`` (a one-kernel all-reduce,
    :class:`~ficco.ops.matmul_all_reduce.schedules.kernel.ShotAllReduce`) when the compute queue runs it:
    on the CPU worker in the interpreter (synchronous: a wait that gives up raises here), on
    GPUs at once on the stream, its error word checked behind it as the gated GEMM's is (the
    group's word is its halt, so a failed group stops it at once)."""
    from .. import config
    from . import configs
    from .all_reduce import check_error, shot_all_reduce

    symm = buffers.symm
    rank, world, j = symm.rank, symm.world, op.b
    out = buffers.outs[j]
    timeout_s = config.timeout_s()
    fault = symm.fault
    flag = getattr(symm, "call_flag", 1)
    # The call's first wait, when no plan barrier came before this launch (one-shot-kernel
    # has none): it answers a peer's first-call exchange (CPU: a thread beside the
    # interpreted launch; GPUs: _Answering, while the launch runs).
    answer = getattr(symm, "first_wait", None)
    if answer is not None:
        symm.first_wait = None

    def run() -> None:
        if out.numel() == 0:
            return
        partials = [buffers.partials[j] if q == rank else buffers.peer(q, "partial", j)
                    for q in range(world)]
        reduceds = [buffers.reduced[j] if q == rank else buffers.peer(q, "reduced", j)
                    for q in range(world)] if op.two_shot else []
        key = (j, op.two_shot, buffers.partial_offsets, buffers.reduced_offsets,
               tuple(out.shape), out.dtype, partials[rank].dtype, out.device)
        cached = _shot_tables.setdefault(symm, {})
        tables = cached.get(key)
        if tables is None:
            from .all_reduce import tables_for

            tables = cached[key] = tables_for(
                partials, reduceds, [symm.pad_address(q) for q in range(world)], out)
        if fault is None:      # the CPU backend: synchronous, in the interpreter
            halt = torch.zeros(1, dtype=torch.int32)

            def launch() -> torch.Tensor:
                return shot_all_reduce(partials, reduceds, None, out, rank=rank, flag=flag,
                                       two_shot=op.two_shot, first_channel=op.first_channel,
                                       scale=op.scale, halt=halt, timeout_s=timeout_s,
                                       tables=tables)
            if answer is None:
                err = launch()
            else:              # the call's first wait: a thread answers beside it
                with _Watch(halt, lambda: False, float("inf"), answer) as watch:
                    err = launch()
                if watch.error is not None:
                    raise watch.error
            check_error(err, rank, timeout_s)
            return
        family = configs.family(symm.backend.target())
        dm = symm.backend.device_module()
        capturing = dm.is_current_stream_capturing()
        # watched from before the launch: a launch that blocks its host thread (Triton's
        # interpreter on the fake GPU) is answered while it waits too
        entry = _Answering.watch(answer, fault) if answer is not None and not capturing \
            else None
        try:
            err = shot_all_reduce(partials, reduceds, None, out, rank=rank, flag=flag,
                                  two_shot=op.two_shot, first_channel=op.first_channel,
                                  scale=op.scale, halt=fault.word_device, timeout_s=timeout_s,
                                  family=family,
                                  max_programs=_resident(dm, out.device, symm.device_sharers),
                                  tables=tables)
        except BaseException:
            if entry is not None:
                _Answering.forget(entry)
            raise
        if capturing:
            return     # a replay that gives up raises the group's word and writes NaN itself
        word = torch.empty(4, dtype=torch.int32, pin_memory=out.device.type != "cpu")
        word.copy_(err, non_blocking=True)
        done = dm.Event()
        done.record()
        fault.gated.append((done, lambda: _shot_error(word, rank, timeout_s)))
        if entry is not None:
            entry[0] = done          # from now on the launch leaves the watch once done
    return run


class _Answering:
    """GPUs: the launches that hold their call's first wait, answered from one host thread
    while they run (the launch returned at once; the kernel waits on the device). Once a
    launch ran a moment the thread answers a peer's first-call agreement exchange now and
    then (:func:`ficco.runtime.agreement.answer`, with the launch's own call number); the
    MismatchError that raises is reported to the group (error slot and word), which halts the
    kernel (its output NaN) and is raised by the group's next call. A launch leaves the watch
    when its ``done`` event completed or its group failed."""

    _lock = threading.Lock()
    _entries: ClassVar[list] = []
    _thread: threading.Thread | None = None
    POLL_S = 0.01

    @classmethod
    def watch(cls, answer, fault) -> list:
        """Watch a launch about to be made; returns its entry, whose first item (None: not
        launched yet) the caller sets to the launch's ``done`` event."""
        import copy

        from ..symm_mem.barrier import ANSWER_AFTER_S

        # a copy: the call's answer object takes the next call's number when that one starts
        entry = [None, copy.copy(answer), fault, time.monotonic() + ANSWER_AFTER_S]
        with cls._lock:
            cls._entries.append(entry)
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._loop, name="ficco-kernel-answer",
                                               daemon=True)
                cls._thread.start()
        return entry

    @classmethod
    def forget(cls, entry: list) -> None:
        """Stop watching ``entry`` (its launch raised)."""
        with cls._lock:
            cls._entries = [e for e in cls._entries if e is not entry]

    @classmethod
    def _loop(cls) -> None:
        from ..errors import FiccoError
        from ..symm_mem.barrier import ANSWER_EVERY_S

        while True:
            time.sleep(cls.POLL_S)
            with cls._lock:
                entries = list(cls._entries)
                if not entries:
                    cls._thread = None
                    return
            now = time.monotonic()
            finished = []
            for entry in entries:
                done, answer, fault, at = entry
                if (done is not None and done.query()) or fault.failed():
                    finished.append(entry)
                    continue
                if now < at:
                    continue
                entry[3] = now + ANSWER_EVERY_S
                try:
                    answer()
                except FiccoError as exc:     # the peer's other call: the group's error
                    fault.report(exc)
                    finished.append(entry)
                except Exception:  # noqa: BLE001 - no answer; the kernel's own bound holds
                    finished.append(entry)
            if finished:
                with cls._lock:
                    cls._entries = [e for e in cls._entries
                                    if not any(e is f for f in finished)]


def _shot_error(word, rank, timeout_s):
    from ..errors import FiccoError
    from .all_reduce import check_error

    try:
        check_error(word, rank, timeout_s)
    except FiccoError as exc:
        return exc
    return None
