"""The one-kernel all-reduce compiled for GPU targets without a GPU (Triton ships its own
LLVM and assemblers): it builds for sm_90 and gfx942, its flags go out as system-scope release
exchanges and come back through acquire loads, its polls read memory every time, its waits
read the device clock, and its decisions are block-wide reductions (shared memory and CTA
barriers), so every warp of a program leaves a wait together."""
from __future__ import annotations

import re

import pytest

from ficco import kernels

pytestmark = pytest.mark.skipif(kernels.triton_reason() is not None, reason="needs Triton")


@pytest.fixture(scope="module")
def ptx():
    from ficco.kernels.all_reduce import compile_offline

    return {shot: compile_offline("cuda:sm_90", world=4, two_shot=shot)["ptx"]
            for shot in (False, True)}


def test_sm90_flags_are_system_scope_releases_and_acquires(ptx):
    for two_shot, text in ptx.items():
        barriers = 3 if two_shot else 2
        releases = re.findall(r"atom\.global\.sys\.release\.exch\.b32", text)
        acquires = re.findall(r"ld\.global\.sys\.acquire\.b32", text)
        assert len(releases) == 4 * barriers, (two_shot, len(releases))   # W flags each
        assert len(acquires) == 4 * (barriers - 1), (two_shot, len(acquires))
        assert "ld.volatile.global" in text and "%globaltimer" in text
        assert "st.global.wt" in text       # the halt word a give-up raises
        # the waits' decisions: reductions across the program's warps (shared memory, bar.sync)
        assert text.count("bar.sync") >= 3 * barriers and "shfl.sync" in text


def test_gfx942_polls_bypass_the_caches():
    from ficco.kernels.all_reduce import compile_offline

    text = compile_offline("rocm:gfx942", world=4)["amdgcn"]
    loads = [line for line in text.splitlines() if "global_load_dword" in line]
    assert loads and any("sc0 sc1" in line for line in loads)
    assert "s_memrealtime" in text and "s_barrier" in text
