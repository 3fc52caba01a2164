"""The GPU check's report (``bench/gpu_check.py``): FlashInfer's times beside the kernel's rows,
whether the bandwidth targets hold, each stage's status, and the compact text table."""

from __future__ import annotations

import json
from typing import Any

from bench.gpu_common import (
    STAGES,
    TARGET_FRACTION,
    TARGET_MIN_BATCH,
    TARGET_MIN_CONTEXT,
    TARGET_VS_FLASHINFER,
    is_target,
)


def merge_flashinfer(result: dict[str, Any]) -> None:
    """Put FlashInfer's times beside the kernel's rows (matched by point) and the ratios."""
    bw = result.get("bandwidth", {})
    fi = result.get("flashinfer", {})
    times = {_key(r): r for r in fi.get("rows", []) if "flashinfer_us" in r}
    for row in bw.get("rows", []):
        other = times.get(_key(row))
        if other and "kernel_us" in row:
            row["flashinfer_us"] = other["flashinfer_us"]
            row["kernel_vs_flashinfer"] = row["kernel_us"] / other["flashinfer_us"]
            row["kernel_vs_flashinfer_range"] = [row["kernel_range_us"][0] / other["flashinfer_range_us"][1],
                                                 row["kernel_range_us"][1] / other["flashinfer_range_us"][0]]


def _key(row: dict[str, Any]) -> tuple:
    return row["dtype"], row["head_size"], row["batch"], row["context"]


def summarize_targets(result: dict[str, Any]) -> dict[str, Any]:
    """Whether the bandwidth targets hold over the target points that were measured."""
    rows = [r for r in result.get("bandwidth", {}).get("rows", []) if "kernel_us" in r and is_target(r)]
    out: dict[str, Any] = {"points_measured": len(rows),
                           "min_batch": TARGET_MIN_BATCH, "min_context": TARGET_MIN_CONTEXT}
    fracs = [r["fraction_of_peak"] for r in rows if r.get("fraction_of_peak") is not None]
    if fracs:
        out["min_fraction_of_peak"] = min(fracs)
        out["fraction_target_met"] = min(fracs) >= TARGET_FRACTION
    ratios = [r["kernel_vs_flashinfer"] for r in rows if "kernel_vs_flashinfer" in r]
    if ratios:
        out["max_kernel_vs_flashinfer"] = max(ratios)
        out["flashinfer_target_met"] = max(ratios) <= TARGET_VS_FLASHINFER
    return out


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def render_table(result: dict[str, Any]) -> str:
    """The compact text report: one line per stage, then the bandwidth table."""
    lines = []
    env = result.get("environment", {})
    if env.get("gpu"):
        peak = env.get("peak_bytes_per_s")
        lines.append(f"GPU {env['gpu']}, peak {peak / 1e12:.2f} TB/s ({env.get('peak_source')})" if peak
                     else f"GPU {env['gpu']}, peak bandwidth unknown")
    for name in STAGES:
        stage = result.get(name)
        if stage is None:
            continue
        status = status_of(stage)
        detail = stage.get("no_gpu") or stage.get("skipped") or stage.get("summary") or stage.get("error", "").strip().splitlines()[-1:] or ""
        if isinstance(detail, list):
            detail = detail[0] if detail else ""
        lines.append(f"{name:<13} {status}  {stage.get('wall_s', 0):6.1f} s  {str(detail)[:110]}")
    rows = [r for r in result.get("bandwidth", {}).get("rows", []) if "kernel_us" in r]
    if rows:
        lines.append("")
        lines.append(f"{'dtype':<8} {'head':>4} {'batch':>5} {'ctx':>6} {'kernel us':>10} {'TB/s':>6} "
                     f"{'of peak':>7} {'sdpa us':>9} {'flashinf us':>11} {'vs FI':>6}")
        for r in rows:
            lines.append(
                f"{r['dtype']:<8} {r['head_size']:>4} {r['batch']:>5} {r['context']:>6} "
                f"{r['kernel_us']:>10.1f} {r['kernel_TBps']:>6.2f} {_fmt(r.get('fraction_of_peak'), '.1%'):>7} "
                f"{_fmt(r.get('sdpa_us'), '.1f'):>9} {_fmt(r.get('flashinfer_us'), '.1f'):>11} "
                f"{_fmt(r.get('kernel_vs_flashinfer'), '.2f', 'x'):>6}")
    targets = result.get("targets")
    if targets:
        lines.append("")
        lines.append("targets (batch >= 64, context >= 1K): " + json.dumps(targets))
    return "\n".join(lines)


def status_of(stage: dict[str, Any]) -> str:
    """PASS, FAIL, SKIP, or NOGPU (a dry run's stage stopped at its first CUDA call)."""
    if "no_gpu" in stage and not stage.get("error"):
        return "NOGPU"
    return "SKIP" if stage.get("skipped") else "PASS" if stage.get("passed") else "FAIL"
