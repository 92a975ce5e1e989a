"""Host work around the scheduler's reads of the device, with the overlap on and off (issue 40, item 4).

    PYTHONPATH=. python bench/host_overlap.py --rows 64 --requests 256
    PYTHONPATH=. python bench/host_overlap.py --rows 256 --requests 512

One rollout (tiny Qwen2, graphs on, EOS reachable, more requests than slots: rows end unevenly and new ones
are admitted) run with ``scheduler.HOST_OVERLAP`` on and off, interleaved in one process. Per look it reports
``last_stats["host_ms_overlapped"]`` (planning done after a run was launched, before the read's wait) and the
host time from each wait to the next run's launch (``host_ms_after_sync``, admission rounds left out), split
by whether the look found rows finished. On an accelerator the second is what the device idles per look; on
the CPU the steps run before the host reaches the read, so only the split itself is meaningful here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)

    from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
    from hybrid_engine.generation import scheduler, timing
    from hybrid_engine.tiny_models import build_model

    ids = torch.randint(4, 384, (a.requests, 32), generator=torch.Generator().manual_seed(0))
    rollout = HybridEngineRollout(build_model("tiny-qwen2"), config=RolloutConfig(
        use_graph_capture=True, max_batch_size=a.rows, sync_interval=4))
    gaps: list[tuple[bool, float]] = []  # (the look found rows finished, ms from its wait to the next launch)
    finished = [False]
    look, launched = scheduler._Executor.look, timing.HostSplit.launched

    def timed_look(self, action):
        seen = look(self, action)
        finished[0] = bool(seen.done)
        return seen

    def timed_launched(self):
        if self._since is not None:
            gaps.append((finished[0], (time.perf_counter() - self._since) * 1e3))
        launched(self)

    scheduler._Executor.look, timing.HostSplit.launched = timed_look, timed_launched
    request = RolloutRequest(ids, torch.ones_like(ids))
    results: dict[bool, list] = {True: [], False: []}
    for r in range(a.repeats + 1):
        for overlap in (True, False):
            scheduler.HOST_OVERLAP = overlap
            gaps.clear()
            rollout.generate(request, SamplingConfig(max_new_tokens=a.new, temperature=1.0, seed=1 + r))
            if r:  # the first round captures
                s = rollout.last_stats
                results[overlap].append((s["host_ms_overlapped"] / s["host_syncs"], list(gaps), s["host_syncs"]))
    print(f"{a.rows} rows, {a.requests} requests of up to {a.new} tokens, median of {a.repeats} calls per mode")
    for overlap in (False, True):
        runs = results[overlap]
        quiet = [d for _, g, _ in runs for f, d in g if not f]
        busy = [d for _, g, _ in runs for f, d in g if f]
        print(f"overlap {'on ' if overlap else 'off'}: {statistics.median(x[0] for x in runs):.3f} ms a look planned "
              f"before its wait; after it {statistics.median(quiet) if quiet else float('nan'):.3f} ms where "
              f"nothing finished ({len(quiet)} looks), {statistics.median(busy) if busy else float('nan'):.3f} ms "
              f"where rows finished ({len(busy)}); {runs[0][2]} looks a call")


if __name__ == "__main__":
    main()
