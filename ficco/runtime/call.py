"""From the caller's arguments to one canonical :class:`Call`: checks shared by every op.

Nothing here communicates: a bad argument raises :class:`~ficco.errors.InvalidArgumentError`
on the rank that made it, before any rank waits for another. Op-specific checks live in the
op spec (``ficco/ops/``); this module holds what every op needs: dimension arguments,
dtypes, the backend and the settings every rank must share (groups: :mod:`ficco.group`).

>>> normalize_dim(-2, 3, "gather_dim")
1
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch

from .. import config
from ..backends import get_backend
from ..errors import ConfigError, InvalidArgumentError
from ..group import key as group_key
from ..plan.problem import dtype_name
from . import agreement
from . import session as sessions

if TYPE_CHECKING:
    from ..executor.compiler import CompiledPlan
    from ..heuristics.decision import Decision
    from ..heuristics.explore import Exploration
    from ..plan import Plan
    from ..plan.problem import DtypeFields

#: The dtypes every op accepts (float64 is for references and tests).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: The role of a call made by the caller; ficco's backward passes make theirs with a role that
#: names the op and input they differentiate (ficco.ops.autograd), so the ranks agree on it too.
FORWARD = "forward"
#: fp8 operands, taken with scales (ficco.plan.epilogue)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
              torch.float8_e5m2fnuz)


class _RankView(Protocol):
    """What a Call reads of its problem: a :class:`~ficco.plan.problem.Problem`, or the expert ops'
    :class:`~ficco.ops.expert.problem.ExpertProblem` (a problem of its own, not a Problem)."""

    @property
    def world(self) -> int: ...

    @property
    def rank(self) -> int: ...


_P = TypeVar("_P", bound=_RankView)


@dataclass
class Call(Generic[_P]):
    """One validated call in canonical form; an op spec subclasses it with its tensors and
    the kind of problem it decides on (``Call[Problem]``)."""

    op: Any                 # the op spec (ficco.ops.base.OpSpec)
    problem: _P
    group: Any              # a ProcessGroup, or None for a world of one
    backend: Any
    #: nothing to overlap (e.g. an output with no columns): agreed, then the op's plain path
    plain_only: bool = False
    #: FORWARD, or the backward pass this call belongs to (part of what ranks agree on)
    role: str = FORWARD
    # Read many times per call: set once here rather than looked up through properties.
    world: int = field(init=False)
    rank: int = field(init=False)
    group_key: str = field(init=False)      # ficco.group.key(group): caches and messages
    target: str = field(init=False)         # backend.target(): cache keys, the signature
    #: the group's session (ficco.runtime.session): where everything derived from this call is kept
    session: sessions.Session = field(init=False, repr=False, compare=False)
    #: what the session knows of this call's key (its template, its Prepared forms), or None
    known: sessions.Known | None = field(init=False, repr=False, compare=False, default=None)
    #: what the op spec derives from this call's key, shared by every warm call of that key
    reuse: Reuse = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.world, self.rank = self.problem.world, self.problem.rank
        self.group_key = group_key(self.group)
        self.target = self.backend.target()
        self.session = sessions.of(self.group, self.backend)
        self.known = None
        self.reuse = Reuse()

    def clone(self, **tensors: Any) -> Call:
        """This call with other tensors: a warm call of a known key (:func:`known`) takes
        every checked and derived field of the call that key first produced, sets its own
        tensors and validates nothing again (the key holds all the checks looked at)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(tensors)
        return new


class Reuse:
    """What an op spec derives from a call's key (op, shapes, dtypes, group, backend) and
    reuses at every warm call of the key (STYLE guideline 11): the byte offsets of its buffers
    in the workspace. (What the runtime derives lives on the session's Prepared.)"""

    __slots__ = ("offsets",)

    def __init__(self) -> None:
        self.offsets: tuple[int, ...] | None = None


