"""The GPU check's environment stage (run by ``bench/gpu_check.py``): the GPU, its peak memory
bandwidth (:func:`peak_bandwidth`), torch, cupy, NVRTC and its headers, FlashInfer, and whether
what the other stages import imports here."""

from __future__ import annotations

import argparse
from typing import Any

from bench.gpu_common import Stage


# Peak HBM bandwidth (bytes/s) by device name, from the vendors' data sheets; the first key
# contained in the name wins, so the more specific names come first.
PEAK_HBM_BYTES_PER_S: dict[str, float] = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "H20": 4.0e12,
    "GH200": 4.0e12,
    "B200": 8.0e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10": 0.6e12,
    "RTX 4090": 1.008e12,
}


def peak_bandwidth(device_name: str, override_tbps: float | None = None,
                   memory_clock_khz: int | None = None, bus_width_bits: int | None = None
                   ) -> tuple[float | None, str]:
    """Peak memory bandwidth in bytes/s and where the figure comes from.

    ``--peak-tbps`` wins, then the data-sheet table, then the memory clock and bus width the
    driver reports (double data rate), else unknown.
    """
    if override_tbps:
        return override_tbps * 1e12, "--peak-tbps"
    for key, value in PEAK_HBM_BYTES_PER_S.items():
        if key.lower() in device_name.lower():
            return value, f"data sheet ({key})"
    if memory_clock_khz and bus_width_bits:
        return 2 * memory_clock_khz * 1e3 * bus_width_bits / 8, "driver: 2 x memory clock x bus width"
    return None, "unknown device"


def stage_environment(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import torch

    d = stage.data
    d.update({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
              "cuda_available": torch.cuda.is_available()})
    if not torch.cuda.is_available():
        d["gpu_unavailable"] = "no CUDA device visible to torch"
    else:
        props = torch.cuda.get_device_properties(0)
        d["gpu"] = props.name
        d["memory_gib"] = props.total_memory / 2**30
        d["l2_bytes"] = getattr(props, "L2_cache_size", None)
        d["sm_count"] = props.multi_processor_count
    from batchgen.kernels.cuda import toolchain

    try:
        cupy = toolchain._import_cupy()
        d["cupy"] = cupy.__version__
        d["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        if d.get("gpu"):
            rt = cupy.cuda.runtime
            d["memory_clock_khz"] = rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, 0)
            d["bus_width_bits"] = rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, 0)
            d["sm_clock_khz"] = rt.deviceGetAttribute(rt.cudaDevAttrClockRate, 0)
    except Exception as exc:  # noqa: BLE001 - recorded
        d["cupy_error"] = f"{type(exc).__name__}: {exc}"
    d["nvrtc"] = toolchain.nvrtc_version()
    major = d["nvrtc"][0] if d["nvrtc"] else None
    d["nvrtc_include_dirs"] = [{"path": str(x.path), "origin": x.origin, "cuda_version": x.cuda_version}
                               for x in toolchain.find_include_dirs(major)]
    why = toolchain.unavailable_reason()
    if why and "gpu_unavailable" not in d:
        d["gpu_unavailable"] = why
    if d.get("gpu"):
        peak, source = peak_bandwidth(d["gpu"], args.peak_tbps, d.get("memory_clock_khz"), d.get("bus_width_bits"))
        d["peak_bytes_per_s"], d["peak_source"] = peak, source
    try:
        import flashinfer  # noqa: F401

        d["flashinfer"] = getattr(flashinfer, "__version__", "installed")
    except Exception as exc:  # noqa: BLE001
        d["flashinfer"] = f"unavailable ({type(exc).__name__}: {exc})"
    d["imports"] = {name: import_error(name) or "ok" for name in NEEDED_IMPORTS + CARRIED_IMPORTS}
    broken = [n for n in NEEDED_IMPORTS if d["imports"][n] != "ok"]
    d["passed"] = not broken
    if broken:
        d["error"] = "cannot import " + "; ".join(f"{n}: {d['imports'][n]}" for n in broken)
    d["summary"] = d.get("gpu_unavailable") or f"{d.get('gpu')}, cupy {d.get('cupy')}, NVRTC {d['nvrtc']}"


# What the stages import (the environment stage fails without them), and what the carried wheels
# add (bench/gpu_models/wheels.txt: recorded, needed by no stage).
NEEDED_IMPORTS = ("batchgen.engine.llm", "batchgen.kernels.cuda.cuda_attention", "bench.gpu_models", "transformers",
                  "pytest")
CARRIED_IMPORTS = ("batchgen.config", "batchgen.plugins", "gguf")


def import_error(name: str) -> str | None:
    """Why ``import name`` fails here (one line), or None."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import-time failure is the finding
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return None
