"""Failed captures and concurrent captures on a real device: what bench/gpu_check.sh runs for issue 29.

Three cases, the first two compared with eager tokens in the same process:

* ``failed_capture``: a forward hook that reads the host, and a model whose own
  code syncs while capturing (as gpt_neo, falcon, mpt ... do), make captures
  fail; then ten failures in a row (ten rollouts, one failure each). After each,
  the allocator must be out of capture mode: on CUDA ``_cuda_endAllocateToPool``
  of every pool handle the runners took must say "not currently recording" (if
  it succeeds, that pool was stuck: it is counted and unstuck),
  ``empty_cache()`` must work and give a freed 64 MiB block back, and the pool
  must hold 0 bytes once emptied. Graphs must then capture and replay again.
* ``two_threads``: two models in two threads, each dropping its graphs and
  capturing again at every call: exact tokens on both, no capture failure.
* ``pinned_copies`` (CUDA): with a long kernel queued, the host's small index
  tensors (page-table entries, admission rows) reach the device without waiting
  for it (``hybrid_engine.accelerator.host_copy``), and hold the right values.

Prints one line per case and writes ``--json``; exits 1 when a case fails.

    python -m bench.capture_faults [--device cuda] [--dtype fp16] [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import warnings
from typing import Any

import torch

from hybrid_engine.accelerator import build_accelerator, is_capturing, set_accelerator
from hybrid_engine.graphs.policy import GraphRefusedWarning
from hybrid_engine.rollout import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.tiny_models import build_model

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SAMPLED = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5)


def prompts(batch: int, width: int, seed: int, device: torch.device) -> RolloutRequest:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 384, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        ids[b, : b % width] = 0
        mask[b, : b % width] = 0
    return RolloutRequest(ids.to(device), mask.to(device))


def rollout_for(model: Any, graphs: bool = True) -> HybridEngineRollout:
    return HybridEngineRollout(model, config=RolloutConfig(use_graph_capture=graphs, max_batch_size=4,
                                                           pad_token_id=0, eos_token_id=10_000))


class PoolProbe:
    """Records every pool handle the accelerator hands out, and checks none is left recording."""

    def __init__(self, acc: Any):
        self.acc, self.handles = acc, []
        real = acc.graph_pool_handle

        def handle() -> Any:
            self.handles.append(real())
            return self.handles[-1]

        acc.graph_pool_handle = handle

    def stuck(self, device: torch.device) -> int:
        """Pools the allocator still records into (each one found is also unstuck, so the run can go on)."""
        if device.type == "cpu":  # the emulation's pools say it themselves
            return sum(1 for p in self.handles if p is not None and p.recording)
        end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
            torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
        if end is None or device.type != "cuda":
            return 0
        found = 0
        for pool in self.handles:
            try:
                end(device.index or 0, pool)
                found += 1  # it was still recording
            except RuntimeError:
                pass  # "not currently recording": as it should be
        return found

    def bytes_held(self) -> int | None:
        sizes = [self.acc.graph_memory_bytes(p) for p in self.handles if p is not None]
        return None if any(s is None for s in sizes) else sum(sizes)


def empty_cache_gives_memory_back(acc: Any, device: torch.device) -> bool:
    """``empty_cache()`` works, and on CUDA returns a freed 64 MiB block to the device (it frees nothing while
    the allocator believes a capture is under way)."""
    acc.empty_cache()
    if device.type != "cuda":
        return True
    block = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    held = torch.cuda.memory_reserved(device)
    del block
    acc.empty_cache()
    return torch.cuda.memory_reserved(device) <= held - (64 << 20)


def failing(model: Any, how: str) -> Any:
    """Make every capture of ``model`` fail, ``how``: "hook" (a hook reads the host) or "model code"."""
    if how == "hook":
        seen: list[float] = []
        return model.lm_head.register_forward_hook(lambda m, a, out: seen.append(float(out[0, -1, 0]))).remove
    real = model.lm_head.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if is_capturing():
            x.sum().item()
        return real(x)

    model.lm_head.forward = forward
    return lambda: model.lm_head.__dict__.pop("forward")


def failed_capture_case(device: torch.device, dtype: torch.dtype, acc: Any) -> dict[str, Any]:
    model = build_model("tiny-gpt2", seed=3, dtype=dtype).to(device)
    request = prompts(3, 6, 1, device)
    want = rollout_for(model, graphs=False).generate(request, SAMPLED)
    probe = PoolProbe(acc)
    steps: list[dict[str, Any]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphRefusedWarning)
        for how, runs in (("hook", 1), ("model code", 1), ("model code", 10)):
            undo = failing(model, how)
            exact, failures = True, 0
            for _ in range(runs):  # a fresh runner each time: one runner stops trying after 3 failures
                rollout = rollout_for(model)
                exact &= torch.equal(rollout.generate(request, SAMPLED).input_ids, want.input_ids)
                failures += rollout.graph_stats.fallbacks
            undo()
            stuck = probe.stuck(device)
            freed = empty_cache_gives_memory_back(acc, device)
            held = probe.bytes_held()
            steps.append({"failure": how, "runs": runs, "failed_captures": failures, "exact": exact,
                          "pools": len(probe.handles), "stuck_pools": stuck, "empty_cache_frees": freed,
                          "pool_bytes_after": held,
                          "ok": exact and failures >= runs and stuck == 0 and freed and held in (0, None)})
    rollout = rollout_for(model)
    got = [rollout.generate(request, SAMPLED) for _ in range(2)]
    again = all(torch.equal(b.input_ids, want.input_ids) for b in got)
    stats = rollout.graph_stats
    recovered = again and stats.captures > 0 and stats.replays > 0 and stats.fallbacks == 0
    return {"steps": steps, "graphs_after": {"exact": again, "captures": stats.captures, "replays": stats.replays,
                                             "fallbacks": stats.fallbacks},
            "ok": all(s["ok"] for s in steps) and recovered}


def two_threads_case(device: torch.device, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    models = {"x": build_model("tiny-llama", seed=4, dtype=dtype).to(device),
              "y": build_model("tiny-gpt2", seed=5, dtype=dtype).to(device)}
    requests = {"x": prompts(3, 5, 1, device), "y": prompts(2, 6, 2, device)}
    want = {k: rollout_for(models[k], graphs=False).generate(requests[k], SAMPLED) for k in models}
    rollouts = {k: rollout_for(models[k]) for k in models}
    got: dict[str, list[Any]] = {k: [] for k in models}
    errors: list[str] = []
    start = threading.Barrier(len(models))

    def calls(name: str) -> None:
        try:
            start.wait(30)
            for _ in range(rounds):
                rollouts[name].runner.invalidate()  # every call captures again
                got[name].append(rollouts[name].generate(requests[name], SAMPLED))
        except BaseException as exc:  # reported below
            errors.append(f"{name}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=calls, args=(k,), name=k) for k in models]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    out: dict[str, Any] = {"rounds": rounds, "errors": errors, "seconds": round(time.perf_counter() - t0, 3)}
    ok = not errors and not any(t.is_alive() for t in threads)
    for name in models:
        stats = rollouts[name].graph_stats
        exact = len(got[name]) == rounds and all(
            torch.equal(b.input_ids, want[name].input_ids) for b in got[name])
        out[name] = {"exact": exact, "captures": stats.captures, "fallbacks": stats.fallbacks,
                     "last_refusal_reason": stats.last_refusal_reason}
        ok &= exact and stats.captures >= rounds and stats.fallbacks == 0
    out["ok"] = ok
    return out


def pinned_copies_case(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"ok": True, "skipped": f"needs CUDA's _sleep kernel, not {device.type}"}
    from hybrid_engine.accelerator.host_copy import device_tensor

    counters = argparse.Namespace(host_syncs=0)
    values = [[i, 2 * i, 3 * i] for i in range(64)]
    device_tensor(values, device, counters=counters)  # first call: pinned allocator warm
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the copy
    queued = time.perf_counter()
    copied = device_tensor(values, device, counters=counters)
    copy_s = time.perf_counter() - queued
    torch.cuda.synchronize(device)
    kernel_s = time.perf_counter() - t0
    ok = copy_s < 0.25 * kernel_s and copied.tolist() == values and counters.host_syncs == 0
    return {"ok": ok, "copy_s": round(copy_s, 4), "queued_kernel_s": round(kernel_s, 4),
            "host_syncs": counters.host_syncs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=4, help="calls per thread in the two-thread case")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    acc = build_accelerator(args.device)
    set_accelerator(acc)
    device = acc.device()
    if device.type == "cpu":
        torch.set_num_threads(1)
    dtype = DTYPES[args.dtype] if device.type != "cpu" else torch.float32
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              "graph_api": acc.graph_api}
    result["failed_capture"] = failed_capture_case(device, dtype, acc)
    result["two_threads"] = two_threads_case(device, dtype, args.rounds)
    result["pinned_copies"] = pinned_copies_case(device)
    result["ok"] = all(result[k]["ok"] for k in ("failed_capture", "two_threads", "pinned_copies"))
    fc, tt = result["failed_capture"], result["two_threads"]
    print(f"failed_capture: ok={fc['ok']} " + "; ".join(
        f"{s['failure']} x{s['runs']}: failed {s['failed_captures']}, stuck pools {s['stuck_pools']}, "
        f"empty_cache frees {s['empty_cache_frees']}, pool bytes after {s['pool_bytes_after']}, exact {s['exact']}"
        for s in fc["steps"]) + f"; graphs after: {fc['graphs_after']}")
    print(f"two_threads: ok={tt['ok']} rounds {tt['rounds']}, x {tt['x']}, y {tt['y']}, errors {tt['errors']}")
    print(f"pinned_copies: {result['pinned_copies']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