class Answer:
    """What a call's first dma barrier runs while it waits (:func:`ficco.runtime.agreement.answer`),
    made once per :class:`Prepared`; ``number`` is set per call (calls on one session are
    serialised). It holds the session, never the group (which the session holds weakly)."""

    __slots__ = ("number", "session", "signature")

    def __init__(self, call: Call, sig: dict[str, Any]):
        self.session, self.signature, self.number = call.session, sig, 0

    def __call__(self) -> None:
        session = self.session
        agreement.answer(session.group, session.rank, session.world, self.signature,
                         self.number)


@dataclass(frozen=True, slots=True)
class Prepared:
    """Everything a warm call of one key under one set of settings reuses: made once, at its
    first sight (:func:`ficco.runtime.path.run`), then looked up. ``decision`` is None for the
    plain path (FICCO_DISABLE, or nothing to overlap)."""

    template: Call | None       # the checked Call, without group and tensors
    settings: Settings          # validated settings (ficco.runtime.path.settings)
    signature: dict[str, Any]   # what every rank agreed on
    digest: int                 # its 63-bit digest
    agreed: agreement.Agreed
    problem: DtypeFields        # the problem decided on (per-rank widths at the widest)
    decision: Decision | None
    plan: Plan | None           # its Plan (None: plain path)
    compiled: CompiledPlan | None   # the Plan compiled once
    workspace_bytes: int | None  # per rank, dma only
    wide: bool                  # the plan's outputs are float32, rounded once (Plan.wide_outputs)
    answer: Answer              # what the call's first dma barrier runs while it waits
    #: ``auto``'s exploration of the key while its calls run the shortlist, and this key's
    #: Prepared form per candidate (schedule, transport) it ran
    explorer: Exploration | None = None
    variants: dict[tuple[str, str], Prepared] | None = None


# -- warm calls: the canonical Call of a known key, validated once -----------------------------


def key_of(op: str, a, b, group, backend, args: tuple, epilogue: tuple = ()) -> tuple | None:
    """The key of a call: the op, the type, shape, dtype and device of ``a`` and of each
    weight (and whether ``b`` was a list), the resolved group and backend, and the op's other
    arguments (``args``: ints, bools, strings). ``epilogue``: ``(a_scale, b_scale, out_dtype,
    bias, activation)`` when one is given: how its lists are made, its tensors' types, shapes,
    dtypes and devices, out_dtype, the activation, and the weights' strides (fp8 GEMMs on
    GPUs take column-major weights only). That is everything the op's checks and its
    canonical form depend on, so a call whose key is known passed them already. None when an
    operand is not a tensor (the full checks say what is wrong)."""
    try:
        if isinstance(b, (list, tuple)):
            weights = (True, *[(type(x), x.shape, x.dtype, x.device, x.layout) for x in b])
        else:
            weights = (type(b), b.shape, b.dtype, b.device, b.layout)
        extra = _epilogue_key(b, *epilogue) if epilogue else ()
        return (op, type(a), a.shape, a.dtype, a.device, a.layout, weights, id(group),
                id(backend), *args, *extra)
    except (AttributeError, TypeError):   # not tensors, or shapes that do not hash (symbolic)
        return None


def _epilogue_key(b, a_scale, b_scale, out_dtype, bias, activation) -> tuple:
    scales = list(b_scale) if isinstance(b_scale, (list, tuple)) else [b_scale]
    biases = list(bias) if isinstance(bias, (list, tuple)) else [bias]
    strides = [x.stride() for x in b] if isinstance(b, (list, tuple)) else [b.stride()]
    return (type(b_scale), len(scales), type(bias), len(biases), out_dtype, activation, *strides,
            *[None if t is None else (type(t), t.shape, t.dtype, t.device)
              for t in [a_scale, *scales, *biases]])


def known(key, group, backend=None) -> Call | None:
    """The Call (without group and tensors: :meth:`Call.clone` them in) that ``key`` produced
    on ``group``'s session before, or None (``backend``: the active one by default)."""
    try:
        found = sessions.of(group, backend or get_backend()).calls.get(key)
    except TypeError:   # an argument that does not hash (an activation given as a list)
        return None
    return None if found is None else found.template


