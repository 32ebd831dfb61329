"""Triton kernels of ficco (optional: ``pip install ficco[triton]``).

Two kernels: the signal-gated GEMM (:mod:`ficco.kernels.gated_gemm`) the ``gated-1d`` /
``gated-2d`` schedules launch once per call, and the one-kernel all-reduce
(:mod:`ficco.kernels.all_reduce`) of ``one-shot-kernel`` / ``two-shot-kernel``. Importing this
package never imports Triton; :func:`unavailable_reason` says whether the kernels can run for
a backend target::

    >>> from ficco import kernels
    >>> kernels.unavailable_reason("cuda:sm_70") is not None      # too old, or no Triton
    True
"""
from __future__ import annotations

import functools
import importlib.util
import threading

#: Triton's oldest version these kernels run on: the device-clock and word builtins
#: (:mod:`.trace`, :mod:`.words`) need its ``_semantic`` builtin convention (3.4).
MIN_TRITON = (3, 4)
#: The newest Triton whose code generation for the words another agent changes was checked
#: (``tests/engine/test_kernel_words.py``: volatile or ``.cv`` loads, write-through stores on sm_90,
#: gfx90a, gfx942; checked on 3.6 and 3.9). A newer one is refused until the
#: test passed on it: a plain load there would let a kernel miss its group's failure.
MAX_TRITON = (3, 9)
#: ... and the oldest whose interpreter (CPU) runs them: Triton 3.6's rejects the persistent
#: loop over tiles (``range(pid, tiles, programs)``) and the fence's loads.
MIN_TRITON_INTERPRETER = (3, 8)

#: Backend targets (prefixes) the gated GEMM has been *verified* on: the GPU suite passed and
#: ``python -m ficco.bench kernels gpu`` measured it (docs/kernels.md). Selectors offer the
#: gated schedules only there, so the default selector never picks a kernel no GPU ran yet; a
#: forced ``schedule="gated-1d"`` (or FICCO_SCHEDULE, FICCO_TUNE_CANDIDATES) runs it anywhere
#: :func:`unavailable_reason` allows. Empty until a lent GPU has run those commands.
VERIFIED_TARGETS: tuple[str, ...] = ()
#: The same for the one-kernel all-reduce (``one-shot-kernel``, ``two-shot-kernel``): targets
#: where the GPU suite ran it and the decode benchmark timed it. Empty until a lent GPU has.
ALL_REDUCE_VERIFIED_TARGETS: tuple[str, ...] = ()


