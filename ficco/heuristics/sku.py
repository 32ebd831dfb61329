"""Which part this is: the device's SKU from its properties, and the built-in profile for it.

One architecture covers parts that differ where the model looks: sm_90 is an H100 SXM (700 W,
HBM3, 900 GB/s NVLink), an H100 PCIe (114 SMs, 350 W, HBM2e), an H800 (NVLink cut to 400 GB/s),
an H20 (78 SMs, a seventh of the FLOP/s) or an H200; gfx942 is an MI300X or an MI325X. So the
SKU is read from what the device says about itself: its name, memory size, compute-unit count,
power limit and clock where the vendor's management library answers (``pynvml``, ``amdsmi``;
both optional). Two results:

- :attr:`Sku.id`: a stable name of exactly this part (name, memory, compute units, power
  limit), the key of a profile calibrated on it (``characterize --quick`` writes
  ``<cache>/profiles/<id>.json``; :func:`ficco.heuristics.profiles.resolve` reads it);
- :attr:`Sku.profile`: the built-in profile that fits it best, by the first rule of
  :data:`RULES` that matches (an unmatched GPU falls back to its vendor's reference part, with
  a warning).

Example::

    >>> s = sku_of(DeviceProps("cuda:sm_90", "NVIDIA H100 PCIe", 80 << 30, 114, 350.0))
    >>> s.profile, s.id
    ('h100-pcie', 'nvidia-h100-pcie-80gb-114cu-350w')
"""
from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("ficco")
GIB = 1 << 30


@dataclass(frozen=True)
class DeviceProps:
    """What a device says about itself (``target`` as the backend names it: ``cuda:sm_90``,
    ``rocm:gfx942``, ``cpu``); unknown numbers are 0 or None."""

    target: str
    name: str = ""
    memory_bytes: int = 0
    compute_units: int = 0
    power_limit_w: float | None = None
    clock_mhz: float | None = None


@dataclass(frozen=True)
class Sku:
    id: str
    profile: str
    reason: str


#: (target prefix, test of the properties, built-in profile, why); first match wins.
Rule = tuple[str, Callable[[DeviceProps], bool], str, str]


def _named(pattern: str) -> Callable[[DeviceProps], bool]:
    regex = re.compile(pattern, re.IGNORECASE)
    return lambda p: bool(regex.search(p.name))


def _pcie(p: DeviceProps) -> bool:
    return "pcie" in p.name.lower() or 0 < p.compute_units <= 114


RULES: tuple[Rule, ...] = (
    ("cuda:sm_80", lambda p: True, "a100", "sm_80"),
    ("cuda:sm_90", _named(r"\bH200\b"), "h200", "named H200"),
    ("cuda:sm_90", _named(r"\bH20\b(?!0)"), "h20", "named H20"),
    ("cuda:sm_90", lambda p: _named(r"\bH800\b")(p) and not _pcie(p), "h800", "named H800 (SXM)"),
    ("cuda:sm_90", _pcie, "h100-pcie", "PCIe form: named so, or at most 114 SMs"),
    ("cuda:sm_90", _named(r"HBM2e"), "h100-hbm2e", "SXM with HBM2e memory"),
    ("cuda:sm_90", lambda p: True, "h100", "sm_90, SXM, HBM3: the H100 reference part"),
    ("cuda:sm_100", lambda p: True, "b200", "sm_100"),
    ("rocm:gfx942", lambda p: _named(r"MI325")(p) or p.memory_bytes > 200 * GIB, "mi325x",
     "named MI325X, or more than 200 GiB"),
    ("rocm:gfx942", lambda p: True, "mi300x", "gfx942: the MI300X reference part"),
    ("rocm:gfx950", lambda p: True, "mi355x", "gfx950 (MI350X and MI355X)"),
    ("cpu", lambda p: True, "cpu", "the CPU backend"),
)
#: An unknown GPU: its vendor's reference part (with a warning).
FALLBACK = {"cuda": "h100", "rocm": "mi300x"}


def sku_of(props: DeviceProps) -> Sku:
    """The SKU of a device with these properties (module doc).

    >>> sku_of(DeviceProps("cuda:sm_90", "NVIDIA H20", 96 << 30, 78, 400.0)).profile
    'h20'
    >>> sku_of(DeviceProps("rocm:gfx942", "AMD Instinct MI300X", 192 << 30, 304)).id
    'amd-instinct-mi300x-192gb-304cu'
    """
    ident = _ident(props)
    for prefix, test, profile, why in RULES:
        if props.target.startswith(prefix) and test(props):
            return Sku(ident, profile, why)
    vendor = props.target.split(":")[0]
    if vendor in FALLBACK:
        log.warning("ficco: no built-in profile for %s (%s); using %r. Run `python -m "
                    "ficco.bench characterize --quick` once on this machine for a calibrated one",
                    props.target, props.name or "unnamed", FALLBACK[vendor])
        return Sku(ident, FALLBACK[vendor], "unknown part: the vendor's reference")
    from ..errors import ConfigError

    raise ConfigError(f"no profile for target {props.target!r}; set FICCO_PROFILE to a "
                      f"built-in profile name or a profile JSON path")


def _ident(p: DeviceProps) -> str:
    """A file-name-safe id of exactly this part; the CPU backend is ``cpu``."""
    if p.target == "cpu" or not p.name:
        return p.target.replace(":", "-")
    words = re.sub(r"[^a-z0-9]+", "-", p.name.lower()).strip("-")
    memory = f"{round(p.memory_bytes / GIB)}gb" if p.memory_bytes else ""
    if memory and memory in words.split("-"):
        memory = ""
    parts = [words, memory, f"{p.compute_units}cu" if p.compute_units else "",
             f"{round(p.power_limit_w)}w" if p.power_limit_w else ""]
    return "-".join(x for x in parts if x)


@functools.lru_cache(maxsize=8)
def local_props(target: str) -> DeviceProps:
    """This process's current device, as ``target`` names it (read once per process). No
    device (a CPU target, or a GPU target named on a machine without one, as in tests and
    ``simulate``): the target alone, which picks the architecture's reference part."""
    if not target.startswith(("cuda", "rocm")):
        return DeviceProps(target)
    try:
        import torch

        if not torch.cuda.is_available():
            return DeviceProps(target)
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        power, clock = _management_numbers(index, target)
        return DeviceProps(target, props.name, int(props.total_memory),
                           int(props.multi_processor_count), power, clock)
    except Exception:  # noqa: BLE001 - best effort: the target alone still picks a profile
        return DeviceProps(target)


def _management_numbers(index: int, target: str) -> tuple[float | None, float | None]:
    """(power limit in W, max SM clock in MHz) from pynvml or amdsmi when installed."""
    try:
        if target.startswith("cuda"):
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return (pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0,
                    float(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)))
        import amdsmi

        amdsmi.amdsmi_init()
        handle = amdsmi.amdsmi_get_processor_handles()[index]
        cap = amdsmi.amdsmi_get_power_cap_info(handle)
        return float(cap["power_cap"]) / 1e6, None
    except Exception:  # noqa: BLE001 - optional libraries, optional answers
        return None, None
