"""``hybrid-engine bench kernels``: device ops and K/V bytes of one decode step, ours next to transformers'.

Why: graphs remove host launch cost, not device work. What a step costs an accelerator is the number of kernels
it launches and the bytes they move, and both can be counted on any machine: every aten op that reaches the
dispatcher is recorded (a ``TorchDispatchMode``); views and allocations launch no kernel and are left out; a
``torch.library`` custom op reaches the mode once, so it counts once, whatever its implementation runs inside.

Ours: the function a capture records, ``DecodeSlots.step`` (decode forward + in-graph sampling + bookkeeping), run
once eagerly on hand-built slots: ``--batch`` live rows at length ``--span`` on distinct pages (the method of
``shared/reference/decode-step-costs/step_bytes.py``). Transformers': one decode step of its own ``generate``
(DynamicCache, its logits warpers): ``generate(k + 1)`` minus ``generate(k)`` from a ``span - k`` token prompt, so
its rows end at the same length. Qwen2.5-0.5B and -7B widths (heads, KV heads, head dim, intermediate, vocab),
``--layers`` layers (default 2), bf16, random weights: per-layer figures are one decoder layer's ops (each op is
attributed to the layer whose module ran it; every layer's must be equal), fixed ones the rest, and totals are
scaled to the real depth. K/V bytes: what the ops of the cache update and the attention core read and write
(inputs over their reachable extent, outputs once; gathers and scatters only the rows they touch), next to the
ideal of a paged kernel (each row's live tokens read once, the new token written once).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybrid_engine.benchmarks import common as C

SHAPES = {  # Qwen2.5 config.json widths and depth
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                 vocab_size=151936, tie_word_embeddings=True, real_layers=24),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False, real_layers=28),
}
#: (our sampling key, transformers' generate kwargs) per mode.
MODES = {
    "greedy": ((0.0, 1.0, -1), dict(do_sample=False)),
    "temperature 1": ((1.0, 1.0, -1), dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)),
    "top-p 0.9": ((1.0, 0.9, -1), dict(do_sample=True, temperature=1.0, top_k=0, top_p=0.9)),
}
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
             "alias", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size", "set_",
             "resize_", "_unsafe_view", "scalar_tensor"}
GATHER_LIKE = {"index_select", "gather", "index", "embedding"}
SCATTER_LIKE = {"index_copy_", "index_copy", "scatter_", "scatter", "index_put_", "index_put", "index_fill_"}
#: Ops whose bytes are K/V traffic: the cache update (write, gather, concatenation) and the attention core.
KV_CATEGORIES = ("kv_write", "kv_gather", "kv_cat", "attention")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="0.5b,7b", help="comma-separated: 0.5b, 7b (default both)")
    p.add_argument("--batch", type=int, default=4, help="rows (default 4)")
    p.add_argument("--span", type=int, default=64, help="tokens each row holds, a multiple of 16 (default 64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers built (default 2; totals are scaled)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--fused", default="both", choices=("on", "off", "both"),
                   help="our step with the fused decode forward (hybrid_engine.fused_decode: true; on a machine "
                        "without kernels its ops run their references, each counted once), with transformers' "
                        "modules, or both (default)")
    p.add_argument("--check", action="store_true",
                   help="instead of counting: run every decode custom op against its reference on --device at "
                        "Qwen2.5-0.5B widths (exit 1 on a mismatch)")
    p.add_argument("--compile-for", default=None, metavar="TARGETS",
                   help="instead of counting: compile every Triton kernel the decode ops launch (at --check's "
                        "widths) for these NVIDIA targets, e.g. sm_80,sm_90, with no GPU; report shared memory, "
                        "registers and spills (exit 1 when one does not compile or does not fit)")
    p.add_argument("--device", default=None, help="--check's device (default: auto-detect)")
    p.add_argument("--dtype", default="auto",
                   help="--check's dtype: auto (bf16), fp32, fp16, bf16; --compile-for's: auto (all three) or one")


def _no_kernel(func: Any) -> bool:
    return bool(getattr(func, "is_view", False)) or func.overloadpacket.__name__ in NO_KERNEL


def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    ext = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return min(ext * t.element_size(), t.untyped_storage().nbytes())


def _bytes(name: str, args: Any, kwargs: Any, out: Any) -> tuple[int, int]:
    """(read, written) bytes one kernel must move at least."""
    ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if name == "paged_decode_attention":  # reads each row's own tokens from the pool, in place
        query, keys, _, table, lengths = ins[:5]
        per_token = 2 * keys.shape[1] * keys.shape[2] * keys.element_size()
        return (int(lengths.sum()) * per_token + query.nbytes + table.nbytes + lengths.nbytes,
                sum(o.nbytes for o in outs))
    if name in GATHER_LIKE and len(ins) > 1:
        moved = sum(o.nbytes for o in outs)
        return moved + sum(_extent(a) for a in ins[1:]), moved
    if name in SCATTER_LIKE and ins:
        src = ins[-1]
        moved = _extent(src) if src.dim() else 0
        return moved + sum(_extent(a) for a in ins[1:-1]), max(moved, src.element_size())
    return sum(_extent(a) for a in ins), sum(o.nbytes for o in outs)


#: Our custom ops, by what they do (each one launch).
CUSTOM_OP_CATEGORIES = {"paged_decode_attention": "attention", "rms_norm": "norm", "add_rms_norm": "norm",
                        "rotary_qk": "rotary", "silu_mul": "activation", "sample_rows": "sampling",
                        "advance_rows": "bookkeeping"}


def _category(frames: list[tuple[str, str, str | None]], op: str) -> str:
    """What an op is for: a custom op by its name, else from the innermost Python frame that says."""
    if op in CUSTOM_OP_CATEGORIES:
        return CUSTOM_OP_CATEGORIES[op]
    for fname, func, cls in frames:
        base = fname.rsplit("/", 1)[-1]
        if func in ("sdpa_attention_forward", "eager_attention_forward") or fname.endswith("ops/paged_attention.py"):
            return "attention"
        if base == "kv_cache.py" and func in ("update", "_update_ring"):
            return "kv_write" if op.startswith("index_copy") else "kv_gather" if op == "index_select" else "kv_other"
        if base == "cache_utils.py" and func == "update":
            return "kv_cat"
        if func in ("apply_rotary_pos_emb", "rotate_half", "_rope_table") or (cls or "").endswith("RotaryEmbedding") \
                or (base == "fused_forward.py" and op == "index_select"):  # the fused step's cos/sin lookup
            return "rotary"
        if (cls or "").endswith("RMSNorm"):
            return "norm"
        if cls == "Linear":
            return "matmul"
        if cls == "Embedding":
            return "embedding"
        if func in ("build_decode_mask", "_additive", "build_ring_mask", "layer_masks") or base == "masking_utils.py":
            return "mask"
        if base == "sampling.py" or func == "choose_tokens" or base == "logits_process.py":
            return "sampling"
        if base in ("slots.py", "step.py", "kv_cache.py", "masking_utils.py"):
            return "bookkeeping"
        if base == "utils.py" and "generation" in fname:
            return "sampling" if op in ("softmax", "_softmax", "multinomial", "argmax") else "bookkeeping"
    return "model"


class Counter(TorchDispatchMode):
    """Every kernel-launching op: (layer or None, category, op name, bytes read, bytes written)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[int | None, str, str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _no_kernel(func):
            return out
        frames, layer = [], None
        f = sys._getframe(1)
        while f is not None and len(frames) < 40:
            s = f.f_locals.get("self")
            cls = type(s).__name__ if s is not None else None
            frames.append((f.f_code.co_filename, f.f_code.co_name, cls))
            if layer is None and cls is not None and cls.endswith("DecoderLayer"):
                layer = getattr(getattr(s, "self_attn", None), "layer_idx", None)
            f = f.f_back
        name = func.overloadpacket.__name__
        read, written = _bytes(name, args, kwargs, out)
        self.ops.append((layer, _category(frames, name), str(func.name()), read, written))
        return out


def build_model(shape: str, layers: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = {k: v for k, v in SHAPES[shape].items() if k != "real_layers"}
    cfg = Qwen2Config(**spec, num_hidden_layers=layers, max_position_embeddings=32768, rope_theta=1_000_000.0,
                      rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643, pad_token_id=151643,
                      attn_implementation="sdpa", dtype=torch.bfloat16)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()


def ours(model: Any, batch: int, span: int, key: tuple[float, float, int], fused: bool | str = True) -> list[tuple]:
    """The ops of one ``DecodeSlots.step`` over ``batch`` live rows of ``span`` tokens (hand-built slots);
    ``fused``: ``hybrid_engine.fused_decode`` for the call (``True``: the fused decode forward, its ops running
    their references where this machine has no kernel, each counted once)."""
    from hybrid_engine.decode.kv_pool import KVPool
    from hybrid_engine.decode.layout import layer_specs
    from hybrid_engine.decode.slots import DecodeSlots

    page = 16
    pages = span // page
    pool = KVPool(layer_specs(model.config), 1 + batch * pages, page, device=torch.device("cpu"),
                  dtype=torch.bfloat16)
    slots = DecodeSlots(model, batch, span + 16, num_eos=1, pool=pool)
    cache = slots.cache
    cache.block_table[:, :pages].copy_(1 + torch.arange(batch * pages).view(batch, pages))
    slots.budget.fill_(10_000)
    slots.seed.fill_(1)
    slots.stream.copy_(torch.arange(batch))
    slots.set_special_ids(151643, (151643,))
    slots.knobs.set(*key)
    slots.begin_call(model, logprobs=True, fused=fused)
    for warm in (True, False):  # a warm-up step first: constants made once per process are not step work
        cache.write_pos.fill_(span - 1)
        cache.position.fill_(span - 1)
        slots.finished.fill_(False)
        slots.live.fill_(True)  # the step reads its mirrors of ``finished`` (decode/ops/bookkeeping.py)
        slots.advance.fill_(1)
        slots.suppress_eos.fill_(False)
        slots.tokens.copy_(torch.randint(10, 1000, (batch,), generator=torch.Generator().manual_seed(1)))
        slots.token_index.fill_(1)
        if warm:
            with torch.no_grad():
                slots.step(model, key, pages)
    counter = Counter()
    with torch.no_grad(), counter:
        slots.step(model, key, pages)
    return counter.ops


def transformers_step(model: Any, batch: int, span: int, gen: dict[str, Any], k: int = 2) -> list[tuple]:
    """The ops of one decode step of ``model.generate``: ``generate(k + 1)`` minus ``generate(k)``, rows ending at
    ``span`` tokens (a multiset difference of (layer, category, op, bytes))."""
    ids = torch.randint(10, 1000, (batch, span - k), generator=torch.Generator().manual_seed(1))
    counted = []
    for n in (k, k + 1):
        counter = Counter()
        with torch.no_grad(), counter:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           eos_token_id=None, pad_token_id=151643, **gen)
        counted.append(collections.Counter(counter.ops))
    diff = counted[1] - counted[0]
    return list(diff.elements())


def implementations(model: Any, fused: bool) -> dict[str, str]:
    """The implementation each decode op runs with on this machine (what the counts above measured)."""
    from hybrid_engine.decode import sampling
    from hybrid_engine.decode.ops import bookkeeping, layer_ops, paged_attention

    device = next(model.parameters()).device
    paged = paged_attention.implementation(device)
    if fused:
        attention = f"hybrid_engine::paged_decode_attention ({paged})"
    elif paged != "reference":
        attention = f"hybrid_engine::paged_decode_attention, {paged} kernel reading each row's pages in place"
    else:
        attention = (f"page gather (index_select) + {model.config._attn_implementation} with a [B, span] mask "
                     "(paged_decode_attention's reference; no kernel on this device)")
    layers = (f"hybrid_engine::add_rms_norm / rms_norm / rotary_qk / silu_mul ({layer_ops.implementation(device)})"
              if fused else "transformers' modules (unfused)")
    return {"attention": attention, "norm / rotary / MLP": layers,
            "sampler": getattr(sampling, "IMPLEMENTATION", "stable full-vocabulary sort + inverse CDF"),
            "bookkeeping": f"hybrid_engine::advance_rows ({bookkeeping.implementation(device)})"}


def summarise(ops: list[tuple], layers: int, real_layers: int, batch: int, span: int, kv_token_bytes: int,
              label: str) -> dict[str, Any]:
    """Per-layer, fixed and scaled totals of kernels and K/V bytes."""
    per_layer = [o[1:] for o in ops if o[0] == 0]
    for i in range(1, layers):
        if sorted(o[1:] for o in ops if o[0] == i) != sorted(per_layer):
            raise RuntimeError(f"bench kernels: {label}: layer {i}'s ops differ from layer 0's")
    fixed = [o[1:] for o in ops if o[0] is None]
    kv_layer = sum(r + w for cat, _, r, w in per_layer if cat in KV_CATEGORIES)
    ideal_layer = batch * span * kv_token_bytes + batch * kv_token_bytes
    return {
        "per_layer": len(per_layer), "fixed": len(fixed), "total": len(fixed) + real_layers * len(per_layer),
        "per_layer_by_category": dict(collections.Counter(c for c, *_ in per_layer)),
        "fixed_by_category": dict(collections.Counter(c for c, *_ in fixed)),
        "fixed_ops": dict(collections.Counter(f"{c}:{op}" for c, op, _, _ in fixed)),
        "kv_read_bytes": real_layers * sum(r for c, _, r, _ in per_layer if c in KV_CATEGORIES),
        "kv_written_bytes": real_layers * sum(w for c, _, _, w in per_layer if c in KV_CATEGORIES),
        "kv_bytes_over_ideal": kv_layer / ideal_layer,
        "step_bytes": sum(r + w for *_, r, w in fixed) + real_layers * sum(r + w for *_, r, w in per_layer),
    }


def measure_shape(shape: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    model = build_model(shape, args.layers)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_token_bytes = 2 * cfg.num_key_value_heads * head_dim * 2  # K and V, bf16
    real = SHAPES[shape]["real_layers"]
    rows = []
    for mode, (key, gen) in MODES.items():
        ways = [("hybrid-engine step, fused", True)] if args.fused in ("on", "both") else []
        ways += [("hybrid-engine step, unfused", False)] if args.fused in ("off", "both") else []
        steps = [(who, ours(model, args.batch, args.span, key, fused)) for who, fused in ways]
        steps.append(("transformers generate", transformers_step(model, args.batch, args.span, gen)))
        for who, ops in steps:
            s = summarise(ops, args.layers, real, args.batch, args.span, kv_token_bytes, f"{shape} {who} {mode}")
            rows.append({"shape": shape, "mode": mode, "who": who, **s})
    rows.append({"shape": shape, "implementations": implementations(model, args.fused != "off")})
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """``--check``: :func:`~hybrid_engine.benchmarks.kernel_check.check_kernels` on the device, as a table."""
    from hybrid_engine.benchmarks.kernel_check import check_kernels

    C.check_output_path("--json", args.json)
    device = C.select_device(args.device).device()
    dtype = torch.bfloat16 if args.dtype == "auto" else C.parse_dtype(args.dtype, device.type)
    env = C.environment(getattr(args, "argv", None))
    # On CUDA with Triton every op should run its kernel: one that fell back to its reference fails, and is run forced
    expect = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    rows = check_kernels(device, dtype, expect_kernels=expect)
    table = C.format_table(["ops", "op", "implementation", "max |ours - reference|", "tolerance", "ok"],
                           [[r["group"], r["op"], r["implementation"],
                             (r["error"] or "")[:80] or f"{r['max_abs_err']:.2e}", f"{r['tolerance']:g}",
                             "yes" if r["ok"] else "NO"] for r in rows])
    ok = all(r["ok"] for r in rows)
    text = (f"\nbench kernels --check: every decode custom op against its reference on {device}, "
            f"{C.dtype_name(dtype)}, Qwen2.5-0.5B widths\n{C.environment_lines(env)}\n\n{table}\n\n"
            f"{'all ops agree with their references' if ok else 'SOME OPS DISAGREE WITH THEIR REFERENCES'}")
    payload = {"benchmark": "kernels", "check": True, "environment": env, "ok": ok,
               "settings": {"device": str(device), "dtype": C.dtype_name(dtype)}, "rows": rows}
    C.finish(args, payload, text, None, "kernels")
    if not ok:
        raise SystemExit(1)
    return payload


def run_compile(args: argparse.Namespace) -> dict[str, Any]:
    """``--compile-for``: :func:`~hybrid_engine.benchmarks.triton_aot.compile_kernels`, as a table."""
    from hybrid_engine.benchmarks.triton_aot import compile_kernels, parse_targets

    C.check_output_path("--json", args.json)
    try:
        targets = parse_targets(args.compile_for)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    dtypes = ([torch.bfloat16, torch.float16, torch.float32] if args.dtype == "auto"
              else [C.parse_dtype(args.dtype, "cuda")])
    env = C.environment(getattr(args, "argv", None))
    rows = compile_kernels(targets, dtypes)

    def number(value: Any) -> str:
        return "?" if value is None else str(value)

    table = C.format_table(["target", "dtype", "op", "kernel", "warps", "shared bytes", "registers", "spill bytes",
                            "compiled"],
                           [[r["target"], r.get("dtype", "-"), r["op"], r["kernel"], number(r.get("num_warps")),
                             number(r.get("shared_bytes")), number(r.get("registers")), number(r.get("spill_bytes")),
                             "yes" if r["ok"] else "NO: " + (r["error"] or "")[:100]] for r in rows])
    ok = all(r["ok"] for r in rows)
    spills = sum(1 for r in rows if r.get("spill_bytes"))
    text = (f"\nbench kernels --compile-for {args.compile_for}: every Triton kernel of the decode ops, compiled "
            f"ahead of time (Qwen2.5-0.5B widths; nothing runs)\n{C.environment_lines(env)}\n\n{table}\n\n"
            f"{'every kernel compiled and fits' if ok else 'SOME KERNELS DO NOT COMPILE OR DO NOT FIT'}"
            f"{f'; {spills} launch(es) spill registers' if spills else ''}")
    payload = {"benchmark": "kernels", "compile_for": [f"sm_{t}" for t in targets], "environment": env, "ok": ok,
               "settings": {"dtypes": [C.dtype_name(d) for d in dtypes]}, "rows": rows}
    C.finish(args, payload, text, None, "kernels")
    if not ok:
        raise SystemExit(1)
    return payload


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.compile_for is not None:
        return run_compile(args)
    if args.check:
        return run_check(args)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        raise SystemExit(f"error: --shapes takes {', '.join(SHAPES)} (comma-separated), got {args.shapes!r}")
    if args.span < 32 or args.span % 16 or args.batch < 1 or args.layers < 2:
        raise SystemExit("error: --span must be a multiple of 16 (at least 32), --batch >= 1, --layers >= 2")
    C.check_output_path("--json", args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = C.environment(getattr(args, "argv", None))
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        rows += measure_shape(shape, args)
    counted = [r for r in rows if "who" in r]
    table = C.format_table(
        ["shape", "mode", "step", "ops / layer", "ops fixed", "ops total (real depth)", "K/V read", "K/V written",
         "K/V / ideal", "by category, fixed"],
        [[r["shape"], r["mode"], r["who"], r["per_layer"], r["fixed"], r["total"], _mib(r["kv_read_bytes"]),
          _mib(r["kv_written_bytes"]), f"{r['kv_bytes_over_ideal']:.2f}x",
          ", ".join(f"{k} {v}" for k, v in sorted(r["fixed_by_category"].items()))] for r in counted])
    impl = "\n".join(f"{r['shape']}: " + "; ".join(f"{k}: {v}" for k, v in r["implementations"].items())
                     for r in rows if "implementations" in r)
    text = (f"\nbench kernels: Qwen2.5 widths, {args.layers} layers built (totals scaled to 24 / 28), bf16, "
            f"batch {args.batch}, rows at {args.span} tokens; ops that launch a kernel (custom ops once)\n"
            f"{C.environment_lines(env)}\n\n{table}\n\nimplementations chosen:\n{impl}")
    payload = {"benchmark": "kernels", "environment": env,
               "settings": {"shapes": shapes, "batch": args.batch, "span": args.span, "layers": args.layers},
               "rows": rows}
    C.finish(args, payload, text, None, "kernels")
    return payload
