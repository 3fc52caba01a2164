"""The GPU check's host side, on the CPU: arguments, stage plan, bandwidth arithmetic, report.

What needs a GPU (the stages' measurements) runs only in ``bash bench/gpu_check.sh``; here the
whole command runs once without a GPU and must record every GPU stage as skipped with the
reason, write its JSON to ``$OUT`` and exit 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import gpu_check as gc  # noqa: E402
from bench import gpu_correctness as correctness  # noqa: E402
from bench import gpu_kernel_stages as ks  # noqa: E402


def test_decode_bytes_counts_kv_query_output_and_tables() -> None:
    # batch 2, context 33 (3 blocks of 16), 4 heads over 2 KV heads of 64, float16
    kv = 2 * 2 * 33 * 2 * 64 * 2  # K and V rows
    q_out = 2 * 2 * 4 * 64 * 2  # query read, output written
    tables = 2 * 3 * 4 + 2 * 4  # block-table entries and context lengths, int32
    assert gc.decode_bytes(2, 33, 4, 2, 64, 16, 2) == kv + q_out + tables
    # The Llama-3-8B-like point: 64 sequences of 4K, head 128 bf16 ~ 1.07 GB per call
    big = gc.decode_bytes(64, 4096, 32, 8, 128, 16, 2)
    assert big == 2 * 64 * 4096 * 8 * 128 * 2 + 2 * 64 * 32 * 128 * 2 + 64 * 256 * 4 + 64 * 4
    assert abs(big / 4.8e12 * 1e6 - 223.9) < 0.1  # µs at the H200's peak


def test_bench_points_cover_the_sweep_with_the_target_points_first() -> None:
    points = gc.bench_points()
    assert len(points) == 4 * 4 * 2 * 2 == len({tuple(p.values()) for p in points})
    flags = [gc.is_target(p) for p in points]
    assert flags == sorted(flags, reverse=True) and sum(flags) == 2 * 3 * 2 * 2
    assert {p["context"] for p in points} == {512, 1024, 4096, 16384}
    assert {p["batch"] for p in points} == {1, 16, 64, 256}


def test_plan_fits_the_deadline() -> None:
    plan = gc.plan_stages(list(gc.STAGES), 450)
    assert [s for s, _ in plan] == list(gc.STAGES)
    assert sum(b for _, b in plan) + gc.GRACE_S * len(plan) <= 450
    assert dict(plan) == gc.STAGE_BUDGETS  # the defaults fit as they are
    short = gc.plan_stages(["bandwidth", "environment"], 100)  # run order, not the given order
    assert [s for s, _ in short] == ["environment", "bandwidth"]
    assert sum(b for _, b in short) == pytest.approx(100 - 2 * gc.GRACE_S)
    with pytest.raises(ValueError, match="unknown stage"):
        gc.plan_stages(["bandwith"], 450)
    with pytest.raises(ValueError, match="leaves no time"):
        gc.plan_stages(list(gc.STAGES), 60)


def test_arguments_and_the_default_output(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OUT", raising=False)
    args = gc.parse_args([])
    assert args.out == ROOT / "bench" / "results" / "gpu_check.json" and args.stage_list == list(gc.STAGES)
    monkeypatch.setenv("OUT", str(tmp_path))
    args = gc.parse_args(["--stages", "environment, bandwidth", "--peak-tbps", "3.35"])
    assert args.out == tmp_path / "gpu_check.json"
    assert args.stage_list == ["environment", "bandwidth"] and args.peak_tbps == 3.35
    with pytest.raises(ValueError, match="unknown stage"):
        gc.parse_args(["--stages", "nope"])


@pytest.mark.parametrize("name,override,clock,bus,want,source", [
    ("NVIDIA H200", None, None, None, 4.8e12, "data sheet (H200)"),
    ("NVIDIA H100 PCIe", None, None, None, 2.0e12, "data sheet (H100 PCIe)"),
    ("NVIDIA H100 80GB HBM3", None, None, None, 3.35e12, "data sheet (H100)"),
    ("NVIDIA H200", 4.0, None, None, 4.0e12, "--peak-tbps"),
    ("Some New GPU", None, 2_619_000, 6144, 2 * 2.619e9 * 6144 / 8, "driver: 2 x memory clock x bus width"),
    ("Some New GPU", None, None, None, None, "unknown device"),
])
def test_peak_bandwidth_sources(name, override, clock, bus, want, source) -> None:
    peak, where = gc.peak_bandwidth(name, override, clock, bus)
    assert where == source
    assert peak == (pytest.approx(want) if want else None)


def test_l2_rotation_copies() -> None:
    assert ks._copies(2 * 2**20, 50 * 2**20) == 64  # capped
    assert ks._copies(20 * 2**20, 50 * 2**20) == 10
    assert ks._copies(17 * 2**30, 50 * 2**20) == 1


def _row(batch: int, context: int, kernel_us: float, peak: float = 4.8e12) -> dict:
    moved = gc.decode_bytes(batch, context, 32, 8, 128, 16, 2)
    return {"dtype": "bfloat16", "head_size": 128, "batch": batch, "context": context, "bytes": moved,
            "kernel_us": kernel_us, "kernel_range_us": [kernel_us * 0.98, kernel_us * 1.03],
            "kernel_TBps": moved / kernel_us / 1e6, "fraction_of_peak": moved / (kernel_us * 1e-6) / peak}


def test_flashinfer_merge_targets_and_table() -> None:
    rows = [_row(64, 4096, 300.0), _row(256, 16384, 4500.0), _row(1, 512, 9.0)]
    result = {
        "environment": {"passed": True, "gpu": "NVIDIA H200", "peak_bytes_per_s": 4.8e12,
                        "peak_source": "data sheet (H200)", "wall_s": 3.0},
        "bandwidth": {"passed": True, "rows": rows + [{"dtype": "float16", "head_size": 64, "batch": 16,
                                                       "context": 512, "skipped": "time budget"}], "wall_s": 50.0},
        "flashinfer": {"passed": True, "wall_s": 40.0, "rows": [
            {"dtype": "bfloat16", "head_size": 128, "batch": 64, "context": 4096, "flashinfer_us": 250.0,
             "flashinfer_range_us": [245.0, 260.0]},
            {"dtype": "bfloat16", "head_size": 128, "batch": 256, "context": 16384, "error": "refused"}]},
        "end_to_end": {"skipped": "no time left before the deadline", "wall_s": 0.0},
    }
    gc.merge_flashinfer(result)
    first = result["bandwidth"]["rows"][0]
    assert first["kernel_vs_flashinfer"] == pytest.approx(1.2)
    assert first["kernel_vs_flashinfer_range"] == pytest.approx([294.0 / 260.0, 309.0 / 245.0])
    assert "flashinfer_us" not in result["bandwidth"]["rows"][1]
    targets = gc.summarize_targets(result)
    assert targets["points_measured"] == 2  # batch 1 is outside the target region
    frac = [r["fraction_of_peak"] for r in rows[:2]]
    assert targets["min_fraction_of_peak"] == pytest.approx(min(frac))
    assert targets["fraction_target_met"] is (min(frac) >= 0.70)
    assert targets["max_kernel_vs_flashinfer"] == pytest.approx(1.2) and targets["flashinfer_target_met"]
    result["targets"] = targets
    table = gc.render_table(result)
    assert "GPU NVIDIA H200, peak 4.80 TB/s (data sheet (H200))" in table
    assert "end_to_end    SKIP" in table and "no time left" in table
    line = next(x for x in table.splitlines() if x.startswith("bfloat16  128    64   4096"))
    assert "300.0" in line and f"{frac[0]:.1%}" in line and "250.0" in line and "1.20x" in line
    assert len(table.splitlines()) == 1 + 4 + 2 + 3 + 2  # header line, stages, table, targets


def test_write_json_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.json"
    gc.write_json(path, {"a": 1})
    gc.write_json(path, {"a": 2, "p": Path("/x")})
    assert json.loads(path.read_text()) == {"a": 2, "p": "/x"}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_a_stage_past_its_budget_is_killed_and_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "GRACE_S", 0.2)
    args = gc.parse_args(["--stages", "environment"])
    data = gc.run_stage("environment", 0.1, args, None)  # importing torch alone takes longer
    assert data["passed"] is False and "killed after 0 s (budget 0 s)" in data["error"]
    assert data["wall_s"] < 10


def test_the_command_without_a_gpu_skips_with_the_reason(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_PYTHON": sys.executable,
           "GPU_CHECK_NO_INSTALL": "1"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["environment"]["passed"] is True
    reason = result["environment"]["gpu_unavailable"]
    assert reason == "no CUDA device visible to torch"
    for stage in gc.GPU_STAGES:
        assert result[stage]["skipped"] == reason, stage
    assert result["passed"] is False and "setup done" in result["setup_log_tail"]
    assert (tmp_path / "gpu_check_setup.log").exists()
    assert f"correctness   SKIP     0.0 s  {reason}" in proc.stdout


def test_the_correctness_stage_runs_on_the_cpu_harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The stage's own code (case builder, comparison, cache ops, index-check probes) on the
    # harness-run kernels, with a few cases; on a GPU the same code runs on cupy.
    from kernel_runners import harness_ops

    import batchgen.kernels.cuda.cuda_attention as kcuda

    monkeypatch.setattr(kcuda, "get_cuda_ops", lambda check_indices=True: harness_ops("warp", "nan"))
    monkeypatch.setattr(ks, "DEVICE", "cpu")
    monkeypatch.setattr(correctness, "CHECK_DTYPES", ("float32",))
    monkeypatch.setattr(correctness, "CHECK_HEAD_SIZES", (64,))
    monkeypatch.setattr(correctness, "CHECK_GROUPS", (3,))
    monkeypatch.setattr(correctness, "EXTRA_CASES", ((128, 4, (300, 3), 16),))
    stage = gc.Stage(tmp_path / "stage.json", budget_s=120)
    correctness.stage_correctness(stage, gc.parse_args([]), {})
    data = stage.data
    assert data["passed"], data
    assert [(r["head_size"], r["group"], r["passed"]) for r in data["rows"]] == [(64, 3, True), (128, 4, True)]
    assert all(r["max_abs_diff"] < 1e-5 for r in data["rows"])
    assert data["cache_ops_exact"] and data["index_checks"]["gpu_usable_after"]
    messages = data["index_checks"]["messages"]
    assert "block_tables[0, 0] = 7" in messages[0] and "context_lens[0] = 104" in messages[1]
    assert "slot_mapping[1] = 112" in messages[2]
    assert json.loads((tmp_path / "stage.json").read_text())["cases"] == 2  # saved as it went


def test_the_sweep_records_a_failed_point_and_skips_past_the_budget(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ks, "_decode_case", lambda *a, **k: ["decode args"])
    stage = gc.Stage(tmp_path / "s.json", budget_s=1000)
    seen: list[dict] = []

    def measure(row: dict, inputs: dict) -> None:
        seen.append(dict(row, copies=inputs["copies"], bytes=inputs["bytes"], sets=len(inputs["sets"])))
        if row["context"] == 4096:
            raise RuntimeError("shape refused\ndetails")
        row["timed"] = True
        if len(seen) == 10:
            stage.budget_s = 0  # out of time from here on

    rows = ks._sweep(stage, {"l2_bytes": 50 * 2**20}, measure)
    assert len(rows) == 64 and len(seen) == 10
    assert [r.get("error") for r in rows[:10]].count("RuntimeError: shape refused") == sum(
        r["context"] == 4096 for r in rows[:10])
    assert all(r["skipped"] == "time budget" for r in rows[10:])
    first = seen[0]  # fp16, head 64, batch 64, context 1K: 134 MB a call, two copies exceed 4 x L2
    assert (first["batch"], first["context"], first["head_size"]) == (64, 1024, 64)
    assert first["bytes"] == gc.decode_bytes(64, 1024, 32, 8, 64, 16, 2) and first["copies"] == first["sets"] == 2
    assert json.loads((tmp_path / "s.json").read_text())["rows"][0]["timed"] is True
