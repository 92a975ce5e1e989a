"""Engine checkpoints: everything a resumed run needs to continue bit for bit.

Why the RNG states: a sampled ``engine.generate`` draws its seed from torch's
global generator, and dropout in the training forward draws from it too. A
resumed run that restored only the weights would sample other rollouts and
train on other masks, so a crash-and-resume run would silently diverge from an
uninterrupted one. With them restored it continues the same streams: a fresh
process that loads a checkpoint and keeps going produces bit-identical weights
and tokens on CPU.

Under ZeRO 1-3 DeepSpeed's own ``save_checkpoint``/``load_checkpoint`` do the
work (every rank must call them), and each rank's torch RNG states go in a file
of its own in the tag directory
(:meth:`~hybrid_engine.training.deepspeed.DeepSpeedTraining.save_checkpoint`
says why). At stage 0 the layout is DeepSpeed's too (:func:`save`).

Nothing is unpickled in full unless the caller says so: the engine's own state
is tensors and plain Python values, loaded with ``torch.load(weights_only=True)``,
and ``client_state`` is pickled on its own (:func:`_pack_client_state`). What
is on disk is checked before anything is loaded
(:mod:`hybrid_engine.training.checkpoint_files`), and a checkpoint that does not
fit this engine is refused before anything changes (:func:`_check_loadable`,
:func:`_check_optimizer`). At ZeRO 1-3 the same checks hold for DeepSpeed's
files and ours, but DeepSpeed unpickles its own files in full
(``weights_only=False``): load only ZeRO checkpoints you trust.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from hybrid_engine.model_access import model_device
from hybrid_engine.training.checkpoint_files import (
    LATEST_FILE,
    begin_save,
    check_tag,
    describe_tags,
    digests,
    finish_save,
    read_latest,
    refusal,
    rng_problem,
    tag_files,
    verify,
    write_atomically,
    write_latest,
)
from hybrid_engine.training.local import LocalTraining
from hybrid_engine.training.overflow import publish_scale


class CheckpointedEngine(Protocol):
    """What saving and loading read of an engine (:class:`~hybrid_engine.engine.HybridEngine`)."""

    training_backend: Any  # LocalTraining, or the ZeRO backend with its own save/load_checkpoint

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def global_steps(self) -> int: ...

    @property
    def zero_stage(self) -> int: ...

__all__ = ["STATE_FILE", "load", "save"]

STATE_FILE = "hybrid_engine_states.pt"
FORMAT = 4
#: What every readable checkpoint holds (skipped_steps and optimizer_class are newer, and optional).
REQUIRED_KEYS = frozenset({"format", "module", "optimizer", "master_weights", "loss_scaler", "lr_scheduler",
                           "global_steps", "micro_steps", "rng", "client_state"})
READABLE_FORMATS = (2, 3, 4)  # 2: client_state inline, no optimizer class; 3: no manifest, no encoding
CLIENT_STATE_ENCODINGS = ("plain", "pickle")  # format 4: loads with weights_only=True, or needs the opt-in


def _directory(path: Any, name: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a directory path (str or os.PathLike), got {type(path).__name__}")
    return Path(path)


def _device_rng_module(device: torch.device) -> Any:
    """The torch module that keeps ``device``'s RNG state (``None`` for the CPU or where there is none)."""
    if device.type == "cpu":
        return None
    module = getattr(torch, "get_device_module", lambda _: None)(device)
    return module if callable(getattr(module, "get_rng_state", None)) else None


def _rng_state(device: torch.device) -> dict[str, Any]:
    module = _device_rng_module(device)
    return {"cpu": torch.get_rng_state(), "device": module.get_rng_state() if module is not None else None}


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    module = _device_rng_module(device)
    if module is not None and state.get("device") is not None:
        module.set_rng_state(state["device"])


