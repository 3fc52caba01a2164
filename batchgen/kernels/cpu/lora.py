"""The LoRA delta kernel (``lora.c``): per row, ``x·Aᵀ`` then ``·Bᵀ`` of that row's adapter,
added to a layer's float32 output in place, on the kernels' thread pool.

Why a C kernel: each row must get its delta from its own row and adapter alone, whatever else
shares the step (the needle rule), and torch's GEMM does not promise that (its blocking, and
its kernel for one row against many, depend on the number of rows). Figures are in
``docs/lora.md``. The per-slot tables it reads are built by :class:`batchgen.lora.layers.LoRALinear`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from . import c_build

LORA_SOURCE = Path(__file__).resolve().parent / "lora.c"


ISAS = {"native": (), "plain": ("-mno-avx512f",)}  # the AVX-512 code, or the plain C (same bits)


def load_lora(isa: str = "native") -> Any:
    """The compiled library (built on first use, cached on disk like the other kernels):
    ``isa="native"`` (AVX-512 where the CPU has it), ``"plain"`` (the C loops alone, what a
    CPU without AVX-512 runs; the tests compare the two bit for bit).

    Raises:
        c_build.CpuKernelError: no compiler, or it would not build here.
    """
    return c_build.load_library("the CPU LoRA kernel", LORA_SOURCE, _declare, ISAS[isa],
                               tag="" if isa == "native" else isa)


def _declare(lib: Any) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.batchgen_lora_f32.restype = ctypes.c_int
    lib.batchgen_lora_f32.argtypes = [p, i64, p, i64, i64, i64, p, p, p, p, p, p, i32, i32, i64]
    lib.batchgen_lora_max_rank.restype = ctypes.c_int


def max_rank() -> int:
    """The largest summed rank of one layer's adapter (a merged q/k/v sums three ranks)."""
    return int(load_lora().batchgen_lora_max_rank())
