"""The shared call path of every op, on the group's :class:`~ficco.runtime.session.Session`: settings
-> agreement -> decision -> plan -> execute, made once per call key and settings (its
:class:`~ficco.runtime.session.Prepared` form), then looked up::

    call = ops.get("all_gather_matmul").prepare(a_shard, b, group)
    out = runtime.run(call)                # what ficco.all_gather_matmul returns

A warm call (a known key under the same settings): take the call's number, one lookup, the
call check (ccl) or the call flag (dma), bind the tensors, execute. A world of one never
communicates: :func:`run` hands it to the op's plain path, here and nowhere else.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import config, logs, profiling, schedules
from ..backends import close_all
from ..config import TRANSPORT_SETTINGS
from ..errors import ConfigError, InvalidArgumentError, MismatchError, known_context
from ..executor import execute as execute_plan
from ..executor.compiler import compile_plan
from ..group import resolve
from ..plan.problem import EXACT_ROWS, Problem
from ..schedules import epilogue_reason
from ..symm_mem import workspace
from ..symm_mem.barrier import call_flag
from . import agreement, guard
from . import session as sessions
from .call import Answer, Call, Prepared, Settings
from .call import settings as read_settings
from .session import Session, channel_of, drop_all, peek

_PREPARED_PER_KEY = 16       # settings x roles x overrides one call key is run under


# -- settings and agreement -----------------------------------------------------------------------
def settings(call: Call, schedule: str | None = None, transport: str | None = None,
             selector: str | None = None) -> Settings:
    """Every setting of this call, validated before any communication: env values, the forced
    schedule (against the op's schedules), the transport, the device profile. Remembered per
    (environment, overrides, arguments) on the call's session. (A forced schedule is checked
    against the call's epilogue by :func:`signed`.)"""
    seen = call.session.settings
    key = (config.snapshot(), call.op.name, call.target, call.world > 1, schedule, transport,
           selector)
    s = seen.get(key)
    if s is None:
        s = _settings(call, schedule, transport, selector)
        if len(seen) >= 256:
            seen.clear()
        seen[key] = s
    return s


def _settings(call: Call, schedule, transport, selector) -> Settings:
    if transport is not None and transport not in TRANSPORT_SETTINGS:
        raise InvalidArgumentError(f"transport must be one of {', '.join(TRANSPORT_SETTINGS)}; "
                                   f"got {transport!r}")
    s = read_settings(schedule, transport, selector)
    forced = s.schedule
    if s.schedule_by == "FICCO_SCHEDULE" and forced is not None and call.op.name not in \
            schedules.ops_with(forced) and schedules.ops_with(forced):
        # One variable for every op: it forces the ops that have a schedule of that name
        # (ring-bidir: the dense ones); the others choose as if it were unset.
        s = s.replace(schedule=None, schedule_by=None)
    if s.schedule is not None:
        try:
            chosen = call.op.schedule(s.schedule)
        except InvalidArgumentError as exc:
            if s.schedule_by != "FICCO_SCHEDULE":
                raise
            raise ConfigError(f"FICCO_SCHEDULE={s.schedule!r} is not valid: {exc}") from None
        # Optional schedules (gated-*: Triton) say here, before any communication, why not.
        why = schedules.why_not_here(chosen.name, call.target,
                                     "ccl" if s.transport == "ccl" else "dma", call.op.name)
        if why and call.world > 1:
            raise InvalidArgumentError(f"schedule {s.schedule!r} cannot run here: {why}")

    from ..heuristics import profiles

    profiles.resolve(call.target)   # a bad FICCO_PROFILE fails here, alone
    # agreed and part of the decision key: which profile prices (a calibrated one included)
    return s.replace(profile=profiles.identity(call.target))


def signature(call: Call, s: Settings) -> dict:
    """What every rank must share for this call: the op's fields and the agreed settings."""
    return {**call.op.signature(call), **s.agreed()}


def signed(call: Call, s: Settings) -> tuple[dict, int]:
    """``(signature, digest)`` of ``call`` under settings ``s``, a forced schedule checked
    against the call's epilogue first (no communication yet)."""
    if s.schedule is not None and call.world > 1:
        why = epilogue_reason(s.schedule, call.problem)
        if why:
            raise InvalidArgumentError(f"schedule {s.schedule!r} cannot run this call: {why}")
    sig = signature(call, s)
    return sig, agreement.digest(sig)


# -- running ----------------------------------------------------------------------------------------
def run(call: Call, schedule: str | None = None, transport: str | None = None,
        selector: str | None = None):
    """The eager implementation of every op: the caller's result for ``call``.

    ``schedule``/``transport``/``selector`` override the settings (argument > env > selector).
    Calls on one group are serialised (one at a time per process); a call that fails after it
    could have communicated, or whose ranks disagree, leaves the group refusing further calls
    until ``ficco.shutdown()`` on every rank (after a failed ``ccl`` plan, until the group is
    destroyed): see :mod:`ficco.runtime.guard`.
    """
    if not profiling.recording():
        return _run(call, schedule, transport, selector, False)
    with profiling.call_range(call.op.name, call.problem):
        return _run(call, schedule, transport, selector, True)


def abandoned(group) -> None:
    """A call that failed on this rank before it reached :func:`run` (its arguments, say) still
    takes its number in the group's sequence of calls, so its peers' same call can never pair
    with this rank's next one (see ficco.runtime.session). Never raises."""
    try:
        channel = channel_of(resolve(group))
    except Exception:  # noqa: BLE001 - no group to name: nothing was numbered there either
        return
    if channel is not None:
        channel.take()


def _alone(call: Call, schedule, transport, selector):
    """A world of one: its settings validated as any call's, then the op's plain path.
    Nothing is agreed and nothing communicates (docs/design.md section 10)."""
    settings(call, schedule, transport, selector)
    return call.op.plain(call)


def _run(call: Call, schedule, transport, selector, profiled: bool):
    """A call in phases (a world of one: :func:`_alone`): admitted, agreed, run (the plain
    path or the plan), a failure named; docs/design.md section 10 walks through them."""
    if call.world == 1:
        return _alone(call, schedule, transport, selector)
    known = call.known
    run_key = (config.snapshot(), call.role, schedule, transport, selector)
    prepared = None if known is None else known.prepared.get(run_key)
    session = call.session
    s, number = _admitted(call, prepared, schedule, transport, selector)
    stage = guard.Stage()
    values = 0
    try:
        try:
            # values every rank must pass alike beyond the signature (the all-reduce's bias)
            values = call.op.values_word(call) if call.op.values_what else 0
            prepared, call, word, exchanged = _agreed(call, prepared, s, run_key, number, stage)
            if prepared.decision is None:      # FICCO_DISABLE, or nothing to overlap
                return _plain(call, prepared, number, exchanged, values, stage)
            if prepared.explorer is not None:      # auto exploring the key's shortlist
                return _explored(call, prepared, known, run_key, word ^ values, number,
                                 exchanged, stage, profiled, values)
            buffers = _execute(session, call, prepared, word ^ values, number, exchanged, stage,
                               profiled, values)
            session.last = prepared.decision
            return call.op.result(call, buffers, prepared.decision.transport)
        except BaseException as exc:
            named = _named(call, exc, number, prepared, values, stage)
            if named is exc:
                raise
            raise named from exc
    finally:
        session.lock.release()


def _admitted(call: Call, prepared: Prepared | None, schedule, transport, selector
              ) -> tuple[Settings, int]:
    """Phase 1: the call's settings (its Prepared's, else validated now), its group's lock
    (bounded; none on a poisoned group) and its number in the group's sequence of calls."""
    session = call.session
    channel = session.channel
    assert channel is not None             # (a group of more than one rank has one)
    lock = session.lock
    try:
        s = prepared.settings if prepared is not None else \
            settings(call, schedule, transport, selector)
        # One call per group at a time (bounded), and none on a poisoned group.
        if not lock.acquire(timeout=s.timeout_s):
            raise session.busy(call.op.name, s.timeout_s)
        if session.poisoned is not None:
            lock.release()
            raise session.refusal()
    except BaseException:
        channel.take()      # refused on this rank: it still took its place (ficco.runtime.session)
        raise
    # This call's place in the group's sequence, in the order calls run (the lock's): two
    # threads of a rank take numbers in the order their calls pair with the peers'.
    number = channel.number = next(channel.numbers)
    return s, number


def _agreed(call: Call, prepared: Prepared | None, s: Settings, run_key: tuple, number: int,
            stage: guard.Stage) -> tuple[Prepared, Call, int, bool]:
    """Phase 2: ``(Prepared, call, word, exchanged)``: a warm call's word from its digest and
    number; else the call agreed with every rank and prepared (:func:`_prepare`), then kept."""
    channel = call.session.channel
    assert channel is not None
    if prepared is not None and prepared.digest in channel.agreed:
        # (agreement.mixed, written out: the warm path)
        return prepared, call, (prepared.digest ^ (number * agreement.MIX)) & agreement.MASK, \
            False
    prepared, call, word, exchanged = _prepare(call, s, number, stage)
    known = call.known
    # (a decision made without measuring where the selector measures, a rank that could not
    # time, is not kept: the next call measures)
    if known is not None and not call.op.exchanges and (
            prepared.decision is None or prepared.decision.final
            or prepared.explorer is not None):
        if len(known.prepared) >= _PREPARED_PER_KEY:
            known.prepared.clear()
        known.prepared[run_key] = prepared
    return prepared, call, word, exchanged


def _plain(call: Call, prepared: Prepared, number: int, exchanged: bool, values: int,
           stage: guard.Stage):
    """Phase 3 of a call without a plan (FICCO_DISABLE, nothing to overlap): the call check
    where no exchange just compared the ranks' calls, then the op's plain collective."""
    stage.transport, stage.schedule = "ccl", "plain"
    stage.step = "the call check before the plain path"
    if not exchanged or values:   # the plain path is a collective too: check it
        channel = call.session.channel
        assert channel is not None
        agreement.check(channel, call.group, call.rank, call.world, prepared.digest ^ values,
                        number, call.op.name)
    stage.step, stage.pending = "the plain path's collective", True
    return call.op.plain(call)


def _named(call: Call, exc: BaseException, number: int, prepared: Prepared | None, values: int,
           stage: guard.Stage) -> BaseException:
    """Phase 4, on failure: ``exc`` named for the caller (rank, op, schedule, step, the peers'
    calls), the group poisoned where the failure left it out of step (:mod:`.guard`)."""
    digest = None if prepared is None else prepared.digest
    named = guard.failed(call, _described(call, exc, number, digest), stage)
    if values and isinstance(named, MismatchError):
        named = _values_differ(call, named, values)
    return named


def _prepare(call: Call, s: Settings, number: int, stage: guard.Stage):
    """The first sight of a call key under settings ``s`` (or a call whose routing is data):
    its signature agreed with every rank (an exchange when its digest is new to the group),
    the call's data exchanged (expert routing), its decision, plan and compiled plan.
    Returns ``(Prepared, the completed call, the call's word, whether it exchanged)``."""
    sig, digest = signed(call, s)
    channel = call.session.channel
    assert channel is not None
    sequence = channel.sequence
    stage.step = "the first-call agreement"
    agreed = agreement.confirm_same_call(call.group, call.rank, call.world, sig, call.op.name,
                                         digest, number)
    word = agreement.mixed(digest, number)
    if call.op.exchanges:
        stage.step = "the exchange of the call's data"
        call, word = call.op.exchange(call, word)      # e.g. expert routing counts
    # Exchanged: the agreement, or the call's data (a routing handed in exchanges nothing):
    # then every rank's call was compared at this place in the sequence, no check is needed.
    exchanged = channel.sequence != sequence
    stage.step = None
    decision = plan = compiled = nbytes = None
    problem = call.problem
    if not (s.disable or call.plain_only):
        problem = call.op.agreed_problem(call, agreed.per_rank)
        # (at a key's first sight a measuring selector runs the call's candidates here)
        stage.step = "choosing its schedule"
        decision = _decide(call, s, agreed, problem, Live(call, s, digest, number))
        stage.step = None
        plan, compiled = _plan(call.session, call.op, decision.schedule, decision.transport,
                               call.problem, s.copy_engines)
        if decision.transport == "dma":
            nbytes = call.op.workspace_bytes(call)
    template = call.known.template if call.known is not None else None
    exploring = None if decision is None else decision.exploring
    prepared = Prepared(template, s, sig, digest, agreed, problem, decision, plan, compiled,
                        nbytes, plan is not None and plan.wide_outputs(), Answer(call, sig),
                        exploring, None if exploring is None else {})
    return prepared, call, word, exchanged


def _explored(call: Call, prepared: Prepared, known, run_key, word: int, number: int,
              exchanged: bool, stage: guard.Stage, profiled: bool, values: int):
    """A call of a key ``auto`` explores (:mod:`ficco.heuristics.explore`): the candidate
    its exploration says every rank runs now, a full call, timed by the backend without a
    synchronize; or, once due, the exchange that settles the decision and then the call as
    decided (kept as the key's Prepared form from then on). A rank that cannot time runs the
    model's pick and leaves the exploration where it is."""
    from ..heuristics import Decision

    backend = call.backend
    exploration, decided, variants = prepared.explorer, prepared.decision, prepared.variants
    assert exploration is not None and decided is not None and variants is not None
    if exploration.settled is None:
        live = Live(call, prepared.settings, prepared.digest, number)
        # (the first call's selector just checked)
        blocked = live.cannot_time() if exploration.calls else None
        if blocked is not None:
            choice = exploration.model_choice()
            decision = Decision(choice.schedule, choice.transport, "auto", decided.inputs,
                                choice.scores, f"not explored: the model's pick: {choice.reason}",
                                decided_by=f"the model's prediction (not explored: this rank "
                                           f"cannot time now: {blocked})", final=False)
            return _run_as(call, _variant(call, prepared, decision), word, number, exchanged,
                           stage, profiled, values)
        stage.step = "the exploring selector's exchange"
        exploration.begin(live)
        stage.step = None
    if exploration.settled is not None:
        final = _variant(call, prepared, exploration.settled)
        if known is not None and known.prepared.get(run_key) is prepared:
            known.prepared[run_key] = final
        return _run_as(call, final, word, number, exchanged, stage, profiled, values)
    index, candidate, _ = exploration.next_call()
    variant = variants.get(candidate)
    if variant is None:
        if candidate == (decided.schedule, decided.transport):
            variant = prepared
        else:
            variant = _variant(call, prepared, dataclasses.replace(
                decided, schedule=candidate[0], transport=candidate[1],
                reason=f"exploring: this call of the key runs {candidate[0]} ({candidate[1]}), "
                       f"one of the shortlisted candidates", exploring=None))
        variants[candidate] = variant
    watch = backend.started()
    out = _run_as(call, variant, word, number, exchanged, stage, profiled, values)
    exploration.record(index, backend.stopped(watch))
    exploration.after_call()
    return out


def _variant(call: Call, prepared: Prepared, decision) -> Prepared:
    """``prepared`` running ``decision``'s schedule and transport instead (not exploring)."""
    plan, compiled = _plan(call.session, call.op, decision.schedule, decision.transport,
                           call.problem, prepared.settings.copy_engines)
    nbytes = call.op.workspace_bytes(call) if decision.transport == "dma" else None
    return dataclasses.replace(prepared, decision=decision, plan=plan, compiled=compiled,
                               workspace_bytes=nbytes, wide=plan.wide_outputs(), explorer=None,
                               variants=None)


def _run_as(call: Call, prepared: Prepared, word: int, number: int, exchanged: bool,
            stage: guard.Stage, profiled: bool, values: int):
    """Phase 3 of ``call`` run as ``prepared`` says (an exploring call's candidate, or its
    settled decision): the plan executed, the result in the caller's layout."""
    buffers = _execute(call.session, call, prepared, word, number, exchanged, stage, profiled,
                       values)
    decision = prepared.decision
    assert decision is not None           # (a call with a plan)
    call.session.last = decision
    return call.op.result(call, buffers, decision.transport)


def _values_differ(call: Call, exc: MismatchError, values: int) -> MismatchError:
    """``exc`` of a call whose values every rank must pass alike (:meth:`OpSpec.values_word`),
    saying so: where the shapes and settings agree, those values are what differs."""
    what = call.op.values_what
    named = MismatchError(
        f"{exc}. The ranks' {call.op.name} calls must also pass the same {what} values (each "
        f"rank applies its own {what}, so different ones would leave the ranks with different "
        f"outputs): where shapes and settings agree, the {what} differs across ranks (its "
        f"digest on rank {call.rank}: {values:016x}); make it identical on every rank, e.g. "
        f"broadcast it from rank 0")
    named.__dict__.update(exc.__dict__)    # (its error context)
    return named


def _execute(session: Session, call: Call, prepared: Prepared, word: int, number: int,
             exchanged: bool, stage: guard.Stage, profiled: bool, values: int = 0):
    """Run ``call``'s prepared plan: the dma workspace (grown if needed, its barriers' call
    flag made from the call's ``word``: digest and number), the op's buffers, then (ccl, a
    call not just agreed by an exchange) the call check, then the plan. The buffers come
    before the check: a rank that cannot allocate leaves no collective of this call pending
    in its peers. Returns the buffers (phase 3 of a call with a plan)."""
    decision, compiled, backend = prepared.decision, prepared.compiled, call.backend
    assert decision is not None and compiled is not None     # (a call with a plan)
    transport = stage.transport = decision.transport
    stage.schedule = decision.schedule
    symm = None
    if transport == "dma":
        nbytes = prepared.workspace_bytes or 0
        if backend.guards_dma:
            # Before allocating or enqueuing: a capture the backend cannot replay, or an error
            # the group owes from an earlier call (GPUs), is raised with nothing sent; the
            # caller's stream is ordered after the session's last call's first (GPUs).
            backend.before_dma(session.workspace, nbytes,
                               session.lane or session.queues_lane())
        symm = session.workspace
        if symm is None or symm.nbytes < nbytes:
            stage.step = "allocating the dma workspace"
            symm = workspace.get(session, nbytes, _agreeing(call))
        symm.call_flag = word % 0x7FFFFFFF + 1      # (barrier.call_flag, written out)
        answer = symm.first_wait = prepared.answer
        answer.number = number
    stage.step, stage.local = "allocating the call's buffers", True
    buffers = call.op.buffers(call, transport, symm, wide=prepared.wide, plan=prepared.plan)
    if prepared.settings.poison:
        _poison(call.op, backend, buffers)
    stage.local = False
    if transport == "ccl" and (not exchanged or values):
        stage.step = "the call check before the plan"
        channel = session.channel
        assert channel is not None
        agreement.check(channel, call.group, call.rank, call.world, prepared.digest ^ values,
                        number, call.op.name)
    stage.step, stage.pending = None, transport == "ccl"
    execute_plan(compiled, backend, buffers, timeout_s=prepared.settings.timeout_s,
                 lane=session.lane or session.queues_lane(), profiled=profiled)
    if symm is not None and backend.guards_dma:
        # GPUs: NaN instead of data if the watchdog had to release one of this call's barriers.
        backend.fence([*buffers.outs, buffers.gathered], symm)
    return buffers


def _poison(op, backend, buffers) -> None:
    """FICCO_POISON's NaN fill of ``buffers``, in the compute queue's order where that is the
    caller's stream (GPUs: the fills are kernels on it, after :meth:`before_dma` ordered it
    after the session's last call, whose GEMMs and peers' pulls may still read the symmetric
    buffers); elsewhere now."""
    if backend.compute_on_current:
        backend.launch_current(lambda: op.poison(buffers))
    else:
        op.poison(buffers)


def _described(call: Call, exc: BaseException, number: int, digest: int | None
               ) -> BaseException:
    """A barrier's MismatchError (it knows only the peers' call flags) with the calls those
    flags stand for, as this rank agreed them (their op, role, shapes and call number), and
    this rank's call (``digest``)."""
    flags = known_context(exc).flags
    if not flags:
        return exc

    def flag_of(word, at):
        return call_flag(agreement.mixed(word, at))

    calls = "; ".join(f"rank {peer}: " + agreement.describe(call.group, flag=flag,
                                                            flag_of=flag_of, near=number)
                      for peer, flag in sorted(flags.items()))
    mine = agreement.describe(call.group, digest)
    return MismatchError(f"{exc}. The peers' calls: {calls}; this rank's: {mine}, as its call "
                         f"{number}")


def candidate_transports(setting: str, same_host: bool) -> tuple[str, ...]:
    """The transports a call may use, preferred first: ``auto`` offers dma when every rank
    shares this host (the model selector then weighs dma against ccl)."""
    if setting != "auto":
        return (setting,)
    return ("dma", "ccl") if same_host else ("ccl",)


def decide(call: Call, s: Settings, agreed: agreement.Agreed):
    """The Decision for ``call`` (identical on every rank: selectors see no rank, and the
    problem they see has each per-rank width at its widest, as ``agreed``), made once per
    (op, that problem's key, backend target, candidate transports, deciding settings) and then
    looked up (LRU, on the call's session: each group decides, and measures, for itself).
    Every part of the key is agreed across ranks, and a decision is a pure function of it
    (what ``auto`` and ``tune`` measure is collective, agreed and cached by them), so a rank
    that forgot a decision the others kept reaches the same one again. A decision made
    without measuring where the selector measures (a rank could not time) is not kept: the
    next call measures. (Outside a numbered call: a measured run carries no call check.)"""
    return _decide(call, s, agreed, call.op.agreed_problem(call, agreed.per_rank),
                   Live(call, s))


def _decide(call: Call, s: Settings, agreed, problem, live: Live):
    transports = candidate_transports(s.transport, agreed.same_host)
    problem = _decided_as(problem)
    key = (call.op.name, problem.key(), call.target, transports, s.deciding())
    decisions = call.session.decisions
    decision = decisions.get(key)
    if decision is not None:
        if decision.exploring is not None and decision.exploring.settled is not None:
            decision = decisions[key] = decision.exploring.settled
        decisions.move_to_end(key)
        return decision
    from ..heuristics import choose

    decision = choose(problem, transport=transports, target=call.target,
                      selector=s.selector, forced=s.schedule, forced_by=s.schedule_by,
                      live=live, auto_mode=s.auto_mode)
    if isinstance(problem, Problem) and problem.m > EXACT_ROWS and decision.selector != "forced":
        decision = dataclasses.replace(decision, reason=f"{decision.reason} (decided at "
                                       f"m={problem.m}: every m of its bucket takes it)")
    if decision.final or decision.exploring is not None:
        decisions[key] = decision
        while len(decisions) > sessions.DECISIONS_KEPT:
            decisions.popitem(last=False)
    return decision


def _decided_as(problem):
    """The problem whose decision ``problem`` takes: a dense op's rows in their bucket
    (:meth:`ficco.plan.problem.Problem.decided_as`: a new sequence length mostly finds its decision
    made); other problems (the expert ops', already bucketed by routing) as they are."""
    return problem.decided_as() if isinstance(problem, Problem) else problem


def plan_for(op, name: str, transport: str, problem, engines=..., session=None):
    """The Plan of schedule ``name`` of ``op`` (an op spec, or a Call) for ``problem``,
    cached (LRU) on ``session`` (a Call's own by default; none: made afresh); ``engines``: the
    FICCO_COPY_ENGINES value the call read (default: read it now)."""
    if isinstance(op, Call):
        session, op = session or op.session, op.op
    if engines is ...:
        engines = config.copy_engines()
    if session is None:
        return op.schedule(name).plan(problem, transport, engines)
    return _plan(session, op, name, transport, problem, engines)[0]


def _agreeing(call: Call):
    """True when a flag is True on every rank of ``call``'s group (one exchange; none for one
    rank): whether every rank can close the group's old workspace as it grows."""
    if call.world == 1:
        return None
    return lambda flag: agreement.all_ranks(call.group, call.rank, call.world, flag,
                                            what=f"{call.op.name}: close the old dma workspace")


def _plan(session: Session, op, name: str, transport: str, problem, engines) -> tuple:
    """``(plan, compiled plan)`` from the session's LRU."""
    key = (op.name, name, transport, problem, engines)
    plans = session.plans
    found = plans.get(key)
    if found is not None:
        plans.move_to_end(key)
        return found
    plan = op.schedule(name).plan(problem, transport, engines)
    if config.log_level() == "debug":
        counts: dict[str, int] = {}
        for item in plan.ops:
            counts[item.kind] = counts.get(item.kind, 0) + 1
        logs.ready().debug(
            "ficco plan rank %d: %s %s over %s, %d ops %s", problem.rank, op.name, name,
            transport, len(plan.ops), counts)
    found = plans[key] = (plan, compile_plan(plan))
    while len(plans) > sessions.PLANS_KEPT:
        plans.popitem(last=False)
    return found


def execute(call: Call, name: str, transport: str, trace: bool = False,
            settings: Settings | None = None, word: int | None = None):
    """Run schedule ``name`` over ``transport`` once, outside the call's own run (the
    measuring selectors' runs, traces): returns (buffers, plan, trace rows). Every rank runs
    the same call here, so its barriers carry one flag on every rank: the call's (``word``:
    its digest and number, as the call's own run carries it), else one for every such run.
    The caller holds the session."""
    if settings is None:
        engines, poison, timeout_s = config.copy_engines(), config.poison(), config.timeout_s()
    else:
        engines, poison, timeout_s = settings.copy_engines, settings.poison, settings.timeout_s
    session = call.session
    plan, compiled = _plan(session, call.op, name, transport, call.problem, engines)
    symm = None
    if transport == "dma":
        nbytes = call.op.workspace_bytes(call)
        if call.backend.guards_dma:
            call.backend.before_dma(session.workspace, nbytes,
                                    session.lane or session.queues_lane())
        symm = workspace.get(session, nbytes, _agreeing(call))
        symm.call_flag = call_flag(word)
        symm.first_wait = None
    buffers = call.op.buffers(call, transport, symm, wide=plan.wide_outputs(), plan=plan)
    if poison:
        _poison(call.op, call.backend, buffers)
    rows = execute_plan(compiled, call.backend, buffers, timeout_s=timeout_s, trace=trace,
                        lane=session.lane or session.queues_lane())
    if symm is not None and call.backend.guards_dma:
        call.backend.fence([*buffers.outs, buffers.gathered], symm)
    return buffers, plan, rows


class Live:
    """This call's group as a measuring selector (``auto``, ``tune``) sees it
    (:class:`ficco.heuristics.measured.Live`), through the call's session: runs of the call
    with its own operands on the session's queues, timed by the backend (CUDA/HIP events on
    GPUs); exchanges through the group's store; the session's set of agreed cache entries. A
    run is what the call would do once decided: with the call's flag (``digest`` and
    ``number``) on its dma barriers, or the ccl call check, then the plan and the result's
    layout, so a transport's per-call cost is in its time. Every rank runs the same runs in
    the same order (the selectors' order), each one collective."""

    def __init__(self, call: Call, s: Settings, digest: int | None = None, number: int = 0):
        self.call, self.settings, self.digest, self.number = call, s, digest, number
        self.word = None if digest is None else agreement.mixed(digest, number)
        self.agreed = call.session.measured
        self.exploring = call.session.exploring
        self.lag = call.backend.timing_lag

    def run(self, name: str, transport: str) -> float:
        session = self.call.session
        return self.call.backend.time_run(lambda: self._call(name, transport),
                                          session.lane or session.queues_lane())

    def _call(self, name: str, transport: str) -> None:
        call = self.call
        channel = call.session.channel
        if transport == "ccl" and self.digest is not None and channel is not None:
            agreement.check(channel, call.group, call.rank, call.world, self.digest,
                            self.number, call.op.name)
        buffers, _, _ = execute(call, name, transport, settings=self.settings, word=self.word)
        call.op.result(call, buffers, transport)

    def read(self, watch) -> float:
        return self.call.backend.seconds_of(watch)

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


def traced(call: Call, schedule: str, transport: str | None = None):
    """One run with a forced schedule: ``(result, plan, rows)``, rows being this rank's
    measured per-op ``{op_index, queue, kind, label, start_s, end_s}`` (for timelines)."""
    s = settings(call, schedule, transport)
    if call.world == 1:
        buffers, plan, rows = execute(call, call.op.schedule(schedule).name, "ccl", trace=True,
                                      settings=s)
        return call.op.result(call, buffers, "ccl"), plan, rows or []
    session = call.session
    assert session.channel is not None
    try:
        sig, word = signed(call, s)
        lock = session.enter(call.op.name, s.timeout_s)
    except BaseException:
        session.channel.take()
        raise
    number = session.channel.take()
    stage = guard.Stage(step="the first-call agreement")
    try:
        same_host = agreement.confirm_same_call(call.group, call.rank, call.world, sig,
                                                call.op.name, word, number).same_host
        if call.op.exchanges:
            call, _ = call.op.exchange(call, agreement.mixed(word, number))
        via = candidate_transports(s.transport, same_host)[0]
        stage.transport, stage.schedule, stage.step = via, schedule, None
        stage.pending = via == "ccl"
        buffers, plan, rows = execute(call, call.op.schedule(schedule).name, via, trace=True,
                                      settings=s)
    except BaseException as exc:
        named = guard.failed(call, exc, stage)
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
    from ..heuristics import choose

    s = settings(call, schedule)
    sig, _ = signed(call, s)
    known = agreement.known(call.group, sig) if call.world > 1 else None
    transports = candidate_transports(s.transport, True if known is None else
                                      known.same_host)
    # The widths every rank agreed on, once agreed (before: this rank's own); the rows in
    # their decision bucket, as the call decides.
    problem = _decided_as(call.problem if known is None else
                          call.op.agreed_problem(call, known.per_rank))
    decision = choose(problem, transport=transports, target=call.target,
                      selector=s.selector, forced=s.schedule, forced_by=s.schedule_by,
                      auto_mode=s.auto_mode, exploring=_explorations(call))
    if known is None and s.transport == "auto" and call.world > 1:
        decision = dataclasses.replace(
            decision, reason=f"{decision.reason} (transport assumes one host: not yet agreed "
                             f"with the other ranks)")
    return call.op.annotate(decision, problem)


def _explorations(call: Call) -> dict | None:
    """The explorations in flight on ``call``'s group in this process (None: no session)."""
    from ..backends import get_backend

    if call.world == 1:
        return None
    found = peek(resolve(call.group), get_backend())
    return None if found is None else found.exploring


def last_run(group=None) -> tuple[str, str] | None:
    """(schedule, transport) of the last multi-rank call on ``group`` (None: the default
    group) in this process, from its session (``ficco.session_of(group).last``)."""
    from ..backends import get_backend

    found = peek(resolve(group), get_backend())
    last = None if found is None else found.last
    return None if last is None else (last.schedule, last.transport)


def shutdown() -> None:
    """Drop every session whole (workspaces released once their queues drained, queues
    closed, every call and decision forgotten), reset every group's channel, close the
    backends. Local: a group is in step again once every rank called it (see ficco.runtime.session)."""
    drop_all()
    close_all()
