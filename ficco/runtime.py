"""The shared call path of every op: settings -> agreement -> decision -> plan -> execute.

An op spec (``ficco/ops/``) turns the caller's arguments into a canonical Call; from there
this module does the rest, the same way for every op::

    call = ops.get("all_gather_matmul").prepare(a_shard, b, group)
    out = runtime.run(call)                # what ficco.all_gather_matmul returns

A world of one never communicates: :func:`run` hands it to the op's plain path, here and
nowhere else.
"""
from __future__ import annotations

import dataclasses
import operator
import threading
from collections import OrderedDict

import torch

from . import agreement, config, guard, logs, profiling, schedules
from .backends import close_all
from .call import Call
from .call import forget as forget_known_calls
from .call import settings as read_settings
from .config import TRANSPORT_SETTINGS
from .errors import ConfigError, InvalidArgumentError, MismatchError
from .executor import execute as execute_plan
from .schedules import epilogue_reason
from .symm_mem import workspace
from .symm_mem.barrier import call_flag

_PLAN_LIMIT = 256                      # plans kept (LRU); each is a few KB
_plans: OrderedDict[tuple, object] = OrderedDict()
_plans_lock = threading.Lock()
_DECISION_LIMIT = 256                  # decisions kept (LRU)
_decisions: OrderedDict[tuple, object] = OrderedDict()
_decisions_lock = threading.Lock()
#: The settings a Decision depends on (the transport setting enters through the candidate
#: transports; timeout, log level and poisoning change how a call runs, not what it picks).
_DECIDING = operator.itemgetter("selector", "schedule", "schedule_by", "profile", "topology",
                                "copy_engines", "paper", "tune_candidates")
_last = threading.local()


# -- settings and agreement -----------------------------------------------------------------------
def settings(call: Call, schedule: str | None = None, transport: str | None = None,
             selector: str | None = None) -> dict:
    """Every setting of this call, validated before any communication: env values, the forced
    schedule (against the op's schedules), the transport, the device profile. Remembered per
    (environment, overrides, arguments): a repeated call costs one snapshot of FICCO_* values.
    (A forced schedule is checked against the call's epilogue by :func:`signed`.)"""
    key = (config.snapshot(), call.op.name, call.target, call.world > 1, schedule,
           transport, selector)
    s = _settings_seen.get(key)
    if s is None:
        s = _settings(call, schedule, transport, selector)
        if len(_settings_seen) >= 256:
            _settings_seen.clear()
        _settings_seen[key] = s
    return s


_settings_seen: dict = {}


def _settings(call: Call, schedule, transport, selector) -> dict:
    if transport is not None and transport not in TRANSPORT_SETTINGS:
        raise InvalidArgumentError(f"transport must be one of {', '.join(TRANSPORT_SETTINGS)}; "
                                   f"got {transport!r}")
    s = read_settings(schedule, transport, selector)
    if s["schedule"] is not None:
        try:
            chosen = call.op.schedule(s["schedule"])
        except InvalidArgumentError as exc:
            if s["schedule_by"] != "FICCO_SCHEDULE":
                raise
            raise ConfigError(f"FICCO_SCHEDULE={s['schedule']!r} is not valid: {exc}") from None
        # Optional schedules (gated-*: Triton) say here, before any communication, why not.
        why = schedules.why_not_here(chosen.name, call.target,
                                     "ccl" if s["transport"] == "ccl" else "dma", call.op.name)
        if why and call.world > 1:
            raise InvalidArgumentError(f"schedule {s['schedule']!r} cannot run here: {why}")

    from .heuristics import profiles

    profiles.resolve(call.target)   # a bad FICCO_PROFILE fails here, alone
    # agreed and part of the decision key: which profile prices (a calibrated one included)
    s["profile"] = profiles.identity(call.target)
    return s


#: Settings that change how long or how loudly a rank works, not what it computes: not agreed.
_NOT_AGREED = frozenset({"schedule_by", "timeout_s", "poison"})