def _pack_client_state(client_state: dict[str, Any] | None) -> tuple[torch.Tensor | None, str | None]:
    """``client_state`` pickled on its own, as bytes in a uint8 tensor, and how it loads back: ``"plain"``
    (with ``weights_only=True``) or ``"pickle"`` (only with ``trust_client_state=True``); ``(None, None)`` if
    empty.

    Pickled apart from the engine's state, so that state always loads safely. Plain data is dicts, lists,
    tuples, numbers, strings, tensors (and whatever the caller allowed with
    ``torch.serialization.add_safe_globals``). Anything else (numpy values, dataclasses, your own classes) saves
    as with DeepSpeed, but loading it needs ``trust_client_state=True``: the full unpickler can run code, so the
    load is refused, saying so, without it. A checkpoint saved with plain or no ``client_state`` is never
    unpickled in full, even with the opt-in."""
    if not client_state:
        return None, None
    buffer = io.BytesIO()
    try:
        torch.save(client_state, buffer)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"save_checkpoint: client_state cannot be pickled ({type(exc).__name__}: {exc}); "
                        "keep to values that pickle (no lambdas, open files or local classes)") from exc
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        encoding = "plain"
    except Exception:  # noqa: BLE001 - whatever the safe unpickler refuses needs the opt-in to load
        encoding = "pickle"
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone(), encoding


def _refused_global(exc: BaseException) -> str:
    """The class or function torch's safe unpickler refused, from its message (else the error's type)."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else type(exc).__name__


def _unpack_client_state(state: dict[str, Any], path: Path, trust: bool) -> dict[str, Any]:
    """The saved ``client_state``: with ``weights_only=True``, or in full when the save recorded values beyond
    plain data (or, format 3, did not record) and the caller passed ``trust_client_state=True``."""
    packed = state["client_state"]
    if state["format"] == 2 or packed is None:
        return packed or {}  # format 2: inline, already read with weights_only=True
    encoding = state.get("client_state_encoding")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 1 or (
            state["format"] >= 4 and encoding not in CLIENT_STATE_ENCODINGS):
        raise ValueError(f"load_checkpoint: {path} holds a client_state that is not one save_checkpoint writes")
    data = packed.numpy().tobytes()
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the safe unpickler's refusals and a damaged pickle alike
        if encoding == "plain":
            raise ValueError(f"load_checkpoint: {path} holds a client_state saved as plain data that does not "
                             f"load as such ({type(exc).__name__}); the file was changed after the save") from None
        if not trust:
            raise ValueError(
                f"load_checkpoint: {path} holds a client_state with values beyond plain data (dicts, lists, "
                f"numbers, strings, tensors): {_refused_global(exc)}. Unpickling it in full can run code, so it "
                "is not done by default; if you trust this checkpoint, pass trust_client_state=True (or register "
                "the class with torch.serialization.add_safe_globals, or keep client_state to plain data)"
            ) from None
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)  # the caller's opt-in
    if not isinstance(value, dict):
        raise ValueError(f"load_checkpoint: {path} holds a client_state that is not a dict")
    return value


def _check_optimizer(state: dict[str, Any], optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Raise before anything is loaded if ``state``'s optimizer state cannot be loaded into ``optimizer``.

    The optimizer's class name is saved for this: another optimizer (or other param groups) is a ``ValueError``
    that changes nothing, not a ``KeyError`` at the next ``step()``."""
    mine, saved = type(optimizer).__name__, state.get("optimizer_class")  # None in format 2
    fix = ("build the engine with the same optimizer, or pass load_optimizer_states=False to load the rest "
           "and start the optimizer afresh")
    if saved is not None and saved != mine:
        raise ValueError(f"load_checkpoint: {path} holds {saved} optimizer state, but this engine's optimizer "
                         f"is {mine}; {fix}")
    saved_sizes = [len(group["params"]) for group in state["optimizer"]["param_groups"]]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != sizes:
        raise ValueError(f"load_checkpoint: {path} holds {saved or 'optimizer'} state for param groups of "
                         f"{saved_sizes} parameters, but this engine's {mine} has {sizes}; {fix}")


