"""``--timeout SECONDS`` per test where pytest-timeout is not installed (a GPU image without
it: nothing can be installed there). Each test's call then runs under SIGALRM: past its bound
the test fails with the bound named; should the alarm not reach Python (a call blocked in C
code), the process dumps every thread's stack and exits 10 s later, so no test outlives its
bound for long. With pytest-timeout present, its own option is used and this does nothing.
tests/conftest.py imports the hooks."""
from __future__ import annotations

import faulthandler
import signal
import sys

import pytest

_OURS = {"active": False}


def pytest_addoption(parser):
    try:
        parser.addoption("--timeout", type=float, default=0.0, metavar="SECONDS",
                         help="fail a test that runs longer than SECONDS (ficco's fallback "
                              "for a missing pytest-timeout)")
    except ValueError:      # pytest-timeout's own option
        return
    _OURS["active"] = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    bound = item.config.getoption("--timeout", 0.0) if _OURS["active"] else 0.0
    if not bound or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame):
        pytest.fail(f"the test ran past its --timeout of {bound:g} s", pytrace=False)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, bound)
    faulthandler.dump_traceback_later(bound + 10, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()
