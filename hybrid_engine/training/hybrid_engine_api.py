"""What a DeepSpeed-Chat style trainer asks of DeepSpeed's ``DeepSpeedHybridEngine``, beyond DeepSpeedEngine.

DeepSpeed's hybrid engine times each PPO iteration: ``generate`` records its gather and generate latency,
``train()`` starts the training clock, ``step()`` adds to it, and ``eval()`` (the start of the next
experience generation) prints one line on rank 0 with the iteration's end-to-end, gather, generate and
training time and the samples per second. The fields (``_t_start``, ``_total_latency``, ``_iters``,
``_generate_latency``, ``_training_latency``, ``_gather_latency``, ``_total_batch_size``, ...) and the
line keep DeepSpeed's names and format, behind the same switch (``hybrid_engine.enabled``, given in the config as DeepSpeed-Chat gives it; implied by graphs alone it stays quiet), so a script
parsing them keeps working. :class:`DeepSpeedHybridEngineAPI` holds them and the memory/LoRA calls
DeepSpeed's engine offers (``empty_partition_cache``, ``fuse_lora_weight``, ``unfuse_lora_weight``,
``retake_inference_cache``); the engine calls its ``_latency_*`` hooks. Nothing here touches graphs:
a LoRA fuse writes the base weights in place (addresses unchanged) and flips the layers' plain flags,
which the graph fingerprint sees, so the next ``generate`` recaptures.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from hybrid_engine.accelerator import get_accelerator
from hybrid_engine.distributed.world import rank, world_size

__all__ = ["DeepSpeedHybridEngineAPI", "latency_line"]


def latency_line(latency: float, gather: float, generate: float, training: float, total_latency: float,
                 iters: int, total_batch_size: int | None) -> str:
    """DeepSpeed's per-iteration line (``DeepSpeedHybridEngine.eval``), character for character."""
    if total_batch_size is not None:
        cur = f'|CurSamplesPerSec={(1 / latency * total_batch_size):.2f} '
        avg = f'|AvgSamplesPerSec={(1 / (total_latency / iters) * total_batch_size):.2f}'
    else:
        cur = avg = ''
    others = latency - (generate + training)
    return (f'|E2E latency={(latency):.2f}s '
            f'|Gather latency={gather:.2f}s ({(gather / latency * 100):.2f}%) '
            f'|Generate time={(generate):.2f}s ({(generate / latency * 100):.2f}%) '
            f'|Training time={(training):.2f}s ({(training / latency * 100):.2f}%) '
            f'|Others={others:.2f} ({(others / latency * 100):.2f}%)' + cur + avg)


class DeepSpeedHybridEngineAPI:
    """DeepSpeed's ``DeepSpeedHybridEngine`` timing fields and calls, mixed into the engine."""

    module: torch.nn.Module
    config: Any

    def _latency_init(self) -> None:
        self._t_start: float | None = None
        self._t0 = time.time()
        self._total_latency = 0.0
        self._iters = 0
        self._training_start_time: float | None = None
        self._generate_latency = 0.0
        self._training_latency = 0.0
        self._total_batch_size: int | None = None
        self._gather_latency = 0.0

    def _latency_generate_start(self, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._total_batch_size is None:
            ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
            if isinstance(ids, torch.Tensor) and ids.dim() == 2:
                self._total_batch_size = ids.shape[0] * world_size()
        self._t0 = time.time()
        self._gather_latency = 0.0

    def _latency_gathered(self) -> None:
        """Parameters gathered for the call (ZeRO-3): the time since the call began is the gather latency."""
        self._gather_latency = time.time() - self._t0

    def _latency_generate_end(self) -> None:
        self._generate_latency = time.time() - self._t0 - self._gather_latency

    def _latency_eval(self) -> None:
        """At ``eval()``, as DeepSpeed: close the iteration begun at the last ``eval()`` and print its line."""
        if self._t_start is not None:
            latency = time.time() - self._t_start
            self._total_latency += latency
            self._iters += 1
            he = self.config.hybrid_engine
            if he.enabled and "enabled" in he.model_fields_set and rank() == 0 and latency > 0:
                print(latency_line(latency, self._gather_latency, self._generate_latency, self._training_latency,
                                   self._total_latency, self._iters, self._total_batch_size))
        self._t_start = time.time()
        self._training_latency = 0.0

    def _latency_train(self) -> None:
        self._training_start_time = time.time()

    def _latency_step(self) -> None:
        if self._training_start_time is not None:
            now = time.time()
            self._training_latency += now - self._training_start_time
            self._training_start_time = now

    # ------------------------------------------------------------- DeepSpeed's calls
    def empty_partition_cache(self) -> None:
        """Free cached memory, as DeepSpeed's: under ZeRO-3 DeepSpeed releases its gathered-parameter cache
        (its own ``empty_partition_cache``); then Python's garbage and the accelerator's cached blocks are freed.
        The engine's decode buffers and graphs are kept (``destroy()`` releases them)."""
        ds = getattr(self, "_deepspeed", lambda: None)()
        if ds is not None and callable(getattr(ds, "empty_partition_cache", None)):
            ds.empty_partition_cache()
        gc.collect()
        get_accelerator().empty_cache()

    def fuse_lora_weight(self) -> None:
        """Merge LoRA adapters into the base weights, in place: PEFT's ``merge_adapter()`` on a PEFT model, else
        ``fuse_lora_weight()`` on every layer that has one (DeepSpeed-Chat's ``LinearLayer_LoRA``). Generation
        needs no fuse here (graphs capture the adapter's matmuls); the next ``generate`` recaptures after it."""
        self._each_lora("merge_adapter", "fuse_lora_weight")

    def unfuse_lora_weight(self) -> None:
        """Undo :meth:`fuse_lora_weight` (PEFT's ``unmerge_adapter()``, or each layer's ``unfuse_lora_weight()``)."""
        self._each_lora("unmerge_adapter", "unfuse_lora_weight")

    def _each_lora(self, peft_call: str, layer_call: str) -> None:
        with torch.no_grad():
            if callable(getattr(self.module, peft_call, None)):
                getattr(self.module, peft_call)()
                return
            for m in self.module.modules():
                if m is not self.module and callable(getattr(m, layer_call, None)):
                    getattr(m, layer_call)()

    def retake_inference_cache(self) -> None:
        """DeepSpeed re-acquires its inference workspace here after ``release_inference_cache`` freed it.
        Here ``generate`` takes its decode buffers back itself (``hybrid_engine.release_inference_cache`` puts the
        page pool to sleep after each call, and the next call wakes it: ``docs/memory-handoff.md``): nothing to
        retake."""
        return None
