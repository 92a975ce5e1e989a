"""Rollout tests run on the CPU with graph emulation (CUDA capture semantics)."""

import pytest
import torch

from hybrid_engine.accelerator import CPUAccelerator, get_accelerator, set_accelerator


@pytest.fixture(autouse=True)
def cpu_graph_accelerator():
    """Every rollout test runs on the CPU with graph emulation (CUDA capture semantics).

    Tiny models gain nothing from intra-op threads, and on a shared 2-core CI box
    thread oversubscription makes them 10-50x slower, so these tests use one thread.
    """
    previous = get_accelerator()
    threads = torch.get_num_threads()
    set_accelerator(CPUAccelerator(emulate_graphs=True))
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    set_accelerator(previous)
