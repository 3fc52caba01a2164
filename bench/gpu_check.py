"""One-command GPU check of the ``cuda`` attention backend (``bash bench/gpu_check.sh``).

    python bench/gpu_check.py [--deadline-s 450] [--stages correctness,bandwidth] [--out F]

Stages, each in its own subprocess with its own time budget (a crash, a hung kernel or a dead
CUDA context in one stage never stops the others), each recorded in the JSON even when it fails
or runs out of time (a stage writes its partial results as it goes):

``environment``  GPU, its peak HBM bandwidth, torch, cupy, NVRTC version and header directory.
``correctness``  ``paged_decode_attention`` against the torch backend (the spec): head sizes 64, 80, 96,
                 128, 256; GQA groups 1, 2, 3, 4, 8; float32, float16, bfloat16; ragged lengths;
                 a 9,217-token context; ``reshape_and_cache`` and ``copy_blocks``; and the index
                 checks (a bad block id raises, and the GPU still works after).
``kernel_tests`` ``tests/kernels/test_kernels.py``'s GPU cases on real cupy.
``bandwidth``    the decode kernel's achieved bandwidth, CUDA events with the host excluded
                 (the calls are queued behind a sleep kernel, so they run back to back), as a
                 fraction of the device's peak: batch 1/16/64/256 × context 512/1K/4K/16K ×
                 head 64/128 × float16/bfloat16; beside torch SDPA's flash backend on the
                 already-gathered (dense) cache.
``flashinfer``   FlashInfer's paged decode on the same points, where it installs.
``end_to_end``   the engine against HF ``generate`` on SmolLM2-135M's config with seeded random
                 weights: greedy, beam 4, n=4 seeded; float16 and bfloat16; blocks 16 and 32
                 (:mod:`bench.gpu_end_to_end`).
``throughput``   generated tokens/s of batchgen, HF ``generate`` and HF ``generate_batch`` on a
                 1B model of Llama-3.2-1B's shape, W32 and W256 (:mod:`bench.gpu_end_to_end`).

Without a CUDA GPU (or cupy), every GPU stage is recorded as skipped with the reason. With
``--dry-run`` (``GPU_CHECK_DRY_RUN=1`` in ``gpu_check.sh``) every stage runs instead, up to its
first CUDA call (:func:`gpu_point`), and is recorded as ``no_gpu`` with the point it reached; the
exit status is then 0 when every stage got there without an error. Otherwise the exit status is
0 only if every stage that ran passed. Results: ``--out`` (default ``$OUT/gpu_check.json``
when ``$OUT`` is set, else ``bench/results/gpu_check.json``), and a compact table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------- plan
# Default budgets in seconds; scaled down together when the deadline is shorter.
# Time a stage leaves unused goes to the next ones.
STAGE_BUDGETS: dict[str, float] = {
    "environment": 30.0,
    "correctness": 45.0,
    "kernel_tests": 30.0,
    "bandwidth": 60.0,
    "flashinfer": 20.0,
    "end_to_end": 70.0,
    "throughput": 90.0,
}
STAGES = tuple(STAGE_BUDGETS)
DRY_RUN_STAGE_S = 90.0  # each stage's budget in a dry run
GPU_STAGES = tuple(s for s in STAGES if s != "environment")
# Seconds a stage's process may run past its budget (start-up, writing) before it is killed.
GRACE_S = 15.0

CHECK_HEAD_SIZES = (64, 80, 96, 128, 256)
CHECK_GROUPS = (1, 2, 3, 4, 8)
CHECK_DTYPES = ("float32", "float16", "bfloat16")
LONG_CONTEXT = 9217  # 37 split-K partitions, one past a block edge
RAGGED_LENS = (1, 15, 16, 17, 300, 257)  # within, at and just past block and partition edges
# (head_size, GQA group, context lengths, block size), run in every dtype besides the grid
EXTRA_CASES = ((128, 4, (LONG_CONTEXT, 3, 600), 16), (64, 8, (LONG_CONTEXT,), 32), (96, 2, (9, 130, 1000), 8))
# Output against the float32 reference: about two units in the last place of the dtype.
TOLERANCES = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

BENCH_BATCHES = (1, 16, 64, 256)
BENCH_CONTEXTS = (512, 1024, 4096, 16384)
BENCH_HEAD_SIZES = (64, 128)
BENCH_DTYPES = ("float16", "bfloat16")
# A Llama-3-8B-like layer (32 query heads over 8 KV heads), 16-token blocks.
BENCH_NUM_HEADS, BENCH_NUM_KV_HEADS, BENCH_BLOCK_SIZE = 32, 8, 16
# The targets: at batch >= 64 and context >= 1K, >= 70 % of peak HBM bandwidth and within
# 1.2x of FlashInfer's time.
TARGET_MIN_BATCH, TARGET_MIN_CONTEXT = 64, 1024
TARGET_FRACTION, TARGET_VS_FLASHINFER = 0.70, 1.2

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


def decode_bytes(batch: int, context: int, num_heads: int, num_kv_heads: int, head_size: int,
                 block_size: int, dtype_bytes: int) -> int:
    """Bytes one decode call must move at the least: what the bandwidth figures divide.

    Every K and V row of every sequence's context, once (``2 · batch · context · kv_heads ·
    head_size`` elements), the query read and the output written (``batch · heads ·
    head_size`` each), the block-table entries read (``ceil(context / block_size)`` int32 per
    sequence) and the context lengths (one int32 each). Split-K scratch and re-reads by a kernel
    are not counted: they are its own cost, not the problem's.
    """
    kv = 2 * batch * context * num_kv_heads * head_size * dtype_bytes
    q_and_out = 2 * batch * num_heads * head_size * dtype_bytes
    tables = batch * math.ceil(context / block_size) * 4 + batch * 4
    return kv + q_and_out + tables


def bench_points(batches=BENCH_BATCHES, contexts=BENCH_CONTEXTS, heads=BENCH_HEAD_SIZES,
                 dtypes=BENCH_DTYPES) -> list[dict[str, Any]]:
    """The bandwidth sweep, target points (batch >= 64, context >= 1K) first."""
    points = [{"dtype": d, "head_size": h, "batch": b, "context": c}
              for d in dtypes for h in heads for b in batches for c in contexts]
    return sorted(points, key=lambda p: not is_target(p))  # stable


def is_target(point: dict[str, Any]) -> bool:
    return point["batch"] >= TARGET_MIN_BATCH and point["context"] >= TARGET_MIN_CONTEXT


def plan_stages(selected: list[str], deadline_s: float,
                budgets: dict[str, float] | None = None) -> list[tuple[str, float]]:
    """(stage, budget) in run order, the budgets scaled to fit ``deadline_s`` (with the grace
    each stage may overrun by)."""
    budgets = budgets or STAGE_BUDGETS
    unknown = [s for s in selected if s not in budgets]
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(budgets)}")
    order = [s for s in budgets if s in selected]
    wanted = sum(budgets[s] for s in order)
    room = deadline_s - GRACE_S * len(order)
    if room <= 0:
        raise ValueError(f"--deadline-s {deadline_s:.0f} leaves no time for {len(order)} stage(s) "
                         f"(each may overrun by {GRACE_S:.0f} s)")
    scale = min(1.0, room / wanted) if wanted else 1.0
    return [(s, budgets[s] * scale) for s in order]


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return ROOT / "bench" / "results" / "gpu_check.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON result (default: $OUT/gpu_check.json "
                   "or bench/results/gpu_check.json)")
    p.add_argument("--deadline-s", type=float, default=450.0, help="wall-clock budget of all stages")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of: " + ", ".join(STAGES))
    p.add_argument("--peak-tbps", type=float, default=None, help="peak memory bandwidth, if the table lacks the GPU")
    p.add_argument("--iters", type=int, default=20, help="timed calls per repeat")
    p.add_argument("--repeats", type=int, default=5, help="repeats of each timing (median and spread)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dry-run", action="store_true", help="without a GPU: run every stage up to its first "
                   "CUDA call, then record no_gpu")
    p.add_argument("--setup-log", type=Path, default=None, help="bench/gpu_check.sh's install log, to include")
    # internal: run one stage in this process
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stage-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--env-json", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.stage_list = [s.strip() for s in args.stages.split(",") if s.strip()]
    plan_stages(args.stage_list, args.deadline_s)  # validates now, not after the first stage
    if args.out is None:
        args.out = default_out()
    return args


# --------------------------------------------------------------------------- report
def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a reader or a kill never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


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


class NoGpu(Exception):
    """Raised by :func:`gpu_point` where a stage would make its first CUDA call without a GPU."""


def gpu_point(what: str, device: str = "cuda") -> None:
    """Mark a stage's first CUDA call: without a CUDA device, stop the stage here (the dry run
    records that it got this far). Does nothing on a GPU, or when ``device`` is the CPU (the
    tests run stages there)."""
    import torch

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise NoGpu(f"no GPU: stopped before {what}")


# --------------------------------------------------------------------------- orchestration
def run_stage(name: str, budget_s: float, args: argparse.Namespace, env_json: Path | None) -> dict[str, Any]:
    """Run one stage in a subprocess; its partial JSON survives a timeout or a crash."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as tmp:
        stage_out = Path(tmp) / "stage.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--stage-out", str(stage_out),
               "--budget-s", f"{budget_s:.1f}", "--iters", str(args.iters), "--repeats", str(args.repeats),
               "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
               "--stages", ",".join(args.stage_list), "--deadline-s", str(args.deadline_s)]
        if args.peak_tbps:
            cmd += ["--peak-tbps", str(args.peak_tbps)]
        if args.dry_run:
            cmd += ["--dry-run"]
        if env_json is not None:
            cmd += ["--env-json", str(env_json)]
        start = time.perf_counter()
        error = None
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s + GRACE_S)
            tail = (proc.stdout + proc.stderr)[-3000:]
            if proc.returncode != 0:
                error = f"stage process exited with status {proc.returncode}"
        except subprocess.TimeoutExpired as exc:
            tail = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or ""))[-3000:]
            error = f"killed after {budget_s + GRACE_S:.0f} s (budget {budget_s:.0f} s)"
        data: dict[str, Any] = {}
        if stage_out.exists():
            try:
                data = json.loads(stage_out.read_text())
            except json.JSONDecodeError:
                data = {}
        if error:
            data.setdefault("passed", False)
            data["error"] = (data.get("error", "") + "\n" + error).strip()
            data["output_tail"] = tail
        elif not data:
            data = {"passed": False, "error": "the stage wrote no result", "output_tail": tail}
        data["wall_s"] = time.perf_counter() - start
        data["budget_s"] = budget_s
        return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage:
        return stage_main(args)
    t0 = time.perf_counter()
    plan = plan_stages(args.stage_list, args.deadline_s)
    if args.dry_run:  # no GPU work: room for slow imports on a small machine
        plan = [(name, max(budget, DRY_RUN_STAGE_S)) for name, budget in plan]
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "plan": {name: round(b, 1) for name, b in plan},
                              "host": {"python": platform.python_version(), "machine": platform.machine()}}
    if args.setup_log and args.setup_log.exists():
        result["setup_log_tail"] = args.setup_log.read_text(errors="replace")[-4000:]
    write_json(args.out, result)
    gpu_reason = None
    saved = 0.0  # budget earlier stages left unused
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        env_json = Path(tmp) / "environment.json"
        for name, budget in plan:
            if name != "environment" and gpu_reason and not args.dry_run:
                result[name] = {"skipped": gpu_reason, "wall_s": 0.0}
            else:
                left = args.deadline_s - (time.perf_counter() - t0)
                planned = budget
                budget = min(budget + saved, left - GRACE_S)
                if budget < 5:
                    result[name] = {"skipped": "no time left before the deadline", "wall_s": 0.0}
                else:
                    result[name] = run_stage(name, budget, args, env_json if env_json.exists() else None)
                    saved = max(0.0, planned + saved - result[name]["wall_s"])
            if name == "environment":
                env = result[name]
                if env.get("passed") or "gpu" in env:
                    write_json(env_json, env)
                gpu_reason = env.get("gpu_unavailable")
                if gpu_reason is None and not env.get("passed"):
                    gpu_reason = "the environment stage failed"
            if name == "flashinfer" or (name == "bandwidth" and "flashinfer" in result):
                merge_flashinfer(result)
            stage = result[name]
            line = f"{name}: {status_of(stage)} ({stage.get('wall_s', 0):.1f} s)"
            print(line + (f": {stage['no_gpu']}" if "no_gpu" in stage else ""), flush=True)
            write_json(args.out, result)
    result["targets"] = summarize_targets(result)
    if args.dry_run:
        result["dry_run"] = True
        # every stage got to its first CUDA call (or finished) without an error
        result["passed"] = all(result[n].get("passed") for n, _ in plan)
        result["wall_s"] = time.perf_counter() - t0
        write_json(args.out, result)
        print(render_table(result))
        print(f"wrote {args.out} (dry run: {'every stage reached its GPU point' if result['passed'] else 'FAILED'})")
        return 0 if result["passed"] else 1
    ran = [result[n] for n, _ in plan if not result[n].get("skipped")]
    result["passed"] = bool(ran) and all(s.get("passed") for s in ran) and not gpu_reason
    result["wall_s"] = time.perf_counter() - t0
    write_json(args.out, result)
    print(render_table(result))
    print(f"wrote {args.out}")
    return 0 if result["passed"] else 1


