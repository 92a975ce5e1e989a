"""One rank of tests/distributed/test_zero_overflow.py: DeepSpeed-Chat's overflow surface at ZeRO 1-3.

``python zero_overflow_worker.py STAGE OUT_DIR [PRECISION]``: a tiny OPT on DeepSpeed ZeRO ``STAGE`` (``PRECISION``
bf16, the default, or fp16: dynamic loss scale from 2**8, hysteresis 2, under the CPU accelerator's fp16 test double
of ``cpu_fp16.py``; AdamW, a WarmupLR schedule) through ``hybrid_engine.initialize``, then, on engine ``a``: ``check_overflow(external=True)`` with no
gradients, on finite gradients, on gradients with a NaN on rank 1 only (then DeepSpeed's own step), and a step with
``optimizer.skip_step = True`` set on rank 0 only, then one more step. Engine ``b``, built alike, takes only the
two steps ``a`` updated with (no overflowing step, no skipped one): if the skips changed nothing, ``a`` and ``b`` end
bit-identical. Then ``a`` takes a second step with a NaN on rank 1 (fp16: the hysteresis is used up, so the scale
backs off). Records the answers, counters, loss-scaler state and weights (gathered) to ``OUT_DIR/rank<R>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hybrid_engine.distributed.deepspeed_import import import_deepspeed
from hybrid_engine.distributed.launch import exit_launched_rank
from hybrid_engine.distributed.world import destroy_process_group, rank
from hybrid_engine.distributed.zero3 import gathered_for_inference

import_deepspeed()
from cpu_fp16 import report_fp16_on_cpu  # noqa: E402  (this folder: the test double for fp16 on CPU)

import hybrid_engine  # noqa: E402
from hybrid_engine.tiny_models import build_model  # noqa: E402


def config(stage: int, precision: str) -> dict:
    mixed = {"bf16": {"enabled": True}} if precision == "bf16" else {
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 2}}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, **mixed,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10, "warmup_type": "linear"}}}


def batch(step: int) -> torch.Tensor:
    """This rank's micro-batch for ``step`` (the ranks' batches differ)."""
    return torch.randint(4, 300, (2, 6), generator=torch.Generator().manual_seed(100 * step + rank()))


def train(engine, step: int, nan: bool = False) -> None:
    ids = batch(step)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss * float("nan") if nan else loss)


def weights(engine) -> dict[str, torch.Tensor]:
    """The whole model's weights (gathered under ZeRO-3: a collective, every rank enters it)."""
    with gathered_for_inference(engine.module), torch.no_grad():
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def optimizer_state(opt) -> list[torch.Tensor]:
    """This rank's fp32 master partitions and AdamW state, inside DeepSpeed's ZeRO optimizer."""
    inner = opt.optimizer
    tensors = [p.detach().clone() for g in inner.param_groups for p in g["params"]]
    for state in inner.state.values():
        tensors += [v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v) for v in state.values()]
    return tensors


def counters(engine) -> dict:
    return {"global": engine.global_steps, "skipped": engine.skipped_steps, "lr": engine.get_lr()[0],
            "scale": float(engine.optimizer.cur_scale), "applied": engine.was_step_applied()}


def scaler_state(opt) -> dict:
    """DeepSpeed's loss scaler's counters (scale, hysteresis, iteration, last overflow)."""
    return {k: v for k, v in vars(opt.loss_scaler).items() if isinstance(v, (bool, int, float))}


def main() -> None:
    stage, out_dir = int(sys.argv[1]), Path(sys.argv[2])
    precision = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    if precision == "fp16":
        report_fp16_on_cpu()
    r: dict = {}
    torch.manual_seed(0)
    a, opt, _, _ = hybrid_engine.initialize(model=build_model("tiny-opt", seed=1), config=config(stage, precision))
    r["same_optimizer"] = opt is a.optimizer
    r["class"] = type(opt).__name__
    r["dtype"] = next(a.module.parameters()).dtype
    r["scale0"] = float(opt.cur_scale)
    r["no_grads"] = opt.check_overflow(external=True)  # before any backward: nothing held
    try:  # refused before any collective, so every rank refuses alike
        opt.check_overflow(external="yes")
    except TypeError as exc:
        r["bad_external"] = str(exc)
    w0 = weights(a)
    train(a, 0)
    r["finite"], r["finite_attr"] = opt.check_overflow(external=True), opt.overflow
    a.step()  # trains
    r["first_changed"] = any(not torch.equal(v, w0[k]) for k, v in weights(a).items())
    r["after_step"] = opt.check_overflow()  # DeepSpeed's own raises here at ZeRO 1/2
    w1 = weights(a)
    train(a, 1, nan=rank() == 1)
    r["nan"], r["nan_attr"] = opt.check_overflow(external=True), opt.overflow
    a.step()  # DeepSpeed's own step finds the NaN and skips
    r["after_nan"] = counters(a)
    r["nan_kept_weights"] = all(torch.equal(v, w1[k]) for k, v in weights(a).items())
    train(a, 2)
    r["finite_again"] = opt.check_overflow(external=True)
    if rank() == 0:  # asked on one rank: every rank skips (a partitioned update cannot be taken on some only)
        opt.skip_step = True
    before, state_before, count_before = weights(a), optimizer_state(opt), counters(a)
    r["scaler_before_skip"] = scaler_state(opt)
    a.step()
    r["scaler_after_skip"] = scaler_state(opt)
    r["skip_flag_after"] = opt.skip_step
    r["skip_overflow_attr"] = opt.overflow  # what DeepSpeed's step found in the (finite) gradients
    r["before_skip"], r["after_skip"] = count_before, counters(a)
    r["skip_kept_weights"] = all(torch.equal(v, before[k]) for k, v in weights(a).items())
    r["skip_kept_state"] = all(torch.equal(x, y) for x, y in zip(state_before, optimizer_state(opt)))
    r["grads_after_skip"] = [p.grad is None or not p.grad.any() for p in a.module.parameters()]
    r["after_skip_check"] = opt.check_overflow()
    train(a, 3)
    a.step()  # trains as it would have without the skipped steps
    r["after_next"] = counters(a)
    wa = weights(a)
    r["next_changed"] = any(not torch.equal(v, before[k]) for k, v in wa.items())
    train(a, 4, nan=rank() == 1)
    a.step()  # a second overflow: under fp16 the hysteresis is used up, so DeepSpeed's scaler backs the scale off
    r["after_second_nan"] = counters(a)
    r["second_nan_kept_weights"] = all(torch.equal(v, wa[k]) for k, v in weights(a).items())
    a.destroy()
    torch.manual_seed(0)
    b, *_ = hybrid_engine.initialize(model=build_model("tiny-opt", seed=1), config=config(stage, precision))
    for step in (0, 3):
        train(b, step)
        b.step()
    r["b_counters"] = counters(b)
    wb = weights(b)
    r["matches_b"] = wb.keys() == wa.keys() and all(torch.equal(wb[k], v) for k, v in wa.items())
    b.destroy()
    torch.save(r, out_dir / f"rank{rank()}.pt")
    destroy_process_group()
    exit_launched_rank()


if __name__ == "__main__":
    main()
