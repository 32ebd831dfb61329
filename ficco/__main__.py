"""``python -m ficco demo``: the end-to-end demo on CPU ranks (see ficco/demo.py).
Benchmarks live under ``python -m ficco.bench``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ficco")
    sub = parser.add_subparsers(dest="verb", required=True)
    demo = sub.add_parser("demo", help="run every schedule on 4 CPU ranks and check the results")
    demo.add_argument("--world", type=int, default=4, help="number of CPU ranks (default 4)")
    args = parser.parse_args(argv)
    from .demo import main as demo_main

    return demo_main(args.world)


if __name__ == "__main__":
    sys.exit(main())
