"""The training side of ZeRO stage 0: plain PyTorch, no DeepSpeed needed.

:class:`LocalTraining` and :class:`hybrid_engine.training.deepspeed.DeepSpeedTraining` are the
two backends behind ``HybridEngine.forward/backward/step``; the engine picks one
in :func:`hybrid_engine.engine.initialize` from ``zero_optimization.stage``.

Graph safety: every update is in place. The optimizer steps the parameters
themselves (fp32) or their fp32 masters, which are then copied into the
low-precision parameters in place (:mod:`hybrid_engine.training.precision`). Nothing
here re-allocates a parameter, so decode graphs captured before a step replay
the new weights after it.

Semantics follow DeepSpeed: the loss is divided by
``gradient_accumulation_steps``, the optimizer steps at accumulation
boundaries only, gradients are clipped to ``gradient_clipping`` (0 = off) and
the LR scheduler steps with the optimizer, except on steps skipped for
non-finite gradients (fp16 overflow; bf16 with ``check_grad_overflow``, on by
default). The config's ``scheduler`` section is built with DeepSpeed's own LR
schedule classes (:func:`build_scheduler`), and optimizer type ``Adam`` means
AdamW's decoupled weight decay unless ``adam_w_mode`` is false, both as
``deepspeed.initialize`` does.

A step never writes non-finite weights: the optimizer steps, then the weights
it wrote (the fp32 masters under bf16/fp16) are checked, and a step that made
any of them NaN or infinite is undone (weights and optimizer state restored
from a snapshot taken just before) and counted in ``skipped_steps``, as a step
with non-finite gradients is. The gradients alone cannot tell: a finite
gradient times an absurd learning rate, weight decay or epsilon is not. The
snapshot costs one copy of the stepped parameters and their optimizer state
(kept between steps); ``bf16.check_grad_overflow: false`` turns this check
off together with the gradient check.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hybrid_engine.config.schema import EngineConfig
from hybrid_engine.distributed.world import rank
from hybrid_engine.model_access import model_device
from hybrid_engine.training.handoff import handoff_for
from hybrid_engine.training.overflow import attach_overflow_surface, publish_scale, take_skip_request
from hybrid_engine.training.precision import MasterWeights
from hybrid_engine.user_warnings import user_stacklevel

logger = logging.getLogger(__name__)

__all__ = ["LOCAL_OPTIMIZERS", "LocalTraining", "LossScalePolicy", "PolicyGradScaler", "UpdateGuard",
           "build_optimizer", "build_scheduler", "check_lr_kwargs", "optimizer_momenta"]


#: The optimizer types stage 0 builds itself (with torch's optimizers); ZeRO 1-3 hand any type to DeepSpeed.
LOCAL_OPTIMIZERS = ("AdamW", "Adam", "SGD")


def build_optimizer(config: EngineConfig, params: Any) -> torch.optim.Optimizer | None:
    """The optimizer ``config.optimizer`` describes (AdamW, Adam or SGD) over ``params``, or ``None``.

    As in DeepSpeed, ``Adam`` means AdamW's decoupled weight decay unless ``adam_w_mode`` is false, and
    ``weight_decay`` defaults to 0 as in DeepSpeed's fused Adam (torch's own default with ``torch_adam``).
    """
    spec = config.optimizer
    if spec is None:
        return None
    if spec.type not in LOCAL_OPTIMIZERS:
        raise ValueError(
            f"optimizer.type {spec.type!r} is built by DeepSpeed, at zero_optimization.stage 1-3; at stage 0 use "
            f"one of {', '.join(LOCAL_OPTIMIZERS)}, or pass optimizer= to initialize()"
        )
    kwargs = dict(spec.params)
    # DeepSpeed's switch between its fused Adam and torch's; torch's here, with the fused one's default weight
    # decay (0; torch's AdamW defaults to 0.01) unless the config asks for torch's optimizer itself.
    torch_adam = kwargs.pop("torch_adam", False)
    adam_w_mode = kwargs.pop("adam_w_mode", True) if spec.type in ("Adam", "AdamW") else None
    if adam_w_mode is not None and not torch_adam:
        kwargs.setdefault("weight_decay", 0.0)
    if "betas" in kwargs:
        betas = kwargs["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"optimizer.params.betas must be a pair [beta1, beta2], got {betas!r}")
        kwargs["betas"] = tuple(betas)
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.AdamW if adam_w_mode else torch.optim.Adam,
           "SGD": torch.optim.SGD}[spec.type]
    if spec.type == "SGD" and "lr" not in kwargs:
        kwargs["lr"] = 1e-3  # torch's SGD needs an explicit learning rate
    try:
        return cls(params, **kwargs)
    except (TypeError, IndexError) as exc:
        raise ValueError(f"optimizer.params are not valid for {spec.type}: {exc}") from exc


def optimizer_momenta(optimizer: torch.optim.Optimizer | None) -> list[Any]:
    """Each param group's ``betas`` (Adam family) or ``momentum`` (SGD, RMSprop), 0.0 where it has neither:
    DeepSpeed's ``get_mom``."""
    if optimizer is None:
        return []
    return [group.get("betas", group.get("momentum", 0.0)) for group in optimizer.param_groups]