def _check_loadable(state: dict[str, Any], training: LocalTraining, module: torch.nn.Module, path: Path, *,
                    strict: bool, load_scheduler: bool, check_module: bool) -> None:
    """Raise before anything is loaded if the module, master or scheduler state of ``state`` does not fit this
    engine (``load_state_dict`` copies what fits before it raises, and a scheduler of another type fails with a
    bare ``KeyError``): a refused load changes nothing. Frozen parameters a checkpoint left out
    (``exclude_frozen_parameters``) are not missing. ``check_module=False``: a ``custom_load_fn`` loads the
    module state, as it sees fit."""
    problem = rng_problem(state["rng"])
    if problem is not None:
        raise ValueError(f"load_checkpoint: {path} {problem}; it is not a checkpoint save_checkpoint wrote")
    counters = [state["global_steps"], state["micro_steps"], state.get("skipped_steps", 0)]
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counters):
        raise ValueError(f"load_checkpoint: {path} holds step counters that are not counts ({counters})")
    own = module.state_dict() if check_module else {}
    saved = state["module"] if check_module else {}
    if not isinstance(saved, dict) or not all(isinstance(v, torch.Tensor) for v in saved.values()):
        raise ValueError(f"load_checkpoint: {path} holds a module state that is not a dict of tensors")
    wrong = [k for k, v in saved.items() if k in own and tuple(v.shape) != tuple(own[k].shape)]
    missing = sorted(set(own) - set(saved) - set(state.get("frozen_excluded") or ()))
    unexpected = sorted(set(saved) - set(own))
    if wrong or (strict and (missing or unexpected)):
        what = "; ".join(f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                         for label, keys in (("shapes differ", wrong), ("missing", missing if strict else []),
                                             ("unexpected", unexpected if strict else [])) if keys)
        raise ValueError(f"load_checkpoint: {path} does not fit this model ({what}); it was saved from another "
                         "model" + ("" if wrong else ", or pass load_module_strict=False to load what matches"))
    if training.masters is not None:
        masters = training.masters.masters
        shapes = [tuple(m.shape) for m in state["master_weights"]]
        if shapes != [tuple(m.shape) for m in masters]:
            raise ValueError(f"load_checkpoint: the checkpoint holds {len(shapes)} master weights, the engine "
                             f"{len(masters)} (or their shapes differ); it was saved from another model, another "
                             "set of trainable parameters or another precision setting")
    scheduler, saved_sched = training.lr_scheduler, state.get("lr_scheduler")
    if load_scheduler and scheduler is not None and saved_sched is not None and hasattr(scheduler, "state_dict"):
        if set(scheduler.state_dict()) != set(saved_sched):
            raise ValueError(f"load_checkpoint: {path} holds the state of another learning-rate scheduler than "
                             f"this engine's {type(scheduler).__name__}; build the engine with the same scheduler, "
                             "or pass load_lr_scheduler_states=False")


def _deepspeed_files(directory: Path) -> list[str]:
    """The model-state files DeepSpeed writes into a tag directory (ZeRO 1/2: ``mp_rank_*``, 3: ``zero_pp_rank_*``)."""
    return sorted(p.name for p in directory.glob("*model_states.pt")) if directory.is_dir() else []


