"""Training on DeepSpeed ZeRO 1/2/3, and generation from ZeRO-3 partitioned parameters.

We write no partitioning of our own: for ``zero_optimization.stage`` 1-3,
:func:`build` hands the model and the same config to ``deepspeed.initialize``,
and :class:`DeepSpeedTraining` forwards ``forward/backward/step``, gradient
accumulation, clipping, the LR scheduler and checkpoints to DeepSpeed's engine.
``deepspeed`` is the optional extra ``hybrid-engine[deepspeed]``.

What this means for graphs:

* ZeRO 1/2 (and DeepSpeed's bf16/fp16): ``deepspeed.initialize`` moves the
  parameters into flat low-precision buffers, once. After that the optimizer
  writes each step's weights into those buffers in place, so decode graphs,
  captured only after ``initialize``, read every update through the same
  addresses: no copy and no recapture per step.
* ZeRO 3: a parameter outside a gather is a 0-element shard, and every gather
  allocates new memory, so graphs are refused (:mod:`hybrid_engine.graph_policy`)
  and generation runs eagerly inside :func:`gathered_for_inference`, with
  ZeRO-3's per-module fetch/release hooks taken off. The one collective (the
  all-gather) happens when a generate call starts, on every rank; the
  forwards that follow are local, so ranks whose rollouts finish at different
  lengths never wait for each other and cannot desynchronise.
  With ``hybrid_engine.zero3_gathered_inference_copy`` generation runs instead
  on an unpartitioned copy refreshed after each step
  (:mod:`hybrid_engine.inference_copy`), and graphs are allowed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .config import EngineConfig
from .ranks import rank

__all__ = ["DeepSpeedTraining", "build", "deepspeed_config", "destroy_deepspeed_engine", "destroy_process_group",
           "gathered_for_inference", "import_deepspeed", "is_zero3_partitioned", "one_rank_without_launcher"]

#: Key under which the engine keeps torch's RNG states inside DeepSpeed's ``client_state``.
RNG_CLIENT_KEY = "hybrid_engine_rng"


def import_deepspeed(needed_for: str | None = None) -> Any:
    """``deepspeed``, with its C++ ops that would be JIT-built on first use on a CPU turned off.

    ``needed_for`` says what needs it, for the ``ImportError`` when it is missing.
    """
    try:
        import deepspeed
    except ImportError as exc:
        what = needed_for or "zero_optimization.stage 1-3 trains on DeepSpeed"
        way_out = "" if needed_for else " (or use zero_optimization.stage 0)"
        raise ImportError(
            f"{what}, which is not installed; install it with `pip install 'hybrid-engine[deepspeed]'`{way_out}"
        ) from exc
    # The shared-memory CPU collective is a C++ op built at first use; plain torch.distributed does its job.
    compatible = getattr(getattr(deepspeed, "ops", None), "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    return deepspeed


def destroy_deepspeed_engine(owner: Any, attr: str) -> None:
    """DeepSpeed's own teardown of the engine at ``owner.<attr>`` (ours, or one a trainer built); the
    attribute is set to ``None`` and the engine collected now.

    DeepSpeed's engine sits in reference cycles that hold its process groups. Left
    to the garbage collection at interpreter shutdown, after the other ranks have
    exited, a ZeRO-3 engine's gloo groups abort the process in a C++ destructor
    (``terminate called without an active exception``). Call it on every rank while
    all are alive, once nothing else refers to the engine.
    """
    engine = getattr(owner, attr, None)
    setattr(owner, attr, None)
    if callable(getattr(engine, "destroy", None)):
        engine.destroy()
    del engine  # no reference left here when the cycles are collected
    gc.collect()


def destroy_process_group() -> None:
    """Leave ``torch.distributed`` (call it on every rank, after a barrier), through DeepSpeed's own
    ``deepspeed.comm.destroy_process_group`` once DeepSpeed has set up its communication.

    DeepSpeed keeps module-level references to the groups it makes, a clone of
    the world group above all (``deepspeed.utils.groups``). Its own teardown drops
    them; ``torch.distributed.destroy_process_group`` does not, and a gloo group
    kept alive that way is torn down at interpreter shutdown, possibly after the
    peer rank has exited, where it can abort the process after its last line
    (``terminate called without an active exception``).
    """
    import torch.distributed as dist

    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and comm.is_initialized():
        comm.destroy_process_group()
    elif dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_zero3_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitioned (DeepSpeed tags each with ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


@contextlib.contextmanager
def gathered_for_inference(module: nn.Module) -> Iterator[None]:
    """Run the block with ``module``'s ZeRO-3 parameters gathered whole (no-op for other modules).

    Collective: every rank must enter it. Inside, the parameters are marked
    persistent, and ZeRO-3's per-module fetch/release hooks are taken off
    (:func:`_without_zero3_module_hooks`), so each forward is local to its rank
    and pays nothing for parameter bookkeeping.
    """
    if not is_zero3_partitioned(module):
        yield
        return
    deepspeed = import_deepspeed()
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        persist = [p.ds_persist for p in params]
        for p in params:
            p.ds_persist = True
        try:
            with _without_zero3_module_hooks(module):
                yield
        finally:
            for p, keep in zip(params, persist):
                p.ds_persist = keep


def _zero3_offload(module: nn.Module) -> Any | None:
    """DeepSpeed's ZeRO-3 parameter offload object whose hooks sit on ``module``'s submodules, if any.

    Found through the hooks themselves (each closes over it, under DeepSpeed's wrappers), so a bare
    transformers model works as well as a DeepSpeed engine's.
    """
    seen: set[int] = set()

    def search(fn: Any, depth: int = 0) -> Any | None:
        if depth > 4 or id(fn) in seen:
            return None
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if all(hasattr(value, a) for a in ("forward_hooks", "backward_hooks", "fwd_pre_hook")):
                return value
            if callable(value):
                found = search(value, depth + 1)
                if found is not None:
                    return found
        wrapped = getattr(fn, "__wrapped__", None)
        return search(wrapped, depth + 1) if wrapped is not None else None

    for sub in module.modules():
        for hook in (*sub._forward_pre_hooks.values(), *sub._forward_hooks.values()):
            found = search(hook)
            if found is not None:
                return found
    return None


@contextlib.contextmanager
def _without_zero3_module_hooks(module: nn.Module) -> Iterator[None]:
    """ZeRO-3's fetch/release hooks off every submodule for the block, then back in their places.

    With the parameters gathered and persistent they have nothing to do, yet
    their bookkeeping runs at every module of every forward: with many small
    modules (LoRA adapters) it cost 10-100x the decode itself. TRL takes them
    off for generation the same way. Only the hooks of DeepSpeed's parameter
    offload are taken (by their handles); every other hook stays, in order.
    """
    offload = _zero3_offload(module)
    if offload is None:
        yield
        return
    handles = [*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook]
    ids = {h.id for h in handles if h is not None}
    taken: list[tuple[dict, list, dict]] = []
    for sub in module.modules():
        for table in (sub._forward_pre_hooks, sub._forward_hooks):
            ours = {k: h for k, h in table.items() if k in ids}
            if ours:
                taken.append((table, list(table), ours))
                for k in ours:
                    del table[k]
    try:
        yield
    finally:
        for table, order, ours in taken:
            added = {k: h for k, h in table.items() if k not in order}  # registered inside the block
            kept = {k: ours[k] if k in ours else table[k] for k in order if k in ours or k in table}
            table.clear()
            table.update(kept)
            table.update(added)


#: The variables a launcher (torchrun, ``deepspeed``) sets for each rank, which DeepSpeed reads.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def one_rank_without_launcher() -> None:
    """Let DeepSpeed set up a one-rank process group when the script runs without a launcher.

    ``python train.py`` at ZeRO 1-3 would otherwise reach DeepSpeed's MPI discovery
    (``mpi4py``) or its ``LOCAL_RANK`` assertion. As accelerate does for a single
    process, the launcher variables DeepSpeed reads are filled in for rank 0 of 1,
    on loopback with a free port; variables already set are kept. A partial launch
    (``WORLD_SIZE`` above 1 with the rest missing) is refused, naming how to launch.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts it even on a group the caller made
        return
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if not missing:
        return
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} are not: launch the ranks with "
            "`torchrun --nproc_per_node N train.py` or `deepspeed train.py`, or unset WORLD_SIZE to train in one "
            "process")
    from .launch import free_port

    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())}
    for name in missing:
        os.environ[name] = defaults[name]


