"""What ``selftest`` says about the machine it ran on, for the bundle a user attaches to a bug
report: versions (ficco, Python, torch, its CUDA/HIP, Triton, the bindings, the driver), the
backend and its target, every rank's device and where it sits, peer access and copy engines,
the signal pads and every FICCO_* setting. Each fact is read defensively: a missing tool is a
value ("unknown: why"), never an exception."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess

import torch


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(*cmd: str) -> str:
    if shutil.which(cmd[0]) is None:
        return f"unknown: no {cmd[0]}"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
        return (done.stdout or done.stderr).strip()[:2000]
    except Exception as exc:  # noqa: BLE001 - a fact, not a failure
        return f"unknown: {type(exc).__name__}: {exc}"


def _driver() -> str:
    if torch.version.hip:
        path = "/sys/module/amdgpu/version"
        if os.path.exists(path):
            with open(path) as fh:
                return f"amdgpu {fh.read().strip()}"
        return _run("rocm-smi", "--showdriverversion")
    try:
        from cuda.bindings import driver

        status, version = driver.cuDriverGetVersion()
        if int(status) == 0:
            return f"CUDA driver API {version // 1000}.{version % 1000 // 10}; " + \
                _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    except Exception:  # noqa: BLE001, S110 - no bindings: nvidia-smi alone
        pass
    return _run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")


def _copy_engines(index: int) -> str:
    if torch.version.hip:
        return "unknown (HIP does not report its SDMA engines)"
    try:
        from cuda.bindings import runtime

        status, count = runtime.cudaDeviceGetAttribute(
            runtime.cudaDeviceAttr.cudaDevAttrAsyncEngineCount, index)
        return str(count) if int(status) == 0 else f"unknown: status {status}"
    except Exception as exc:  # noqa: BLE001 - a fact, not a failure
        return f"unknown: {type(exc).__name__}"


def local_facts(rank: int) -> dict:
    """What this rank sees of its own device and process."""
    import socket

    from ..backends import get_backend

    backend = get_backend()
    facts = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
             "backend": backend.name, "target": backend.target(), "device": str(backend.device())}
    if backend.name in ("cuda", "rocm"):
        from ..symm_mem.device import device_identity

        index = backend.device().index or 0
        props = backend.device_module().get_device_properties(index)
        facts.update(name=props.name, identity=device_identity(index, backend.device_module()),
                     compute_units=props.multi_processor_count,
                     memory_gib=round(getattr(props, "total_memory", 0) / 2 ** 30, 1),
                     copy_engines=_copy_engines(index))
    return facts


def global_facts() -> dict:
    """Versions, topology and settings (rank 0 reports them once)."""
    import ficco

    from .. import config, kernels
    from ..backends import get_backend
    from ..heuristics import profiles

    backend = get_backend()
    target = backend.target()
    facts: dict = {
        "ficco": ficco.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "torch_hip": torch.version.hip,
        "triton": _version("triton") or _version("pytorch-triton-rocm"),
        "triton_for_kernels": kernels.triton_reason() or "ok",
        "cuda_bindings": _version("cuda-bindings"), "cuda_python": _version("cuda-python"),
        "hip_python": _version("hip-python"),
        "backend": backend.name, "target": target,
        "gated_gemm": kernels.selectable_reason(target) or "offered to selectors",
        "signal_pads": config.get("FICCO_SIGNAL_PADS"),
        "settings": {k: v for k, v in sorted(os.environ.items())
                     if k.startswith(("FICCO_", "CUDA_DEVICE_MAX_CONNECTIONS", "GPU_MAX_HW",
                                      "CUDA_VISIBLE", "HIP_VISIBLE", "ROCR_VISIBLE"))},
    }
    try:
        profile = profiles.resolve(target)
        facts["profile"] = profile.name
        facts["topology"] = config.topology() or profile.topology
    except Exception as exc:  # noqa: BLE001 - a fact, not a failure
        facts["profile"] = f"unknown: {type(exc).__name__}: {exc}"
    if backend.name in ("cuda", "rocm"):
        count = torch.cuda.device_count()
        facts["driver"] = _driver()
        facts["devices"] = count
        facts["peer_access"] = [[i == j or torch.cuda.can_device_access_peer(i, j)
                                 for j in range(count)] for i in range(min(count, 16))]
        facts["topology_matrix"] = _run("nvidia-smi", "topo", "-m") if not torch.version.hip \
            else _run("rocm-smi", "--showtopo")
    return facts


def pads_facts(group) -> dict:
    """Where the group's signal pads and error words live and whether every rank's memory is
    a view (after a dma call made the workspace; GPUs only)."""
    from ..backends import get_backend
    from ..group import resolve
    from ..runtime.session import peek

    session = peek(resolve(group), get_backend())
    handle = None if session is None else session.workspace
    if handle is None or not hasattr(handle, "view_problems"):
        return {"pads": "no GPU workspace"}
    return {"pads": "host" if handle.host_pads is not None else "device",
            "ranks_on_this_gpu": handle.device_sharers,
            "view_problems": handle.view_problems()}
