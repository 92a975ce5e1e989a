"""Two ranks as one 2-way model-parallel group: ``initialize(mpu=...)`` must reach ``deepspeed.initialize``.

``python mpu_worker.py OUT``: each rank is its own data-parallel group (data-parallel world 1), so a config
with ``train_batch_size`` = micro batch is valid (it is not against the launched world of 2), and DeepSpeed
averages gradients over the data-parallel group only: each rank keeps the weights of its own data.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from hybrid_engine import initialize
from hybrid_engine.distributed.launch import exit_launched_rank
from hybrid_engine.distributed.world import destroy_process_group
from hybrid_engine.tiny_models import build_model


class ModelParallelUnit:
    """A Megatron-style mpu: every rank in one model-parallel group, each rank its own data-parallel group."""

    def __init__(self) -> None:
        self.calls: set[str] = set()
        own = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank builds all
        self._data = own[dist.get_rank()]

    def _note(self, name: str) -> None:
        self.calls.add(name)

    def get_model_parallel_rank(self) -> int:
        self._note("get_model_parallel_rank")
        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        self._note("get_model_parallel_world_size")
        return dist.get_world_size()

    def get_model_parallel_group(self):
        self._note("get_model_parallel_group")
        return dist.group.WORLD

    def get_data_parallel_rank(self) -> int:
        self._note("get_data_parallel_rank")
        return 0

    def get_data_parallel_world_size(self) -> int:
        self._note("get_data_parallel_world_size")
        return 1

    def get_data_parallel_group(self):
        self._note("get_data_parallel_group")
        return self._data


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mpu = ModelParallelUnit()
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = initialize(model=build_model("tiny-llama", seed=1), config=config, mpu=mpu)
    ds = engine.training_backend.ds_engine
    rows = torch.randint(4, 384, (2, 8), generator=torch.Generator().manual_seed(100 + rank))
    engine.backward(engine(input_ids=rows, labels=rows).loss)
    engine.step()
    result = {"rank": rank, "mpu_kept": ds.mpu is mpu, "dp_world_size": ds.dp_world_size, "calls": sorted(mpu.calls),
              "train_batch_size": engine.config.train_batch_size, "global_steps": engine.global_steps,
              "checksum": sum(float(p.detach().double().sum()) for p in engine.module.parameters())}
    torch.save(result, f"{out}.rank{rank}")
    engine.destroy()
    destroy_process_group()
    exit_launched_rank()


if __name__ == "__main__":
    main()
