"""``hybrid-engine bench memory``: decode cost and K/V memory against the cache capacity, side by side in one run.

A fixed long-tailed workload (GRPO-like: a few long responses among many
short ones, ``--samples`` per prompt) runs as a rollout with graphs at each
``cache_capacity`` of the sweep. What a step costs should follow the tokens
the rows hold, not the capacity (attention reads only the span of pages the
longest live row reaches), and the pages held at the peak should follow the
page-rounded tokens held then. The same prompts and budgets also run through
transformers' ``generate`` (a ``DynamicCache`` grown to the longest response)
and, where it runs here, its continuous batching (``generate_batch``'s paged
cache), for the memory each holds. A second scenario holds one prompt with
16 samples: its full pages are held once.

Targets on a CPU: step time at capacity 4096 within 1.2x of capacity 64; peak
pages within 1.3x of the page-rounded tokens held at that peak; the shared
prompt's pages held once.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from hybrid_engine.benchmarks import common as C
from hybrid_engine.decode.kv_pool import pages_for
from hybrid_engine.decode.layout import layer_specs

DEFAULT_MODEL = "tiny-llama"
TARGET_STEP_RATIO = 1.2
TARGET_PAGE_RATIO = 1.3


def add_arguments(p: argparse.ArgumentParser) -> None:
    C.add_common_args(p, default_model=DEFAULT_MODEL, plot=False)
    p.add_argument("--capacities", type=C.parse_int_list, default=[64, 256, 1024, 4096, 8192],
                   help="cache_capacity values swept (default 64,256,1024,4096,8192)")
    p.add_argument("--prompts", type=int, default=8, help="prompts of the workload (default 8)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--prompt-len", type=int, default=12, help="longest prompt in tokens (default 12)")
    p.add_argument("--long", type=int, default=48, help="the long responses' budget (default 48)")
    p.add_argument("--short", type=int, default=8, help="the other responses' budget (default 8)")
    p.add_argument("--slots", type=int, default=8, help="concurrently decoding rows (default 8)")
    p.add_argument("--page-size", type=int, default=16, help="kv_page_size (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="measured calls per capacity (default 3)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="the budget of the last row, at the largest capacity (default: the smallest capacity's "
                        "default pool)")
    p.add_argument("--no-transformers-cb", action="store_true",
                   help="skip transformers' continuous batching (generate_batch) baseline")


def _positions(args: argparse.Namespace, positions: int) -> dict[str, int]:
    """A config-built model's position limit raised to ``positions`` (a capacity past it is refused)."""
    if getattr(args, "model_path", None):
        return {}
    from hybrid_engine.benchmarks.options import resolve_model_name
    from hybrid_engine.tiny_models import build_config

    config = build_config(resolve_model_name(args.model))
    name = "n_positions" if hasattr(config, "n_positions") else "max_position_embeddings"
    return {name: max(positions, getattr(config, name))}


def _check(args: argparse.Namespace) -> None:
    for name in ("prompts", "samples", "prompt_len", "long", "short", "slots", "page_size", "repeats",
                 "kv_cache_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")
    need = args.prompt_len + max(args.long, args.short)
    if min(args.capacities) < need:
        raise SystemExit(f"error: --capacities: every capacity must hold the longest prompt plus the long budget "
                         f"({need} tokens)")


def _workload(args: argparse.Namespace, vocab: int, device: torch.device) -> Any:
    from hybrid_engine.rollout import RolloutRequest

    gen = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (args.prompts,), generator=gen)
    lengths[0] = args.prompt_len
    width = args.prompt_len
    ids = torch.randint(4, vocab, (args.prompts, width), generator=gen)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    # The long tail: one prompt in four gets the long budget, the rest the short one.
    budgets = [args.long if i % 4 == 0 else args.short for i in range(args.prompts)]
    return RolloutRequest((ids * mask).to(device), mask.to(device), max_new_tokens=budgets)


