"""ficco inside the tensor-parallel code people already run, one documented line each:

- :mod:`ficco.integrations.transformers`: Hugging Face transformers' tensor and expert
  parallelism (``DistributedConfig``, the models' ``tp_plan`` / ``ep_plan``):
  ``ficco.integrations.transformers.use_ficco()``, or ficco's style names in a plan.
- :mod:`ficco.integrations.megatron`: Megatron-core's layer specs:
  ``spec = ficco.integrations.megatron.use_ficco(get_gpt_layer_local_spec())``.

(torchtitan has its own: :mod:`ficco.torchtitan`.) Each module imports without its client and
declares the client release it is tested with; on another release outside the supported range
its entry points raise :class:`~ficco.errors.BackendUnavailableError` naming the range. The
modules load when first used (``ficco.integrations.megatron`` after ``import ficco``);
importing this package imports no client:

>>> import ficco.integrations
>>> sorted(ficco.integrations.CLIENTS)
['megatron', 'transformers']
"""
from __future__ import annotations

import importlib
import importlib.util

#: Module -> (distribution, the release its tests run, the supported releases ``[low, high)``):
#: one place for both (the modules read them; pyproject's extras and the Makefile pin the
#: tested ones, which the tests check).
CLIENTS = {
    "transformers": ("transformers", "5.24.0", ("5.24", "5.25")),
    "megatron": ("megatron-core", "0.16.1", ("0.16", "0.17")),
}

__all__ = ["CLIENTS"]


def __getattr__(name: str):
    """``ficco.integrations.<module>`` imported on first use (PEP 562)."""
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
