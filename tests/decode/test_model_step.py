"""prefill/decode_one_token over a paged cache: parity with transformers' generate, eager and graph-replayed
(CPU emulation), one graph per span."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch
from transformers import PreTrainedModel

from hybrid_engine.accelerator import GraphCaptureError
from hybrid_engine.decode.kv_cache import PagedKVCache
from hybrid_engine.decode.model_support import check_model_supported
from hybrid_engine.decode.step import (
    build_decode_mask,
    build_prefill_mask,
    decode_one_token,
    prefill,
    prompt_position_ids,
)
from hybrid_engine.tiny_models import ARCHITECTURES, PAD_ID, build_model, build_tokenizer

N_NEW = 12
CAPACITY = 32


_MODELS: dict[str, PreTrainedModel] = {}


def tiny(arch: str) -> PreTrainedModel:
    if arch not in _MODELS:
        _MODELS[arch] = build_model(f"tiny-{arch}", seed=0, attn_implementation="sdpa")
    return _MODELS[arch]


def prompts(batch: int, length: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 384, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : (2 * b) % (length - 1)] = 0  # row b has 2b pads (left padding)
    return ids.masked_fill(mask == 0, PAD_ID), mask


def reference(model, ids, mask) -> torch.Tensor:
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
        do_sample=False, pad_token_id=PAD_ID,
    )
    return out[:, ids.shape[1]:]


def eager_greedy(model, cache, ids, mask) -> torch.Tensor:
    tok = prefill(model, cache, ids, mask).argmax(-1)
    out = [tok]
    for _ in range(N_NEW - 1):
        tok = decode_one_token(model, cache, tok).argmax(-1)
        out.append(tok)
    return torch.stack(out, 1)


def graph_greedy(acc, model, cache, ids, mask, per_span: bool = False, n_new: int = N_NEW) -> torch.Tensor:
    tok = prefill(model, cache, ids, mask).argmax(-1)
    out = [tok]
    static_tok = tok.clone()
    graphs: dict[int, tuple] = {}
    for _ in range(n_new - 1):
        key = 0
        if per_span:  # the pages the longest row reads, with the token this step writes
            key = -(-(int(cache.write_pos.max()) + 1) // cache.page_size)
        if key not in graphs:
            graph = acc.create_graph()
            with acc.capture_to_graph(graph):
                logits = decode_one_token(model, cache, static_tok, span=key or None)
            graphs[key] = (graph, logits)
        graph, logits = graphs[key]
        acc.replay_graph(graph)
        tok = logits.argmax(-1)
        static_tok.copy_(tok)
        out.append(tok)
    return torch.stack(out, 1)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_matches_generate(arch, batch, cpu_graphs):
    model = tiny(arch)
    ids, mask = prompts(batch)
    ref = reference(model, ids, mask)
    cache = PagedKVCache(model.config, batch, CAPACITY, dtype=model.dtype)
    assert torch.equal(eager_greedy(model, cache, ids, mask), ref)
    cache = PagedKVCache(model.config, batch, CAPACITY, dtype=model.dtype)
    assert torch.equal(graph_greedy(cpu_graphs, model, cache, ids, mask), ref)


@pytest.mark.parametrize("arch", ["opt", "qwen3"])
def test_per_span_graphs_match(arch, cpu_graphs):
    """One graph per span (attention reads only the pages the longest row reaches: here 2, 3, then 4 pages of
    4 tokens), the tokens those of transformers."""
    model = tiny(arch)
    ids, mask = prompts(3)
    ref = reference(model, ids, mask)
    cache = PagedKVCache(model.config, 3, CAPACITY, page_size=4, dtype=model.dtype)
    got = graph_greedy(cpu_graphs, model, cache, ids, mask, per_span=True, n_new=N_NEW)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("arch", ["opt", "mistral", "qwen2"])
def test_rows_at_different_lengths(arch, cpu_graphs):
    """Prefill rows one by one with different prompt lengths, then decode the batch together."""
    model = tiny(arch)
    lengths = [3, 9, 5]
    singles = [prompts(1, length=n, seed=10 + i) for i, n in enumerate(lengths)]
    cache = PagedKVCache(model.config, 3, CAPACITY, dtype=model.dtype)
    first = torch.empty(3, dtype=torch.int64)
    for row in (2, 0, 1):
        ids, mask = singles[row]
        first[row] = prefill(model, cache, ids, mask, rows=torch.tensor([row])).argmax(-1)[0]
    assert cache.write_pos.tolist() == lengths
    assert cache.position.tolist() == lengths
    static_tok = first.clone()
    graph = cpu_graphs.create_graph()
    with cpu_graphs.capture_to_graph(graph):
        logits = decode_one_token(model, cache, static_tok)
    out = [first]
    for _ in range(N_NEW - 1):
        cpu_graphs.replay_graph(graph)
        tok = logits.argmax(-1)
        static_tok.copy_(tok)
        out.append(tok)
    got = torch.stack(out, 1)
    for row, (ids, mask) in enumerate(singles):
        assert torch.equal(got[row : row + 1], reference(model, ids, mask)), row
    assert cache.write_pos.tolist() == [n + N_NEW - 1 for n in lengths]


def test_shared_prefill_fanned_out_with_copy_rows(cpu_graphs):
    model = tiny("llama")
    ids, mask = prompts(1)
    cache = PagedKVCache(model.config, 4, CAPACITY, dtype=model.dtype)
    logits = prefill(model, cache, ids, mask, rows=torch.tensor([0]))
    cache.copy_rows(torch.zeros(3, dtype=torch.int64), torch.tensor([1, 2, 3]))
    tok = logits.argmax(-1).expand(4).clone()
    out = [tok]
    for _ in range(N_NEW - 1):
        tok = decode_one_token(model, cache, tok).argmax(-1)
        out.append(tok)
    got = torch.stack(out, 1)
    ref = reference(model, ids, mask)
    assert torch.equal(got, ref.expand(4, -1))


def test_decode_capture_does_no_host_reads_and_leaves_state(cpu_graphs):
    model = tiny("qwen3")
    ids, mask = prompts(2)
    cache = PagedKVCache(model.config, 2, CAPACITY, dtype=model.dtype)
    tok = prefill(model, cache, ids, mask).argmax(-1)
    before = (cache.write_pos.clone(), cache.position.clone(), [k.clone() for k in cache.pool.keys])
    graph = cpu_graphs.create_graph()
    with cpu_graphs.capture_to_graph(graph):
        decode_one_token(model, cache, tok)
    # capture does not apply its work; the first replay is the first real step
    assert torch.equal(cache.write_pos, before[0]) and torch.equal(cache.position, before[1])
    assert all(torch.equal(a, b) for a, b in zip(cache.pool.keys, before[2]))
    cpu_graphs.replay_graph(graph)
    assert torch.equal(cache.write_pos, before[0] + 1)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts device values read on the host (``.item()``, ``int(t)``, ``bool(t)``: a sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eager_steps_read_nothing_on_the_host(arch):
    """An eager step must not sync where its graph does not: OPT asks the cache for its sequence length at every
    forward, which is answered with a device tensor inside every step, not only while capturing."""
    model = tiny(arch)
    ids, mask = prompts(2)
    cache = PagedKVCache(model.config, 2, CAPACITY, dtype=model.dtype)
    cache.bounds_checks = False  # as the engines run it (they check lengths up front)
    with torch.no_grad():
        tok = prefill(model, cache, ids, mask).argmax(-1)
        with _HostReads() as reads:
            for _ in range(3):
                tok = decode_one_token(model, cache, tok).argmax(-1)
    assert reads.count == 0
    assert isinstance(cache.get_seq_length(), int)  # outside a step, the host int it always was


def test_host_read_inside_capture_is_caught(cpu_graphs):
    """Sanity check of the harness: the seq-length host read would raise while capturing."""
    model = tiny("gpt2")
    cache = PagedKVCache(model.config, 1, 8, dtype=model.dtype)
    graph = cpu_graphs.create_graph()
    with pytest.raises(GraphCaptureError):
        with cpu_graphs.capture_to_graph(graph):
            int(cache.write_pos.max())


def test_decode_past_capacity_raises():
    model = tiny("gpt2")
    ids, mask = prompts(1, length=4)
    cache = PagedKVCache(model.config, 1, 5, page_size=4, dtype=model.dtype)
    tok = prefill(model, cache, ids, mask).argmax(-1)
    tok = decode_one_token(model, cache, tok).argmax(-1)
    with pytest.raises(ValueError, match="capacity"):
        decode_one_token(model, cache, tok)
    cache.reset()
    prefill(model, cache, ids, mask)
    with pytest.raises(ValueError, match="span"):  # 4 tokens a row: the prompt fills them
        decode_one_token(model, cache, tok, span=1)


def test_prefill_rejects_bad_input():
    model = tiny("llama")
    cache = PagedKVCache(model.config, 2, 4, dtype=model.dtype)
    ids, mask = prompts(2, length=6)
    with pytest.raises(ValueError, match="capacity"):
        prefill(model, cache, ids, mask)
    right = torch.tensor([[1, 1, 0]])
    with pytest.raises(ValueError, match="LEFT"):
        prefill(model, cache, torch.tensor([[5, 6, 0]]), right, rows=torch.tensor([0]))


def test_helpers():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert prompt_position_ids(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    m = build_decode_mask(torch.tensor([1, 3]), 4, torch.float32)  # rows holding 1 and 3 tokens write one more
    low = torch.finfo(torch.float32).min
    assert m.shape == (2, 1, 1, 4)
    assert m[:, 0, 0].tolist() == [[0.0, 0.0, low, low], [0.0, 0.0, 0.0, 0.0]]
    assert build_decode_mask(torch.tensor([0]), 2, torch.bfloat16).dtype == torch.bfloat16


def test_check_model_supported():
    for arch in ARCHITECTURES:
        check_model_supported(tiny(arch))
    eager = build_model("tiny-llama", attn_implementation="eager")
    check_model_supported(eager)
    m = build_model("tiny-llama")
    m.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        check_model_supported(m)
    with pytest.raises(TypeError):
        check_model_supported(torch.nn.Linear(2, 2))
    windowed = build_model("tiny-mistral", sliding_window=8)
    check_model_supported(windowed)  # its window is masked: any capacity
    assert PagedKVCache(windowed.config, 1, 16).capacity == 16
    longrope = build_model("tiny-llama").config  # as Phi-3 128k's: factors that switch past a length
    longrope.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                                "long_factor": [2.0] * 4, "original_max_position_embeddings": 8}
    with pytest.raises(ValueError, match="longrope .* exact only up to 8 tokens, less than capacity 16"):
        PagedKVCache(longrope, 1, 16)


def test_check_model_supported_is_cached_until_what_it_read_changes(monkeypatch):
    """A supported model is checked once (no probe cache per call); a change of its config, attention
    implementation or forward is checked again."""
    import hybrid_engine.decode.model_support as support

    model = build_model("tiny-llama")
    model.config.model_type = "my-llama"  # outside the known types: each check probes with a forward
    model.config.scaling = {"factor": 1.0}  # a nested field (as rope_scaling or rope_parameters are)
    probes = []
    real = support.prefill
    monkeypatch.setattr(support, "prefill", lambda *a, **k: probes.append(1) or real(*a, **k))
    for _ in range(3):
        check_model_supported(model)
    assert len(probes) == 1
    model.config.scaling["factor"] = 2.0  # changed in place, inside a nested field
    check_model_supported(model)
    assert len(probes) == 2
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        check_model_supported(model)
    model.config._attn_implementation = "sdpa"
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no cache here"))  # a new forward
    with pytest.raises(TypeError, match="rejected past_key_values"):
        check_model_supported(model)


def test_eager_attention_parity():
    model = build_model("tiny-llama", attn_implementation="eager")
    ids, mask = prompts(3)
    cache = PagedKVCache(model.config, 3, CAPACITY, dtype=model.dtype)
    assert torch.equal(eager_greedy(model, cache, ids, mask), reference(model, ids, mask))


def test_tokenizer_matches_model_ids():
    tok = build_tokenizer(384)
    model = tiny("llama")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id,
    )
    assert tok.padding_side == "left" and len(tok) == 384
    enc = tok(["the of", "and to in is"], padding=True, return_tensors="pt")
    assert enc["attention_mask"][0].tolist() == [0, 0, 1, 1]
    assert int(enc["input_ids"].max()) < model.config.vocab_size


def test_a_padding_query_sees_its_own_slot_so_fp16_eager_attention_makes_no_nan():
    """Every key of a padding query is masked; in fp16 eager attention a very negative score plus
    finfo.min rounds to -inf, the row's softmax is NaN, and the NaN written into the padding slot's K/V at
    the next layer poisons every real row (NaN + mask is NaN). Here every score is about -64."""
    model = build_model("tiny-gpt2", seed=0, dtype=torch.float16, attn_implementation="eager")
    width = model.config.n_embd
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.zero_()
            bias = torch.zeros(3 * width)
            bias[:width], bias[width:2 * width] = -2.0, 2.0  # every query -2, every key +2: scores of -64
            block.attn.c_attn.bias.copy_(bias)
    ids = torch.tensor([[PAD_ID, PAD_ID, 5, 6], [7, 8, 9, 10]])
    mask = (ids != PAD_ID).long()
    cache = PagedKVCache(model.config, 2, 8, dtype=torch.float16)
    logits = prefill(model, cache, ids, mask)
    assert torch.isfinite(logits).all()
    assert not build_prefill_mask(mask, 8, torch.float16).amax(-1).lt(0).any()  # no row masked throughout


def test_a_decode_step_reads_one_set_of_indices_set_for_it_and_cleared_after():
    """Every layer's cache update in a step sees the same ForwardIndices (its span's K/V length and read
    slots); none is left on the cache after the step."""
    model = tiny("llama")
    ids, mask = prompts(2, length=3)
    cache = PagedKVCache(model.config, 2, 8, page_size=4, dtype=model.dtype)
    tok = prefill(model, cache, ids, mask).argmax(-1)
    assert cache.forward_indices is None  # the prefill ran on a view of the rows
    seen = []
    real_update = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        seen.append(cache.forward_indices)
        assert cache.get_seq_length().dim() == 0  # a device tensor inside the step: no host read
        return real_update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = update
    decode_one_token(model, cache, tok, span=1)
    assert len(seen) == model.config.num_hidden_layers and all(f is seen[0] for f in seen)
    assert seen[0].kv_len == 4 and seen[0].read_slots.numel() == 2 * 4 and not seen[0].fresh
    assert cache.forward_indices is None and isinstance(cache.get_seq_length(), int)


def test_a_step_captured_before_any_eager_one_leaves_no_constant_an_eager_step_reads(cpu_graphs, monkeypatch):
    """The mask's constants are made once and kept, but never from inside a capture: a capture runs none of its
    work, so a tensor it made holds its value only after a replay, and a later eager step would read garbage."""
    import hybrid_engine.decode.step as step_module

    monkeypatch.setattr(step_module, "_CONSTANTS", {})
    model = tiny("gpt2")
    ids, mask = prompts(2)
    tokens = torch.tensor([5, 7])
    graph_cache, eager_cache = (PagedKVCache(model.config, 2, CAPACITY, dtype=model.dtype) for _ in range(2))
    prefill(model, graph_cache, ids, mask)
    prefill(model, eager_cache, ids, mask)
    graph = cpu_graphs.create_graph()
    with cpu_graphs.capture_to_graph(graph):  # the first step of the process: its constants are made here
        captured = decode_one_token(model, graph_cache, tokens)
    assert step_module._CONSTANTS == {}
    eager = decode_one_token(model, eager_cache, tokens)
    cpu_graphs.replay_graph(graph)
    assert torch.equal(eager, captured)
    assert step_module._CONSTANTS  # made eagerly: kept
