"""Replay vs eager for one decode step under the CPU graph emulation.

Measures, side by side in one process, the time of a GPT-2-shaped decode step
(``model_step.decode_one_token`` against a ``PagedKVCache``) run eagerly and
replayed from a captured CPU graph, interleaving the two so machine noise hits
both alike. Prints a table and the ratio eager / replay (>= 1 means replay is at
least as fast), and checks that both give the same logits.

    python bench/cpu_graph_replay.py [--layers 4] [--hidden 256] [--batch 1 4] [--iters 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

from hybrid_engine.accelerator import CPUAccelerator
from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.step import decode_one_token, prefill


def build(layers: int, hidden: int, heads: int, vocab: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=1024,
                     bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return GPT2LMHeadModel(cfg).eval()


def measure(model, batch: int, prompt: int, capacity: int, iters: int, acc: CPUAccelerator) -> dict:
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        eager_cache = PagedKVCache(model.config, batch, capacity)
        graph_cache = PagedKVCache(model.config, batch, capacity)
        prefill(model, eager_cache, ids, mask)
        prefill(model, graph_cache, ids, mask)
        tokens = torch.randint(3, model.config.vocab_size, (batch,))
        g = acc.create_graph()
        with acc.capture_to_graph(g):
            graph_logits = decode_one_token(model, graph_cache, tokens)
        # Same step on both: rewind the write position so every timed step writes the same slot.
        start_e = eager_cache.write_pos.clone(), eager_cache.position.clone()
        start_g = graph_cache.write_pos.clone(), graph_cache.position.clone()

        def eager_step():
            eager_cache.write_pos.copy_(start_e[0])
            eager_cache.position.copy_(start_e[1])
            return decode_one_token(model, eager_cache, tokens)

        def graph_step():
            graph_cache.write_pos.copy_(start_g[0])
            graph_cache.position.copy_(start_g[1])
            acc.replay_graph(g)
            return graph_logits

        same = torch.equal(eager_step(), graph_step())
        for _ in range(5):
            eager_step()
            graph_step()
        eager_t, graph_t = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            eager_step()
            t1 = time.perf_counter()
            graph_step()
            t2 = time.perf_counter()
            eager_t.append(t1 - t0)
            graph_t.append(t2 - t1)
    e_ms, g_ms = statistics.median(eager_t) * 1e3, statistics.median(graph_t) * 1e3
    return {"batch": batch, "eager_ms": e_ms, "replay_ms": g_ms, "speedup": e_ms / g_ms,
            "ops_per_step": g.num_ops, "logits_identical": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    for flag in ("layers", "hidden", "heads", "vocab", "prompt", "iters"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(a, flag)}")
    if min(a.batch) < 1:
        p.error(f"--batch sizes must be >= 1, got {a.batch}")
    model = build(a.layers, a.hidden, a.heads, a.vocab)
    acc = CPUAccelerator()
    rows = [measure(model, b, a.prompt, a.prompt + 64, a.iters, acc) for b in a.batch]
    print(f"# CPU graph emulation: replay vs eager, one decode step ({date.today()}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads)")
    print(f"# GPT-2 shape: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, vocab {a.vocab}, prompt {a.prompt}")
    print("| batch | eager ms/step | replay ms/step | eager/replay | aten ops | identical logits |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['eager_ms']:.3f} | {r['replay_ms']:.3f} | {r['speedup']:.2f}x | {r['ops_per_step']} | {r['logits_identical']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "args": vars(a)}, f, indent=2)


if __name__ == "__main__":
    main()