def signature(call: Call, s: dict) -> dict:
    """What every rank must share for this call: the op's fields and the settings."""
    agreed = {k: v for k, v in s.items() if k not in _NOT_AGREED}
    return {**call.op.signature(call), **agreed}


def signed(call: Call, s: dict) -> tuple[dict, int]:
    """``(signature, digest)`` of ``call`` under settings ``s``, a forced schedule checked
    against the call's epilogue first (no communication yet): made once per (call key,
    settings, role) and then looked up, since they depend on nothing else. (A signature field
    that is not a function of those, say another one set on the Call after ``prepare``, must
    join the lookup's key.)"""
    seen = call.reuse.signed.get((id(s), call.role))
    if seen is not None and seen[0] is s:   # (the entry holds s: its id is not reused)
        return seen[1], seen[2]
    if s["schedule"] is not None and call.world > 1:
        why = epilogue_reason(s["schedule"], call.problem)
        if why:
            raise InvalidArgumentError(f"schedule {s['schedule']!r} cannot run this call: {why}")
    sig = signature(call, s)
    word = agreement.digest(sig)
    if len(call.reuse.signed) >= 16:
        call.reuse.signed.clear()
    call.reuse.signed[(id(s), call.role)] = (s, sig, word)
    return sig, word


def _joined(call: Call, exc: BaseException, via: str | None) -> None:
    """After a MismatchError of an agreement exchange that peers joined from their per-call
    check (``via`` is this rank's own check, None when it opened the exchange): complete the
    check collective they left in flight, and drop the workspace whose pads their barriers
    wrote, so the ranks are in step again (every rank sees the same ``exc.joined``)."""
    joined = getattr(exc, "joined", None)
    if not joined:
        return
    if joined["ccl"] and via != "ccl":
        guard.flush_check(call)
    if joined["dma"] and via != "dma":       # a dma check drops its workspace as it fails
        workspace.drain(call.backend, cancel=True)
        workspace.drop(call.group, call.backend)


def _answer(call: Call, sig: dict, via: str):
    """What a per-call check runs while it waits (see ficco.agreement.answer)."""
    def answer():
        agreement.answer(call.group, call.rank, call.world, sig, via)
    return answer


# -- running ----------------------------------------------------------------------------------------
def run(call: Call, schedule: str | None = None, transport: str | None = None,
        selector: str | None = None):
    """The eager implementation of every op: the caller's result for ``call``.

    ``schedule``/``transport``/``selector`` override the settings (argument > env > selector).
    Calls on one group are serialised (one at a time per process); a call that fails after
    communication began leaves the group refusing further calls until ``ficco.shutdown()``
    on every rank (or, after a failed ``ccl`` collective, until the group is destroyed).
    """
    if not profiling.recording():
        return _run(call, schedule, transport, selector)
    with profiling.call_range(call.op.name, call.problem):
        return _run(call, schedule, transport, selector)


def _run(call: Call, schedule, transport, selector):
    s = settings(call, schedule, transport, selector)
    if call.world == 1:
        return call.op.plain(call)
    lock = guard.enter(call, s["timeout_s"])   # one call per group at a time; not poisoned
    try:
        workspace.settle(call.backend)   # before any communication of this call
        sig, word = signed(call, s)
        # check: the per-call check running (None: the agreement; "ccl": the check collective;
        # "dma": the plan, whose first barrier checks)
        stage = {"transport": None, "schedule": None, "step": "the first-call agreement",
                 "check": None}
        try:
            agreed = agreement.confirm_same_call(call.group, call.rank, call.world, sig,
                                                 call.op.name, word)
            if call.op.exchanges:
                stage["step"] = "the exchange of the call's data"
                call, word = call.op.exchange(call, word)   # e.g. expert routing counts
            stage["step"] = None
            if s["disable"] or call.plain_only:
                stage.update(transport="ccl", schedule="plain", check="ccl",
                             step="the call check before the plain path")
                # The plain path is a collective too: check the call like every ccl call.
                guard.check_word_ccl(call, word, sig)
                stage["step"] = "the plain path's collective"
                return call.op.plain(call)
            # (at a key's first sight a measuring selector runs the call's candidates here)
            stage["step"] = "choosing its schedule"
            decision = decide(call, s, agreed, word)
            stage.update(transport=decision.transport, schedule=decision.schedule,
                         step="the call check before the plan", check=decision.transport)
            if decision.transport == "ccl":
                guard.check_word_ccl(call, word, sig)
            stage["step"] = None      # from here the executor names the plan step
            buffers, _, _ = execute(call, decision.schedule, decision.transport, word=word,
                                    settings=s, answer=_answer(call, sig, "dma"))
            return call.op.result(call, buffers, decision.transport)
        except BaseException as exc:
            if isinstance(exc, MismatchError):
                _joined(call, exc, stage["check"])
            named = guard.failed(call, _described(call, exc, word), stage["transport"],
                                 stage["schedule"], stage["step"])
            if named is exc:
                raise
            raise named from exc
    finally:
        lock.release()


