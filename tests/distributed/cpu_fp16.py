"""Test double at a hardware-capability boundary: DeepSpeed's CPU accelerator reports no fp16; torch computes fp16
on CPU.

DeepSpeed 0.19's ``CPU_Accelerator.is_fp16_supported()`` answers whether oneDNN has fp16 kernels for this CPU
(``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX-FP16), and DeepSpeed's engine
(``_do_sanity_check``: "Type fp16 is not supported on your device.") and ``hybrid_engine.training.deepspeed.build``
refuse fp16 on that answer. torch's CPU operators compute fp16 without those kernels, so on 2 gloo CPU ranks
:func:`report_fp16_on_cpu` lets the multi-process tests run DeepSpeed's own fp16 ZeRO 2/3 optimizers: dynamic loss
scaling, the overflow check all-reduced over the ranks, skipped steps, the scale backing off. Only this process's
accelerator's capability report is replaced (on a CPU with those kernels it already answers ``True``); DeepSpeed's
logic runs as it is, on CPU tensors. It shows nothing about GPU kernels, CUDA streams or NCCL, nor fp16 speed.
"""

from __future__ import annotations

__all__ = ["report_fp16_on_cpu"]


def report_fp16_on_cpu() -> None:
    """Make this process's DeepSpeed CPU accelerator report fp16 support (its ``is_fp16_supported`` only).

    Call it in each rank before ``deepspeed.initialize``/``hybrid_engine.initialize``. Raises ``RuntimeError`` on
    any other accelerator (a GPU's report is never overridden)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    accelerator = get_accelerator()  # DeepSpeed's one accelerator instance for this process
    if not isinstance(accelerator, CPU_Accelerator):
        raise RuntimeError(f"report_fp16_on_cpu: DeepSpeed's accelerator is {type(accelerator).__name__}, not its CPU "
                           "one; this test double only stands in for the CPU accelerator's fp16 report")
    accelerator.is_fp16_supported = lambda: True  # test double: an instance attribute over the class's method
