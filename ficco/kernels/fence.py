"""The fence kernel of :mod:`ficco.backends.gpu.fence`: NaN into one output when the group's
error word is raised. Its own module because it imports Triton (an optional extra) and its
globals (the word builtins) must be module globals for the interpreter too."""
from __future__ import annotations

import triton.language as tl

from .words import load_word


def fence_body(out_ptr, numel, err_ptr, BLOCK: tl.constexpr, AMD: tl.constexpr):
    # A load from memory every time (ficco.kernels.words): the
    # word is host memory a host thread wrote after this kernel's stream was released; a
    # cached, scalar or hoisted read could miss it.
    if load_word(err_ptr, AMD) != 0:
        # int64 counter and offsets: numel < 2**31 comes in as int32, and in int32
        # ``start + step`` (or ``start + arange``) near 2**31 wraps negative, passes the mask
        # and stores before the output.
        pid = tl.program_id(0).to(tl.int64)
        programs = tl.num_programs(0).to(tl.int64)
        nan = tl.full((BLOCK,), float("nan"), tl.float32)
        for start in range(pid * BLOCK, numel, programs * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            tl.store(out_ptr + offsets, nan, mask=offsets < numel)
