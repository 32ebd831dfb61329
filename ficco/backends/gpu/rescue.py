"""How the barrier watchdog (:mod:`ficco.backends.gpu.watchdog`) reaches a GPU's signal pads
without ever blocking on a stream.

A stream stuck in a barrier wait blocks every stream that shares its hardware queue
(``CUDA_DEVICE_MAX_CONNECTIONS=1`` always; otherwise whenever streams outnumber the queues,
ROCm's few above all). A rescue that goes through a stream and waits for it can then never
return, and a watchdog thread that blocks leaves every other barrier without a deadline.

- Host-mapped pads (``FICCO_SIGNAL_PADS=auto``, the default, and ``host``): slots are read and
  released with host loads and stores. Nothing queues; nothing can block.
- Device pads (``FICCO_SIGNAL_PADS=device``): a read is an asynchronous device-to-host copy on
  a private stream whose event the watchdog only *queries*; until it completed the slots
  count as unreadable. A release is a stream write on that private stream that nobody waits
  for. Whether it lands depends on the hardware queue it shares: the reason host pads are the
  default and ``device`` is refused with one hardware queue.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...errors import FiccoError
from ...symm_mem.device import tensor_at
from .vendor import Vendor
from .watchdog import WatchdogPort

_PROBES_KEPT = 256


class Rescue(WatchdogPort):
    """The :class:`WatchdogPort` of a GPU backend: ``bind_thread`` and ``died`` are the
    backend's; reads and releases go through host pads, or the vendor's stream writes."""

    def __init__(self, device: torch.device, vendor: Vendor, bind_thread: Callable[[], None],
                 died: Callable[[FiccoError], None], device_module: Any,
                 native: Callable[[Any], int]):
        self._device, self.vendor = device, vendor
        #: the backend's torch device module and a stream's native handle (GpuBackend's)
        self.dm, self.native = device_module, native
        self._bind, self._died = bind_thread, died
        self._stream = None
        self._probes: dict[int, tuple] = {}    # id(deadline) -> (deadline, event, host buffer)

    def bind_thread(self) -> None:
        self._bind()
        self.vendor.relax_capture_mode()

    def new_event(self):
        return self.dm.Event()

    def died(self, error: FiccoError) -> None:
        self._died(error)

    def _side(self):
        if self._stream is None:
            self._stream = self.dm.Stream(self._device)
        return self._stream

    def reader(self, deadline):
        host = deadline.handle.host_pads if deadline.handle is not None else None
        if host is not None:
            return host.read
        return self._probe(deadline)

    def _probe(self, deadline):
        """Device pads: the values of the latest read of this barrier's slots that came back
        (None before the first did), and a new read started whenever none is in flight."""
        key = id(deadline)
        probe = self._probes.get(key)
        if probe is None or probe[0] is not deadline:
            if len(self._probes) >= _PROBES_KEPT:
                self._probes.clear()
            probe = self._probes[key] = [deadline, None, None, None]   # + event, buffer, last
        _, event, buffer, last = probe
        if event is not None and event.query():
            probe[3] = last = {op.slot: int(v) for op, v in zip(deadline.waits, buffer.tolist())}
            event = None
        if event is None:
            probe[1], probe[2] = self._read_async(deadline.waits)
        return None if last is None else last.__getitem__

    def _read_async(self, waits):
        """Copy the waits' slots to host memory on the private stream; (event, buffer)."""
        side = self._side()
        buffer = torch.empty(len(waits), dtype=torch.int32,
                             pin_memory=self._device.type != "cpu")
        with self.dm.stream(side):
            for i, op in enumerate(waits):
                slot = tensor_at(op.slot, 4, self._device).view(torch.int32)
                buffer[i: i + 1].copy_(slot, non_blocking=True)
            event = self.dm.Event()
            event.record(side)
        return event, buffer

    def release(self, deadline, ops) -> None:
        host = deadline.handle.host_pads if deadline.handle is not None else None
        if host is not None:
            for op in ops:
                host.write(op.slot, op.value)
            return
        stream = self.native(self._side())
        for op in ops:     # never waited for: see the module docstring
            self.vendor.write_value32(stream, op.slot, op.value)
