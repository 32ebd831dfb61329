"""``python -m ficco selftest``: ficco checks itself where it runs (ficco/selftest); ``python
-m ficco demo``: the end-to-end demo on CPU ranks (ficco/demo.py). Benchmarks live under
``python -m ficco.bench``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ficco")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="verb", required=True)
    demo = sub.add_parser("demo", help="run every schedule on 4 CPU ranks and check the results")
    demo.add_argument("--world", type=_ranks, default=4, help="number of CPU ranks (default 4)")
    sub.add_parser("selftest", add_help=False,
                   help="check ficco on this machine: every schedule vs float64, faults, a "
                        "graph replay, timings, the environment (--help for its options)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["selftest"]:
        from .selftest import main as selftest_main

        return selftest_main(argv[1:])
    args = parser.parse_args(argv)
    from .demo import main as demo_main

    return demo_main(args.world)


def version() -> str:
    """What ``--version`` prints: ficco's version and the torch it runs on.

    >>> version().startswith("ficco ")
    True
    """
    import torch

    from . import __version__

    return f"ficco {__version__} (torch {torch.__version__})"


def _ranks(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 rank; got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
