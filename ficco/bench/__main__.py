"""Entry point: ``python -m ficco.bench {sweep,characterize,simulate,timeline,...} --help``.

Each verb is a module of this package with ``add_arguments(parser)``, ``main(args) -> int``
and ``EXAMPLES`` (shown under ``--help``). Only the module of the verb asked for is imported,
so one verb's optional dependency (matplotlib, a GPU runtime) never breaks another.

    python -m ficco.bench --help              # the verbs
    python -m ficco.bench sweep --help        # one verb's options, defaults and examples
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from ..__main__ import version
from ..errors import FiccoError
from .cli import BenchUsageError, report_usage_error

VERBS = {
    "sweep": "measure every schedule and the baselines on the live group (run under torchrun)",
    "characterize": "measure DIL, copy efficiency and CIL on one device; write a profile JSON",
    "simulate": "predict every schedule's time on a device profile, no GPU needed",
    "timeline": "draw one measured call per queue above the simulator's prediction "
                "(run under torchrun)",
    "validate": "hold the simulator against the paper's Table I picks and published results",
    "calls": "count the Python calls and serialisations of one warm call inside ficco",
    "overhead": "host time to enqueue one W=8 call per op and schedule (null backend or a GPU)",
    "kernels": "the gated GEMM alone: vs torch.matmul, one-device timelines, offline compile",
    "default": "the default choice (no settings) against the better serial on CPU ranks, "
               "every op, tiny/GEMM-bound/copy-bound shapes",
    "decode": "simulated tensor-parallel decode: matmul_all_reduce's picks and the one-kernel "
              "all-reduce against published custom all-reduces (docs/all_reduce.md's table)",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks and appends each option's default where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False \
                or default is argparse.SUPPRESS or not action.option_strings or default == []:
            return text
        return f"{text} (default: %(default)s)"


def verbs() -> dict[str, str]:
    """The verbs whose module exists in this install."""
    return {v: h for v, h in VERBS.items() if importlib.util.find_spec(f"ficco.bench.{v}")}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The CLI parser; ``verb``'s module is imported and its options attached."""
    available = verbs()
    parser = argparse.ArgumentParser(
        prog="python -m ficco.bench", formatter_class=HelpFormatter,
        description="ficco's benchmarks. '<verb> --help' lists a verb's options.",
        epilog="examples:\n  python -m ficco.bench simulate --profile h100\n"
               "  python -m ficco.bench characterize\n"
               "  torchrun --nproc-per-node 2 -m ficco.bench sweep --shape 2048,1024,1024")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name, help_text in available.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text,
                                    formatter_class=HelpFormatter)
        if name == verb:
            module = importlib.import_module(f"ficco.bench.{name}")
            module.add_arguments(sub_parser)
            examples = getattr(module, "EXAMPLES", "").strip("\n")
            if examples.startswith("examples:"):
                examples = examples[len("examples:"):].strip("\n")
            if examples:
                sub_parser.epilog = "examples:\n" + examples
            sub_parser.set_defaults(_main=module.main)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(verb if verb in VERBS else None).parse_args(argv)
    try:
        return int(args._main(args) or 0)
    except BenchUsageError as exc:
        return report_usage_error(exc)
    except FiccoError as exc:
        # ficco's errors say what was wrong and how to fix it: one line, no traceback
        # (e.g. an unknown --profile lists the built-in ones).
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