def save(engine: CheckpointedEngine, save_dir: Any, tag: str | None, client_state: dict[str, Any] | None,
         save_latest: bool, exclude_frozen_parameters: bool = False) -> bool:
    """``engine.save_checkpoint``: at stage 0, ``save_dir/<tag>/hybrid_engine_states.pt`` and a
    ``save_dir/latest`` file naming the last tag, as DeepSpeed lays them out.

    The one file holds the model and optimizer state dicts, the fp32 master weights (bf16/fp16), the fp16 loss
    scaler, the LR scheduler, the step counters, torch's RNG states and the caller's ``client_state``. Format 4
    is always saved with a manifest; formats 2 and 3 (:data:`READABLE_FORMATS`) still load. Under ZeRO 1-3 the
    training backend saves."""
    root = _directory(save_dir, "save_checkpoint: save_dir")
    check_tag(tag, "save_checkpoint: tag")
    if client_state is not None and not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint: client_state must be a dict or None, got {type(client_state).__name__}")
    if not isinstance(exclude_frozen_parameters, bool):
        raise TypeError(f"save_checkpoint: exclude_frozen_parameters must be True or False, got "
                        f"{exclude_frozen_parameters!r}")
    tag = tag or f"global_step{engine.global_steps}"
    rng = _rng_state(model_device(engine.module))
    training = engine.training_backend
    if not isinstance(training, LocalTraining):
        return training.save_checkpoint(root, tag, client_state or {}, save_latest, rng,
                                        exclude_frozen_parameters=exclude_frozen_parameters)
    packed_client_state, encoding = _pack_client_state(client_state)  # before writing anything: it may not pickle
    module_state = engine.module.state_dict()
    frozen = {name for name, p in engine.module.named_parameters()
              if exclude_frozen_parameters and not p.requires_grad and name in module_state}
    state = {
        "format": FORMAT,
        "module": {k: v for k, v in module_state.items() if k not in frozen},
        "frozen_excluded": sorted(frozen),  # left out by exclude_frozen_parameters: not missing when loaded
        "optimizer": training.optimizer.state_dict() if training.optimizer is not None else None,
        "optimizer_class": type(training.optimizer).__name__ if training.optimizer is not None else None,
        "master_weights": training.masters.state_dict() if training.masters is not None else None,
        "loss_scaler": training.scaler.state_dict() if training.scaler is not None else None,
        "lr_scheduler": training.lr_scheduler.state_dict() if training.lr_scheduler is not None else None,
        "global_steps": training.global_steps,
        "micro_steps": training.micro_steps,
        "skipped_steps": training.skipped_steps,
        "rng": rng,
        "client_state": packed_client_state,
        "client_state_encoding": encoding,
    }
    directory = root / tag
    # Marked incomplete first, the manifest last, then latest: a kill at any point leaves latest on a
    # complete checkpoint (checkpoint_files).
    begin_save(root, directory)
    write_atomically(directory / STATE_FILE, lambda f: torch.save(state, f))
    finish_save(directory, digests(directory, tag_files(directory)))
    if save_latest:
        write_latest(root, tag)
    return True


def resolve_tag(root: Path, tag: str | None) -> tuple[Path | None, bool]:
    """``(root/<tag>, whether the tag came from latest)``, the tag read from ``root/latest`` (and checked)
    when not given. ``(None, False)``, with a warning, when there is no such directory to load, as DeepSpeed
    returns ``(None, None)``; a ``latest`` naming a directory that is not there is a ``ValueError``."""
    from_latest = tag is None
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            warnings.warn(f"load_checkpoint: no {root / LATEST_FILE} file ({describe_tags(root)}); pass tag= to "
                          "load a specific checkpoint", UserWarning, stacklevel=4)
            return None, False
    directory = root / tag
    if not directory.is_dir():
        if from_latest:
            raise ValueError(f"load_checkpoint: {root / LATEST_FILE} names {tag!r}, but there is no {directory} "
                             f"({describe_tags(root)}); pass tag= to load one of them")
        warnings.warn(f"load_checkpoint: no checkpoint at {directory}", UserWarning, stacklevel=4)
        return None, False
    return directory, from_latest