class LossScalePolicy:
    """The fp16 loss scale from step to step, as DeepSpeed's loss scalers set it.

    Static (``loss_scale > 0``): never changes; an overflowing step is only skipped.
    Dynamic: starts at ``2**initial_scale_power``. An overflow halves it (never
    below ``min_loss_scale``) once ``hysteresis`` overflows have been absorbed;
    each overflow before that only uses one up. One that would halve it while it
    is at ``min_loss_scale`` already is an error, as DeepSpeed's
    ``DynamicLossScaler`` raises (every later step would be skipped). After ``loss_scale_window``
    clean steps since the last overflow it doubles, and the hysteresis is
    restored then (or after every clean step with ``consecutive_hysteresis``).
    """

    def __init__(self, fp16: Any) -> None:
        self.static = fp16.loss_scale > 0
        self.scale = float(fp16.loss_scale) if self.static else float(2 ** fp16.initial_scale_power)
        self.window, self.min_scale = fp16.loss_scale_window, float(fp16.min_loss_scale)
        self.hysteresis = self.hysteresis_left = fp16.hysteresis
        self.consecutive = fp16.consecutive_hysteresis
        self.iteration, self.last_overflow = 0, -1

    def update(self, *, overflow: bool) -> float:
        """The scale for the next step, after a step that did (``overflow``) or did not overflow."""
        if self.static:
            return self.scale
        if overflow:
            if self.hysteresis_left <= 1:
                if self.scale == self.min_scale:
                    raise RuntimeError(
                        f"fp16: the gradients overflowed with the loss scale already at fp16.min_loss_scale "
                        f"({self.min_scale:g}), so it cannot be lowered and every step would be skipped (DeepSpeed "
                        "stops the run here too); lower fp16.min_loss_scale, lower the learning rate, or use bf16")
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive:
                self.hysteresis_left = self.hysteresis
            clean = self.iteration - self.last_overflow - 1
            if clean > 0 and clean % self.window == 0:
                self.hysteresis_left = self.hysteresis
                self.scale *= 2
        self.iteration += 1
        return self.scale


class PolicyGradScaler(torch.amp.GradScaler):
    """A GradScaler whose scale a :class:`LossScalePolicy` sets, and whose state (checkpoints) includes it."""

    def __init__(self, device_type: str, policy: LossScalePolicy) -> None:
        super().__init__(device_type, init_scale=policy.scale)
        self.policy = policy

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "policy": dict(vars(self.policy))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        policy = state.pop("policy", None)
        super().load_state_dict(state)
        if policy is not None:
            vars(self.policy).update(policy)
        else:  # a checkpoint from before the policy: its scale, with the policy's counters fresh
            self.policy.scale = float(self.get_scale())


