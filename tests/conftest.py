"""Every test runs on the CPU with the graph emulation (CUDA capture semantics), on one thread.

Tiny models gain nothing from intra-op threads, and on a shared 2-core box thread
oversubscription makes them 10-50x slower. Tests that need another accelerator set
it themselves; the fixture restores detection afterwards.

A graph pool left recording by a failed capture is what poisons CUDA's allocator
for the rest of a process; the emulation keeps it recording too. After each test
the fixture ends and releases any such pool, so one test cannot break the next,
and fails the test unless it is marked ``leaves_pool_recording`` (tests of the
emulation's raw capture, which leave one on purpose).
"""

import pytest
import torch

from hybrid_engine.accelerator import CPUAccelerator, cpu_graph, set_accelerator


def release_recording_pools() -> int:
    """End and release every pool a failed capture left recording; how many there were."""
    stuck = cpu_graph.recording_pools()
    for pool in stuck:
        cpu_graph.end_allocating_to_pool(pool)
        while pool._failed:
            cpu_graph.release_graph_pool(pool)
    return len(stuck)


@pytest.fixture(autouse=True)
def cpu_graphs(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    acc = CPUAccelerator(emulate_graphs=True)
    set_accelerator(acc)
    yield acc
    set_accelerator(None)
    torch.set_num_threads(threads)
    stuck = release_recording_pools()
    if stuck and request.node.get_closest_marker("leaves_pool_recording") is None:
        pytest.fail(f"{stuck} graph pool(s) left recording by a failed capture: on CUDA the allocator would "
                    "believe a capture is under way for the rest of the process")


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


def exact_mode_unavailable() -> str | None:
    """Why this machine's matmul kernels cannot run the exact mode (no row-invariant chunk size), or ``None``.
    A property of the CPU and its BLAS, asked before the exact-mode tests run (they skip with this reason)."""
    from hybrid_engine.exact.chunks import NoInvariantChunk, chunk_rows

    try:
        chunk_rows(torch.float32)
        chunk_rows(torch.bfloat16)
    except NoInvariantChunk as exc:
        return str(exc)
    return None