def _described(call: Call, exc: BaseException, word: int) -> BaseException:
    """A barrier's MismatchError (it knows only the peers' call flags) with the calls those
    flags stand for, as this rank agreed them (their op, role and shapes)."""
    flags = getattr(exc, "flags", None)
    if not flags:
        return exc
    calls = "; ".join(f"rank {peer}: " + agreement.describe(call.group, flag=flag,
                                                            flag_of=call_flag)
                      for peer, flag in sorted(flags.items()))
    named = MismatchError(f"{exc}. The peers' calls: {calls}; this rank's: "
                          f"{agreement.describe(call.group, word)}")
    return agreement.consistent(named)


def candidate_transports(setting: str, same_host: bool) -> tuple[str, ...]:
    """The transports a call may use, preferred first: ``auto`` offers dma when every rank
    shares this host (the model selector then weighs dma against ccl)."""
    if setting != "auto":
        return (setting,)
    return ("dma", "ccl") if same_host else ("ccl",)


def decide(call: Call, s: dict, agreed: agreement.Agreed, word: int | None = None):
    """The Decision for ``call`` (identical on every rank: selectors see no rank, and the
    problem they see has each per-rank width at its widest, as ``agreed``), made once per
    (op, that problem's key, backend target, candidate transports, deciding settings, group)
    and then looked up (LRU). Every part of the key is agreed across ranks, and a decision is a pure
    function of it (what ``auto`` and ``tune`` measure is collective, agreed and cached by
    them), so a rank that forgot a decision the others kept reaches the same one again. A
    decision made without measuring where the selector measures (a rank could not time) is
    not kept: the next call measures. ``word``: the call's digest, which a measured run checks
    as the call itself does (see :class:`_Live`)."""
    transports = candidate_transports(s["transport"], agreed.same_host)
    seen = call.reuse.agreed
    if seen is not None and seen[0] is agreed:   # a function of the call key and agreed
        problem, problem_key = seen[1], seen[2]
    else:
        problem = call.op.agreed_problem(call, agreed.per_rank)
        problem_key = problem.key()
        call.reuse.agreed = (agreed, problem, problem_key)
    # (the group too: a measuring selector's first sight on a group is collective, so a rank
    # must not skip it because it decided this problem in another group)
    key = (call.op.name, problem_key, call.target, transports, _DECIDING(s), call.group_key)
    with _decisions_lock:
        decision = _decisions.get(key)
        if decision is not None:
            _decisions.move_to_end(key)
            return decision
    from .heuristics import choose

    decision = choose(problem, transport=transports, target=call.target,
                      selector=s["selector"], forced=s["schedule"], forced_by=s["schedule_by"],
                      live=_Live(call, s, word))
    if decision.final:
        with _decisions_lock:
            _decisions[key] = decision
            while len(_decisions) > _DECISION_LIMIT:
                _decisions.popitem(last=False)
    return decision


