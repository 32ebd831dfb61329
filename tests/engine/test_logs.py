"""ficco's log (ficco/logs.py): the application owns logging, so the library adds no handler
that prints; it sets the ``ficco`` logger's level from FICCO_LOG and drops other ranks' records
(FICCO_LOG_RANKS, tested across ranks in tests/engine/test_heuristics.py)."""
from __future__ import annotations

import logging

from ficco import config, logs


def test_the_library_adds_no_handler_that_prints(monkeypatch):
    """Before: with nobody's logging configured, ``logs.ready()`` added a StreamHandler to the
    ``ficco`` logger, so an application could not keep ficco quiet or route its records."""
    ficco_log = logging.getLogger("ficco")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(ficco_log, "handlers", list(ficco_log.handlers))
    with config.scope(log="info"):
        assert logs.ready() is ficco_log
    assert all(isinstance(h, logging.NullHandler) for h in ficco_log.handlers), \
        ficco_log.handlers
    assert ficco_log.getEffectiveLevel() <= logging.INFO


def test_an_application_handler_sees_the_records(monkeypatch):
    """What the README tells users: FICCO_LOG=info and a handler of their own (here on the
    root logger, as ``logging.basicConfig`` makes) receive ficco's records."""
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    monkeypatch.setattr(logging.getLogger(), "handlers", [Keep()])
    with config.scope(log="info"):
        logs.ready().info("ficco test record %d", 7)
    assert seen == ["ficco test record 7"]
