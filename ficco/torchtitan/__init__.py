"""torchtitan 0.3 on ficco in one config line::

    torchrun ... -m torchtitan.train ... --override.imports ficco.torchtitan.tensor_parallel

torchtitan 0.3 no longer builds tensor parallelism from torch's ParallelStyles (so
``ficco.parallel``'s styles reach none of its modules): each module declares sharding configs,
and ``--override.imports module.function`` names an ``@override`` factory that replaces nodes of
the config tree before the model is built (torchtitan's ``overrides/fused_swiglu.py``).
:func:`tensor_parallel` is such a factory. In every transformer block it replaces

- the Q/K/V projection (fused ``wqkv`` or separate ``wq``/``wk``/``wv``): one
  ``ficco.all_gather_matmul`` of the sequence shard into every Q/K/V weight,
- the SwiGLU feed-forward: one ``all_gather_matmul`` into ``w1`` and ``w3``, then
  ``ficco.matmul_reduce_scatter`` through ``w2``,
- the attention output ``wo``: ``matmul_reduce_scatter``,

with modules that call ficco's ops on the local tensors, and sets their sharding configs as
torchtitan's own ``tp_gemm_backend="dist_gemm"`` modules do (parameters sharded as torchtitan's
stock plan shards them, so checkpoints and optimizers see the same state; no all-gather at the
attention and feed-forward boundaries: the modules gather inside their GEMMs). Nothing global is
installed: what changes is the config tree torchtitan hands it.

It needs sequence parallelism (torchtitan's default) and ``parallelism.spmd_backend =
"spmd_types"`` (0.3's default; the DTensor backends are refused). When the model is built it logs
how many TP GEMMs per layer reach ficco and warns when none do; a module that runs without a
tensor-parallel group falls back to torchtitan's own forward and warns once.

torchtitan 0.2.x has no override mechanism: there the TP plan (``apply_tp``) uses torch's styles,
and swapping them for ``ficco.parallel``'s (``PrepareModuleInput`` included) is the way in;
docs/training.md shows it. This module imports without torchtitan; :func:`tensor_parallel`
refuses a torchtitan other than 0.3 with that advice.

>>> import ficco.torchtitan
>>> ficco.torchtitan.TESTED_TORCHTITAN
'0.3.0'
"""
from __future__ import annotations

import importlib.util

from ..errors import BackendUnavailableError

#: The torchtitan release the tests run (tests/faces/test_torchtitan.py; pyproject's ``torchtitan``
#: extra pins it).
TESTED_TORCHTITAN = "0.3.0"

__all__ = ["TESTED_TORCHTITAN", "tensor_parallel"]


def tensor_parallel(cfg):
    """torchtitan ``@override`` factory (target: ``TransformerBlock.Config``): the block's
    tensor-parallel linears on ficco. Activate with ``--override.imports
    ficco.torchtitan.tensor_parallel`` (or ``Trainer.Config.override.imports``)."""
    _check_torchtitan()
    from . import modules

    return modules.replace_block(cfg)


def torchtitan_version() -> str | None:
    """The installed torchtitan's version, or None when it is not installed.

    >>> torchtitan_version() is None or torchtitan_version()[0].isdigit()
    True
    """
    if importlib.util.find_spec("torchtitan") is None:
        return None
    from importlib import metadata

    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:    # a source checkout on sys.path
        return "unknown"


def _check_torchtitan() -> None:
    version = torchtitan_version()
    if version is None:
        raise BackendUnavailableError(
            f"ficco.torchtitan.tensor_parallel needs torchtitan {TESTED_TORCHTITAN} (pip "
            f"install 'ficco[torchtitan]'); torchtitan is not installed")
    if not _has_overrides():
        raise BackendUnavailableError(
            f"ficco.torchtitan.tensor_parallel needs torchtitan 0.3 (tested: "
            f"{TESTED_TORCHTITAN}); torchtitan {version} has no override mechanism. In "
            f"torchtitan 0.2.x, import ColwiseParallel, RowwiseParallel, SequenceParallel and "
            f"PrepareModuleInput from ficco.parallel in apply_tp instead of torch's "
            f"(docs/training.md, 'torchtitan')")


def _has_overrides() -> bool:
    return importlib.util.find_spec("torchtitan.config.override") is not None


def _register() -> None:
    """Register :func:`tensor_parallel` with torchtitan's override registry, which
    ``--override.imports`` looks it up in right after importing this module. Without
    torchtitan 0.3 there is nothing to register with."""
    if importlib.util.find_spec("torchtitan") is None or not _has_overrides():
        return
    from torchtitan.config.override import _REGISTRY, override
    from torchtitan.models.common.decoder import TransformerBlock

    if f"{__name__}.tensor_parallel" in _REGISTRY:    # a reload of this module
        return
    override(target=TransformerBlock.Config,
             description="tensor-parallel linears on ficco's overlapped all-gather/"
                         "reduce-scatter GEMMs")(tensor_parallel)


_register()