# --------------------------------------------------------------------------- stages
class Stage:
    """A stage's result dict, written to disk after every update, and its time budget."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.path, self.budget_s = path, budget_s
        self.start = time.perf_counter()
        self.data: dict[str, Any] = {"passed": False}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def save(self) -> None:
        write_json(self.path, self.data)


def stage_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT))
    stage = Stage(args.stage_out or Path(tempfile.mkdtemp()) / "stage.json", args.budget_s)
    env = json.loads(args.env_json.read_text()) if args.env_json and args.env_json.exists() else {}
    from bench import gpu_end_to_end

    fn: Callable[..., None] = {"environment": stage_environment, "correctness": stage_correctness,
                               "kernel_tests": stage_kernel_tests, "bandwidth": stage_bandwidth,
                               "flashinfer": stage_flashinfer, "end_to_end": gpu_end_to_end.stage_end_to_end,
                               "throughput": gpu_end_to_end.stage_throughput}[args.stage]
    try:
        fn(stage, args, env)
    except NoGpu as exc:
        stage.data.update(no_gpu=str(exc), passed=True)
    except Exception:  # noqa: BLE001 - recorded; the orchestrator goes on with the next stage
        stage.data["passed"] = False
        stage.data["error"] = traceback.format_exc()[-4000:]
    stage.save()
    return 0


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
    from batchgen.kernels.cuda import loader

    try:
        cupy = loader._import_cupy()
        d["cupy"] = cupy.__version__
        d["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        if d.get("gpu"):
            rt = cupy.cuda.runtime
            d["memory_clock_khz"] = rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, 0)
            d["bus_width_bits"] = rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, 0)
            d["sm_clock_khz"] = rt.deviceGetAttribute(rt.cudaDevAttrClockRate, 0)
    except Exception as exc:  # noqa: BLE001 - recorded
        d["cupy_error"] = f"{type(exc).__name__}: {exc}"
    d["nvrtc"] = loader.nvrtc_version()
    major = d["nvrtc"][0] if d["nvrtc"] else None
    d["nvrtc_include_dirs"] = [{"path": str(x.path), "origin": x.origin, "cuda_version": x.cuda_version}
                               for x in loader.find_include_dirs(major)]
    why = loader.unavailable_reason()
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


# The device the correctness stage runs on ("cpu" lets it be tried on the CPU harness).
DEVICE = "cuda"


def _sync() -> None:
    import torch

    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def _decode_case(batch_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                 dtype, device, seed: int, spare_blocks: int = 3):
    """``[query, k_cache, v_cache, block_tables, context_lens]`` on ``device``: random data
    (drawn on the device), each sequence's blocks scattered over the pool by a permutation, and
    one more table column of garbage that no kernel may read."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [math.ceil(n / block_size) for n in batch_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    # Block 0 pads short rows up to the longest (the torch reference gathers that far).
    tables = torch.zeros(len(batch_lens), max(need) + 1, dtype=torch.int32)
    tables[:, -1] = 2**30
    pos = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[pos:pos + n]
        pos += n
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    v = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    q = torch.randn(len(batch_lens), num_heads, head_size, generator=dev_gen, device=device, dtype=dtype)
    return [q, k, v, tables.to(device), torch.tensor(batch_lens, dtype=torch.int32, device=device)]