#: DeepSpeed's own LR schedules (``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``); any other type is
#: looked up in ``torch.optim.lr_scheduler``, as DeepSpeed does, without importing DeepSpeed.
DEEPSPEED_LR_SCHEDULES = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def build_scheduler(config: EngineConfig, optimizer: torch.optim.Optimizer | None) -> Any | None:
    """The LR scheduler of the config's ``scheduler`` section, built as ``deepspeed.initialize`` builds it at
    stages 1-3: with DeepSpeed's own classes (``deepspeed.runtime.lr_schedules``: WarmupLR, WarmupDecayLR,
    WarmupCosineLR, OneCycle, LRRangeTest), else the ``torch.optim.lr_scheduler`` class of that name;
    ``None`` without that section."""
    section = config.model_extra.get("scheduler") if config.model_extra else None
    if section is None:
        return None
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise ValueError('scheduler must be {"type": "<DeepSpeed scheduler>", "params": {...}}, got '
                         f"{section!r}")
    if optimizer is None:
        raise ValueError("scheduler: there is no optimizer to schedule; set config.optimizer or pass optimizer=")
    name = section["type"]
    torch_cls = getattr(torch.optim.lr_scheduler, name, None)
    if name in DEEPSPEED_LR_SCHEDULES:
        from hybrid_engine.distributed.deepspeed_import import import_deepspeed

        import_deepspeed(f"the config's scheduler {name!r} is one of DeepSpeed's")
        from deepspeed.runtime import lr_schedules

        cls = getattr(lr_schedules, name)
    elif isinstance(torch_cls, type) and issubclass(torch_cls, torch.optim.lr_scheduler.LRScheduler):
        cls = torch_cls  # DeepSpeed's fallback for a type it has no class of; needs no DeepSpeed
    else:
        raise ValueError(f"scheduler.type {name!r} is neither a DeepSpeed LR schedule "
                         f"({', '.join(DEEPSPEED_LR_SCHEDULES)}) nor a torch.optim.lr_scheduler class; use one of "
                         "those, or pass lr_scheduler= to initialize()")
    params = dict(section.get("params") or {})
    _rehearse_schedule(cls, name, params, optimizer)  # first: a refused schedule leaves the optimizer's lr alone
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"scheduler.params are not valid for {name}: {exc}") from exc


#: Scheduler steps rehearsed on a stand-in optimizer before training (:func:`_rehearse_schedule`).
REHEARSED_STEPS = 4


def _rehearse_schedule(cls: type, name: str, params: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """Step a copy of the schedule over a stand-in optimizer with ``optimizer``'s hyperparameters, a few times:
    a schedule that raises (``StepLR`` with ``step_size`` 0: ZeroDivisionError) or gives a learning rate that is
    not a finite number in ``[0, MAX_LR]`` is refused now, naming the section, instead of at a later step after
    the optimizer has stepped (or silently, with NaN weights)."""
    from hybrid_engine.config.schema import MAX_LR

    dummy = torch.nn.Parameter(torch.zeros(1))
    stand_in = torch.optim.SGD([dummy], lr=0.0)
    stand_in.defaults = dict(optimizer.defaults)  # schedules that cycle momentum look for betas there
    stand_in.param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [dummy]}
                             for group in optimizer.param_groups]
    plateau = issubclass(cls, torch.optim.lr_scheduler.ReduceLROnPlateau)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": nothing trains here
        try:
            schedule = cls(stand_in, **params)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"scheduler.params are not valid for {name}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - any failure of the user's schedule is reported as theirs
            raise ValueError(f"scheduler {name!r} with params {params!r} cannot be built ({type(exc).__name__}: "
                             f"{exc}); fix scheduler.params") from exc
        lrs = [[group["lr"] for group in stand_in.param_groups]]
        try:
            for _ in range(REHEARSED_STEPS):
                schedule.step(0.0) if plateau else schedule.step()
                lrs.append([group["lr"] for group in stand_in.param_groups])
        except Exception as exc:  # noqa: BLE001 - as above
            raise ValueError(f"scheduler {name!r} with params {params!r} fails at its first steps "
                             f"({type(exc).__name__}: {exc}); fix scheduler.params") from exc
    for step, values in enumerate(lrs):
        for lr in values:
            if not isinstance(lr, (int, float)) or not (math.isfinite(lr) and 0 <= lr <= MAX_LR):
                raise ValueError(f"scheduler {name!r} with params {params!r} sets the learning rate to {lr!r} at step "
                                 f"{step}; a learning rate must be a finite number in [0, {MAX_LR:g}]: fix "
                                 "scheduler.params")