def _rollout_row(model: Any, request: Any, args: argparse.Namespace, capacity: int, sampling: Any,
                 budget: int | None = None) -> dict[str, Any]:
    from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig

    rollout = HybridEngineRollout(model, config=RolloutConfig(
        use_graph_capture=True, cache_capacity=capacity, max_batch_size=args.slots, pad_token_id=0,
        eos_token_id=10**9, kv_page_size=args.page_size, kv_cache_tokens=budget))
    for _ in range(C.WARMUP_CALLS):
        rollout.generate(request, sampling)
    step_ms, call_ms, tokens = [], [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        batch = rollout.generate(request, sampling)
        call_ms.append((time.perf_counter() - t0) * 1e3)
        s = rollout.last_stats
        step_ms.append(s["decode_ms"] / max(1, s["decode_steps"]))
        tokens = batch.input_ids
    responses = [batch.responses[i, : int(n)].tolist() for i, n in enumerate(batch.response_lengths)]
    s = rollout.last_stats
    return {"capacity": capacity, "kv_cache_tokens": budget, "decode_ms_per_step": C.median(step_ms),
            "call_ms": C.median(call_ms), "decode_steps": s["decode_steps"],
            "kv_pages_peak": s["kv_pages_peak"], "kv_pages_held_peak": s["kv_pages_held_peak"],
            "kv_bytes_peak": s["kv_bytes_peak"], "kv_pages_total": s["kv_pages_total"],
            "pool_bytes": s["cache_memory_bytes"], "span_buckets": list(s["span_buckets"]),
            "graph_replays": s["graph_replays"], "fallbacks": s["fallbacks"], "tokens": tokens,
            "responses": responses}


def _hf_generate(model: Any, request: Any, n: int, per_token_bytes: int) -> dict[str, Any]:
    """transformers' generate on every request at once: its DynamicCache grows to the longest response."""
    ids = request.prompt_ids.repeat_interleave(n, 0)
    mask = request.prompt_attention_mask.repeat_interleave(n, 0)
    longest = max(request.max_new_tokens)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                       min_new_tokens=longest, pad_token_id=0)
    ms = (time.perf_counter() - t0) * 1e3
    held = ids.shape[0] * (ids.shape[1] + longest - 1)
    return {"decode_ms_per_step": ms / longest, "kv_bytes_peak": held * per_token_bytes, "tokens_held": held}


def _hf_continuous(model: Any, request: Any, n: int, args: argparse.Namespace, pages: int) -> dict[str, Any]:
    """transformers' continuous batching on the same requests and budgets (its pages of ``--page-size`` tokens,
    ``pages`` of them, ``--slots`` requests at a time): its paged cache's bytes, and how many of its greedy
    responses equal ours (its paged attention kernel may round differently)."""
    import gc

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(request.max_new_tokens), eos_token_id=-1,
                              pad_token_id=0)
    # Sized like our pool: left to itself it takes most of the free memory (hundreds of MB here).
    cb_config = ContinuousBatchingConfig(page_size=args.page_size, num_blocks=pages,
                                         max_requests_per_batch=args.slots)
    responses: dict[str, list[int]] = {}
    # The context manager warms the manager up before starting its thread; started bare it never answers here.
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                   block=True, timeout=30) as manager:
        t0 = time.perf_counter()
        for row, budget in enumerate(request.max_new_tokens):
            prompt = request.prompt_ids[row][request.prompt_attention_mask[row].bool()].tolist()
            for j in range(n):
                manager.add_request(prompt, request_id=f"{row}_{j}", max_new_tokens=budget)
        deadline = time.perf_counter() + 600
        while len(responses) < n * len(request.max_new_tokens):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                responses[result.request_id] = list(result.generated_tokens)
            elif result is None and (not manager.is_running() or time.perf_counter() > deadline):
                raise RuntimeError(f"transformers' continuous batching stopped after {len(responses)} responses")
        ms = (time.perf_counter() - t0) * 1e3
        cache_bytes = int(manager.batch_processor.cache.cache_tensor.nbytes)
    gc.collect()
    return {"wall_ms": ms, "cache_bytes": cache_bytes, "responses": responses}


