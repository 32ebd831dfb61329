"""ficco's log: the ``ficco`` logger, at ``FICCO_LOG``'s level, from rank 0 only.

Every rank of a job makes the same decisions, so W ranks logging them say the same thing W
times: records come from the process whose default-group rank is 0 (or a process without a
process group) unless ``FICCO_LOG_RANKS=all``. Both settings are read per record, never at
import.

>>> import ficco.logs
>>> ficco.logs.log.name
'ficco'
"""
from __future__ import annotations

import logging

from . import config

log = logging.getLogger("ficco")


def ready() -> logging.Logger:
    """The logger, at ``FICCO_LOG``'s level, with a handler when nobody configured logging
    (Python would drop INFO records without one)."""
    level = config.log_level()
    wanted = {"debug": logging.DEBUG, "info": logging.INFO}.get(level)
    if wanted is not None and log.getEffectiveLevel() > wanted:
        log.setLevel(wanted)
    if not log.handlers and not logging.getLogger().handlers:
        log.addHandler(logging.StreamHandler())
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
