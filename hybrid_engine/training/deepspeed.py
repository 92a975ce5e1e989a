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
  allocates new memory, so graphs are refused (:mod:`hybrid_engine.graphs.policy`)
  and generation runs eagerly inside :func:`gathered_for_inference`, with
  ZeRO-3's per-module fetch/release hooks taken off. The one collective (the
  all-gather) happens when a generate call starts, on every rank; the
  forwards that follow are local, so ranks whose rollouts finish at different
  lengths never wait for each other and cannot desynchronise.
  With ``hybrid_engine.zero3_gathered_inference_copy`` generation runs instead
  on an unpartitioned copy refreshed after each step
  (:mod:`hybrid_engine.distributed.inference_copy`), and graphs are allowed.

DeepSpeed's ZeRO optimizer, which the engine hands out, also gets DeepSpeed-Chat's ``check_overflow(external=...)``
and ``skip_step`` (:mod:`hybrid_engine.training.zero_overflow`; :meth:`DeepSpeedTraining.step` carries out a skip).

Checkpoints are DeepSpeed's files plus ours (each rank's RNG states), under the
same rules as at stage 0 (:mod:`hybrid_engine.training.checkpoint_files`;
:meth:`DeepSpeedTraining.save_checkpoint`, :meth:`DeepSpeedTraining.load_checkpoint`).
DeepSpeed unpickles its own files in full (``weights_only=False``).
"""

from __future__ import annotations

import gc
import io
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.distributed.deepspeed_import import deepspeed_initialize, import_deepspeed
from hybrid_engine.distributed.world import one_rank_without_launcher, rank
from hybrid_engine.training.checkpoint_files import (
    begin_save,
    digests,
    finish_save,
    refusal,
    rng_problem,
    tag_files,
    verify,
    warn_unverified,
    write_atomically,
    write_latest,
)
from hybrid_engine.training.handoff import handoff_for
from hybrid_engine.training.zero_overflow import attach_zero_overflow_surface, requested_skip, skip_agreed

__all__ = ["DeepSpeedTraining", "RNG_CLIENT_KEY", "build", "deepspeed_config", "destroy_deepspeed_engine", "rng_file"]


#: Key under which the engine keeps torch's RNG states inside DeepSpeed's ``client_state``.
RNG_CLIENT_KEY = "hybrid_engine_rng"


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
    # Not deepspeed.initialize: a script may have replaced it with hybrid_engine.initialize (it would recurse).
    ds_engine, _, _, _ = deepspeed_initialize(deepspeed)(
        model=model, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
        config=deepspeed_config(config), mpu=mpu, dist_init_required=dist_init_required,
    )
    return DeepSpeedTraining(ds_engine)


class DeepSpeedTraining:
    """The training calls of a ``HybridEngine``, delegated to a ``deepspeed.DeepSpeedEngine``."""

    def __init__(self, ds_engine: Any) -> None:
        self._ds_engine = ds_engine
        self.module = ds_engine.module
        # DeepSpeed-Chat's --align_overflow: check_overflow(external=True) answers, skip_step skips (ZeRO 1-3).
        attach_zero_overflow_surface(ds_engine.optimizer)
        #: The optimizer's memory hand-off (engine.sleep("optimizer"); DeepSpeed's offload_states).
        self.handoff = handoff_for(self) if ds_engine.optimizer is not None else None

    def wake_optimizer(self) -> None:
        """A training call needs the optimizer's memory: wake it if asleep (counted in ``handoff.wakes``)."""
        if self.handoff is not None:
            self.handoff.wake(auto=True)

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
        self.wake_optimizer()
        return self.ds_engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """DeepSpeed's ``step``; at a boundary where any rank set ``optimizer.skip_step``, skipped on every rank
        (:mod:`hybrid_engine.training.zero_overflow`)."""
        self.wake_optimizer()
        ds = self.ds_engine
        if ds.is_gradient_accumulation_boundary() and skip_agreed(ds.optimizer):
            with requested_skip(ds.optimizer):
                ds.step(lr_kwargs=lr_kwargs)
            return
        ds.step(lr_kwargs=lr_kwargs)

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

    def save_checkpoint(self, save_dir: Path, tag: str, client_state: dict[str, Any],
                        save_latest: bool, rng: dict[str, Any], exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_checkpoint``, plus this rank's RNG states in ``<tag>/`` :func:`rng_file` (at ZeRO
        1/2 DeepSpeed writes ``client_state`` from rank 0 only, so every rank would load rank 0's streams), then
        the manifest and ``latest``. Every rank must call it.

        The tag directory is marked incomplete, written, given a manifest of every file's sha256, and only then
        named in ``latest`` (which we write, atomically; DeepSpeed's own is not)."""
        root, directory = Path(save_dir), Path(save_dir) / tag
        if rank() == 0:
            begin_save(root, directory)
        _barrier()
        state = {**client_state, RNG_CLIENT_KEY: rng}
        ok = bool(self.ds_engine.save_checkpoint(str(root), tag=tag, client_state=state, save_latest=False,
                                                 exclude_frozen_parameters=exclude_frozen_parameters))
        buffer = io.BytesIO()
        torch.save(rng, buffer)
        write_atomically(directory / rng_file(), lambda f: f.write(buffer.getvalue()))
        _barrier()  # every rank's files are written
        names = _every_rank(tag_files(directory) if rank() == 0 else None)[0]  # rank 0's listing, for all
        index, count = _share()
        files: dict[str, Any] = {}
        for part in _every_rank(digests(directory, names[index::count])):
            files.update(part)
        if rank() == 0:
            finish_save(directory, files)
            if save_latest:
                write_latest(root, tag)
        _barrier()
        return ok

    def load_checkpoint(self, load_dir: Path, tag: str, **options: Any
                        ) -> tuple[str | None, dict[str, Any] | None, dict[str, Any] | None]:
        """DeepSpeed's ``load_checkpoint`` of ``load_dir/tag``, after every rank verified its share of the files
        and its own RNG file and all agreed; returns ``(path, client_state, this rank's rng states or None)``.

        Verifying before DeepSpeed reads a file makes a corrupt file refuse the load on every rank alike instead
        of failing after weights and counters were loaded. The ranks split the hashing and agree on the verdict
        (one all-gather), so no rank goes on into DeepSpeed's collective load while another refuses."""
        directory = Path(load_dir) / tag
        has_manifest, problems = verify(directory, _share())
        own = directory / rng_file()
        rng = None
        if own.is_file():
            try:
                rng = torch.load(own, map_location="cpu", weights_only=True)
                problem = rng_problem(rng)
            except Exception as exc:  # noqa: BLE001 - torch's unpickling errors vary
                problem = f"cannot be read ({type(exc).__name__})"
            if problem is not None:
                problems.append(f"{own} {problem}")
        problems = [p for found in _every_rank(problems) for p in found]
        if problems:
            raise refusal(directory, problems)
        if not has_manifest and rank() == 0:
            warn_unverified(directory)
        path, client_state = self.ds_engine.load_checkpoint(str(load_dir), tag=tag, **options)
        if client_state is None:
            return path, None, None
        client_state = dict(client_state)
        fallback = client_state.pop(RNG_CLIENT_KEY, None)  # rank 0's at ZeRO 1/2: for older checkpoints
        if rng is None and rng_problem(fallback) is None:
            rng = fallback
        return path, client_state, rng


def _share() -> tuple[int, int]:
    """This rank's share of a checkpoint's files to hash: ``(rank, world size)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _every_rank(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (one all-gather; just ``[value]`` in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def rng_file() -> str:
    """The file, in a checkpoint's tag directory, holding this data-parallel rank's torch RNG states."""
    return f"hybrid_engine_rng_rank{rank()}.pt"
