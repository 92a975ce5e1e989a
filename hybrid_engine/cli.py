"""The ``hybrid-engine`` command line: ``info`` (environment and graph capability), ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _info(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from . import __version__
    from .accelerator import get_accelerator

    acc = get_accelerator()
    print(f"hybrid-engine  {__version__}")
    print(f"python         {sys.version.split()[0]}")
    print(f"torch          {torch.__version__}")
    print(f"transformers   {transformers.__version__}")
    print(f"accelerator    {acc.device_name()} ({type(acc).__name__})")
    if acc.supports_graph_capture:
        print(f"graph capture  available via {acc.graph_api}")
    else:
        print(f"graph capture  unavailable: {acc.graph_unavailable_reason}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print versions, the selected accelerator and graph-capture support")
    info.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
