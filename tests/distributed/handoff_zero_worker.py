"""One rank of the ZeRO hand-off test (run under torchrun by tests/distributed/test_handoff_zero.py).

``python handoff_zero_worker.py STAGE OUT_DIR``: two engines on the same seeded tiny Llama at ZeRO ``STAGE``,
one trained plainly, one with ``engine.sleep(["optimizer"])`` (DeepSpeed's ``offload_states``) between its
steps, half of them woken by the next training call and half by ``wake()``; saves losses, weights, parameter
addresses, sleeping tags and the hand-off's counters (or the error) to ``OUT_DIR/rank<R>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid_engine import initialize
from hybrid_engine.distributed.launch import exit_launched_rank
from hybrid_engine.distributed.world import destroy_process_group, rank
from hybrid_engine.tiny_models import build_model

STEPS = 4


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "hybrid_engine": {"enable_graph_capture": True}}


def train(engine, hand_off: bool) -> tuple[list[torch.Tensor], list[str]]:
    losses, tags = [], []
    for step in range(STEPS):
        ids = torch.randint(4, 384, (2, 8), generator=torch.Generator().manual_seed(100 * rank() + step))
        engine.train()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
        if hand_off:
            engine.sleep(["optimizer"])
            offloaded = engine.training_backend.ds_engine.optimizer.offloaded_states  # DeepSpeed's own record
            tags.append(sorted(engine.sleeping_tags) + sorted(str(s.value) for s in offloaded))
            if step % 2:
                engine.wake(["optimizer"])
    return losses, tags


def main() -> None:
    stage, out_dir = int(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    plain, *_ = initialize(model=build_model("tiny-llama", seed=1), config=config(stage))
    engine, *_ = initialize(model=build_model("tiny-llama", seed=1), config=config(stage))
    result: dict = {"rank": rank()}
    addresses = [p.data_ptr() for p in engine.module.parameters()]
    result["plain_losses"], _ = train(plain, False)
    try:
        result["losses"], result["tags"] = train(engine, True)
    except Exception as exc:  # noqa: BLE001 - the test asserts on the message
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["tags_after_error"] = sorted(engine.sleeping_tags)
        ids = torch.randint(4, 384, (2, 8), generator=torch.Generator().manual_seed(rank()))
        engine.backward(engine(input_ids=ids, labels=ids).loss)  # still trains
        engine.step()
        result["trained_after_error"] = True
    result["weights_equal"] = all(torch.equal(p, q) for p, q in zip(plain.module.parameters(),
                                                                     engine.module.parameters()))
    result["addresses_kept"] = addresses == [p.data_ptr() for p in engine.module.parameters()]
    result["stats"] = engine.handoff_stats.to_dict()
    plain.destroy()
    engine.destroy()
    torch.save(result, out_dir / f"rank{rank()}.pt")
    dist.barrier()
    destroy_process_group()
    exit_launched_rank()


if __name__ == "__main__":
    main()