def remember(key, call: Call, **tensors) -> None:
    """Keep ``call`` for ``key`` on its session, without its group and its tensors
    (``tensors``: each set to None), so a warm call clones it; ``call`` and its warm clones
    carry what the session knows of the key (``call.known``)."""
    template = call.clone(group=None, **tensors)
    call.known = template.known = call.session.remember(key, template)


def check_flag(value, name: str) -> bool:
    """``value`` as a bool, which it must be (a NumPy bool too): a string such as "yes" or
    "false" is not taken for one.

    >>> check_flag(False, "return_gathered")
    False
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise InvalidArgumentError(f"{name} must be True or False; got {type(value).__name__} "
                               f"{value!r}")


def normalize_dim(value, ndim: int, name: str) -> int:
    """``value`` as a dimension index in ``[0, ndim)``; accepts Python and NumPy integers
    (anything with ``__index__``) but not bools."""
    if isinstance(value, bool) or (hasattr(value, "dtype") and str(value.dtype) == "bool"):
        raise InvalidArgumentError(f"{name}={value!r} is a bool; pass a dimension index")
    try:
        index = operator.index(value)
    except TypeError:
        raise InvalidArgumentError(
            f"{name} must be an integer dimension; got {type(value).__name__} {value!r}") from None
    if not -ndim <= index < ndim:
        raise InvalidArgumentError(f"{name}={index} is out of range for a tensor of {ndim} dims")
    return index % ndim


def row_dim(value, t: torch.Tensor, name: str, t_name: str, does: str) -> int:
    """``value`` as a non-negative dimension of ``t`` that is a row dimension (never the last,
    K): the dimension ``does`` works along (e.g. "gathers along", "scatters")."""
    nd = t.dim()
    try:
        index = normalize_dim(value, nd, name)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{exc}; use 0 … {nd - 2}") from None
    if index == nd - 1:
        raise InvalidArgumentError(
            f"{name}={index} is the last (K) dimension of {t_name} {tuple(t.shape)}; ficco "
            f"{does} a row dimension (0 … {nd - 2})")
    return index


def check_tensor(t, name: str, *, min_dim: int = 2, fp8: bool = False) -> None:
    """``t`` is a tensor of at least ``min_dim`` dims and a supported dtype (fp8 too when
    ``fp8``: the ops that take scales)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    check_strided(t, name)
    if t.dim() < min_dim:
        raise InvalidArgumentError(
            f"{name} must have at least {min_dim} dims; got shape {tuple(t.shape)}")
    allowed = SUPPORTED_DTYPES + (FP8_DTYPES if fp8 else ())
    if t.dtype not in allowed:
        extra = "" if fp8 or t.dtype not in FP8_DTYPES else \
            " here (fp8 operands go to the scaled ops, with a_scale and b_scale)"
        raise InvalidArgumentError(f"{name} dtype {t.dtype} is not supported{extra}; use one "
                                   f"of {[dtype_name(d) for d in allowed]}")


def check_strided(t: torch.Tensor, name: str) -> None:
    """``t`` is a dense (strided) tensor: rows of a sparse one have no place in memory to copy
    from or to."""
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{name} is a {t.layout} tensor; ficco's ops take dense "
                                   f"tensors: pass {name}.to_dense()")


def check_like(t, ref: torch.Tensor, name: str, ref_name: str, *, dtype: bool = True) -> None:
    """``t`` has the dtype (unless not ``dtype``) and device of ``ref``."""
    if dtype and t.dtype != ref.dtype:
        raise InvalidArgumentError(f"{name} is {t.dtype} but {ref_name} is {ref.dtype}; "
                                   f"cast one so both match")
    if t.device != ref.device:
        raise InvalidArgumentError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; "
                                   f"move them to one device")


