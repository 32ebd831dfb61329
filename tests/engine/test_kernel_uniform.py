"""Every thread of a gated-GEMM program reaches the same CTA barriers the same number of times,
and one thread per program reads the halt word per poll: read in the kernel compiled offline
for sm_90 (Triton ships its compilers; no GPU needed) by the divergence analysis of
``tests/ptx_uniform.py``.

The gated GEMM's wait loop holds CTA barriers (the broadcast of the flag poll, the reduction
that decides the poll) and the K loop it gates holds more (the dot's). When each thread read
the halt word and ``%globaltimer`` itself and its own values decided the loop's exit (and
``ok``, which gates the K loop), warps could leave at different iterations: a kernel hang, or
shared-memory tiles read half-written. The analysis is checked first on two small kernels that
differ only in who decides."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

import triton.language as tl

from ficco import kernels

from ..ptx_uniform import divergent_barriers, volatile_loads

pytestmark = pytest.mark.skipif(kernels.triton_reason() is not None,
                                reason=str(kernels.triton_reason()))

from ficco.kernels.gated_gemm import BIGGER, POLL
from ficco.kernels.trace import TRACE_GLOBALTIMER, read_clock
from ficco.kernels.words import load_word

NV_CLOCK = tl.constexpr(TRACE_GLOBALTIMER)   # (a kernel reads constexpr globals only)
LANES = tl.constexpr(POLL)


def _each_thread_decides(word, out, ticks, CLOCK: tl.constexpr):
    """Spins while the word is 0 (or, CLOCK, until ``ticks`` passed), a reduction in the loop;
    every thread's own load (or clock) decides when it leaves."""
    x = tl.arange(0, LANES)
    total = 0
    i = 0
    began = read_clock(NV_CLOCK, out)
    if CLOCK:
        while read_clock(NV_CLOCK, out) - began < ticks:
            total += tl.reduce(x + i, 0, BIGGER)
            i += 1
    else:
        while load_word(word, False) == 0:
            total += tl.reduce(x + i, 0, BIGGER)
            i += 1
    tl.store(out, total)


def _one_thread_decides(word, out, ticks, CLOCK: tl.constexpr):
    """The same loops, their exit decided by one thread's reads and handed to all by a
    block-wide reduction (the gated GEMM's way)."""
    x = tl.arange(0, LANES)
    lane0 = tl.arange(0, LANES) == 0
    at0 = tl.arange(0, LANES) * 0
    total = 0
    i = 0
    began = read_clock(NV_CLOCK, out)
    stop = 0
    while stop == 0:
        total += tl.reduce(x + i, 0, BIGGER)
        i += 1
        if CLOCK:
            late = read_clock(NV_CLOCK, out) - began >= ticks
            stop = tl.reduce(tl.where(lane0 & late, 1, 0), 0, BIGGER)
        else:
            seen = load_word(word + at0, False, lane0)
            stop = tl.reduce(tl.where(lane0, seen, 0), 0, BIGGER)
    tl.store(out, total)


def _ptx(fn, clock: bool, num_warps: int = 4) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"word": "*i32", "out": "*i64", "ticks": "i64", "CLOCK": "constexpr"}
    return triton.compile(ASTSource(fn=triton.jit(fn), signature=sig,
                                    constexprs={"CLOCK": clock}),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps}).asm["ptx"]


@pytest.mark.parametrize("clock", [False, True], ids=["word", "clock"])
def test_the_analysis_finds_a_per_thread_exit_around_a_cta_barrier(clock):
    found = divergent_barriers(_ptx(_each_thread_decides, clock))
    assert any("bar.sync" in f for f in found), found
    assert divergent_barriers(_ptx(_one_thread_decides, clock)) == []


def _gated(block, warps, stages, trace=0):
    from ficco.kernels.gated_gemm import compile_offline

    return compile_offline("cuda:sm_90", "bf16", block=block, num_warps=warps,
                           num_stages=stages, trace_mode=trace)["ptx"]


#: a 4-warp and an 8-warp config of the NVIDIA family (ficco/kernels/configs.py), the first
#: also with the per-tile trace compiled in
GATED = [((128, 128, 64), 4, 4, 0), ((128, 256, 64), 8, 3, 0),
         ((128, 128, 64), 4, 4, TRACE_GLOBALTIMER)]


@pytest.mark.parametrize("block,warps,stages,trace", GATED,
                         ids=["128x128-4w", "128x256-8w", "128x128-4w-traced"])
def test_every_thread_of_a_gated_gemm_program_reaches_its_barriers_alike(block, warps, stages,
                                                                         trace):
    found = divergent_barriers(_gated(block, warps, stages, trace))
    assert found == [], "\n".join(f[:240] for f in found[:8])


def test_one_thread_per_program_reads_the_halt_word():
    """Every thread of every spinning program read the halt word (host memory, over PCIe)
    at every poll: now one thread does, its guard a function of the thread index."""
    loads = volatile_loads(_gated((128, 128, 64), 4, 4))
    assert loads and not [ld for ld, who in loads if who == "every thread"], loads
    assert any(who == "some threads" for _, who in loads), loads


def test_the_poll_vectors_span_every_thread_of_every_config():
    """The reductions that decide a poll span the CTA only if no element of the poll vectors
    is held by two threads: POLL must be at least the threads of every config."""
    from ficco.kernels import configs

    for family, warp in (("nvidia", 32), ("amd", 64)):
        assert all(c.num_warps * warp <= POLL for c in configs.for_family(family)), family


def test_no_amd_config_spills_registers_on_gfx942():
    """Every AMD config of the gated GEMM compiles for gfx942 without spilling vector
    registers to scratch (the 256 x 256 tile spilled 28 VGPRs, 116 bytes of scratch per
    thread: a slow kernel the autotuner would still time and could pick)."""
    import re

    from ficco.kernels import configs
    from ficco.kernels.gated_gemm import compile_offline

    spilled = []
    for c in configs.for_family("amd"):
        kw = c.kwargs
        text = compile_offline("rocm:gfx942", "bf16", block=(kw["BLOCK_M"], kw["BLOCK_N"],
                                                            kw["BLOCK_K"]),
                               num_warps=c.num_warps, num_stages=c.num_stages,
                               matrix_instr_nonkdim=kw["matrix_instr_nonkdim"],
                               waves_per_eu=kw["waves_per_eu"])["amdgcn"]
        scratch = [int(x) for x in re.findall(r"ScratchSize:\s*(\d+)", text)]
        spills = [int(x) for x in re.findall(r"\.vgpr_spill_count:\s*(\d+)", text)]
        if not scratch or any(scratch) or any(spills):
            spilled.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], scratch, spills))
    assert not spilled, spilled
