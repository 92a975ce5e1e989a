"""``hybrid-engine bench kernels --compile-for sm_80,sm_90``: every Triton kernel the decode ops launch, compiled
for NVIDIA GPUs on a machine that has none.

Why: CPU CI runs our kernels under Triton's interpreter, which executes each program with NumPy: it shares the
compiler's front end, but not its lowering (layouts, LLVM, ``ptxas``), and checks no resource a GPU has, so a
program it runs may still fail to compile, or need more shared memory than a block gets. Triton's wheel carries its NVIDIA back end (LLVM and ``ptxas``), so the real
compiler runs on any machine. This calls each op at the check widths
(:data:`~hybrid_engine.benchmarks.kernel_check.LAUNCHES`: Qwen2.5-0.5B's decode step) with its implementation
forced to Triton, and intercepts each kernel launch: the arguments are specialised as Triton's JIT would
specialise them (pointer dtypes, 16-byte alignment, integer divisibility, constexprs, launch options), the
kernel is compiled to a cubin for each target, and its resources are read: shared memory (against the target's
per-block limit) and, from ``ptxas -v``, registers and spills. Nothing runs: the intercepted launch returns,
so the op's outputs are left unwritten and unused.

What it cannot tell: whether the kernel computes the right values (``bench kernels --check`` on a GPU, and the
interpreter tests in CI, do), or how fast it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SHARED_MEMORY_LIMIT", "compile_kernels", "parse_targets"]

#: Shared memory one block may use (bytes, opt-in maximum), by compute capability.
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def parse_targets(text: str) -> list[int]:
    """``"sm_80,sm_90"`` (or ``"80,90"``) as compute capabilities; ``ValueError`` naming the bad entry."""
    targets = []
    for item in (t.strip() for t in text.split(",")):
        number = item[3:] if item.startswith("sm_") else item
        if not number.isdigit() or int(number) not in SHARED_MEMORY_LIMIT:
            raise ValueError(f"--compile-for takes NVIDIA targets among "
                             f"{', '.join(f'sm_{c}' for c in SHARED_MEMORY_LIMIT)}, comma-separated; got {item!r}")
        targets.append(int(number))
    if not targets:
        raise ValueError("--compile-for needs at least one target, e.g. sm_90")
    return targets


@contextlib.contextmanager
def _launches_compiled(capability: int, rows: list[dict[str, Any]], label: list[str]) -> Iterator[None]:
    """Triton launches compile for ``capability`` (one row each, for the op ``label[0]``) instead of running."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        # What JITFunction.run does before it compiles, without asking a driver for the device.
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        row = {"op": label[0], "kernel": self._fn_name.rsplit(".", 1)[-1], "target": f"sm_{capability}",
               "num_warps": options.num_warps, "shared_bytes": None, "registers": None, "spill_bytes": None,
               "error": None}
        start = time.perf_counter()
        try:
            kernel = triton_compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
            row["shared_bytes"] = int(kernel.metadata.shared)
            row.update(_ptxas_usage(kernel.asm.get("ptx"), capability))
        except Exception as exc:  # noqa: BLE001 -- a kernel that does not compile is a failed row
            row["error"] = f"{type(exc).__name__}: {exc}"
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        return None

    saved = JITFunction.run
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = saved


def _ptxas_usage(ptx: str | None, capability: int) -> dict[str, int | None]:
    """Registers per thread and spill bytes (stores + loads) of ``ptx``, from ``ptxas -v`` (``None`` where this
    Triton's ptxas cannot be found or run)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        ptxas = get_ptxas(capability).path
    except Exception:  # noqa: BLE001 -- internal Triton API: report unknown rather than fail
        return {}
    if not ptx:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o",
                               os.path.join(tmp, "k.o")], capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    return {"registers": max(map(int, regs)) if regs else None, "spill_bytes": max(spills) if spills else None}


def compile_kernels(capabilities: list[int], dtypes: list[torch.dtype]) -> list[dict[str, Any]]:
    """One row per kernel launch of every op in ``kernel_check.LAUNCHES``, per target and dtype: the kernel,
    shared memory, registers, spills, and an error where it did not compile, exceeded the target's shared memory,
    or the op never launched a kernel. Needs Triton with its NVIDIA back end (no GPU, no interpreter)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("--compile-for compiles kernels: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    import triton  # noqa: F401 -- fail here, with ImportError, where Triton is missing

    from hybrid_engine.benchmarks.kernel_check import LAUNCHES, forced_triton

    rows: list[dict[str, Any]] = []
    cpu = torch.device("cpu")
    for capability in capabilities:
        for dtype in dtypes:
            for name, launch in LAUNCHES:
                label = [name]
                before = len(rows)
                with forced_triton(), _launches_compiled(capability, rows, label):
                    try:
                        launch(cpu, dtype, torch.Generator().manual_seed(0))
                    except Exception as exc:  # noqa: BLE001 -- the op refused before launching: a failed row
                        rows.append({"op": name, "kernel": "-", "target": f"sm_{capability}", "error":
                                     f"{type(exc).__name__}: {exc}"})
                if len(rows) == before:
                    rows.append({"op": name, "kernel": "-", "target": f"sm_{capability}",
                                 "error": "the op launched no Triton kernel"})
                for row in rows[before:]:
                    row["dtype"] = str(dtype).removeprefix("torch.")
                    shared = row.get("shared_bytes")
                    if row["error"] is None and shared is not None and shared > SHARED_MEMORY_LIMIT[capability]:
                        row["error"] = (f"needs {shared} bytes of shared memory, sm_{capability} gives a block "
                                        f"{SHARED_MEMORY_LIMIT[capability]}")
                    row["ok"] = row["error"] is None
    return rows