def check_weights(b, a: torch.Tensor, a_name: str, *, k: int | None = None,
                  k_from: str | None = None, list_name: str = "b",
                  role: str = "", k_may_be_zero: bool = False) -> tuple[list, bool]:
    """``(weights as a list, whether b was a list)``, each a 2-D ``(k, n)`` tensor with the
    dtype and device of ``a``. ``k`` defaults to ``a``'s last dim; ``k_from`` says where a
    different ``k`` comes from (for the error message); ``role`` adds what the weight is;
    ``k_may_be_zero``: this rank may hold none of K (a reduce-scatter's shard of it)."""
    b_is_list = isinstance(b, (list, tuple))
    bs = list(b) if b_is_list else [b]
    if not bs:
        raise InvalidArgumentError(
            f"{list_name} is an empty list; pass a (K, n) tensor or a list of them")
    k = a.shape[-1] if k is None else k
    k_from = k_from or f"{a_name} has K={k} columns"
    for j, bj in enumerate(bs):
        name = f"{list_name}[{j}]" if b_is_list else list_name
        if not isinstance(bj, torch.Tensor) or bj.dim() != 2:
            raise InvalidArgumentError(
                f"{name} must be a 2-D (K, n) tensor{role}; got "
                f"{tuple(bj.shape) if isinstance(bj, torch.Tensor) else type(bj).__name__}")
        check_strided(bj, name)
        if bj.shape[0] != k:
            raise InvalidArgumentError(
                f"{name} has {bj.shape[0]} rows but {k_from} ({a_name} {tuple(a.shape)}, "
                f"{name} {tuple(bj.shape)}); they must match")
        # fp8 forms may mix (e4m3 activations, e5m2 gradients): torch._scaled_mm takes it
        check_like(bj, a, name, a_name,
                   dtype=not (a.dtype in FP8_DTYPES and bj.dtype in FP8_DTYPES))
    if k == 0 and not k_may_be_zero:
        raise InvalidArgumentError(f"{a_name} has K=0 columns: {tuple(a.shape)}")
    return bs, b_is_list


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse, before any communication, a call whose buffers alone are larger than its
    device's whole memory: it could only fail later, when allocating, after every rank had
    agreed on it (an expanded input has stride-0 rows and no memory of its own)."""
    total = _memory_bytes(device.type, device.index)
    if total is not None and nbytes > total:
        raise InvalidArgumentError(
            f"{what} needs {nbytes / 2**30:.1f} GiB for its buffers, more than the "
            f"{total / 2**30:.1f} GiB of memory of {device}; split the work into smaller calls")


@functools.lru_cache(maxsize=16)
def _memory_bytes(kind: str, index: int | None) -> int | None:
    if kind == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module = getattr(torch, kind, None)      # torch's device module (cuda: ROCm too; xpu…)
    if module is None or not hasattr(module, "get_device_properties"):
        return None      # meta tensors: shapes only
    props = module.get_device_properties(index if index is not None else
                                         module.current_device())
    return getattr(props, "total_memory", None)


def backend_for(t: torch.Tensor, name: str, backend=None):
    """The active backend (or ``backend``, the one the caller got), checked to run where ``t``
    lives."""
    backend = backend or get_backend()
    if t.device.type != backend.device().type:
        from ..backends import unavailable_note

        why = unavailable_note() if backend.name == "cpu" else ""
        raise InvalidArgumentError(
            f"{name} is on {t.device} but the active backend {backend.name!r} runs on "
            f"{backend.device().type}; move the tensors or set FICCO_BACKEND"
            + (f"; {why}" if why else ""))
    backend.check_device(t, name)   # GPUs: the very device it drives
    return backend


def check_environment(knobs: dict) -> None:
    """What a setting's value must be beyond its own parse, checked with the call's settings
    (before any communication): FICCO_TUNE_CANDIDATES names schedules, FICCO_CACHE_DIR is no
    file. (The cache's own faults, unwritable or corrupt, only warn: ficco.heuristics.cache.)"""
    from .. import schedules

    unknown = [n for n in knobs["FICCO_TUNE_CANDIDATES"] or () if not schedules.ops_with(n)]
    if unknown:
        known = sorted({n for op in schedules.ops() for n in schedules.names(op=op)})
        raise ConfigError(f"FICCO_TUNE_CANDIDATES names no schedule: {', '.join(unknown)}; "
                          f"known: {', '.join(known)}")
    cache = knobs["FICCO_CACHE_DIR"]
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        raise ConfigError(f"FICCO_CACHE_DIR={cache!r} is a file, not a directory; name a "
                          f"directory (made if missing) or unset it")


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting of one call, read and validated once (:func:`settings`); a call reads
    them as fields. Field names are the keys ranks agree on (:meth:`agreed`)."""

    disable: bool                        # FICCO_DISABLE: the plain path
    schedule: str | None                 # the forced schedule (argument > FICCO_SCHEDULE)
    schedule_by: str | None              # "argument", "FICCO_SCHEDULE", or None
    transport: str                       # "dma", "ccl" or "auto"
    selector: str                        # FICCO_SELECTOR (argument first)
    #: auto's measuring mode (FICCO_AUTO): every rank must explore (or measure up front) alike
    auto_mode: str
    #: tune measures each candidate collectively: every rank must measure the same list
    tune_candidates: tuple[str, ...] | None
    profile: str | None                  # FICCO_PROFILE, then the identity of the one in force
    topology: str | None
    copy_engines: int | None
    symm: str | None
    signal_pads: str | None
    #: the selector prices one hardware queue differently: agreed
    hardware_queues: tuple[int | None, int | None]
    backward_gather: str | None
    paper: tuple[float, float]
    # how long a rank waits, and whether it poisons its buffers: not agreed
    timeout_s: float
    poison: bool

    #: settings that change how long or how loudly a rank works, not what it computes
    NOT_AGREED: ClassVar[frozenset[str]] = frozenset({"schedule_by", "timeout_s", "poison"})
    #: the settings a Decision depends on (the transport enters through the candidate
    #: transports; timeout, log level and poisoning change how a call runs, not what it picks)
    DECIDING: ClassVar[tuple[str, ...]] = ("selector", "schedule", "schedule_by", "profile",
                                           "topology", "copy_engines", "paper",
                                           "tune_candidates", "auto_mode")

    def agreed(self) -> dict[str, Any]:
        """The settings every rank must share, by name (part of the call's signature)."""
        return {f: getattr(self, f) for f in self.__slots__ if f not in self.NOT_AGREED}

    def deciding(self) -> tuple:
        """The values of :attr:`DECIDING` (part of a decision's key)."""
        return tuple(getattr(self, f) for f in self.DECIDING)

    def replace(self, **changes: Any) -> Settings:
        """These settings with ``changes``."""
        return dataclasses.replace(self, **changes)


def settings(schedule: str | None = None, transport: str | None = None,
             selector: str | None = None) -> Settings:
    """Every setting that changes what a rank does, read and validated now (before any
    communication) so a bad value fails on its own rank, and so ranks can agree on them.
    Settings that only change how long or how loudly a rank works (timeout, log, poison,
    cache directory) are validated here but not agreed; the backend is agreed through the
    op's signature (its target)."""
    knobs = {env: knob.read() for env, knob in config.KNOBS.items()}   # every value checked
    config.warn_unknown()
    check_environment(knobs)
    low, high = config.paper_thresholds()
    return Settings(
        disable=knobs["FICCO_DISABLE"],
        schedule=schedule if schedule is not None else knobs["FICCO_SCHEDULE"],
        schedule_by="argument" if schedule is not None else (
            "FICCO_SCHEDULE" if knobs["FICCO_SCHEDULE"] else None),
        transport=transport or knobs["FICCO_TRANSPORT"],
        selector=selector or knobs["FICCO_SELECTOR"],
        auto_mode=knobs["FICCO_AUTO"],
        tune_candidates=knobs["FICCO_TUNE_CANDIDATES"],
        profile=knobs["FICCO_PROFILE"],
        topology=knobs["FICCO_TOPOLOGY"],
        copy_engines=knobs["FICCO_COPY_ENGINES"],
        symm=knobs.get("FICCO_SYMM"),
        signal_pads=knobs.get("FICCO_SIGNAL_PADS"),
        hardware_queues=(config.hardware_queues("cuda"), config.hardware_queues("rocm")),
        backward_gather=knobs.get("FICCO_BACKWARD_GATHER"),
        paper=(low, high),
        timeout_s=knobs["FICCO_TIMEOUT"],
        poison=knobs["FICCO_POISON"],
    )
