"""PagedKVCache against the Cache API of the transformers installed, whatever its version.

Why: models call their cache through transformers' ``Cache`` and layer methods, and each release may add one
(5.25 added ``increase_count`` and ``get_recurrent_states_to_keep``; every state-layer family then failed with an
``AttributeError`` deep in its forward and was refused). Here every public method and property that
transformers' ``Cache``, ``CacheLayerMixin`` and ``LinearAttentionCacheLayerMixin`` define must be implemented by
``PagedKVCache`` or its layer, and accept the arguments the base accepts, or be listed below with why the base
implementation is right for a paged cache. The next API addition fails this one test, by name.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoConfig, cache_utils

from hybrid_engine.decode.kv_cache import PagedKVCache, _PagedKVLayer

#: Cache members whose transformers implementation is right for PagedKVCache, and why.
INHERITED_CACHE = {
    "__len__": "the number of layers, which the cache builds up front",
    "__getitem__": "4.57's legacy (keys, values) view of a layer: that layer's pool storage",
    "__iter__": "4.57's legacy iteration over those views",
}
#: Layer members whose transformers implementation is right for the paged layer, and why.
INHERITED_LAYER: dict[str, str] = {}
#: Dunder members checked besides the public ones (the rest are Python's object protocol).
DUNDERS = ("__len__", "__getitem__", "__iter__")

BASE_LAYERS = tuple(getattr(cache_utils, name) for name in ("CacheLayerMixin", "LinearAttentionCacheLayerMixin")
                    if hasattr(cache_utils, name))


def api_members(base: type) -> dict[str, Any]:
    """Public methods and properties ``base`` defines or inherits from transformers (not data attributes)."""
    members: dict[str, Any] = {}
    for klass in reversed(base.__mro__):
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if (name.startswith("_") and name not in DUNDERS) or not (
                    inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod))):
                continue
            members[name] = value
    return members


def defining_class(cls: type, name: str) -> type | None:
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def from_transformers(klass: type | None) -> bool:
    return klass is not None and klass.__module__.split(".")[0] == "transformers"


def missing_arguments(base_fn: Any, ours: Any) -> str | None:
    """Whether ``ours`` accepts a call shaped as callers of ``base_fn`` make it: required parameters by position,
    optional ones by keyword. Returns the reason it does not, or None."""
    base_fn = base_fn.__func__ if isinstance(base_fn, (staticmethod, classmethod)) else base_fn
    ours = ours.__func__ if isinstance(ours, (staticmethod, classmethod)) else ours
    args, kwargs = [], {}
    for i, p in enumerate(inspect.signature(base_fn).parameters.values()):
        if i == 0 or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty and p.kind is not p.KEYWORD_ONLY:
            args.append(None)
        else:
            kwargs[p.name] = None
    try:
        inspect.signature(ours).bind(None, *args, **kwargs)
    except TypeError as err:
        return f"{inspect.signature(ours)} does not accept {len(args)} positional and {sorted(kwargs)}: {err}"
    return None


def check(ours: type, bases: tuple[type, ...], inherited: dict[str, str]) -> list[str]:
    problems = []
    for base in bases:
        for name, base_member in sorted(api_members(base).items()):
            where = defining_class(ours, name)
            if where is None:
                problems.append(f"{base.__name__}.{name} (transformers {transformers.__version__}) is missing "
                                f"from {ours.__name__}")
            elif from_transformers(where):
                if name not in inherited:
                    problems.append(f"{base.__name__}.{name} (transformers {transformers.__version__}) is "
                                    f"{where.__name__}'s, not {ours.__name__}'s: implement it in "
                                    "hybrid_engine/decode/kv_cache.py, or list it here with why the base one is "
                                    "right for a paged cache")
            elif not isinstance(base_member, property) and not isinstance(vars(where)[name], property):
                reason = missing_arguments(base_member, vars(where)[name])
                if reason:
                    problems.append(f"{ours.__name__}.{name}: {reason}")
    return problems


def test_paged_cache_implements_every_method_of_transformers_cache():
    assert check(PagedKVCache, (cache_utils.Cache,), INHERITED_CACHE) == []


def test_paged_layer_implements_every_method_of_transformers_layers():
    assert check(_PagedKVLayer, BASE_LAYERS, INHERITED_LAYER) == []


def test_the_check_catches_a_method_transformers_adds():
    """The check itself: a method added to the base (as 5.25 added ``increase_count``) is reported by name."""
    class NewCache(cache_utils.Cache):
        def brand_new_method(self, layer_idx: int) -> None: ...

    class Narrow(PagedKVCache):
        def get_seq_length(self) -> int: ...  # drops layer_idx, which callers pass

    assert any("NewCache.brand_new_method" in p and "missing from PagedKVCache" in p
               for p in check(PagedKVCache, (NewCache,), INHERITED_CACHE))
    # A base method left to the base class: PagedKVCache's own methods less one.
    bare = type("Bare", (cache_utils.Cache,), {n: v for n, v in vars(PagedKVCache).items() if n != "get_seq_length"})
    assert any("Cache.get_seq_length" in p and "is Cache's" in p for p in check(bare, (cache_utils.Cache,), {}))
    assert any(p.startswith("Narrow.get_seq_length") for p in check(Narrow, (cache_utils.Cache,), INHERITED_CACHE))


@pytest.mark.skipif(not hasattr(cache_utils.Cache, "increase_count"), reason="transformers before 5.25")
def test_the_state_layer_calls_of_5_25_keep_each_rows_state():
    """``increase_count`` has nothing to count (``write_pos`` is each row's length), nothing asks for intermediate
    recurrent states, and a list of states keeps the last one."""
    config = AutoConfig.for_model("mamba", vocab_size=128, hidden_size=16, num_hidden_layers=2, state_size=4)
    cache = PagedKVCache(config, 2, 8, page_size=4, dtype=torch.float32)  # states made at the first write
    before = cache.write_pos.clone()
    cache.increase_count(0, 0)
    cache.layers[0].increase_count(0)
    assert torch.equal(cache.write_pos, before)
    assert cache.get_recurrent_states_to_keep(0) == 0 and cache.get_recurrent_states_to_keep() == 0
    first, last = torch.ones(2, 3), torch.full((2, 3), 7.0)
    assert torch.equal(cache.update_recurrent_state([first, last], 0), last)
    assert not cache.fresh  # outside a prefill: the states are continued
    assert torch.equal(cache.get_recurrent_state(0), last)
    with pytest.raises(NotImplementedError, match="past states"):
        cache.activate_past_recording(recurrent_states_to_keep=2)