def check_lr_kwargs(scheduler: Any, lr_kwargs: dict[str, Any] | None) -> None:
    """``ReduceLROnPlateau`` steps on a metric: refuse ``engine.step()`` without ``lr_kwargs={"metrics": value}``
    before anything steps (it was a TypeError from the scheduler after the optimizer had stepped)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and "metrics" not in (lr_kwargs or {}):
        raise ValueError(
            "engine.step(): the LR scheduler is ReduceLROnPlateau, which steps on a metric; pass it as "
            "engine.step(lr_kwargs={'metrics': value}) (the validation loss, say) at each optimizer step")


class UpdateGuard:
    """A snapshot of what an optimizer step writes: the stepped parameters and their optimizer state.

    :meth:`save` copies them into buffers kept between steps (allocated at the first step, and again only when
    a shape changes); :meth:`finite_or_restore` checks the stepped parameters after the step and, when any is
    not finite, copies the snapshot back, so the step leaves no trace. One host sync per step.
    """

    def __init__(self) -> None:
        self._params: list[torch.Tensor] = []
        self._param_copies: dict[int, torch.Tensor] = {}
        self._state: dict[int, dict[str, Any] | None] = {}

    @staticmethod
    def _copy_into(buffers: dict[Any, torch.Tensor], key: Any, value: torch.Tensor) -> torch.Tensor:
        buf = buffers.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype or buf.device != value.device:
            buf = buffers[key] = torch.empty_like(value, memory_format=torch.preserve_format)
        buf.copy_(value)
        return buf

    @torch.no_grad()
    def save(self, optimizer: torch.optim.Optimizer) -> None:
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        live = {id(p) for p in self._params}
        for key in [k for k in self._param_copies if k not in live]:  # parameters no longer stepped
            del self._param_copies[key]
            self._state.pop(key, None)
        for p in self._params:
            self._copy_into(self._param_copies, id(p), p.detach())
            state = optimizer.state.get(p)
            if not state:
                self._state[id(p)] = None
                continue
            old = self._state.get(id(p)) or {}
            saved: dict[str, Any] = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    buffers = {key: old[key]} if isinstance(old.get(key), torch.Tensor) else {}
                    saved[key] = self._copy_into(buffers, key, value.detach())
                else:
                    saved[key] = value
            self._state[id(p)] = saved

    def tensors(self) -> Iterator[torch.Tensor]:
        """The snapshot's buffers (kept between steps: the memory hand-off moves them with the optimizer's)."""
        yield from self._param_copies.values()
        for saved in self._state.values():
            if saved:
                yield from (v for v in saved.values() if isinstance(v, torch.Tensor))

    @torch.no_grad()
    def finite_or_restore(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the step kept every finite stepped parameter finite; if not, put them and their state back
        first. A weight that was not finite before the step does not count: the step did not write it so."""
        if not self._params:
            return True
        broke = [(torch.isfinite(self._param_copies[id(p)]) & ~torch.isfinite(p)).any() for p in self._params]
        if not bool(torch.stack(broke).any()):
            return True
        for p in self._params:
            p.copy_(self._param_copies[id(p)])
            saved = self._state.get(id(p))
            if saved is None:
                optimizer.state.pop(p, None)  # the step created it
                continue
            state = optimizer.state[p]
            for key in [k for k in state if k not in saved]:
                del state[key]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    state[key].copy_(value)
                else:
                    state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        return False


