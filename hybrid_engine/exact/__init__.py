"""Exact on-policy logprobs: batch-invariant kernels shared by the rollout and the training forward."""

from hybrid_engine.exact.chunks import chunk_rows, fixed_bmm
from hybrid_engine.exact.kernels import KEY_BLOCK, block_attention, exact_linear
from hybrid_engine.exact.mode import EXACT_ATTENTION, exact_forward, exact_kernels
from hybrid_engine.exact.rows import pack_order, pack_rows, unpack

__all__ = ["EXACT_ATTENTION", "KEY_BLOCK", "block_attention", "chunk_rows", "exact_forward", "exact_kernels",
           "exact_linear", "fixed_bmm", "pack_order", "pack_rows", "unpack"]