def deepspeed_config(config: EngineConfig) -> dict[str, Any]:
    """The dict handed to ``deepspeed.initialize``: our config without our own ``hybrid_engine`` section.

    DeepSpeed's Adam/AdamW default to its fused kernel, a C++ op compiled at first
    use; unless the config chooses (``optimizer.params.torch_adam``), torch's is used,
    with the fused kernel's default ``weight_decay`` of 0 (torch's AdamW defaults to 0.01).
    """
    data = config.to_dict()
    data.pop("hybrid_engine", None)  # ours; DeepSpeed's own section of that name would build its engine
    optimizer = data.get("optimizer")
    if optimizer is not None and optimizer["type"] in ("Adam", "AdamW"):
        params = optimizer.setdefault("params", {})
        if "torch_adam" not in params:
            params["torch_adam"] = True
            params.setdefault("weight_decay", 0.0)
    return data


def build(model: nn.Module, optimizer: Any, config: EngineConfig, lr_scheduler: Any,
          model_parameters: Any, *, mpu: Any = None, dist_init_required: bool | None = None,
          needed_for: str | None = None) -> DeepSpeedTraining:
    """``deepspeed.initialize`` on ``model`` with ``config`` (and a model-parallel unit ``mpu``, which sets the
    data-parallel group); the engine it returns, wrapped. ``needed_for``: why DeepSpeed is needed, when not for a
    ZeRO stage (for the ``ImportError``)."""
    deepspeed = import_deepspeed(needed_for)
    from deepspeed.accelerator import get_accelerator

    if dist_init_required is not False:
        one_rank_without_launcher()

    accelerator = get_accelerator()
    if config.fp16.enabled and not accelerator.is_fp16_supported():
        raise ValueError(
            f"fp16.enabled: DeepSpeed's {accelerator.device_name()} accelerator does not support fp16, so DeepSpeed "
            "cannot train in it here; use bf16.enabled, or fp16 on a GPU (in one process, stage 0 trains fp16 in "
            "plain PyTorch)")
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
        config=deepspeed_config(config), mpu=mpu, dist_init_required=dist_init_required,
    )
    return DeepSpeedTraining(ds_engine)