class LocalTraining:
    """Stage-0 training of ``module``: optimizer, optional fp32 masters and fp16 loss scaling."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, config: EngineConfig,
                 lr_scheduler: Any, masters: MasterWeights | None, *, built_from_config: bool = False) -> None:
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.lr_scheduler = lr_scheduler
        self.masters = masters
        self.global_steps = 0
        self.micro_steps = 0
        #: Optimizer steps skipped for non-finite gradients (fp16 overflow, or bf16 with check_grad_overflow).
        self.skipped_steps = 0
        #: Whether the last ``step()`` updated the weights (DeepSpeed's ``was_step_applied``).
        self.step_applied = False
        #: The gradient norm clipping measured at the last optimizer step (a device scalar), or ``None``.
        self.grad_norm: torch.Tensor | None = None
        #: DeepSpeed's ``set_gradient_accumulation_boundary``: overrides the micro-step count when not ``None``.
        self.boundary_override: bool | None = None
        self.inside_no_sync = False
        #: Whether the optimizer was built from ``config.optimizer`` (not passed in): DeepSpeed's ``optimizer_name``.
        self.built_from_config = built_from_config
        #: Optimizer steps undone because they wrote non-finite weights (also counted in ``skipped_steps``).
        self.non_finite_updates = 0
        # bf16 with check_grad_overflow off checks nothing, as DeepSpeed's bf16 optimizer then does not.
        self._guard = None if masters is not None and config.bf16.enabled and not config.bf16.check_grad_overflow \
            else UpdateGuard()
        self.scaler: PolicyGradScaler | None = None
        if config.fp16.enabled:
            # GradScaler scales, unscales and skips; the scale itself follows DeepSpeed's policy.
            self.scaler = PolicyGradScaler(model_device(module).type, LossScalePolicy(config.fp16))
        attach_overflow_surface(optimizer, self)  # DeepSpeed's optimizer.overflow/check_overflow/skip_step
        #: The optimizer's memory hand-off (engine.sleep("optimizer")); ``None`` without an optimizer.
        self.handoff = handoff_for(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's ``no_sync``: one process has no gradients to reduce, so only its rules are kept
        (no re-entry, no ``step()`` inside)."""
        if self.inside_no_sync:
            raise RuntimeError("engine.no_sync() cannot be entered again inside itself (as in DeepSpeed)")
        self.inside_no_sync = True
        try:
            yield
        finally:
            self.inside_no_sync = False

    def wake_optimizer(self) -> None:
        """A training call needs the optimizer's memory: wake it if asleep (counted in ``handoff.wakes``)."""
        if self.handoff is not None:
            self.handoff.wake(auto=True)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        self.wake_optimizer()
        if scale_wrt_gas:
            loss = loss / self.config.gradient_accumulation_steps
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward(retain_graph=retain_graph)
        if self.masters is not None:
            self.masters.fold_gradients()
        return loss  # as DeepSpeed's backward: the loss divided by the accumulation steps, not loss-scaled

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        self.wake_optimizer()
        optimizer = self.optimizer
        if optimizer is None:  # before any counting: a refused step changes nothing
            raise RuntimeError(
                "engine.step(): no optimizer; pass optimizer= to initialize() or set config.optimizer"
            )
        if self.inside_no_sync:
            raise RuntimeError("engine.step() cannot be called inside engine.no_sync() (as in DeepSpeed); step "
                               "after the block")
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.step_applied = False
        if not boundary:
            return
        if take_skip_request(optimizer):  # optimizer.skip_step = True, as DeepSpeed's: no update, scale kept
            self._skip_requested_step()
            return
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if self.config.gradient_clipping > 0:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.gradient_clipping)
        stepped = True
        if self.scaler is not None:
            stepped = self._grads_finite()  # unscaled above; GradScaler skips exactly these steps
            optimizer.overflow = not stepped
            if stepped:
                self._save_for_undo()
            self.scaler.step(optimizer)
            # The scale answers gradient overflow only: an update undone below is no reason to lower it.
            self.scaler.update(new_scale=self.scaler.policy.update(overflow=not stepped))
            publish_scale(optimizer, self)
        elif self.masters is not None and self.config.bf16.check_grad_overflow and not self._grads_finite():
            stepped = False  # as DeepSpeed's bf16 check_grad_overflow: skip, so no NaN reaches the weights
        else:
            self._save_for_undo()
            optimizer.step()
        if stepped and not self._update_finite():
            stepped = False
        self.skipped_steps += not stepped
        self.step_applied = stepped
        if self.masters is not None and stepped:
            self.masters.publish()
        try:
            if stepped and self.lr_scheduler is not None:
                try:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
                except TypeError as exc:
                    if not lr_kwargs:
                        raise
                    raise TypeError(f"engine.step(lr_kwargs={lr_kwargs!r}): {type(self.lr_scheduler).__name__}.step "
                                    f"does not take them ({exc}); the optimizer step was taken, the scheduler "
                                    "did not step") from exc
        finally:  # the optimizer has stepped: its gradients are spent and the step counts, whatever lr_kwargs did
            self.zero_grad()
            self.global_steps += 1
            self._report_progress()

    def _skip_requested_step(self) -> None:
        """A boundary step skipped on request (``optimizer.skip_step``): gradients dropped, counted as skipped."""
        self.zero_grad()
        self.skipped_steps += 1
        self.global_steps += 1
        self._report_progress()

    def gradients_overflow(self, partition_gradients: bool = True) -> bool:
        """Whether the gradients held now overflow the fp16 loss scale (never under bf16/fp32, as DeepSpeed's
        bf16 optimizer reports none): :mod:`hybrid_engine.training.overflow`'s ``check_overflow``. One process
        holds whole gradients: ``partition_gradients`` changes nothing."""
        return self.scaler is not None and self.optimizer is not None and not self._grads_finite()

    def _report_progress(self) -> None:
        """DeepSpeed's progress line every ``steps_per_print`` optimizer steps (logged at INFO, rank 0)."""
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0 and rank() == 0:
            logger.info("step=%d, skipped=%d, lr=%s, mom=%s", self.global_steps, self.skipped_steps,
                        [group["lr"] for group in self.optimizer.param_groups], optimizer_momenta(self.optimizer))

    def _save_for_undo(self) -> None:
        if self._guard is not None:
            self._guard.save(self.optimizer)

    def _update_finite(self) -> bool:
        """Whether the step just taken wrote finite weights; if not, it is undone (weights and optimizer state)
        and a warning names the optimizer's hyperparameters, the usual cause when the gradients were finite."""
        if self._guard is None or self._guard.finite_or_restore(self.optimizer):
            return True
        self.non_finite_updates += 1
        hyper = [{k: v for k, v in group.items() if k in ("lr", "weight_decay", "eps", "momentum", "betas")}
                 for group in self.optimizer.param_groups]
        warnings.warn(
            f"engine.step(): the optimizer step would have written non-finite weights (NaN or inf); it was undone "
            f"and skipped (engine.skipped_steps counts it). Check the learning rate and the optimizer's settings, "
            f"{hyper}, and the gradients", RuntimeWarning, stacklevel=user_stacklevel())
        return False

    def _grads_finite(self) -> bool:
        """Whether every gradient the optimizer steps is finite (one host read, at boundaries only)."""
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        return not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wake_optimizer()
        if self.optimizer is not None:
            _optimizer_zero_grad(self.optimizer, set_to_none)
        self.module.zero_grad(set_to_none=set_to_none)

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0


def _optimizer_zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
    """``optimizer.zero_grad(set_to_none=...)`` where it takes the argument (torch's optimizers). DeepSpeed's own
    (``FusedAdam``, ``FusedLion``: DeepSpeed-Chat's default) take none, as DeepSpeed's engine calls them: called
    bare, with the gradients then dropped here when ``set_to_none`` asks for it."""
    try:
        takes = "set_to_none" in inspect.signature(optimizer.zero_grad).parameters
    except (TypeError, ValueError):  # a builtin without a signature: torch's convention
        takes = True
    if takes:
        optimizer.zero_grad(set_to_none=set_to_none)
        return
    optimizer.zero_grad()
    if set_to_none:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
