"""HybridEngine: one module that trains a causal LM and generates its rollouts.

The engine holds the Hugging Face model once. Training goes to one of two
backends, chosen from ``zero_optimization.stage``: plain PyTorch for stage 0
in one process (:mod:`hybrid_engine.training.local`), DeepSpeed's engine for ZeRO 1-3
and for stage 0 over several ranks (:mod:`hybrid_engine.training.deepspeed`). With
``bf16``/``fp16`` both keep low-precision module parameters and fp32 master
weights in the optimizer, so rollouts run at low precision too. Generation
goes through :mod:`hybrid_engine.generation.generate`, which decodes on the engine's
graph runner (:mod:`hybrid_engine.graphs.runner`): one captured step per batch
bucket and sampling mode, replayed at every position.

Why the two sides can share one model safely: every optimizer update lands in
the module's parameters in place, so captured graphs, which read weights by
address, see them on the next replay; anything that re-allocates a parameter or
buffer changes the weight fingerprint, and the runner drops its graphs before
the next replay. Under ZeRO-3 graphs are refused and each generate call runs
eagerly on parameters gathered for that call, unless generation runs on the
gathered inference copy (:mod:`hybrid_engine.distributed.inference_copy`).

Train/eval: ``eval()`` selects the inference path, ``train()`` the training
forward. ``generate`` called in train mode runs that one call in eval mode (no
dropout) under ``torch.no_grad`` and gives every submodule its own mode back.

Threads: generation and the training calls (``engine(...)``, ``backward``,
``step``, ``train``/``eval``) on one model run one at a time; a call from
another thread waits for the running one (:mod:`hybrid_engine.generation.call_context`),
so no training forward runs in the eval mode a generate set and no generation
sees a half-applied optimizer step.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybrid_engine.accelerator.memory import free_memory
from hybrid_engine.config.loading import ConfigSource, load_config
from hybrid_engine.config.schema import EngineConfig, HybridEngineConfig
from hybrid_engine.distributed.deepspeed_import import REPLACES_DEEPSPEED_INITIALIZE, remember_initialize
from hybrid_engine.distributed.inference_copy import InferenceCopy
from hybrid_engine.distributed.world import rank, world_size
from hybrid_engine.distributed.zero3 import gathered_for_inference
from hybrid_engine.exact.mode import check_exact_support, exact_forward
from hybrid_engine.generation.call_context import decode_grad_mode, eval_for_generation, exclusive_model_call
from hybrid_engine.generation.generate import GenerateFrontEnd
from hybrid_engine.graphs.handoff import SleepingTags
from hybrid_engine.graphs.runner import DecodeGraphRunner
from hybrid_engine.graphs.stats import GraphStats
from hybrid_engine.model_access import decode_model
from hybrid_engine.rollout.handoff import HandoffStats, MemoryHandoff, sleep_optimizer_during_generation
from hybrid_engine.training import checkpoint
from hybrid_engine.training.deepspeed import DeepSpeedTraining
from hybrid_engine.training.deepspeed import build as build_deepspeed_training
from hybrid_engine.training.deepspeed_interface import DeepSpeedEngineInterface
from hybrid_engine.training.hybrid_engine_api import DeepSpeedHybridEngineAPI
from hybrid_engine.training.local import LocalTraining, build_optimizer, build_scheduler, check_lr_kwargs
from hybrid_engine.training.precision import MasterWeights
from hybrid_engine.user_warnings import user_stacklevel

__all__ = ["HybridEngine", "initialize"]


class HybridEngine(DeepSpeedHybridEngineAPI, DeepSpeedEngineInterface, nn.Module):
    """Wraps ``module`` (a causal LM) for training and fast rollout generation.

    Built by :func:`initialize` or :meth:`from_deepspeed`; ``training_backend``
    owns the optimizer, the LR scheduler and the step counters. DeepSpeed's
    smaller engine queries (ranks, config flags, ``was_step_applied``, ``no_sync``...)
    come from :class:`~hybrid_engine.training.deepspeed_interface.DeepSpeedEngineInterface`.
    """

    def __init__(self, model: nn.Module, config: EngineConfig, training: LocalTraining | DeepSpeedTraining):
        super().__init__()
        self.module = model
        self.config = config
        self.training_backend = training
        self._inference_copy = _inference_copy(model, config)
        self._front_end = GenerateFrontEnd(self.inference_module, config)
        if config.hybrid_engine.exact_logprobs:
            check_exact_support(self.inference_module)
        self._latency_init()
        self._routed_generate: list[tuple[nn.Module, Any]] = []
        he = config.hybrid_engine
        if he.enabled and "enabled" in he.model_fields_set:  # DeepSpeed's switch, given (not implied by graphs)
            self._route_module_generate()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "module" and "module" in self.__dict__.get("_modules", {}):
            raise AttributeError(
                "engine.module cannot be replaced: the optimizer, DeepSpeed and the decode graphs hold the model "
                "the engine was built with; build a new engine with hybrid_engine.initialize(model=...) instead"
            )
        super().__setattr__(name, value)

    @property
    def inference_module(self) -> nn.Module:
        """The transformers model that generation runs on (and rollouts built on this engine).

        ``module`` itself, a PEFT wrapper's base model, or under ZeRO-3 with
        ``zero3_gathered_inference_copy`` the unpartitioned copy (:mod:`hybrid_engine.distributed.inference_copy`).
        """
        return self._inference_copy.module if self._inference_copy is not None else decode_model(self.module)

    @classmethod
    def from_deepspeed(cls, ds_engine: Any, config: ConfigSource | None = None) -> HybridEngine:
        """Wrap a ``deepspeed.DeepSpeedEngine`` the caller already built (after ``deepspeed.initialize``).

        Training is the DeepSpeed engine's: its own config (batch sizes,
        gradient accumulation, precision, ZeRO stage, optimizer...) is the
        engine's. ``config`` adds the ``hybrid_engine`` section (e.g.
        ``enable_graph_capture``) for generation; a training setting it gives
        that differs from the DeepSpeed engine's is ignored, with a warning
        naming it.
        """
        module = getattr(ds_engine, "module", None)
        if not isinstance(module, nn.Module) or not callable(getattr(ds_engine, "backward", None)):
            raise TypeError("HybridEngine.from_deepspeed: ds_engine must be the DeepSpeedEngine returned by "
                            f"deepspeed.initialize, got {type(ds_engine).__name__}")
        training = DeepSpeedTraining(ds_engine)
        own = dict(getattr(getattr(ds_engine, "_config", None), "_param_dict", None) or {})
        if config is not None:
            given = load_config(config).model_dump(exclude_unset=True)
            ignored = sorted(k for k, v in given.items() if k != "hybrid_engine" and k in own and v != own[k])
            if ignored:
                warnings.warn(f"HybridEngine.from_deepspeed: {', '.join(ignored)} in config differ from the DeepSpeed "
                              "engine's own and are ignored: it trains as deepspeed.initialize configured it",
                              UserWarning, stacklevel=2)
            own = {**own, **{k: v for k, v in given.items() if k == "hybrid_engine" or k not in own}}
        cfg = load_config(own)
        if cfg.zero_optimization.stage != training.zero_stage:
            data = cfg.dump_for_reload()
            data["zero_optimization"]["stage"] = training.zero_stage
            cfg = load_config(data)
        return cls(module, cfg, training)

    # --------------------------------------------------------------- training
    @property
    def optimizer(self) -> Any:
        """The optimizer ``initialize`` built or was given (DeepSpeed's under ZeRO), or ``None``."""
        return self.training_backend.optimizer

    @property
    def lr_scheduler(self) -> Any:
        """Stepped once per optimizer step (not on fp16 overflow-skipped steps), as DeepSpeed does."""
        return self.training_backend.lr_scheduler

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped overflow steps included, as DeepSpeed counts them)."""
        return self.training_backend.global_steps

    @property
    def micro_steps(self) -> int:
        """``step()`` calls made: micro-batches, gradient accumulation included."""
        return self.training_backend.micro_steps

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped: for non-finite gradients (fp16 overflow, bf16 ``check_grad_overflow``), or on
        request (``optimizer.skip_step = True``: DeepSpeed-Chat's ``--align_overflow``)."""
        return self.training_backend.skipped_steps

    @property
    def zero_stage(self) -> int:
        """``zero_optimization.stage``: 0 trains in plain PyTorch (on DeepSpeed across ranks), 1-3 on DeepSpeed ZeRO."""
        return self.config.zero_optimization.stage

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (a method, as on DeepSpeed's engine)."""
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Samples per optimizer step over every data-parallel rank, as DeepSpeed's engine says."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per ``forward``/``backward`` on one rank, as DeepSpeed's engine says."""
        return self.config.train_micro_batch_size_per_gpu

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer param group (empty without an optimizer), as DeepSpeed's."""
        optimizer = self.optimizer
        return [group["lr"] for group in optimizer.param_groups] if optimizer is not None else []

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` call will update the weights."""
        return self.training_backend.is_gradient_accumulation_boundary()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The training forward of ``module`` (through DeepSpeed's engine under ZeRO). Waits for a generation
        running in another thread on this model (:mod:`hybrid_engine.generation.call_context`). With
        ``hybrid_engine.exact_logprobs``, it runs as :func:`~hybrid_engine.exact.exact_forward`."""
        with exclusive_model_call(self.inference_module, "HybridEngine.forward"):
            if self.config.hybrid_engine.exact_logprobs:
                return exact_forward(self.inference_module, *args, forward=self.training_backend.forward, **kwargs)
            return self.training_backend.forward(*args, **kwargs)

    def train(self, mode: bool = True) -> HybridEngine:
        """Train mode (``eval()``: eval mode) for the model, as ``nn.Module.train``; waits for a generation running
        in another thread, which has the model in eval mode until it returns."""
        with exclusive_model_call(self.inference_module, "HybridEngine.train" if mode else "HybridEngine.eval"):
            if "_iters" in self.__dict__:  # DeepSpeed's hybrid-engine timing, once __init__ has set its fields
                self._latency_train() if mode else self._latency_eval()
            return super().train(mode)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps`` (loss-scaled under fp16), as DeepSpeed's
        ``backward``: ``retain_graph`` keeps the autograd graph, ``scale_wrt_gas=False`` skips the division.
        Returns the loss after that division (not loss-scaled), as DeepSpeed's does."""
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError("engine.backward(loss): loss must be a scalar tensor")
        for name, value in (("retain_graph", retain_graph), ("scale_wrt_gas", scale_wrt_gas)):
            if not isinstance(value, bool):
                raise TypeError(f"engine.backward: {name} must be True or False, got {value!r}")
        with exclusive_model_call(self.inference_module, "HybridEngine.backward"):
            return self.training_backend.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Count a micro-step; at an accumulation boundary clip, step the optimizer and zero grads. As in
        DeepSpeed, ``lr_kwargs`` are passed to the LR scheduler's ``step``."""
        if lr_kwargs is not None and not isinstance(lr_kwargs, dict):
            raise TypeError(f"engine.step: lr_kwargs must be a dict or None, got {type(lr_kwargs).__name__}")
        # Held for the whole update: no generation in another thread sees half-updated weights.
        with exclusive_model_call(self.inference_module, "HybridEngine.step"):
            if self.training_backend.is_gradient_accumulation_boundary():  # before anything steps
                check_lr_kwargs(self.lr_scheduler, lr_kwargs)
            steps = self.training_backend.global_steps
            self.training_backend.step(lr_kwargs=lr_kwargs)
            if self._inference_copy is not None and self.training_backend.global_steps != steps:
                self._inference_copy.refresh()  # in place: graphs on the copy replay the new weights
        self._latency_step()

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self.training_backend.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: dict[str, Any] | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save the training state under ``save_dir/tag`` (DeepSpeed's names; returns ``True``).

        Saved: the model, the optimizer, the fp32 master weights (bf16/fp16), the fp16
        loss scaler, the LR scheduler, the step counters, torch's RNG state (CPU and
        the accelerator's, which seeds sampled ``generate`` calls and dropout) and
        ``client_state``. ``tag`` defaults to ``global_step<N>`` (a plain directory name: no path, not blank,
        not ``latest``); ``save_latest`` records it in ``save_dir/latest`` for :meth:`load_checkpoint`, atomically
        and only once the checkpoint and its sha256 manifest are complete. ``exclude_frozen_parameters``
        leaves parameters with ``requires_grad=False`` out (a LoRA run's base weights), as DeepSpeed does;
        loading such a checkpoint keeps the model's own values of them. Under ZeRO 1-3
        this is DeepSpeed's ``save_checkpoint`` (every rank must call it).
        """
        self.training_backend.wake_optimizer()  # the optimizer's states are saved from where they train
        return checkpoint.save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The model's weights alone, as ``torch.save`` of a state dict at ``save_dir/save_filename``, as
        DeepSpeed's ``save_16bit_model`` (every rank must call it under ZeRO, where it is DeepSpeed's own; at
        ZeRO-3 it saves only with ``stage3_gather_16bit_weights_on_model_save``). At stage 0 the weights are
        saved in the module's dtype (bf16/fp16 when enabled). Returns whether a file was written."""
        if not isinstance(save_dir, (str, os.PathLike)) or not isinstance(save_filename, str) or not save_filename:
            raise TypeError("save_16bit_model: save_dir must be a path and save_filename a non-empty file name")
        training = self.training_backend
        if isinstance(training, DeepSpeedTraining):
            return bool(training.ds_engine.save_16bit_model(save_dir, save_filename,
                                                            exclude_frozen_parameters=exclude_frozen_parameters))
        if rank() != 0:  # as DeepSpeed: rank 0 writes the file
            return True
        params = dict(self.module.named_parameters())
        state = {name: t for name, t in self.module.state_dict().items()
                 if not (exclude_frozen_parameters and name in params and not params[name].requires_grad)}
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Callable[..., Any] | None = None,
                        trust_client_state: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        """Restore what :meth:`save_checkpoint` saved; returns ``(load_path, client_state)``.

        ``custom_load_fn(src=state_dict, dst=module)``, as in DeepSpeed, loads the module state in place of
        ``load_state_dict``. ``tag`` defaults to the one in ``load_dir/latest``. When there is no such
        file, or no directory for an explicit ``tag``, it warns and returns ``(None, None)``, as DeepSpeed
        does; a ``latest`` that is unreadable, empty or names no checkpoint is a ``ValueError`` naming it
        and the checkpoints present. Every file is verified against the checkpoint's sha256 manifest before
        anything is loaded (a mismatch is a ``ValueError`` naming the file, and nothing changes).
        ``trust_client_state=True`` lets a stage-0 ``client_state`` holding values beyond plain data (dicts,
        lists, numbers, strings, tensors) be unpickled in full, which can run code: pass it only for
        checkpoints you trust. At ZeRO 1-3 DeepSpeed unpickles its own files in full whatever it says.
        The engine's graphs are dropped and recaptured by the next ``generate``
        (loading may re-allocate; rollouts compare weight addresses before replaying).
        """
        with exclusive_model_call(self.inference_module, "HybridEngine.load_checkpoint"):
            self.training_backend.wake_optimizer()  # states load into the optimizer where it trains
            result = checkpoint.load(self, load_dir, tag, load_module_strict=load_module_strict,
                                     load_optimizer_states=load_optimizer_states,
                                     load_lr_scheduler_states=load_lr_scheduler_states,
                                     load_module_only=load_module_only, custom_load_fn=custom_load_fn,
                                     trust_client_state=trust_client_state)
            if result[0] is not None:
                self._front_end.runner.invalidate()
                if self._inference_copy is not None:
                    self._inference_copy.refresh()
        return result

    # ------------------------------------------------------------- generation
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Drop-in for transformers' ``generate`` (same arguments, same return value).

        In train mode the call runs in eval mode (no dropout); afterwards every
        submodule has its own mode back. Concurrent calls on one model are serialised
        (:mod:`hybrid_engine.generation.call_context`). See :mod:`hybrid_engine.generation.generate` for the paths
        and :mod:`hybrid_engine.graphs.policy` for when graphs are refused.
        """
        self._latency_generate_start(args, kwargs)
        with exclusive_model_call(self.inference_module, "HybridEngine.generate"), eval_for_generation(self.module):
            if self.config.hybrid_engine.sleep_between_phases:  # issue 41: the optimizer sleeps during rollouts
                sleep_optimizer_during_generation(self)
            with decode_grad_mode(), gathered_for_inference(self.inference_module):
                if self.zero_stage == 3:
                    self._latency_gathered()
                try:
                    return self._front_end.generate(*args, **kwargs)
                finally:
                    self._latency_generate_end()

    def destroy(self) -> None:
        """Release the engine's decode buffers and graphs and, under ZeRO, DeepSpeed's engine state.

        Call it on every rank when training is over, before
        :func:`hybrid_engine.distributed.world.destroy_process_group` (or DeepSpeed's
        ``deepspeed.comm.destroy_process_group()``). The engine cannot train or
        generate with DeepSpeed afterwards.
        """
        with exclusive_model_call(self.inference_module, "HybridEngine.destroy"):  # after a running generate
            self._front_end.runner.release()
            self._restore_module_generate()
        if isinstance(self.training_backend, DeepSpeedTraining):
            self.training_backend.destroy()

    # ------------------------------------------- module.generate routed here (DeepSpeed's hybrid engine does)
    def _route_module_generate(self) -> None:
        """With ``hybrid_engine.enabled: true`` given in the config, as DeepSpeed's hybrid engine:
        ``module.generate`` (and the unwrapped model's, under a PEFT wrapper) becomes :meth:`generate`, so a
        trainer calling ``engine.module.generate(...)`` gets the fast path. What the fast path delegates goes to the model's own
        ``generate``, taken before the swap (no recursion). :meth:`destroy` puts them back."""
        own = self.inference_module.generate  # transformers' (or the instance's own), before any swap
        self._front_end.delegate = own if self._inference_copy is None else None
        for target in dict.fromkeys([self.module, decode_model(self.module)]):
            if callable(getattr(target, "generate", None)):
                self._routed_generate.append((target, target.__dict__.get("generate", _NOT_SET)))
                target.__dict__["generate"] = self.generate  # plain instance attribute: no nn.Module registration

    def _restore_module_generate(self) -> None:
        for target, previous in reversed(self._routed_generate):
            if previous is _NOT_SET:
                target.__dict__.pop("generate", None)
            else:
                target.__dict__["generate"] = previous
        self._routed_generate.clear()
        self._front_end.delegate = None

    def invalidate_graphs(self) -> None:
        """Drop ``generate``'s graphs; the next call captures again. Needed only after a change the graph
        fingerprint cannot see, such as a module-level function patched (:mod:`hybrid_engine.graphs.fingerprint`)."""
        with exclusive_model_call(self.inference_module, "HybridEngine.invalidate_graphs"):
            self._front_end.runner.invalidate()

    @property
    def generate_runner(self) -> DecodeGraphRunner:
        """The graph runner ``generate`` decodes on (its buffers, graphs and policy), for inspection."""
        return self._front_end.runner

    @property
    def graph_stats(self) -> GraphStats:
        """Graph counters of ``generate`` (captures, replays, refusal reason, memory): :class:`GraphStats`."""
        return self._front_end.stats()

    @property
    def last_stats(self) -> dict[str, Any]:
        """The last ``generate`` call's counters on the fast path, with the keys of
        :class:`~hybrid_engine.graphs.stats.CallStats` (the schema of ``HybridEngineRollout.last_stats``); ``{}``
        before the first. A call delegated to transformers' ``generate`` leaves it as it was."""
        return self._front_end.last_stats

    # ------------------------------------------------------ memory hand-off (issue 41)
    @property
    def _handoff(self) -> MemoryHandoff:
        handoff = self.__dict__.get("_memory_handoff")
        if handoff is None:
            handoff = self.__dict__["_memory_handoff"] = MemoryHandoff(self.inference_module, self.training_backend)
        return handoff

    def sleep(self, tags: str | list[str] | None = None) -> None:
        """Release memory between phases, every graph kept (``docs/memory-handoff.md``). Tags: ``"kv_cache"``
        (the page pools, rings and linear states of ``generate`` and of every rollout on this model, at the same
        addresses (a backend without VMM drops them, and the graphs, counted in ``handoff_stats``); contents
        discarded, kept episode pages evicted first), ``"graphs"`` (graph memory; kept on every backend so far,
        as :attr:`sleeping_tags` says), ``"optimizer"`` (optimizer states, fp32 masters and their gradients to
        host memory; DeepSpeed's ``offload_states`` under ZeRO; never the weights). ``None``: ``"kv_cache"`` and
        ``"graphs"``. Waits for a running call; the next generation or training call wakes what it needs."""
        self._handoff.sleep(tags, caller="HybridEngine.sleep")

    def wake(self, tags: str | list[str] | None = None) -> None:
        """Take back what :meth:`sleep` released (``None``: everything asleep), at the same addresses."""
        self._handoff.wake(tags, caller="HybridEngine.wake")

    @property
    def sleeping_tags(self) -> SleepingTags:
        """The tags asleep now (a frozenset); ``.kept``: tags asked to sleep that keep their memory, and why."""
        return self._handoff.sleeping_tags

    @property
    def handoff_stats(self) -> HandoffStats:
        """Sleeps, wakes (asked for, and made by generation and training calls), their times, bytes moved."""
        return self._handoff.stats

    def graph_refusal_reason(self) -> str | None:
        """Why graphs would be refused for a ``generate`` call now, or ``None``."""
        return self._front_end.gate_reason()


def initialize(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None = None,
    config: ConfigSource | None = None,
    model_parameters: Any = None,
    **kwargs: Any,
) -> tuple[HybridEngine, Any, None, Any]:
    """Build a :class:`HybridEngine`; returns ``(engine, optimizer, None, lr_scheduler)`` as ``deepspeed.initialize``.

    ``config`` is a dict, a JSON path or an ``EngineConfig`` (DeepSpeed's keys).
    ``zero_optimization.stage`` 1-3 trains on DeepSpeed (``hybrid-engine[deepspeed]``),
    built with ``deepspeed.initialize`` from the same config; so does stage 0 when
    more than one rank is launched and there is an optimizer (DeepSpeed's data
    parallelism averages the gradients), or when an ``mpu`` (model-parallel unit,
    which sets the data-parallel group) is given. Otherwise stage 0 is plain
    PyTorch on this rank alone (a frozen reference model, say). The optimizer is
    ``optimizer`` if given (an optimizer, or a callable building one from the parameters), else the
    one ``config.optimizer`` describes over
    ``model_parameters`` (default: the model's trainable parameters), else
    ``None`` (generation only). ``lr_scheduler`` (a scheduler, or a callable
    building one from the optimizer) is stepped with the optimizer. With ``bf16`` or
    ``fp16`` enabled the module's parameters are cast to that dtype and the optimizer
    steps fp32 master weights. The third item (DeepSpeed's data loader) is always ``None``.
    """
    if kwargs.get("config_params") is not None and config is None:
        config = kwargs.pop("config_params")
    args = kwargs.get("args")
    if getattr(args, "deepspeed_config", None) is not None:  # deepspeed.add_config_arguments' --deepspeed_config
        if config is not None:  # deepspeed.initialize refuses this too
            raise ValueError("initialize(): a config was given both as args.deepspeed_config and as config= "
                             "(or config_params=); pass only one")
        config = args.deepspeed_config
    unknown = set(kwargs) - {"config_params", "args", "training_data", "lr_scheduler", "mpu", "dist_init_required"}
    if unknown:
        raise TypeError(f"initialize() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    if kwargs.get("training_data") is not None:
        raise ValueError("initialize(): training_data is not supported; iterate over your data yourself")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(): model must be a torch.nn.Module, got {type(model).__name__}")
    mpu = kwargs.get("mpu")
    ranks = _data_parallel_ranks(mpu)
    cfg = load_config(config if config is not None else {}, world_size=ranks)
    lr_scheduler = kwargs.get("lr_scheduler")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise TypeError("initialize(): optimizer must be a torch.optim.Optimizer, a callable that builds one from "
                        f"the model's parameters (as deepspeed.initialize takes), or None, got {type(optimizer).__name__}")
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and not callable(lr_scheduler):
        raise TypeError("initialize(): lr_scheduler must be a scheduler (with .step()) or a callable that "
                        f"builds one from the optimizer, got {type(lr_scheduler).__name__}")
    if optimizer is not None and cfg.optimizer is not None:
        warnings.warn(
            "initialize(): both an optimizer and config.optimizer were given; using the optimizer passed in",
            UserWarning,
            stacklevel=2,
        )
    if cfg.hybrid_engine.inference_tp_size > 1:
        warnings.warn(
            f"hybrid_engine.inference_tp_size={cfg.hybrid_engine.inference_tp_size}: tensor-parallel inference "
            "is not implemented; each rank generates unsharded and eagerly",
            UserWarning,
            stacklevel=2,
        )
    if cfg.hybrid_engine.zero3_gathered_inference_copy and cfg.zero_optimization.stage != 3:
        warnings.warn(
            "hybrid_engine.zero3_gathered_inference_copy has no effect below ZeRO stage 3 (the parameters are "
            "whole already, and graphs read them directly); remove it or set zero_optimization.stage to 3",
            UserWarning,
            stacklevel=2,
        )
    trains = optimizer is not None or cfg.optimizer is not None
    if cfg.zero_optimization.stage > 0 or mpu is not None or (ranks > 1 and trains):
        # Data parallelism (gradients averaged over ranks, rank-aware checkpoints) is DeepSpeed's, stage 0 included.
        why = None if cfg.zero_optimization.stage > 0 else (
            "initialize(mpu=...) hands the model-parallel unit to DeepSpeed" if mpu is not None
            else f"data-parallel training over {ranks} ranks (zero_optimization.stage 0) runs on DeepSpeed")
        if why is not None and cfg.fp16.enabled:
            # DeepSpeed's engine.backward scales the loss only for its ZeRO optimizers (checked on 0.19.8): its
            # stage-0 fp16 optimizer would then unscale unscaled gradients, updates ~loss_scale times too small.
            raise ValueError(
                f"fp16.enabled with zero_optimization.stage 0: {why}, whose stage-0 fp16 optimizer never scales "
                "the loss (updates would be about loss_scale times too small); set zero_optimization.stage to 1 "
                "(the same training, optimizer states partitioned), or use bf16.enabled")
        training: LocalTraining | DeepSpeedTraining = build_deepspeed_training(
            model, optimizer, cfg, lr_scheduler, model_parameters, mpu=mpu,
            dist_init_required=kwargs.get("dist_init_required"), needed_for=why,
        )
    else:
        training = _local_training(model, optimizer, cfg, lr_scheduler, model_parameters)
    engine = HybridEngine(model, cfg, training)
    return engine, engine.optimizer, None, engine.lr_scheduler


setattr(initialize, REPLACES_DEEPSPEED_INITIALIZE, True)  # `deepspeed.initialize = initialize` must not recurse
remember_initialize()  # DeepSpeed's own, if it is imported (and still its own)

#: No instance attribute was there before the engine routed ``generate``.
_NOT_SET = object()


#: The most of the device's free memory a ZeRO-3 inference copy the config only implies may take: the rest is
#: left to the K/V pool, activations and the training step. A copy asked for explicitly is built whatever it takes.
IMPLIED_COPY_MAX_FREE_FRACTION = 0.5


def _inference_copy(model: nn.Module, config: EngineConfig) -> InferenceCopy | None:
    """The ZeRO-3 gathered inference copy ``config`` asks for, or ``None``.

    Implied by graph capture (the key not given), the copy is built only where it takes at most
    :data:`IMPLIED_COPY_MAX_FREE_FRACTION` of the device's free memory and where a copy of this model can be
    built at all (a module tree that can be deep-copied). Otherwise the engine goes on without it: one warning,
    then generation gathers the parameters and decodes eagerly. Asked for explicitly, it is built (or the
    reason it cannot be is an error).
    """
    he = config.hybrid_engine
    if config.zero_optimization.stage != 3 or not he.zero3_gathered_inference_copy:
        return None
    source = decode_model(model)
    implied = "zero3_gathered_inference_copy" not in he.model_fields_set
    if implied:
        too_big = _copy_too_big(source)
        if too_big is not None:
            return _without_copy(he, too_big, "to true to build it anyway, or to false to silence this warning")
    try:
        return InferenceCopy(source)
    except ValueError as exc:
        if not implied:
            raise
        return _without_copy(he, str(exc), "to false to say so and silence this warning")


def _copy_too_big(source: nn.Module) -> str | None:
    """Why an implied copy of ``source`` would take too much of its device's free memory, or ``None``."""
    tensors = [*source.parameters(), *source.buffers()]
    need = sum(int(getattr(t, "ds_numel", t.numel())) * t.element_size() for t in tensors)
    free = free_memory(tensors[0].device) if tensors else None
    if free is None or need <= IMPLIED_COPY_MAX_FREE_FRACTION * free:
        return None
    return (f"it would take {need / 2**30:.3g} GiB, more than {IMPLIED_COPY_MAX_FREE_FRACTION:.0%} of the "
            f"{free / 2**30:.3g} GiB free on {tensors[0].device}")


def _without_copy(he: HybridEngineConfig, reason: str, fix: str) -> None:
    he.zero3_gathered_inference_copy = False  # as if given: a reload must not imply it again; graphs refused
    warnings.warn(f"graph capture at ZeRO stage 3 generates on a gathered inference copy, which is not built here "
                  f"({reason}); generation gathers the parameters and decodes eagerly instead. Set "
                  f"hybrid_engine.zero3_gathered_inference_copy {fix}", UserWarning, stacklevel=user_stacklevel())


def _data_parallel_ranks(mpu: Any) -> int:
    """The ranks batch sizes are split over: the launched world, or ``mpu``'s data-parallel group (DeepSpeed's)."""
    if mpu is None:
        return world_size()
    get = getattr(mpu, "get_data_parallel_world_size", None)
    if not callable(get):
        raise TypeError("initialize(): mpu must be a model-parallel unit with get_data_parallel_world_size() (as "
                        f"deepspeed.initialize expects), got {type(mpu).__name__}")
    return int(get())


def _local_training(model: nn.Module, optimizer: Any, cfg: EngineConfig,
                    lr_scheduler: Any, model_parameters: Any) -> LocalTraining:
    dtype = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else None
    masters = MasterWeights(model, dtype) if dtype is not None else None
    built_from_config = optimizer is None
    if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
        params = model_parameters if model_parameters is not None else [
            p for p in model.parameters() if p.requires_grad
        ]
        params = masters.master_params(params) if masters is not None else params
        if optimizer is None:
            optimizer = build_optimizer(cfg, params)
        else:  # a callable builds the optimizer from the parameters, as deepspeed.initialize's does
            optimizer = optimizer(params)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError("initialize(): the optimizer callable must return a torch.optim.Optimizer, got "
                                f"{type(optimizer).__name__}")
    elif masters is not None:
        masters.adopt(optimizer)
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step"):
        if optimizer is None:
            raise ValueError("initialize(): lr_scheduler was given as a callable but there is no optimizer to "
                             "build it for; pass optimizer= or config.optimizer")
        lr_scheduler = lr_scheduler(optimizer)
    elif lr_scheduler is None:
        lr_scheduler = build_scheduler(cfg, optimizer)  # the config's "scheduler" section, as DeepSpeed's
    training = LocalTraining(model, optimizer, cfg, lr_scheduler, masters, built_from_config=built_from_config)
    if masters is not None:
        masters.cast_module()  # last: a refused setup leaves the caller's model in its own precision
    return training
