"""Entry point: ``python -m ficco.bench {sweep,characterize,simulate,timeline} --help``.

Each verb is a module of this package with ``add_arguments(parser)`` and ``main(args) -> int``;
modules are imported only when their verb runs, so one verb's optional dependency (matplotlib,
a GPU runtime) never breaks another.
"""
from __future__ import annotations

import argparse
import importlib
import sys

VERBS = {
    "sweep": "measure every schedule and the baselines on the live group (run under torchrun)",
    "characterize": "measure DIL, copy efficiency and CIL on one device; write a profile JSON",
    "simulate": "predict every schedule's time on a device profile, no GPU needed",
    "timeline": "draw one measured call per queue next to the simulator's prediction",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ficco.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, help_text in VERBS.items():
        sub_parser = sub.add_parser(verb, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=f"ficco.bench.{verb}")
        # A verb's own arguments are attached only when it is the one asked for.
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(args._module)
    verb_parser = argparse.ArgumentParser(prog=f"python -m ficco.bench {args.verb}",
                                          description=VERBS[args.verb])
    module.add_arguments(verb_parser)
    return int(module.main(verb_parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
