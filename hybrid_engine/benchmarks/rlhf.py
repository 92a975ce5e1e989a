"""``hybrid-engine bench rlhf``: the reference's RLHF-style iteration, eager vs graph, in one process per rank.

One iteration is ``eval -> generate (pinned length, greedy) -> train -> forward /
backward / step`` on the generated sequences (prompt tokens masked out of the
labels). Both modes start from the same seeded weights and see the same
prompts, so their tokens must match call for call. Each mode runs its own
engine in turn (the other one is freed first, so each peak memory figure is its
own): ``--warmup`` iterations, the first of which includes the graph capture,
then ``--iterations`` measured ones, averaged.

Reported: the phase table (generate, train step, iteration; eager, graph,
speedup), peak memory per mode where the backend reports it, the one-time
capture cost (the first graph generate minus the eager mean, and the engine's
own ``capture_seconds``) and the token agreement ``N/N``.

``--zero-stage N`` (1-3) trains on DeepSpeed ZeRO N across ``--world-size``
ranks (default 2; ``--zero-stage 0 --world-size N`` is DeepSpeed's plain data
parallelism) that the bench starts on this machine over loopback, as
torchrun would (:mod:`hybrid_engine.distributed.launch`); every rank runs the iteration on
its own prompts (``--batch-size`` per rank) and rank 0 reports, with the token
agreement summed over all ranks. Under ZeRO-3 (every parameter partitioned here:
``stage3_param_persistence_threshold`` 0) the graph side generates on the gathered
inference copy its graph flag implies, refreshed after each step;
``--no-zero3-inference-copy`` turns it off, and the "graph" column then measures
the eager fallback on parameters gathered per call (graphs refused).

Captures per iteration: ``engine.graph_stats.captures`` and
``capture_seconds`` are read just before and just after every generate, and
their differences are reported per iteration (table, text and JSON). How many
graphs a new shape costs, and whether later iterations capture again, is the
property of the graph runner this bench exists to show: one capture per batch
bucket in the first iteration and none afterwards is the goal, where a runner
that captures one graph per decode position shows ``new_tokens - 1`` captures
(and their seconds) on the first iteration.
"""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.benchmarks.options import UsageError, check_common_args
from hybrid_engine.benchmarks.paths import engine_generate, graph_counts, make_engine

DEFAULT_MODEL = "tiny-gpt2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model=DEFAULT_MODEL)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per iteration (default 8)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per sequence (default 128)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up iterations per mode (default 1)")
    p.add_argument("--iterations", type=int, default=4, help="measured iterations per mode (default 4)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (default 1e-5)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3),
                   help="0: plain PyTorch, one process (default; with --world-size, DeepSpeed data parallel); "
                        "1-3: DeepSpeed ZeRO on --world-size ranks")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks started on this machine (default: 2 for --zero-stage 1-3, one process for 0)")
    p.add_argument("--zero3-inference-copy", action=argparse.BooleanOptionalAction, default=None,
                   help="with --zero-stage 3: generate on a gathered inference copy (graphs allowed; one full "
                        "copy of the weights per rank). Default: what the config implies, the copy on the graph "
                        "side; --no-zero3-inference-copy: none, eager decode on gathered parameters")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds before the ranks of --zero-stage 1-3 are killed (default 3600)")


def _capture_counters(engine: Any) -> tuple[int, float]:
    """(captures, capture_seconds) of the engine's graph store so far (public ``graph_stats``)."""
    stats = engine.graph_stats
    return int(stats.captures or 0), float(stats.capture_seconds or 0.0)


