"""Loads and stores of a *word* that another agent changes while a kernel runs: the group's
error word (host memory a host thread or a peer process raises), polled by the fence and the
gated GEMM, and raised by the gated GEMM itself when it gives up.

Such a load must go to memory at every poll, on every Triton ficco accepts:

- NVIDIA: ``volatile=True`` compiles to ``ld.volatile.global`` (Triton 3.6 and 3.9);
- AMD: ``volatile=True`` is not enough. On Triton 3.6 and 3.8 a volatile load of a uniform
  address compiles to ``s_load_dword`` (through the scalar cache, never refreshed while the
  kernel runs) on gfx942; ``cache_modifier=".cv"`` compiles to ``global_load_dword ... sc0
  sc1`` on gfx942/gfx950 and ``... glc`` on gfx90a with 3.6 and 3.9 alike.

A store that peers or the host must see is write-through (``cache_modifier=".wt"``:
``st.global.wt``; ``global_store_dword ... sc0 sc1``). ``tests/engine/test_kernel_words.py`` checks
the compiled loads and stores of both kernels for sm_90, gfx90a and gfx942.

Both are Triton *builtins* (as :func:`ficco.kernels.trace.read_clock`): the compiler calls them
with its ``_semantic``, the interpreter as plain Python.
"""
from __future__ import annotations

import triton.language as tl  # optional extra: imported only with the kernels


def load_word(pointer, amd, mask=None, _semantic=None):
    """The int32 at ``pointer``, read from memory now (``amd``: a constexpr, the target is
    AMD). ``pointer`` may be a vector of one address with a ``mask`` naming the elements
    that read it (the others are 0): the gated GEMM's one reader per program."""
    other = None if mask is None else 0
    if tl.core._unwrap_if_constexpr(amd):
        return tl.load(pointer, mask=mask, other=other, cache_modifier=".cv",
                       _semantic=_semantic)
    return tl.load(pointer, mask=mask, other=other, volatile=True, _semantic=_semantic)


def store_word(pointer, value, _semantic=None):
    """Write ``value`` at ``pointer`` through every cache, so the host and peers see it."""
    return tl.store(pointer, value, cache_modifier=".wt", _semantic=_semantic)


setattr(load_word, tl.core.TRITON_BUILTIN, True)
setattr(store_word, tl.core.TRITON_BUILTIN, True)