class _Live:
    """This call's group as a measuring selector sees it (ficco.heuristics.measured.Live):
    runs of the call with its own operands, timed by the backend (CUDA/HIP events on GPUs),
    and exchanges through the group's store. A run is what the call would do after deciding:
    with the call's digest (``word``), the ccl call check, the plan and the result's layout,
    so a transport's per-call check is in its time."""

    def __init__(self, call: Call, s: dict, word: int | None):
        self.call, self.settings, self.word = call, s, word
        self.scope = call.group_key

    def run(self, name: str, transport: str) -> float:
        return self.call.backend.time_run(lambda: self._call(name, transport))

    def _call(self, name: str, transport: str) -> None:
        call = self.call
        if transport == "ccl" and self.word is not None:
            guard.check_word_ccl(call, self.word)
        buffers, _, _ = execute(call, name, transport, word=self.word, settings=self.settings)
        call.op.result(call, buffers, transport)

    def everyone(self, value) -> list:
        call = self.call
        return agreement.exchange(call.group, call.rank, call.world, value,
                                  what="the measuring selector's exchange")

    def cannot_time(self) -> str | None:
        if torch.compiler.is_compiling():
            return "torch.compile is tracing"
        if torch._C._len_torch_dispatch_stack():
            return "a torch dispatch mode is active (fake or meta tensors, tracing)"
        return self.call.backend.timing_blocked()


def plan_for(call_or_op, name: str, transport: str, problem, engines=...):
    """The (cached, LRU) Plan of schedule ``name`` for ``problem``; ``engines``: the
    FICCO_COPY_ENGINES value the call read (default: read it now)."""
    op = getattr(call_or_op, "op", call_or_op)
    if engines is ...:
        engines = config.copy_engines()
    key = (op.name, name, transport, problem, engines)
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return plan
    plan = op.schedule(name).plan(problem, transport, engines)
    if config.log_level() == "debug":
        counts: dict[str, int] = {}
        for item in plan.ops:
            counts[item.kind] = counts.get(item.kind, 0) + 1
        logs.ready().debug(
            "ficco plan rank %d: %s %s over %s, %d ops %s", problem.rank, op.name, name,
            transport, len(plan.ops), counts)
    with _plans_lock:
        _plans[key] = plan
        while len(_plans) > _PLAN_LIMIT:
            _plans.popitem(last=False)
    return plan


def execute(call: Call, name: str, transport: str, trace: bool = False,
            word: int | None = None, settings: dict | None = None, answer=None):
    """Run schedule ``name`` over ``transport`` once: returns (buffers, plan, trace rows).
    With ``word`` (the call's digest) a dma run's barriers carry its call flag, so ranks making
    different calls raise MismatchError on every rank at the plan's first barrier (see
    :mod:`ficco.symm_mem.barrier`); without it (benchmarks) every rank uses the same flag.
    ``settings``: the call's (:func:`settings`), else the knobs are read now. The caller has
    settled the backend's queues (``workspace.settle``). ``answer``: what that first barrier
    runs while it waits (ficco.agreement.answer)."""
    if settings is None:
        engines, poison, timeout_s = config.copy_engines(), config.poison(), config.timeout_s()
    else:
        engines, poison, timeout_s = _RUNNING(settings)
    plan = plan_for(call, name, transport, call.problem, engines)
    _last.run = (name, transport)
    symm = None
    if transport == "dma":
        nbytes = call.reuse.workspace_bytes
        if nbytes is None:
            nbytes = call.reuse.workspace_bytes = call.op.workspace_bytes(call)
        if call.backend.guards_dma:
            # Before allocating or enqueuing: a capture the backend cannot replay, or an error
            # the group owes from an earlier call (GPUs), is raised with nothing sent.
            call.backend.before_dma(workspace.current(call.group, call.backend), nbytes)
        symm = workspace.get(call.group, call.backend, nbytes, call.group_key)
        symm.call_flag = call_flag(word)
        symm.first_wait = answer
    buffers = call.op.buffers(call, transport, symm, wide=plan.wide_outputs(), plan=plan)
    if poison:
        call.op.poison(buffers)
    try:
        rows = execute_plan(plan, call.backend, buffers, timeout_s=timeout_s, trace=trace)
    except BaseException:
        if transport == "ccl" and call.backend.name == "cpu":
            # No workspace in use; a collective stuck on a late peer would hold the error
            # one more FICCO_TIMEOUT: drain on a helper thread, the next call waits for it.
            # (GPU streams are still synchronised here, on the caller's thread.)
            workspace.drain_in_background(call.backend)
            raise
        # Queues may still touch the workspace, and its barrier generations may now differ
        # across ranks: stop the queues, then drop it (unmapped only once they drained).
        workspace.drain(call.backend, cancel=True)
        workspace.drop(call.group, call.backend)
        raise
    if symm is not None and call.backend.guards_dma:
        # GPUs: NaN instead of data if the watchdog had to release one of this call's barriers.
        call.backend.fence([*buffers.outs, buffers.gathered], symm)
    return buffers, plan, rows