def _run_mode(args: argparse.Namespace, graphs: bool, dtype: torch.dtype, device: torch.device,
              prompts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    from hybrid_engine.accelerator import get_accelerator

    acc = get_accelerator()
    gc.collect()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    model = C.build_bench_model(args, dtype, device, seed=args.seed)
    engine = make_engine(model, graphs=graphs, max_out_tokens=args.prompt_len + args.new_tokens,
                         batch_size=args.batch_size, dtype=dtype, lr=args.lr, zero_stage=args.zero_stage,
                         inference_copy=args.zero3_inference_copy)
    # Same RNG stream in both modes: dropout masks match, so the weights stay equal and every
    # iteration's tokens can be compared, not only the first one's.
    torch.manual_seed(args.seed)
    gen_ms: list[float] = []
    train_ms: list[float] = []
    iter_ms: list[float] = []
    tokens: list[torch.Tensor] = []
    losses: list[float] = []
    captures_per_iter: list[int] = []
    capture_s_per_iter: list[float] = []
    T, N = args.prompt_len, args.new_tokens
    for ids, mask in prompts:
        with C.timer(iter_ms):
            engine.eval()
            before = _capture_counters(engine)  # outside the generate timer
            with C.timer(gen_ms):
                new = engine_generate(engine, ids, mask, N)
            after = _capture_counters(engine)
            captures_per_iter.append(after[0] - before[0])
            capture_s_per_iter.append(after[1] - before[1])
            tokens.append(new.cpu())
            with C.timer(train_ms):
                engine.train()
                seq = torch.cat([ids, new], dim=1)
                seq_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
                labels = seq.clone()
                labels[:, :T] = -100
                loss = engine(input_ids=seq, attention_mask=seq_mask, labels=labels).loss
                engine.backward(loss)
                engine.step()
            losses.append(float(loss.detach()))
    counts = graph_counts(engine)
    peak = acc.max_memory_allocated()
    engine.destroy()
    del engine, model
    gc.collect()
    acc.empty_cache()
    w = args.warmup
    return {
        "generate_ms": gen_ms, "train_ms": train_ms, "iteration_ms": iter_ms,
        "generate_mean_ms": C.mean(gen_ms[w:]), "train_mean_ms": C.mean(train_ms[w:]),
        "iteration_mean_ms": C.mean(iter_ms[w:]), "first_generate_ms": gen_ms[0],
        "peak_memory_bytes": peak or None, "losses": losses, "graph": counts, "tokens": tokens,
        "captures_per_iteration": captures_per_iter, "capture_seconds_per_iteration": capture_s_per_iter,
    }


def _launch_ranks(args: argparse.Namespace) -> dict[str, Any]:
    """Start ``--world-size`` ranks that each run this same command; they print (rank 0 reports)."""
    from hybrid_engine.distributed.launch import RanksTimedOut, run_ranks

    world = args.world_size or 2
    print(f"bench rlhf: ZeRO stage {args.zero_stage} (DeepSpeed) on {world} ranks (loopback) ...", flush=True)
    try:
        proc = run_ranks(["-m", "hybrid_engine", *args.argv], nproc=world, timeout_s=args.timeout, capture=False)
    except RanksTimedOut:
        raise SystemExit(f"error: the ranks of bench rlhf --zero-stage {args.zero_stage} did not finish within "
                         f"--timeout {args.timeout:g} s and were stopped; raise --timeout") from None
    if proc.returncode != 0:
        raise SystemExit(f"error: a rank of bench rlhf --zero-stage {args.zero_stage} exited with {proc.returncode}")
    return {"benchmark": "rlhf", "world_size": world, "zero_stage": args.zero_stage}


def _summed_over_ranks(device: torch.device, *values: int) -> list[int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)  # on the model's device: NCCL reduces only there
    dist.all_reduce(t)
    return [int(v) for v in t]


def _graph_side_copy(args: argparse.Namespace) -> bool:
    """Whether the graph side generates on a gathered inference copy (ZeRO-3: implied unless turned off)."""
    return args.zero_stage == 3 and args.zero3_inference_copy is not False


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.iterations < 1 or args.warmup < 1:
        raise UsageError("--warmup and --iterations must be >= 1 (the first warm-up call captures)")
    if args.world_size is not None and args.world_size < 1:
        raise UsageError("--world-size must be >= 1")
    if args.zero3_inference_copy is not None and args.zero_stage != 3:
        raise UsageError("--zero3-inference-copy / --no-zero3-inference-copy need --zero-stage 3")
    if not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    ranks = args.zero_stage > 0 or args.world_size is not None  # the bench starts ranks
    if ranks and "RANK" not in os.environ:
        check_common_args(args)  # before any rank starts: a bad option is one error here, not one per rank
        return _launch_ranks(args)
    from hybrid_engine.distributed.ranks import world_size
    from hybrid_engine.distributed.world import rank

    reporting = rank() == 0
    acc, device, dtype, env = C.prepare(args)
    probe = C.build_bench_model(args, dtype, torch.device("cpu") if device.type != "cpu" else device, seed=args.seed)
    pad, _ = C.special_ids(probe)
    vocab = int(probe.config.vocab_size)
    del probe
    n_iter = args.warmup + args.iterations
    prompts = [C.random_prompts(args.batch_size, args.prompt_len, vocab, seed=args.seed + 100 + i, device=device,
                                avoid=(pad,)) for i in range(n_iter)]
    if ranks:  # each rank its own prompts
        prompts = [C.random_prompts(args.batch_size, args.prompt_len, vocab, seed=args.seed + 100 + i + 7919 * rank(),
                                    device=device, avoid=(pad,)) for i in range(n_iter)]
    results = {}
    for mode, graphs in (("eager", False), ("graph", True)):
        if reporting:
            print(f"bench rlhf: {mode}, {args.warmup} warm-up + {args.iterations} measured iterations ...", flush=True)
        results[mode] = _run_mode(args, graphs, dtype, device, prompts)
    eager, graph = results["eager"], results["graph"]

    same0, total0 = C.agreement(eager["tokens"][0], graph["tokens"][0])
    same_all = sum(C.agreement(a, b)[0] for a, b in zip(eager["tokens"], graph["tokens"]))
    total_all = sum(C.agreement(a, b)[1] for a, b in zip(eager["tokens"], graph["tokens"]))
    same0, total0, same_all, total_all = _summed_over_ranks(device, same0, total0, same_all, total_all)
    capture_ms = graph["first_generate_ms"] - eager["generate_mean_ms"]
    for mode in (eager, graph):
        mode.pop("tokens")
    phases = [
        ("generate", eager["generate_mean_ms"], graph["generate_mean_ms"]),
        ("train step", eager["train_mean_ms"], graph["train_mean_ms"]),
        ("iteration", eager["iteration_mean_ms"], graph["iteration_mean_ms"]),
    ]
    world = world_size()
    payload = {
        "benchmark": "rlhf", "environment": env,
        "settings": {"model": C.model_label(args), "dtype": C.dtype_name(dtype), "batch_size": args.batch_size,
                     "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "warmup": args.warmup,
                     "iterations": args.iterations, "lr": args.lr, "zero_stage": args.zero_stage,
                     "zero3_inference_copy": _graph_side_copy(args),
                     "world_size": world},
        "phases": {name: {"eager_ms": e, "graph_ms": g, "speedup": C.speedup(e, g)} for name, e, g in phases},
        "eager": eager, "graph": graph,
        "peak_memory": {"eager_bytes": eager["peak_memory_bytes"], "graph_bytes": graph["peak_memory_bytes"]},
        "capture": {"first_generate_extra_ms": capture_ms,
                    "capture_seconds": graph["graph"].get("capture_seconds"),
                    "captures": graph["graph"].get("captures"),
                    "captures_per_iteration": graph["captures_per_iteration"],
                    "capture_seconds_per_iteration": graph["capture_seconds_per_iteration"],
                    "eager_captures_per_iteration": eager["captures_per_iteration"]},
        "token_agreement": {"identical": same0, "total": total0},
        "token_agreement_all_iterations": {"identical": same_all, "total": total_all},
        # ZeRO-3 with the inference copy turned off refuses graphs by design (reported as such below).
        "graph_side_problems": [] if args.zero_stage == 3 and args.zero3_inference_copy is False else
        [p for p in [C.graph_side_problem("graph mode", graph["graph"])] if p],
    }
    table = C.format_table(["phase", "eager", "graph", "speedup"], [
        [name, f"{e:.1f} ms", f"{g:.1f} ms", f"{C.speedup(e, g):.2f}x"] for name, e, g in phases
    ])
    per_iter = C.format_table(
        ["iteration", "kind", "eager generate", "graph generate", "graph captures", "capture time"],
        [[i + 1, "warm-up" if i < args.warmup else "measured", f"{e:.1f} ms", f"{g:.1f} ms", c, f"{cs * 1e3:.1f} ms"]
         for i, (e, g, c, cs) in enumerate(zip(eager["generate_ms"], graph["generate_ms"],
                                               graph["captures_per_iteration"],
                                               graph["capture_seconds_per_iteration"]))])
    caps = ", ".join(str(c) for c in graph["captures_per_iteration"])
    cap_times = ", ".join(f"{cs * 1e3:.1f}" for cs in graph["capture_seconds_per_iteration"])
    pe, pg = eager["peak_memory_bytes"], graph["peak_memory_bytes"]
    mem = (f"{C.gib(pe)} -> {C.gib(pg)} ({(pg - pe) / 2**30:+.2f} GiB)" if pe and pg
           else "n/a (this backend reports no allocator statistics)")
    cap_s = graph["graph"].get("capture_seconds")
    refusal = graph["graph"].get("refusal")
    copy = " with a gathered inference copy" if _graph_side_copy(args) else ""
    scale = (f"ZeRO stage {args.zero_stage}{copy} (DeepSpeed) on {world} ranks, batch {args.batch_size} per rank; "
             if ranks else "")
    text = (
        f"\nbench rlhf: {scale}{C.model_label(args)} {C.dtype_name(dtype)}, batch {args.batch_size}, "
        f"{args.prompt_len}-token prompt, {args.new_tokens} new tokens, greedy; "
        f"mean of {args.iterations} iterations after {args.warmup} warm-up\n{C.environment_lines(env)}\n\n{table}\n\n"
        f"token agreement (first generate, same weights and input): {same0}/{total0} "
        f"(all iterations: {same_all}/{total_all})\n"
        f"peak memory eager -> graph: {mem}\n"
        f"one-time capture cost: first graph generate {graph['first_generate_ms']:.1f} ms "
        f"({capture_ms:+.1f} ms vs the eager mean); engine capture_seconds "
        f"{cap_s if cap_s is None else f'{cap_s:.2f} s'}, captures {graph['graph'].get('captures')}\n\n"
        f"{per_iter}\n\n"
        f"captures per iteration: {caps}; capture time per iteration: {cap_times} ms"
        + (f"\ngraphs refused, the graph column ran eagerly: {refusal}" if refusal and not graph["graph"].get("captures")
           else "")
    )

    def draw(plt: Any) -> None:
        C.bar_pairs(plt, [p[0] for p in phases], [p[1] for p in phases], [p[2] for p in phases], "ms (mean)")

    if reporting:
        C.finish(args, payload, text, draw, f"RLHF iteration: {C.model_label(args)} batch {args.batch_size}")
    if ranks:
        import torch.distributed as dist

        from hybrid_engine.distributed.launch import exit_launched_rank
        from hybrid_engine.distributed.world import destroy_process_group

        dist.barrier()  # rank 0 has written its report; then every rank leaves the group
        destroy_process_group()
        exit_launched_rank()  # a rank this bench started: done, without interpreter teardown
    return payload