def load(engine: CheckpointedEngine, load_dir: Any, tag: str | None, *, load_module_strict: bool,
         load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
         custom_load_fn: Any = None, trust_client_state: bool = False) -> tuple[str | None, dict[str, Any] | None]:
    root = _directory(load_dir, "load_checkpoint: load_dir")
    check_tag(tag, "load_checkpoint: tag")
    if custom_load_fn is not None and not callable(custom_load_fn):
        raise TypeError("load_checkpoint: custom_load_fn must be a callable taking (src=state_dict, dst=module), "
                        f"got {type(custom_load_fn).__name__}")
    if not isinstance(trust_client_state, bool):
        raise TypeError(f"load_checkpoint: trust_client_state must be True or False, got {trust_client_state!r}")
    training = engine.training_backend
    device = model_device(engine.module)
    directory, from_latest = resolve_tag(root, tag)
    if directory is None:
        return None, None
    path = directory / STATE_FILE
    if not isinstance(training, LocalTraining):
        if path.is_file() and not _deepspeed_files(directory):
            raise ValueError(
                f"load_checkpoint: {directory} holds a stage-0 (plain PyTorch) checkpoint, but this engine trains "
                f"on DeepSpeed (ZeRO stage {engine.zero_stage}); load it into a single-process stage-0 engine, or "
                f"load its 'module' state dict (torch.load of {STATE_FILE}) into the model before initialize")
        try:  # every file is verified, on every rank, before DeepSpeed reads any (training.deepspeed)
            load_path, client_state, rng = training.load_checkpoint(
                root, directory.name, load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        except AssertionError as exc:  # DeepSpeed's own check of the files it expects
            found = ", ".join(_deepspeed_files(directory))
            raise ValueError(
                f"load_checkpoint: DeepSpeed cannot read {directory} at ZeRO stage {engine.zero_stage} "
                f"(it holds: {found or 'no DeepSpeed files'}); a checkpoint saved at another ZeRO stage loads at "
                "that stage, or converts to a state dict with DeepSpeed's zero_to_fp32.py") from exc
        if rng is not None and not load_module_only:
            _set_rng_state(rng, device)
        return load_path, client_state
    if not path.is_file() and _deepspeed_files(directory):
        raise ValueError(
            f"load_checkpoint: {directory} holds a DeepSpeed ZeRO checkpoint "
            f"({', '.join(_deepspeed_files(directory))}), but this engine trains at zero_optimization.stage 0; "
            "load it with the ZeRO stage it was saved with, or convert it to a state dict with DeepSpeed's "
            "zero_to_fp32.py and load that into the model")
    has_manifest, problems = verify(directory)  # every byte checked before anything is read
    if problems:
        raise refusal(directory, problems)
    if not path.is_file():
        if from_latest:
            raise refusal(directory, [f"{root / LATEST_FILE} names {directory.name!r}, which holds no {STATE_FILE}"])
        warnings.warn(f"load_checkpoint: no checkpoint at {path}", UserWarning, stacklevel=3)
        return None, None
    not_ours = (f"load_checkpoint: {path} is not a hybrid-engine checkpoint of format "
                f"{' or '.join(map(str, READABLE_FORMATS))}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, garbage, or not a torch file: torch's unpickler errors vary
        raise ValueError(f"{not_ours} (it cannot be read: {type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict) or state.get("format") not in READABLE_FORMATS or not REQUIRED_KEYS <= set(state):
        raise ValueError(not_ours)
    if state["format"] >= 4 and not has_manifest:
        raise refusal(directory, [f"{directory} has no manifest, which every checkpoint of format "
                                  f"{state['format']} is saved with (it was removed), so {path} cannot be verified"])
    if (state["master_weights"] is None) != (training.masters is None):
        raise ValueError(f"load_checkpoint: {path} was saved with bf16/fp16 "
                         f"{'off' if state['master_weights'] is None else 'on'}, but this engine has it "
                         f"{'on' if training.masters is not None else 'off'}; use the same precision setting")
    load_optimizer = (not load_module_only and load_optimizer_states and training.optimizer is not None
                      and state["optimizer"] is not None)
    if load_optimizer:
        _check_optimizer(state, training.optimizer, path)
    # Before the engine changes: it may be refused (values beyond plain data, without the opt-in).
    client_state = _unpack_client_state(state, path, trust_client_state)
    _check_loadable(state, training, engine.module, path, strict=load_module_strict,
                    load_scheduler=not load_module_only and load_lr_scheduler_states,
                    check_module=custom_load_fn is None)
    if custom_load_fn is not None:  # the caller's own loading of the module state, as DeepSpeed's
        custom_load_fn(src=state["module"], dst=engine.module)
    else:  # strictness checked above; frozen parameters the checkpoint left out keep their values
        engine.module.load_state_dict(state["module"], strict=load_module_strict and not state.get("frozen_excluded"))
    if training.masters is not None:
        training.masters.load_state_dict(state["master_weights"])
    if not load_module_only:
        if load_optimizer:
            training.optimizer.load_state_dict(state["optimizer"])
        if training.scaler is not None and state["loss_scaler"] is not None:
            training.scaler.load_state_dict(state["loss_scaler"])
            publish_scale(training.optimizer, training)
        if load_lr_scheduler_states and training.lr_scheduler is not None and state["lr_scheduler"] is not None:
            training.lr_scheduler.load_state_dict(state["lr_scheduler"])
        training.global_steps = state["global_steps"]
        training.micro_steps = state["micro_steps"]
        training.skipped_steps = state.get("skipped_steps", 0)  # not in checkpoints before 2026-12-01
        _set_rng_state(state["rng"], device)
    return str(directory), client_state