def _major_minor(version: str) -> tuple[int, ...]:
    """``(3, 6)`` of ``"3.6.0"``: of the first two dot-separated parts, those of digits only."""
    return tuple(int(x) for x in version.split(".")[:2] if x.isdigit())


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@functools.cache
def triton_reason() -> str | None:
    """None when a usable Triton imports, else why not and how to fix it."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed: pip install 'ficco[triton]' (or the triton wheel " \
               "matching your torch build)"
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - a broken install is reported, not raised
        return f"Triton is installed but does not import ({type(exc).__name__}: {exc})"
    version = _major_minor(triton.__version__)
    if version < MIN_TRITON:
        return f"Triton {triton.__version__} is too old; ficco's kernels need >= " \
               f"{_dotted(MIN_TRITON)}"
    if version > MAX_TRITON:
        return (f"Triton {triton.__version__} is newer than the newest ficco's kernels were "
                f"checked against ({_dotted(MAX_TRITON)}): whether its loads of "
                f"the group's error word still go to memory is unverified "
                f"(tests/engine/test_kernel_words.py decides; then raise ficco.kernels.MAX_TRITON)")
    return None


def unavailable_reason(target: str) -> str | None:
    """None when the gated GEMM can run on backend ``target`` ("cpu", "cuda:sm_90",
    "rocm:gfx942", ...), else one sentence why not. CPU runs it in Triton's interpreter
    (correctness only); NVIDIA needs sm_80 or newer, AMD a CDNA (gfx9xx) or RDNA3+ GPU."""
    reason = triton_reason()
    if reason is not None:
        return reason
    kind, _, arch = target.partition(":")
    if kind == "cuda":
        digits = "".join(ch for ch in arch if ch.isdigit())
        if digits and int(digits) < 80:
            return f"the gated GEMM needs an NVIDIA GPU of sm_80 or newer; this is {arch}"
        return None
    if kind in ("rocm", "hip"):
        if arch and not arch.startswith(("gfx9", "gfx11", "gfx12")):
            return f"the gated GEMM is not built for AMD {arch}; it needs gfx9xx/gfx11xx/gfx12xx"
        return None
    if kind == "cpu":
        return interpreter_reason()
    return f"no Triton backend for target {target!r}"


def all_reduce_unavailable_reason(target: str) -> str | None:
    """None when the one-kernel all-reduce can run on backend ``target``: where the gated GEMM
    can (:func:`unavailable_reason`: the same Triton, clock and word builtins)."""
    reason = unavailable_reason(target)
    return None if reason is None else reason.replace("the gated GEMM", "the one-kernel all-reduce")


def all_reduce_selectable_reason(target: str) -> str | None:
    """Why selectors do not offer ``one-shot-kernel`` / ``two-shot-kernel`` on ``target``
    (None: they may): the interpreter on CPU, or no GPU verified it there yet."""
    reason = all_reduce_unavailable_reason(target)
    if reason is None and target.partition(":")[0] == "cpu":
        return "the CPU backend runs Triton kernels in the interpreter (correctness only), " \
               "so selectors do not offer the one-kernel all-reduce on CPU; force it to run it"
    if reason is None and not target.startswith(ALL_REDUCE_VERIFIED_TARGETS):
        return (f"the one-kernel all-reduce has not been verified on {target} yet (GPU suite "
                f"and decode benchmark, docs/kernels.md), so selectors do not offer it there; "
                f"force schedule='one-shot-kernel'/'two-shot-kernel' to run it")
    return reason


def interpreter_reason() -> str | None:
    """None when Triton's interpreter runs the gated GEMM and the fence on CPU, else why not."""
    import triton

    version = _major_minor(triton.__version__)
    if version < MIN_TRITON_INTERPRETER:
        return (f"Triton {triton.__version__}'s interpreter cannot run the gated GEMM on CPU "
                f"(it rejects the kernel's persistent loop over tiles and the fence's loads); "
                f"the CPU backend needs Triton >= "
                f"{_dotted(MIN_TRITON_INTERPRETER)} for it")
    return None


def selectable_reason(target: str) -> str | None:
    """Like :func:`unavailable_reason`, but for selectors: on CPU the kernel runs in the
    interpreter, far slower than a torch GEMM, so selectors never pick it there (a forced
    ``schedule="gated-1d"`` still runs)."""
    reason = unavailable_reason(target)
    if reason is None and target.partition(":")[0] == "cpu":
        return "the CPU backend runs Triton kernels in the interpreter (correctness only), " \
               "so selectors do not offer gated schedules on CPU; force one to run it"
    if reason is None and not target.startswith(VERIFIED_TARGETS):
        return (f"the gated GEMM has not been verified on {target} yet (GPU suite and kernel "
                f"benchmark, docs/kernels.md), so selectors do not offer it there; force "
                f"schedule='gated-1d'/'gated-2d' (or FICCO_TUNE_CANDIDATES) to run it")
    return reason


#: Held by every launch of a kernel in Triton's interpreter (:func:`interpreted`).
_INTERPRETER_LOCK = threading.Lock()


class _OneAtATime:
    """An interpreted kernel whose launches (``kernel[grid](*args)``) run one at a time."""

    def __init__(self, function):
        self.function = function

    def __getitem__(self, grid):
        launch = self.function[grid]

        def run(*args, **kwargs):
            with _INTERPRETER_LOCK:
                return launch(*args, **kwargs)
        return run


def interpreted(body):
    """The kernel function ``body`` built for Triton's interpreter (CPU tensors), whatever
    TRITON_INTERPRET says, launched as ``kernel[grid](*args)``, one launch at a time in this
    process. The interpreter patches ``triton.language`` process-wide for the length of a
    launch and keeps the running program's id in one global, so two launches at once (the
    compute workers of two CPU sessions, two fake-GPU streams) make one fail when the other
    restores the patches, or read the other's program ids. A gated GEMM waiting inside the
    lock waits for flags that copy workers raise, never for another interpreted kernel."""
    from triton.runtime.interpreter import InterpretedFunction

    return _OneAtATime(InterpretedFunction(body))


__all__ = ["ALL_REDUCE_VERIFIED_TARGETS", "MAX_TRITON", "MIN_TRITON", "MIN_TRITON_INTERPRETER", "all_reduce_selectable_reason",
           "all_reduce_unavailable_reason", "interpreted",
           "interpreter_reason", "selectable_reason", "triton_reason", "unavailable_reason"]
