"""The ``hybrid-engine`` command line: ``info`` (environment and graph capability), ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _info(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from hybrid_engine import __version__
    from hybrid_engine.accelerator import get_accelerator

    print(f"hybrid-engine  {__version__}")
    print(f"python         {sys.version.split()[0]}")
    print(f"torch          {torch.__version__}")
    print(f"transformers   {transformers.__version__}")
    try:
        acc = get_accelerator()
    except (ValueError, ImportError) as exc:  # HYBRID_ENGINE_ACCELERATOR names one this machine cannot build
        acc = None
        print(f"accelerator    unavailable: {exc}")
    if acc is not None:
        here = "" if acc.is_available() else ", not available on this machine"
        print(f"accelerator    {acc.device_name()} ({type(acc).__name__}{here})")
        if acc.supports_graph_capture:
            print(f"graph capture  available via {acc.graph_api}")
        else:
            print(f"graph capture  unavailable: {acc.graph_unavailable_reason}")
    for name, extra, use in (("deepspeed", "deepspeed", "ZeRO 1-3"), ("trl", "trl", "TRL rollout_func"),
                             ("peft", "peft", "PEFT LoRA")):
        version = _version_of(name)
        status = f"{version} ({use})" if version else f"not installed (pip install 'hybrid-engine[{extra}]' for {use})"
        print(f"{name:<14} {status}")
    return 0 if acc is not None else 1


def _version_of(distribution: str) -> str | None:
    """The installed version of ``distribution``, without importing it (DeepSpeed's import is slow)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _demo(args: argparse.Namespace) -> int:
    from hybrid_engine import demo

    return demo.run(args)


def _bench(args: argparse.Namespace) -> int:
    from hybrid_engine.benchmarks import module

    module(args.bench_command).run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from hybrid_engine import demo
    from hybrid_engine.benchmarks import SUBCOMMANDS, module

    parser = argparse.ArgumentParser(prog="hybrid-engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print versions, the selected accelerator and graph-capture support")
    info.set_defaults(func=_info)

    demo_p = sub.add_parser("demo", help="the main job: a small RL loop with graph-captured rollouts",
                            description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(demo_p)
    demo_p.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks: eager vs graph, side by side in one run")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text in SUBCOMMANDS.items():
        mod = module(name)
        bp = bench_sub.add_parser(name, help=help_text, description=mod.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(bp)
        bp.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the exact command, for benchmark reports
    from hybrid_engine.benchmarks.options import UsageError

    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