_RUNNING = operator.itemgetter("copy_engines", "poison", "timeout_s")


def traced(call: Call, schedule: str, transport: str | None = None):
    """One run with a forced schedule: ``(result, plan, rows)``, rows being this rank's
    measured per-op ``{op_index, queue, kind, label, start_s, end_s}`` (for timelines)."""
    s = settings(call, schedule, transport)
    sig, word = signed(call, s)
    lock = guard.enter(call, s["timeout_s"])
    try:
        workspace.settle(call.backend)
        same_host = agreement.confirm_same_call(
            call.group, call.rank, call.world, sig, call.op.name, word).same_host \
            if call.world > 1 else True
        if call.world > 1 and call.op.exchanges:
            call, _ = call.op.exchange(call, word)
        via = candidate_transports(s["transport"], same_host)[0]
        buffers, plan, rows = execute(call, call.op.schedule(schedule).name, via, trace=True,
                                      settings=s)
    except BaseException as exc:
        named = guard.failed(call, exc, None)
        if named is exc:
            raise
        raise named from exc
    finally:
        lock.release()
    return call.op.result(call, buffers, via), plan, rows or []


def explain(call: Call, schedule: str | None = None):
    """The Decision ``run`` would take for ``call``, made on this rank alone: no
    communication, so one rank may explain while the others do something else. Before the
    group agreed on this call, ``auto`` transport assumes every rank shares this host; before
    a measuring selector (``auto``, ``tune``) measured it, the decision is the ``model``'s
    prediction (and says so; a cache *file* entry counts only once the first call confirmed it
    with every rank: trusting it here would put it in this rank's memory alone)."""
    from .heuristics import choose

    s = settings(call, schedule)
    sig, _ = signed(call, s)
    known = agreement.known(call.group, sig) if call.world > 1 else None
    transports = candidate_transports(s["transport"], True if known is None else
                                      known.same_host)
    # The widths every rank agreed on, once agreed (before: this rank's own).
    problem = call.problem if known is None else call.op.agreed_problem(call, known.per_rank)
    decision = choose(problem, transport=transports, target=call.target,
                      selector=s["selector"], forced=s["schedule"], forced_by=s["schedule_by"])
    if known is None and s["transport"] == "auto" and call.world > 1:
        decision = dataclasses.replace(
            decision, reason=f"{decision.reason} (transport assumes one host: not yet agreed "
                             f"with the other ranks)")
    return decision


def last_run() -> tuple[str, str] | None:
    """(schedule, transport) of this thread's last multi-rank run, for tests and logs."""
    return getattr(_last, "run", None)


def shutdown() -> None:
    """Release workspaces, symmetric allocations, queues, cached plans and agreements."""
    from .backends import _active

    for backend in list(_active.values()):
        workspace.drain(backend, cancel=True)
        workspace.release_all(backend)
    workspace.release_all()
    with _plans_lock:
        _plans.clear()
    with _decisions_lock:
        _decisions.clear()
    from .heuristics import measured

    measured.forget_groups()
    agreement.forget()
    forget_known_calls()
    guard.reset()
    close_all()
