"""A decode step reads pages in place where the paged op has a kernel: under ``TRITON_INTERPRET=1`` (the
kernel on the CPU, in a process of its own: Triton reads the variable when imported) a tiny Qwen2 rollout runs
the kernel in every step, graph tokens and logprobs equal eager ones bit for bit, and the reported logprobs
are the training forward's, teacher-forced, within 1e-5 (fp32). Without a kernel the step gathers, as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.step import reads_pages_in_place
from hybrid_engine.tiny_models import build_model

_ROLLOUT = """
import json, torch
from hybrid_engine import HybridEngineRollout, RolloutConfig, RolloutRequest, SamplingConfig
from hybrid_engine.decode.ops import paged_attention as pa
from hybrid_engine.tiny_models import build_model

calls = {"n": 0}
kernel = pa._triton_attention
def counted(*a, **k):
    calls["n"] += 1
    return kernel(*a, **k)
pa._triton_attention = counted
ids = torch.randint(10, 200, (3, 7), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
mask[0, :3] = 0
runs = []
for graphs in (False, True):
    rollout = HybridEngineRollout(build_model("tiny-qwen2", seed=0), config=RolloutConfig(use_graph_capture=graphs))
    b = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=6, temperature=1.0, seed=3))
    runs.append({"ids": b.input_ids.tolist(), "mask": b.attention_mask.tolist(),
                 "logprobs": b.response_logprobs.tolist(), "start": b.response_start_idx})
    rollout.release()
print(json.dumps({"runs": runs, "kernel_calls": calls["n"], "impl": pa.implementation("cpu")}))
"""


def test_without_a_kernel_the_step_gathers():
    model = build_model("tiny-qwen2", seed=0)
    assert not reads_pages_in_place(model, PagedKVCache(model.config, 2, 32))


@pytest.mark.slow  # a process of its own (tests/tiers.py)
def test_a_rollout_reads_pages_in_place_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _ROLLOUT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["impl"] == "triton" and got["kernel_calls"] > 0
    eager, graph = got["runs"]
    assert eager == graph  # tokens and logprobs, bit for bit
    model = build_model("tiny-qwen2", seed=0)
    ids, mask = torch.tensor(eager["ids"]), torch.tensor(eager["mask"])
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position).logits.float()
    start = eager["start"]
    lp = torch.log_softmax(logits[:, start - 1:-1], -1).gather(-1, ids[:, start:, None]).squeeze(-1)
    assert torch.allclose(lp, torch.tensor(eager["logprobs"]), atol=1e-5, rtol=0)
