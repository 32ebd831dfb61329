"""A symmetric allocation as every provider hands it out (:class:`SymmHandle`), the provider
contract (:class:`Provider`) and the providers by device type (each backend registers its
own: :func:`register_provider`), and the registry of tensors made by ``ficco.symm_mem.empty``.
Kept apart from the package so its modules import these without importing the package back."""
from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .barrier import SIGNAL_CHANNELS, host_barrier

ALIGN_BYTES = 256


class SymmHandle(ABC):
    """One symmetric allocation of ``nbytes`` bytes per rank, mapped on this rank. Subclasses
    call :meth:`_init_signals` once ``rank``/``world`` are known and provide :meth:`slot`."""

    rank: int
    world: int
    nbytes: int
    backend: Any
    #: set by the runtime per call, taken by the call's first plan barrier: what its wait runs
    #: now and then to answer a peer's agreement exchange (see ficco.symm_mem.barrier)
    first_wait: Any = None
    #: GPUs: the group's error slot and error word (:class:`ficco.symm_mem.fault.GroupFault`);
    #: None where a failed barrier raises from the call itself (the CPU backend)
    fault: Any = None
    #: GPUs: :class:`ficco.symm_mem.host_pads.HostPads` when the signal pads are host memory
    host_pads: Any = None
    #: GPUs: set once a graph captured a barrier on this handle (kept mapped until exit)
    captured: bool = False

    def _init_signals(self, backend) -> None:
        self.backend = backend
        self._generation = [0] * SIGNAL_CHANNELS   # count-mode barriers, per channel
        self._programs: dict = {}                  # barrier programs (slots never move)

    @abstractmethod
    def get_buffer(self, rank: int, shape, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """``rank``'s allocation viewed as a contiguous tensor of ``shape`` starting ``offset``
        bytes in. Raises when it does not fit."""

    @abstractmethod
    def signal_pad(self, rank: int) -> torch.Tensor:
        """``rank``'s signal pad: an int32 tensor of shape ``(SIGNAL_CHANNELS, world)``."""

    @abstractmethod
    def slot(self, owner: int, channel: int, writer: int) -> Any:
        """Where ``writer`` signals ``owner`` on ``channel``, in the form the backend's
        ``signal_write``/``signal_wait`` take (a device address on GPUs)."""

    def pad_address(self, owner: int) -> int:
        """The address of ``owner``'s signal pad as a kernel of this rank reads it (the slot of
        ``[0, 0]``; kernels that run the barrier protocol themselves take it)."""
        return int(self.slot(owner, 0, 0))

    def barrier(self, channel: int = 2, timeout_s: float | None = None, step: int | None = None,
                *, timeout: float | None = None) -> None:
        """Host-side barrier over the signal pads: blocks until every rank called it for this
        channel as often as this rank has; raises CommTimeoutError naming the late peers.
        ``timeout`` (DESIGN's name) and ``timeout_s`` are the same seconds; default
        FICCO_TIMEOUT.

        >>> # h = ficco.symm_mem.rendezvous(t); h.barrier(channel=2, timeout=30)
        """
        from .. import config

        timeout_s = timeout if timeout is not None else timeout_s
        timeout_s = config.timeout_s() if timeout_s is None else timeout_s
        host_barrier(self.backend, self, channel, timeout_s, step)

    @abstractmethod
    def close(self) -> None:
        """Unmap and release everything; safe to call twice."""

    def _check_fits(self, shape, dtype: torch.dtype, offset: int) -> int:
        numel = math.prod(shape)
        need = offset + numel * torch.empty((), dtype=dtype).element_size()
        if need > self.nbytes or offset < 0:
            raise InvalidArgumentError(
                f"get_buffer(shape={tuple(shape)}, dtype={dtype}, offset={offset}) needs {need} "
                f"bytes but the symmetric allocation holds {self.nbytes}; allocate more")
        return numel


class Provider(ABC):
    """Allocates symmetric memory for one backend."""

    @abstractmethod
    def allocate(self, nbytes: int, group: Any, device: torch.device) -> SymmHandle:
        """Collective over ``group``: every rank allocates ``nbytes`` and maps all peers."""


#: device type -> (the provider, the device it allocates on by default) of the backend
#: instance that registered last for that type; None: the process's active backend's
_providers: dict[str | None, tuple[Callable[[], Provider], Callable[[], torch.device]]] = {}


def register_provider(device_type: str | None, provider: Callable[[], Provider],
                      device: Callable[[], torch.device]) -> None:
    """A backend's symmetric memory for ``device_type`` (``provider()``: its
    :class:`Provider`; ``device()``: where it allocates by default). Each backend instance
    registers when it is made; ``ficco.backends`` registers None, the active backend's."""
    _providers[device_type] = (provider, device)


def provider_for(device_type: str | None) -> tuple[Provider, torch.device]:
    """``(provider, default device)`` registered for ``device_type`` (None: the active
    backend's); raises InvalidArgumentError when no backend registered one."""
    found = _providers.get(device_type)
    if found is None:
        raise InvalidArgumentError(
            f"no backend of this process provides symmetric memory on "
            f"{device_type or 'any device'} (registered: "
            f"{', '.join(sorted(t for t in _providers if t)) or 'none'}); make a ficco call "
            f"or ficco.backends.get_backend() first")
    return found[0](), found[1]()


_owned: weakref.WeakValueDictionary[int, SymmHandle] = weakref.WeakValueDictionary()


def owner_of(tensor: torch.Tensor) -> SymmHandle | None:
    ptr = tensor.untyped_storage().data_ptr()
    return _owned.get(ptr)


def register_local(handle: SymmHandle, local: torch.Tensor) -> None:
    """Remember that ``local`` (this rank's part of ``handle``) lives in symmetric memory, so
    :func:`rendezvous` finds its handle. (``all_gather_matmul`` still publishes such a tensor
    into its workspace with one copy: using it in place needs plans that read peers' inputs.)"""
    _owned[local.untyped_storage().data_ptr()] = handle


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