class DeepSpeedTraining:
    """The training calls of a ``HybridEngine``, delegated to a ``deepspeed.DeepSpeedEngine``."""

    def __init__(self, ds_engine: Any) -> None:
        self._ds_engine = ds_engine
        self.module = ds_engine.module

    @property
    def ds_engine(self) -> Any:
        if self._ds_engine is None:
            raise RuntimeError("the engine was destroyed (engine.destroy()); build a new one to train again")
        return self._ds_engine

    @property
    def optimizer(self) -> Any:
        return self.ds_engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.ds_engine.lr_scheduler

    @property
    def global_steps(self) -> int:
        return int(self.ds_engine.global_steps)

    @property
    def micro_steps(self) -> int:
        return int(self.ds_engine.micro_steps)

    @property
    def skipped_steps(self) -> int:
        return int(self.ds_engine.skipped_steps)

    @property
    def zero_stage(self) -> int:
        return int(self.ds_engine.zero_optimization_stage())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ds_engine(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        return bool(self.ds_engine.is_gradient_accumulation_boundary())

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        return self.ds_engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        self.ds_engine.step(lr_kwargs=lr_kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ds_engine.zero_grad()

    @property
    def loss_scale(self) -> float:
        scale = getattr(self.ds_engine.optimizer, "cur_scale", None)
        return float(scale) if scale is not None else 1.0

    def destroy(self) -> None:
        """DeepSpeed's own teardown of its engine, dropped and collected now (see :func:`destroy_deepspeed_engine`)."""
        if self._ds_engine is not None:
            destroy_deepspeed_engine(self, "_ds_engine")

    def save_checkpoint(self, save_dir: Any, tag: str, client_state: dict[str, Any],
                        save_latest: bool, rng: dict[str, Any], exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_checkpoint``, plus this rank's RNG states in ``<tag>/`` :func:`rng_file`: at ZeRO
        1/2 DeepSpeed writes ``client_state`` from rank 0 only, so every rank would load rank 0's streams."""
        state = {**client_state, RNG_CLIENT_KEY: rng}
        ok = bool(self.ds_engine.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=save_latest,
                                                 exclude_frozen_parameters=exclude_frozen_parameters))
        directory = os.path.join(save_dir, tag)
        os.makedirs(directory, exist_ok=True)
        torch.save(rng, os.path.join(directory, rng_file()))
        return ok

    def load_checkpoint(self, load_dir: Any, tag: str | None, **options: Any
                        ) -> tuple[str | None, dict[str, Any] | None, dict[str, Any] | None]:
        """DeepSpeed's ``load_checkpoint``; returns ``(path, client_state, this rank's rng states or None)``."""
        path, client_state = self.ds_engine.load_checkpoint(load_dir, tag=tag, **options)
        if client_state is None:
            return path, None, None
        client_state = dict(client_state)
        rng = client_state.pop(RNG_CLIENT_KEY, None)  # rank 0's at ZeRO 1/2: the fallback for older checkpoints
        own = os.path.join(os.path.dirname(os.fspath(path)), rng_file())
        if os.path.isfile(own):
            rng = torch.load(own, map_location="cpu", weights_only=True)
        return path, client_state, rng


def rng_file() -> str:
    """The file, in a checkpoint's tag directory, holding this data-parallel rank's torch RNG states."""
    return f"hybrid_engine_rng_rank{rank()}.pt"
