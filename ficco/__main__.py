"""``python -m ficco selftest``: ficco checks itself where it runs (ficco/selftest); ``python
-m ficco demo``: the end-to-end demo on CPU ranks (ficco/demo/__init__.py). Benchmarks live under
``python -m ficco.bench``."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """``python -m ficco``'s parser (the selftest verb parses its own options)."""
    parser = argparse.ArgumentParser(prog="python -m ficco",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="verb", required=True)
    demo = sub.add_parser("demo", help="on CPU ranks: the four patterns in a small MoE "
                                       "transformer, then every schedule of the two "
                                       "sequence-parallel ops, each checked against float64")
    demo.add_argument("--world", type=_ranks, default=4, help="number of CPU ranks (default 4)")
    sub.add_parser("selftest", add_help=False,
                   help="check ficco on this machine: every schedule vs float64, faults, a "
                        "graph replay, timings, the environment (--help for its options)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["selftest"]:
        from .selftest import main as selftest_main

        return selftest_main(argv[1:])
    args = parser.parse_args(argv)
    from .demo import main as demo_main

    return demo_main(args.world)


def version() -> str:
    """What ``--version`` prints: ficco's version and, one a line, those of what it runs on (torch and its
    CUDA or ROCm, Triton, the GPU bindings, the clients ficco integrates with: torchtitan,
    transformers, megatron-core), "-" for what is not installed.

    >>> version().startswith("ficco ")
    True
    """
    import torch

    from . import __version__

    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else \
        f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else "CPU"
    parts = [f"torch {torch.__version__} ({build})"]
    for label, dist in (("Triton", "triton"), ("cuda-bindings", "cuda-bindings"),
                        ("hip-python", "hip-python"), ("torchtitan", "torchtitan"),
                        ("transformers", "transformers"), ("megatron-core", "megatron-core")):
        parts.append(f"{label} {_installed(dist)}")
    return "\n".join([f"ficco {__version__}", *parts])


def _installed(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def _ranks(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 rank; got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