def _shared_prompt(model: Any, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One prompt of 4 full pages and 16 samples: its pages are held once."""
    from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig

    length = 4 * args.page_size
    ids = torch.randint(4, int(model.config.vocab_size), (1, length), generator=torch.Generator().manual_seed(7))
    request = RolloutRequest(ids.to(device), torch.ones_like(ids).to(device))
    rollout = HybridEngineRollout(model, config=RolloutConfig(
        use_graph_capture=True, max_batch_size=16, pad_token_id=0, eos_token_id=10**9, kv_page_size=args.page_size))
    rollout.generate(request, SamplingConfig(max_new_tokens=args.short, temperature=1.0, n_samples_per_prompt=16))
    s = rollout.last_stats
    own = pages_for(length + args.short - 1, args.page_size) - 4  # each sample's response pages
    return {"prompt_pages": 4, "samples": 16, "kv_pages_peak": s["kv_pages_peak"], "held_once": 4 + 16 * own,
            "unshared": 16 * (4 + own), "prompt_held_once": s["kv_pages_peak"] == 4 + 16 * own}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hybrid_engine.rollout import SamplingConfig

    _check(args)
    acc, device, dtype, env = C.prepare(args)
    model = C.build_bench_model(args, dtype, device, seed=args.seed, **_positions(args, max(args.capacities)))
    specs = layer_specs(model.config)
    per_token = sum(s.paged_elements for s in specs) * dtype.itemsize
    request = _workload(args, int(model.config.vocab_size), device)
    sampling = SamplingConfig(max_new_tokens=max(args.long, args.short), temperature=0.0,
                              n_samples_per_prompt=args.samples)
    rows = [_rollout_row(model, request, args, c, sampling) for c in args.capacities]
    # The largest capacity again with a budget: the pool follows kv_cache_tokens, not the capacity.
    budget = args.kv_cache_tokens or rows[0]["kv_pages_total"] * args.page_size
    rows.append(_rollout_row(model, request, args, max(args.capacities), sampling, budget))
    same = all(torch.equal(r["tokens"], rows[0]["tokens"]) for r in rows)
    ours = rows[0]["responses"]
    for r in rows:
        del r["tokens"], r["responses"]
    hf = _hf_generate(model, request, args.samples, per_token)
    cb: dict[str, Any] | None = None
    if not args.no_transformers_cb:
        try:
            cb = _hf_continuous(model, request, args.samples, args, rows[-1]["kv_pages_total"])
            theirs = cb.pop("responses")
            cb["responses_equal_ours"] = sum(theirs.get(f"{i // args.samples}_{i % args.samples}") == r
                                             for i, r in enumerate(ours))
            cb["responses"] = len(ours)
        except Exception as exc:  # a baseline that does not run here is reported, not fatal
            cb = {"error": f"{type(exc).__name__}: {exc}"}
    shared = _shared_prompt(model, args, device)
    base = rows[0]
    at_4096 = next((r for r in rows if r["capacity"] == 4096), rows[-2])
    step_ratio = at_4096["decode_ms_per_step"] / base["decode_ms_per_step"]
    page_ratio = max(r["kv_pages_peak"] / max(1, r["kv_pages_held_peak"]) for r in rows)
    problems = [f"capacity {r['capacity']}" for r in rows if not r["graph_replays"] or r["fallbacks"]]
    payload = {
        "benchmark": "memory", "environment": env,
        "settings": {"model": C.model_label(args), "dtype": C.dtype_name(dtype), "prompts": args.prompts,
                     "samples": args.samples, "prompt_len": args.prompt_len, "long": args.long, "short": args.short,
                     "slots": args.slots, "page_size": args.page_size, "repeats": args.repeats},
        "rows": rows, "transformers_generate": hf, "transformers_continuous": cb, "shared_prompt": shared,
        "tokens_identical_across_capacities": same,
        "step_ratio": step_ratio, "target_step_ratio": TARGET_STEP_RATIO,
        "page_ratio": page_ratio, "target_page_ratio": TARGET_PAGE_RATIO,
        "graph_side_problems": [f"bench memory: no graph replay at {p}" for p in problems],
    }
    table = C.format_table(
        ["cache_capacity", "kv_cache_tokens", "decode ms/step", "ms/call", "span pages", "pages peak", "held peak",
         "KV bytes peak", "cache bytes"],
        [[r["capacity"], r["kv_cache_tokens"] or "default", r["decode_ms_per_step"], r["call_ms"], ",".join(map(str, r["span_buckets"])), r["kv_pages_peak"],
          r["kv_pages_held_peak"], r["kv_bytes_peak"], r["pool_bytes"]] for r in rows])
    cb_line = ("skipped" if cb is None else cb.get("error") or
               f"{cb['wall_ms']:.1f} ms for the workload, paged cache {cb['cache_bytes']} bytes, "
               f"{cb['responses_equal_ours']} of {cb['responses']} greedy responses equal ours")
    text = (
        f"\nbench memory: {C.model_label(args)} {C.dtype_name(dtype)}, {args.prompts} prompts x {args.samples} "
        f"samples, budgets {args.long} (1 in 4) and {args.short}, {args.slots} slots, pages of {args.page_size}\n"
        f"{C.environment_lines(env)}\n\n{table}\n\n"
        f"transformers generate (DynamicCache to the longest response): {hf['decode_ms_per_step']:.2f} ms/step, "
        f"KV {hf['kv_bytes_peak']} bytes\n"
        f"transformers continuous batching (generate_batch's paged cache): {cb_line}\n"
        f"step time at capacity {at_4096['capacity']} / {base['capacity']}: {step_ratio:.2f}x "
        f"(target <= {TARGET_STEP_RATIO}x)\n"
        f"peak pages / page-rounded tokens held at the peak: {page_ratio:.2f}x (target <= {TARGET_PAGE_RATIO}x)\n"
        f"one prompt of 4 pages, 16 samples: {shared['kv_pages_peak']} pages at the peak (held once: "
        f"{shared['held_once']}, one copy per sample: {shared['unshared']})\n"
        f"tokens identical across capacities: {same}"
    )
    C.finish(args, payload, text, None, "decode cost and K/V memory against the cache capacity")
    return payload
