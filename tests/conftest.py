"""Every test runs on the CPU with the graph emulation (CUDA capture semantics), on one thread.

Tiny models gain nothing from intra-op threads, and on a shared 2-core box thread
oversubscription makes them 10-50x slower. Tests that need another accelerator set
it themselves; the fixture restores detection afterwards.
"""

import pytest
import torch

from hybrid_engine.accelerator import CPUAccelerator, set_accelerator


@pytest.fixture(autouse=True)
def cpu_graphs():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    acc = CPUAccelerator(emulate_graphs=True)
    set_accelerator(acc)
    yield acc
    set_accelerator(None)
    torch.set_num_threads(threads)


def left_padded_prompts(batch: int, width: int, seed: int = 0, vocab: int = 384) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded prompts where row ``b`` has ``b % width`` left pads (id 0, mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        pads = b % width
        ids[b, :pads] = 0
        mask[b, :pads] = 0
    return ids, mask
