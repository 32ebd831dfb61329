"""Tile configurations the gated GEMM's autotuner tries, per device family.

A few configs per family, not a sweep: the autotuner times each once per (N, K, M, dtype)
key on the first call of a shape (with every arrival flag preset, so waiting never enters a
timing) and remembers the winner for the process, as Triton does. The families differ where
the hardware does: NVIDIA Hopper/Ampere like 128x128/128x256 tiles with 3-4 pipeline stages;
AMD CDNA3 (MI300-class) wants larger 256-wide tiles, 2 stages (LDS is the limit) and the 16x16
MFMA shape, short of spilling registers (a 256 x 256 tile spills on gfx942).

>>> family("cuda:sm_90"), family("rocm:gfx942"), family("cpu")
('nvidia', 'amd', 'cpu')
"""
from __future__ import annotations

#: the one tile shape the interpreter runs (CPU correctness runs; speed means nothing there)
INTERPRETER = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}

_NVIDIA = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (128, 128, 64, 4, 4),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (64, 128, 64, 4, 4),     # small M per segment (decode-like shards, 1d chunks of few rows)
]
_AMD = [
    # (256, 256, 64, 8, 2) spilled on gfx942 (28 VGPRs, 116 bytes of scratch per thread, Triton
    # 3.9; 256x256x32 too): 256 x 128 is its no-spill neighbour (tests/test_kernel_uniform.py)
    (256, 128, 64, 8, 2),
    (128, 256, 64, 8, 2),
    (128, 128, 64, 4, 2),
    (64, 128, 64, 4, 2),
]


def block_shapes(name: str) -> list[tuple[int, int]]:
    """(BLOCK_M, BLOCK_N) of every config of family ``name`` (no Triton needed).

    >>> block_shapes("cpu")
    [(32, 32)]
    """
    table = {"nvidia": _NVIDIA, "amd": _AMD}.get(name)
    if table is None:
        return [(INTERPRETER["BLOCK_M"], INTERPRETER["BLOCK_N"])]
    return [(m, n) for m, n, *_ in table]


def resident_programs(compute_units: int, sharers: int = 1) -> int:
    """Most programs of the gated GEMM resident at once on a device with ``compute_units``
    SMs/CUs, when ``sharers`` ranks launch it on that device at once: all but a reserve (1/32
    of them, at least one), split between the sharers. Its tiles spin while their data is
    missing; whatever must run for the data to arrive and needs a compute unit (ROCm's stream
    memory operations and 2-D copies, same-device copies on one GPU) keeps at least the
    reserve, also when several processes share the GPU (each
    taking all but the reserve would together fill every unit). The persistent grid walks
    tiles in arrival order.

    >>> resident_programs(132), resident_programs(304), resident_programs(2)
    (128, 295, 1)
    >>> resident_programs(132, sharers=4), resident_programs(16, sharers=32)
    (32, 1)
    """
    return max(1, (compute_units - max(1, compute_units // 32)) // max(1, sharers))


def family(target: str) -> str:
    """The config family of a backend target string ("cuda:sm_90" -> "nvidia")."""
    if target.startswith("cuda"):
        return "nvidia"
    if target.startswith(("rocm", "hip")):
        return "amd"
    return "cpu"


def for_family(name: str) -> list:
    """``triton.Config`` list for family ``name`` (imports Triton: call only where it is)."""
    import triton

    if name == "nvidia":
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w,
                              num_stages=s) for m, n, k, w, s in _NVIDIA]
    if name == "amd":
        # matrix_instr_nonkdim / waves_per_eu are AMD backend options of triton.Config kwargs.
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k,
                               "matrix_instr_nonkdim": 16, "waves_per_eu": 0},
                              num_warps=w, num_stages=s) for m, n, k, w, s in _AMD]
    return [triton.Config(dict(INTERPRETER), num_warps=4, num_stages=1)]


def current_target() -> str:
    """The target string of torch's current GPU ("cuda:sm_90", "rocm:gfx942"), else "cpu"."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    if torch.version.hip:
        return "rocm:" + torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
    major, minor = torch.cuda.get_device_capability()
    return f"cuda:sm_{major}{minor}"
