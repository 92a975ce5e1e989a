"""``free_memory``: the device's own answer, or ``None``."""

from __future__ import annotations

from hybrid_engine.accelerator.memory import device_memory, free_memory


def test_the_host_reports_what_it_can_allocate_within_what_it_has():
    free = free_memory("cpu")
    assert isinstance(free, int) and 0 < free <= device_memory("cpu")


def test_a_device_type_without_mem_get_info_is_unknown():
    assert free_memory("meta") is None
