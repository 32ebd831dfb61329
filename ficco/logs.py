"""ficco's log: the ``ficco`` logger, at ``FICCO_LOG``'s level, from rank 0 only.

Every rank of a job makes the same decisions, so W ranks logging them say the same thing W
times: records come from the process whose default-group rank is 0 (or a process without a
process group) unless ``FICCO_LOG_RANKS=all``. Both settings are read per record, never at
import.

The application owns logging: ficco adds no handler that prints (only the ``NullHandler`` a
library puts on its logger), so its records go wherever the application's handlers send them,
e.g. ``logging.basicConfig(level=logging.INFO)`` with ``FICCO_LOG=info``.

>>> import ficco.logs
>>> ficco.logs.log.name
'ficco'
"""
from __future__ import annotations

import logging

from . import config

log = logging.getLogger("ficco")


def ready() -> logging.Logger:
    """The logger, at ``FICCO_LOG``'s level (lowered to it, never raised)."""
    level = config.log_level()
    wanted = {"debug": logging.DEBUG, "info": logging.INFO}.get(level)
    if wanted is not None and log.getEffectiveLevel() > wanted:
        log.setLevel(wanted)
    return log


class _FromRankZero(logging.Filter):
    """Drops the records of every rank but 0 unless FICCO_LOG_RANKS=all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if config.log_ranks() == "all":
            return True
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


if not any(isinstance(f, _FromRankZero) for f in log.filters):
    log.addFilter(_FromRankZero())
if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
    log.addHandler(logging.NullHandler())