def stage_correctness(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import torch

    from batchgen.kernels import torch_attention as reference
    from batchgen.kernels.cuda.cuda_attention import KernelInputError, get_cuda_ops

    dev = torch.device(DEVICE)
    cases = []
    for dtype_name in CHECK_DTYPES:
        for head in CHECK_HEAD_SIZES:
            for group in CHECK_GROUPS:
                cases.append((dtype_name, head, group, list(RAGGED_LENS), 16))
        cases += [(dtype_name, head, group, list(lens), bs) for head, group, lens, bs in EXTRA_CASES]
    rows: list[dict[str, Any]] = []
    stage.data.update(rows=rows, cases=len(cases))
    gpu_point(f"cupy and the first of {len(cases)} decode cases on {DEVICE}", DEVICE)
    ops = get_cuda_ops()
    for i, (dtype_name, head, group, lens, bs) in enumerate(cases):
        if stage.left() < 5:
            rows.append({"dtype": dtype_name, "head_size": head, "group": group, "skipped": "time budget"})
            continue
        dtype = _dtype(dtype_name)
        q, k, v, tables, lens_t = _decode_case(lens, 2 * group, 2, head, bs, dtype, dev, seed=i)
        scale = head ** -0.5
        out = ops.paged_decode_attention(q, k, v, tables, lens_t, scale)
        want = reference.paged_decode_attention(q.float(), k.float(), v.float(), tables, lens_t, scale)
        diff = (out.float() - want).abs()
        tol = TOLERANCES[dtype_name]
        within = bool((diff <= tol + tol * want.abs()).all())  # as torch.testing.assert_close
        rows.append({"dtype": dtype_name, "head_size": head, "group": group, "block_size": bs,
                     "context_lens": lens, "max_abs_diff": diff.max().item(), "atol_rtol": tol,
                     "passed": within})
        stage.save()
    # the cache ops, one shape per dtype
    cache_ok = []
    for dtype_name in CHECK_DTYPES:
        dtype = _dtype(dtype_name)
        gen = torch.Generator().manual_seed(11)
        kv = torch.randn(2, 2, 12, 16, 2, 128, generator=gen).to(dtype).to(dev)
        key = torch.randn(9, 2, 128, generator=gen).to(dtype).to(dev)
        val = torch.randn(9, 2, 128, generator=gen).to(dtype).to(dev)
        slots = torch.tensor([5, 17, -1, 40, 41, 100, 191, 0, 63], device=dev)
        got_k, got_v = kv[0, 0].clone(), kv[0, 1].clone()
        want_k, want_v = got_k.clone(), got_v.clone()
        ops.reshape_and_cache(key, val, got_k, got_v, slots)
        keep = slots >= 0
        reference.reshape_and_cache(key[keep], val[keep], want_k, want_v, slots[keep])
        mapping = torch.tensor([[0, 7], [3, 8], [3, 9], [5, 1]], device=dev)
        got_kv, want_kv = kv.clone(), kv.clone()
        ops.copy_blocks(got_kv, mapping)
        reference.copy_blocks(want_kv, mapping)
        cache_ok.append(torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and torch.equal(got_kv, want_kv))
    stage.data["cache_ops_exact"] = all(cache_ok)
    # the index checks on the device: bad values raise, and the context is still usable after
    q, k, v, tables, lens_t = _decode_case([40, 9], 8, 2, 128, 16, torch.float16, dev, seed=99)
    raised = []
    for bad_tables, bad_lens in ((tables.clone().index_fill_(1, torch.tensor([0], device=dev), k.shape[0]), lens_t),
                                 (tables, lens_t + tables.shape[1] * 16)):
        try:
            ops.paged_decode_attention(q, k, v, bad_tables, bad_lens, 0.1)
            raised.append(None)
        except KernelInputError as exc:
            raised.append(str(exc))
    try:
        ops.reshape_and_cache(q[:, :2], q[:, :2], k, v, torch.tensor([0, k.shape[0] * 16], device=dev))
        raised.append(None)
    except KernelInputError as exc:
        raised.append(str(exc))
    after = ops.paged_decode_attention(q, k, v, tables, lens_t, 0.1)
    _sync()
    stage.data["index_checks"] = {"messages": raised, "all_raised": all(raised),
                                  "gpu_usable_after": bool(torch.isfinite(after).all().item())}
    # the cost of one check on the largest tables of the sweep (one host sync)
    from batchgen.kernels.cuda import checks

    big_tables = torch.randint(0, 2**20, (256, 1024), dtype=torch.int32, device=dev)
    big_lens = torch.full((256,), 16384, dtype=torch.int32, device=dev)
    times = []
    for _ in range(20):
        _sync()
        t = time.perf_counter()
        checks.context_violation(big_tables, big_lens, 2**20, 16)
        times.append(time.perf_counter() - t)
    stage.data["index_check_us_256x16K"] = sorted(times)[len(times) // 2] * 1e6
    measured = [r for r in rows if "passed" in r]
    failed = [r for r in measured if not r["passed"]]
    stage.data["passed"] = (bool(measured) and not failed and len(measured) == len(cases)
                            and stage.data["cache_ops_exact"] and stage.data["index_checks"]["all_raised"]
                            and stage.data["index_checks"]["gpu_usable_after"])
    stage.data["summary"] = (f"{len(measured) - len(failed)}/{len(cases)} decode cases within tolerance, "
                             f"cache ops exact: {stage.data['cache_ops_exact']}, "
                             f"bad indices raised: {stage.data['index_checks']['all_raised']}")


def stage_kernel_tests(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import xml.etree.ElementTree as ET

    import torch

    report = stage.path.with_name("junit.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "gpu",
           f"--junitxml={report}", "tests/kernels/test_kernels.py"]
    if not torch.cuda.is_available():  # the dry run: the GPU cases must at least be collected
        proc = subprocess.run(cmd[:-2] + ["--collect-only", cmd[-1]], cwd=ROOT, capture_output=True, text=True,
                              timeout=max(5.0, stage.left()))
        stage.data["collected"] = (proc.stdout.strip().splitlines() or ["?"])[-1]
        if proc.returncode != 0:
            stage.data["error"] = (proc.stdout + proc.stderr)[-2000:]
            return
    gpu_point("running the GPU cases of tests/kernels/test_kernels.py")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(5.0, stage.left()))
    except subprocess.TimeoutExpired:
        stage.data["error"] = "pytest ran out of the stage's time"
        return
    stage.data["output_tail"] = (proc.stdout + proc.stderr)[-2000:]
    if report.exists():
        suite = ET.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        stage.data.update(counts)
        stage.data["passed"] = proc.returncode == 0 and counts["tests"] - counts["skipped"] > 0
        stage.data["summary"] = f"{counts['tests'] - counts['skipped']} run, {counts['failures']} failed"


def gpu_time(fn: Callable[[int], Any], iters: int, repeats: int, clock_khz: int | None) -> list[float]:
    """Seconds per call of ``fn(i)``, one figure per repeat, with the host's time excluded.

    Each repeat queues a sleep kernel first, long enough to cover the host's enqueueing of all
    ``iters`` calls (measured on a warm-up), then the start event, the calls, the end event: the
    GPU reaches the calls only once they are all queued, so they run back to back and the
    events time the GPU alone. ``fn`` must not synchronise.
    """
    import torch

    fn(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(iters):
        fn(i)
    enqueue = time.perf_counter() - t  # the host's share (the GPU may still be running)
    torch.cuda.synchronize()
    # twice the enqueue time, plus 0.1 ms; an unknown clock is taken as 2 GHz (a slower real
    # clock only lengthens the sleep)
    cycles = int(min((2 * enqueue + 1e-4) * (clock_khz or 2_000_000) * 1e3, 2**40))
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for i in range(iters):
            fn(i)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / iters)
    return out


def _copies(bytes_per_copy: int, l2_bytes: int | None) -> int:
    """How many copies of the inputs to rotate through so that no call finds them in L2."""
    l2 = l2_bytes or 64 * 2**20
    return max(1, min(64, math.ceil(4 * l2 / max(1, bytes_per_copy))))


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def _sweep(stage: Stage, env: dict[str, Any], measure: Callable[[dict[str, Any], dict[str, Any]], None]) -> list:
    """Run ``measure(row, inputs)`` on every sweep point while the stage has time.

    ``inputs`` holds the point's ``dtype``, ``bytes`` per call, the ``copies`` rotated over (so
    that no call finds its inputs in L2) and their ``sets`` of decode arguments. A point that
    fails is recorded with its error and the sweep goes on; results are saved after each point.
    """
    import torch

    rows: list[dict[str, Any]] = []
    stage.data["rows"] = rows
    for point in bench_points():
        if stage.left() < 8:
            rows.append({**point, "skipped": "time budget"})
            continue
        row: dict[str, Any] = {**point}
        inputs: dict[str, Any] = {}
        try:
            dtype = _dtype(point["dtype"])
            b, ctx, head = point["batch"], point["context"], point["head_size"]
            moved = decode_bytes(b, ctx, BENCH_NUM_HEADS, BENCH_NUM_KV_HEADS, head, BENCH_BLOCK_SIZE, dtype.itemsize)
            n = _copies(moved, env.get("l2_bytes"))
            inputs = {"dtype": dtype, "bytes": moved, "copies": n, "sets": [
                _decode_case([ctx] * b, BENCH_NUM_HEADS, BENCH_NUM_KV_HEADS, head, BENCH_BLOCK_SIZE, dtype,
                             torch.device("cuda"), seed=1000 + j, spare_blocks=0) for j in range(n)]}
            measure(row, inputs)
        except Exception as exc:  # noqa: BLE001 - recorded per point; the sweep goes on
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        rows.append(row)
        inputs.clear()
        torch.cuda.empty_cache()
        stage.save()
    return rows


def stage_bandwidth(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import torch.nn.functional as F

    from batchgen.kernels.cuda.cuda_attention import get_cuda_ops
    from batchgen.kernels.torch_attention import gather_kv

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - older torch
        SDPBackend = sdpa_kernel = None
    peak = env.get("peak_bytes_per_s")
    clock = env.get("sm_clock_khz")
    gpu_point(f"cupy and the first of {len(bench_points())} sweep points")
    ops = get_cuda_ops(check_indices=False)  # timing: the checks are a per-step host sync, measured apart
    stage.data.update(peak_bytes_per_s=peak, method="CUDA events around iters back-to-back calls "
                      "queued behind a sleep kernel; inputs rotated over copies larger than L2",
                      shape={"num_heads": BENCH_NUM_HEADS, "num_kv_heads": BENCH_NUM_KV_HEADS,
                             "block_size": BENCH_BLOCK_SIZE}, index_checks=False)

    def measure(row: dict[str, Any], inputs: dict[str, Any]) -> None:
        ctx, scale = row["context"], row["head_size"] ** -0.5
        sets, n, moved = inputs["sets"], inputs["copies"], inputs["bytes"]
        row.update(bytes=moved, copies=n)
        times = gpu_time(lambda i: ops.paged_decode_attention(*sets[i % n], scale), args.iters, args.repeats, clock)
        row.update(kernel_us=_median(times) * 1e6, kernel_range_us=[min(times) * 1e6, max(times) * 1e6])
        row["kernel_TBps"] = moved / _median(times) / 1e12
        row["fraction_of_peak"] = moved / _median(times) / peak if peak else None
        if sdpa_kernel is None:
            return
        dense = []  # SDPA reads the cache already gathered: the dense peer's best case
        for q, k, v, tables, _lens in sets:
            kd, vd = gather_kv(k, v, tables, math.ceil(ctx / BENCH_BLOCK_SIZE))
            dense.append((q.unsqueeze(2), kd[:, :ctx].transpose(1, 2).contiguous(),
                          vd[:, :ctx].transpose(1, 2).contiguous()))
            del kd, vd

        def sdpa(i: int) -> Any:
            q, kd, vd = dense[i % n]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, kd, vd, scale=scale, enable_gqa=True)

        try:
            ref = sdpa(0).squeeze(2)
            row["max_abs_diff_vs_sdpa"] = (ops.paged_decode_attention(*sets[0], scale).float()
                                           - ref.float()).abs().max().item()
            t_sdpa = gpu_time(sdpa, args.iters, args.repeats, clock)
            row.update(sdpa_us=_median(t_sdpa) * 1e6, sdpa_range_us=[min(t_sdpa) * 1e6, max(t_sdpa) * 1e6],
                       kernel_vs_sdpa=_median(times) / _median(t_sdpa))
        except RuntimeError as exc:  # flash may refuse a shape or GQA on this torch
            row["sdpa_error"] = f"{exc}".splitlines()[0][:200]

    rows = _sweep(stage, env, measure)
    measured = [r for r in rows if "kernel_us" in r]
    diffs_ok = all(r.get("max_abs_diff_vs_sdpa", 0) < TOLERANCES[r["dtype"]] * 8 for r in measured)
    stage.data["passed"] = bool(measured) and diffs_ok and not any("error" in r for r in rows)
    target = [r for r in measured if is_target(r) and r.get("fraction_of_peak") is not None]
    stage.data["summary"] = (f"{len(measured)}/{len(rows)} points; at batch>=64, ctx>=1K: "
                             f"{min(r['fraction_of_peak'] for r in target):.0%}-"
                             f"{max(r['fraction_of_peak'] for r in target):.0%} of peak" if target
                             else f"{len(measured)}/{len(rows)} points")


def stage_flashinfer(stage: Stage, args: argparse.Namespace, env: dict[str, Any]) -> None:
    import torch

    from batchgen.kernels.cuda.cuda_attention import get_cuda_ops

    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - not installable here: say why and move on
        stage.data.update(skipped=f"FlashInfer unavailable ({type(exc).__name__}: {exc}); not carried to the "
                          "GPU machine (flashinfer-python 0.7.4 is a 101 MB wheel, over the 64 MiB a call "
                          "carries): SDPA's flash kernel is the bandwidth stage's peer", passed=True)
        return
    gpu_point("FlashInfer's first call")
    dev = torch.device("cuda")
    clock = env.get("sm_clock_khz")
    workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    stage.data["flashinfer"] = getattr(flashinfer, "__version__", "?")

    def measure(row: dict[str, Any], inputs: dict[str, Any]) -> None:
        b, ctx, head = row["batch"], row["context"], row["head_size"]
        sets, n, dtype = inputs["sets"], inputs["copies"], inputs["dtype"]
        pages = math.ceil(ctx / BENCH_BLOCK_SIZE)
        # Every copy's pool has the same number of blocks, so copy 0's tables are valid for all
        # of them: one plan serves every copy.
        indptr = torch.arange(0, (b + 1) * pages, pages, dtype=torch.int32, device=dev)
        last = torch.full((b,), ctx - (pages - 1) * BENCH_BLOCK_SIZE, dtype=torch.int32, device=dev)
        indices = sets[0][3][:, :pages].reshape(-1).contiguous()
        best = None
        for tensor_cores in (False, True):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
            w.plan(indptr, indices, last, BENCH_NUM_HEADS, BENCH_NUM_KV_HEADS, head, BENCH_BLOCK_SIZE,
                   q_data_type=dtype, kv_data_type=dtype, sm_scale=head ** -0.5)

            def call(i: int, w=w) -> Any:
                q_i, k_i, v_i = sets[i % n][:3]
                return w.run(q_i, (k_i, v_i))

            if not tensor_cores:  # FlashInfer's output agrees with the kernel's on copy 0
                q0, k0, v0 = sets[0][:3]
                ours = get_cuda_ops(check_indices=False).paged_decode_attention(
                    q0, k0, v0, indices.view(b, pages), sets[0][4], head ** -0.5)
                row["max_abs_diff_vs_kernel"] = (call(0).float() - ours.float()).abs().max().item()
            times = gpu_time(call, args.iters, args.repeats, clock)
            if best is None or _median(times) < _median(best[0]):
                best = (times, tensor_cores)
        times, tensor_cores = best
        row.update(flashinfer_us=_median(times) * 1e6, flashinfer_range_us=[min(times) * 1e6, max(times) * 1e6],
                   flashinfer_TBps=inputs["bytes"] / _median(times) / 1e12, use_tensor_cores=tensor_cores)

    rows = _sweep(stage, env, measure)
    measured = [r for r in rows if "flashinfer_us" in r]
    # Same numbers as the kernel's (a wrong call would make the timing meaningless).
    stage.data["passed"] = bool(measured) and all(
        r.get("max_abs_diff_vs_kernel", 0) < TOLERANCES[r["dtype"]] * 8 for r in measured)
    stage.data["summary"] = f"{len(measured)}/{len(rows)} points timed"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.path.insert(0, str(ROOT))
    sys.modules["bench.gpu_check"] = sys.modules[__name__]  # one NoGpu, whoever imports it
    sys.exit(main())
