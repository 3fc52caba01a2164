"""The Ray executor on a local Ray: the same records as a local run, faults, resume, missing Ray.

One local Ray serves the whole module (it is slow to start on two cores), and one pair of
SmolLM2 replicas serves the tests that compare with a local run (loading is the slow part).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchgen.cli import main as cli_main
from batchgen.config import ConfigError, validate_config
from batchgen.run.execute import execute
from batchgen.run.plan import plan
from batchgen.plugins import load_registry

PROMPTS = [
    "Name three primary colors.", "What is the capital of France?", "Give one tip for writing clear emails.",
    "Explain what a prime number is.", "Write a haiku about the sea.", "List two uses of a paperclip.",
    "What does a compiler do?", "Why do cats purr?",
]
ROWS = 2 * len(PROMPTS)  # each prompt twice, under two ids
# A full batch on each replica, and a few waves of it, so that a replica can be killed mid-run.
ENGINE = {"max_num_seqs": 4, "kv_cache_memory": "64MiB"}
GREEDY = {"mode": "greedy", "max_tokens": 16, "ignore_eos": True}
# Seeded n=3 sampling through a third-party sampler plugin (an entry point of the venv), which
# therefore runs on the replicas.
SEEDED = {"mode": "sample", "n": 3, "temperature": 0.9, "top_p": 0.95, "max_tokens": 12,
          "sampler": {"name": "typical", "options": {"mass": 0.9}}}


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def ray_address() -> Any:
    """One local Ray for the module; executors find it initialised and join it."""
    ray = pytest.importorskip("ray", reason='the Ray executor tests need: pip install "batchgen[ray]"')
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"uid": f"r{i:02d}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS * 2)))
    return path


def _config(tmp: Path, source: Path, generation: dict[str, Any], name: str, **executor: Any) -> Any:
    return validate_config({
        "model": {"name": "smollm2-135m-instruct", "device": "cpu", "dtype": "float32"},
        "data": {"source": str(source), "id_column": "uid"},
        "prompt": {"column": "prompt"},
        "generation": generation,
        "engine": ENGINE,
        "executor": {"backend": "ray", "replicas": 2, **executor},
        "metrics": [{"name": "length"}],
        "output": {"path": str(tmp / f"{name}.jsonl")},
    })


def _generations(records: list[dict[str, Any]], logprob_digits: int | None = None) -> dict[str, Any]:
    """What a run computed for each id. ``usage.cached_tokens`` depends on which rows shared a
    replica's prefix cache, so it is left out; with ``logprob_digits`` the cumulative logprobs
    are rounded (a prompt computed partly from cached blocks differs in its last float bits)."""
    def gens(record: dict[str, Any]) -> list[dict[str, Any]]:
        if logprob_digits is None:
            return record["generations"]
        return [{**g, "cumulative_logprob": round(g["cumulative_logprob"], logprob_digits)}
                for g in record["generations"]]

    return {r["id"]: (r["prompt"], gens(r), r["error"], r["metrics"], r["usage"]["generated_tokens"])
            for r in records}


@pytest.fixture(scope="module")
def local_records(smollm2_path: str, prompts_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The local run's records, greedy and seeded n=3, at one torch thread: the replicas' kernels."""
    import torch

    from batchgen import LLM
    from batchgen.run.executors import engine_config

    tmp = tmp_path_factory.mktemp("local")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        greedy = _config(tmp, prompts_file, GREEDY, "greedy", backend="local", replicas=1)
        llm = LLM(config=engine_config(greedy))
        out = {}
        for name, generation in (("greedy", GREEDY), ("seeded", SEEDED)):
            config = _config(tmp, prompts_file, generation, name, backend="local", replicas=1)
            execute(plan(config, load_registry()), quiet=True, llm=llm)
            out[name] = _read(Path(config.output.path))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.slow
class TestTwoReplicas:
    """Two SmolLM2 replicas, started once for the class and stopped after it."""

    @pytest.fixture(scope="class")
    def executor(self, ray_address: str, prompts_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
        from batchgen.run.executors.ray import RayExecutor

        config = _config(tmp_path_factory.mktemp("ray"), prompts_file, GREEDY, "x")
        executor = RayExecutor(config)
        executor.start()
        yield executor
        executor.close()

    def _run(self, executor: Any, config: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        summary = execute(plan(config, load_registry()), quiet=True, executor=executor)
        return summary, _read(Path(config.output.path))

    def test_greedy_records_equal_local_run(self, executor, local_records, prompts_file, tmp_path, monkeypatch) -> None:
        from batchgen.run.progress import Progress

        ticked: list[int] = []
        monkeypatch.setattr(Progress, "on_tokens", lambda self, n: ticked.append(n))
        summary, records = self._run(executor, _config(tmp_path, prompts_file, GREEDY, "greedy"))
        assert len(records) == ROWS
        assert _generations(records) == _generations(local_records["greedy"])
        assert summary["status"] == "completed" and summary["records"]["ok"] == len(records)
        # The progress bar saw every generated token, from both replicas.
        generated = sum(r["usage"]["generated_tokens"] for r in records)
        assert sum(ticked) == generated == summary["throughput"]["generated_tokens"]
        per_replica = summary["executor"]["per_replica"]
        assert summary["executor"]["backend"] == "ray" and len(per_replica) == 2
        assert all(r["records"] > 0 and r["tokens_per_s"] > 0 and r["threads"] == 1 for r in per_replica)
        assert sum(r["records"] for r in per_replica) == len(records)
        assert sum(r["generated_tokens"] for r in per_replica) == generated
        assert len({r["pid"] for r in per_replica}) == 2
        assert all(0 < r["kv_peak_blocks"] <= r["kv_num_blocks"] for r in per_replica)

    def test_seeded_sampling_with_a_plugin_sampler_equals_local_run(self, executor, local_records, prompts_file,
                                                                    tmp_path) -> None:
        summary, records = self._run(executor, _config(tmp_path, prompts_file, SEEDED, "seeded"))
        assert _generations(records) == _generations(local_records["seeded"])
        assert all(len(r["generations"]) == 3 for r in records)
        assert summary["status"] == "completed"

    def test_killed_replica_is_restarted_and_its_rows_run_again(self, executor, local_records, prompts_file,
                                                                 tmp_path) -> None:
        config = _config(tmp_path, prompts_file, GREEDY, "killed")
        out = Path(config.output.path)
        result: dict[str, Any] = {}
        job = plan(config, load_registry())
        thread = threading.Thread(target=lambda: result.update(summary=execute(job, quiet=True, executor=executor)))
        thread.start()
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_bytes().count(b"\n") >= 2):
            assert thread.is_alive() and time.monotonic() < deadline, "no records before the kill"
            time.sleep(0.01)
        victim = executor.replicas[1]
        assert victim.in_flight, "the replica had finished its rows; make the job longer"
        killed = victim.info["pid"]
        os.kill(killed, signal.SIGKILL)
        thread.join(timeout=300)
        assert not thread.is_alive()
        records = _read(out)
        assert sorted(r["id"] for r in records) == [f"r{i:02d}" for i in range(ROWS)]
        # Re-run rows are the same records (their prompts may now come from the prefix cache).
        assert _generations(records, 4) == _generations(local_records["greedy"], 4)
        summary = result["summary"]
        assert summary["status"] == "completed" and summary["executor"]["restarts"] == 1
        assert summary["executor"]["per_replica"][1]["restarts"] == 1
        assert summary["executor"]["per_replica"][1]["pid"] != killed


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigterm_then_sigkill_then_resume_of_the_driver(ray_address: str, tiny_llama: str, tmp_path: Path,
                                                         signal_after_records) -> None:
    """The driver keeps the local run's guarantees: SIGTERM stops it cleanly (Ray's own SIGTERM
    handler would exit at once), SIGKILL loses nothing, and a resume writes each id once."""
    rows = 24
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"uid": f"p{i:03d}", "prompt": f"Tell me about item {i}."}) + "\n"
                            for i in range(rows)))
    out = tmp_path / "out.jsonl"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"name": tiny_llama, "device": "cpu", "dtype": "float32"},
        "data": {"source": str(data), "id_column": "uid"},
        "prompt": {"column": "prompt", "chat_template": False},
        # One sequence at a time per replica: records land one by one, far from the end.
        "generation": {"mode": "greedy", "max_tokens": 32, "ignore_eos": True},
        "engine": {"kv_cache_memory": "8MiB", "max_num_seqs": 1},
        # The driver joins the module's cluster, as it would join a real one. One replica: what
        # is tested is the driver, and each of the three runs starts its replicas anew.
        "executor": {"backend": "ray", "replicas": 1, "address": ray_address},
        "output": {"path": str(out)},
    }))
    command = [sys.executable, "-m", "batchgen.cli", "run", str(job), "--quiet"]
    summary_file = tmp_path / "out.summary.json"

    stopped, returncode, err = signal_after_records(command, out, 2, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "batchgen: error: interrupted by SIGTERM" in err
    summary = json.loads(summary_file.read_text())
    assert (summary["status"], summary["signal"]) == ("interrupted", "SIGTERM")
    assert summary["records"]["total"] == stopped.count(b"\n") < rows  # counted from the file
    assert summary["executor"]["backend"] == "ray" and not (tmp_path / "out.jsonl.lock").exists()

    killed, returncode, _ = signal_after_records([*command, "--resume"], out, stopped.count(b"\n") + 2)
    assert returncode == -signal.SIGKILL and killed.startswith(stopped)
    complete = killed[: killed.rfind(b"\n") + 1]
    before = [json.loads(line)["id"] for line in complete.splitlines()]
    assert len(before) < rows

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = out.read_bytes()
    assert final.startswith(complete)  # the records written before the kill are untouched
    records = [json.loads(line) for line in final.splitlines()]
    assert sorted(r["id"] for r in records) == [f"p{i:03d}" for i in range(rows)]  # each id once
    assert all(r["error"] is None and r["generations"][0]["num_tokens"] == 32 for r in records)
    summary = json.loads(summary_file.read_text())
    assert summary["status"] == "completed" and summary["records"]["resumed"] == len(before)
    assert [run["status"] for run in summary["runs"]] == ["interrupted", "running", "completed"]


def test_missing_ray_is_a_config_error(job_config, monkeypatch, capsys) -> None:
    path = job_config()
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    for command in ("run", "validate"):
        assert cli_main([command, str(path), "--set", "executor.backend=ray"]) == 2
        err = capsys.readouterr().err
        assert "executor.backend" in err and 'pip install "batchgen[ray]"' in err
        assert "Traceback" not in err
    assert not Path(yaml.safe_load(path.read_text())["output"]["path"]).exists()  # nothing was written


def test_validate_checks_the_executor(job_config, capsys) -> None:
    pytest.importorskip("ray", reason='needs: pip install "batchgen[ray]"')
    path = job_config()
    t0 = time.monotonic()
    assert cli_main(["validate", str(path), "--set", "executor.backend=ray", "--set", "executor.address=127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "executor.address" in err and "ray start --head" in err and time.monotonic() - t0 < 30
    for bad, where in (("executor.replicas=2", "executor"), ("executor.replicas=zero", "executor.replicas"),
                       ("executor.address=nowhere", "executor.address")):
        sets = ["--set", bad] + ([] if bad.startswith("executor.replicas=2") else ["--set", "executor.backend=ray"])
        assert cli_main(["validate", str(path), *sets]) == 2
        assert f"{where}: " in capsys.readouterr().err
    with pytest.raises(ConfigError, match="resources_per_replica.num_gpus"):
        validate_config({"data": {"source": "x"}, "output": {"path": "o.jsonl"},
                         "executor": {"backend": "ray", "resources_per_replica": {"num_gpus": -1}}})


class CrashingEngine:
    """An instant engine whose process dies (as on a segfault) when it is given the row 'poison'."""

    max_model_len = 1024

    def __init__(self, engine: Any) -> None:
        self.pending: list[Any] = []

    def add_request(self, request: Any) -> None:
        self.pending.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> tuple[list[Any], int]:
        from batchgen.engine.outputs import CompletionOutput, RequestOutput

        if any(r.request_id == "poison" for r in self.pending):
            os._exit(1)
        done = [RequestOutput(r.request_id, None, list(r.prompt), outputs=[CompletionOutput(0, "ok", [1], 0.0)])
                for r in self.pending]
        self.pending = []
        return done, len(done)

    def stats(self) -> dict[str, Any]:
        return {"num_blocks": 1, "block_size": 16}


def crashing_engine(engine: Any) -> CrashingEngine:
    return CrashingEngine(engine)


def test_a_row_that_keeps_crashing_its_replica_becomes_an_error_record(ray_address: str, tiny_llama: str,
                                                                       tmp_path: Path) -> None:
    import ray

    from batchgen.engine.outputs import Request
    from batchgen.run.executors.ray import MAX_ROW_CRASHES, RayExecutor

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replicas cannot import a test module
    config = validate_config({"model": {"name": tiny_llama}, "data": {"source": "x"}, "engine": {"max_num_seqs": 4},
                              "executor": {"backend": "ray", "replicas": 2}, "output": {"path": str(tmp_path / "o")}})
    executor = RayExecutor(config, engine_factory=crashing_engine)
    ids = [f"row{i:03d}" for i in range(100)] + ["poison"] + [f"row{i:03d}" for i in range(100, 200)]
    read = 0

    def source():
        nonlocal read
        for i in ids:
            read += 1
            yield Request(i, [1, 2, 3], None)

    outputs, ahead = [], 0
    executor.start()
    try:
        for output in executor.stream(source()):
            outputs.append(output)
            ahead = max(ahead, read - len(outputs))
    finally:
        executor.close()
    assert sorted(o.request_id for o in outputs) == sorted(ids)  # every row once, the job went on
    # The rows are read lazily: at most a full queue per replica is in flight, plus the rows of a
    # restarting replica waiting to run again (200 rows, at most 48 read ahead).
    assert ahead <= 2 * 2 * executor.in_flight_limit()
    errors = {o.request_id: o.error for o in outputs if o.error is not None}
    assert list(errors) == ["poison"] and f"crashed {MAX_ROW_CRASHES} times" in errors["poison"]
    assert executor.describe()["restarts"] == MAX_ROW_CRASHES


def test_replicas_and_resources_follow_the_cluster() -> None:
    from batchgen.run.executors import ExecutorError
    from batchgen.run.executors.ray import RayExecutor

    def plan(cluster: dict[str, float], device: str = "auto", **executor: Any) -> tuple[int, float, float, int]:
        config = validate_config({"model": {"device": device}, "data": {"source": "x"},
                                  "executor": {"backend": "ray", **executor}, "output": {"path": "o.jsonl"}})
        ex = RayExecutor(config)
        return ex._plan_resources(cluster), ex.num_cpus, ex.num_gpus, ex.threads

    assert plan({"CPU": 16, "GPU": 8}, replicas="auto") == (8, 1.0, 1.0, 1)  # one replica per GPU
    assert plan({"CPU": 16, "GPU": 8}, device="cpu", replicas="auto",
                resources_per_replica={"num_cpus": 4}) == (4, 4.0, 0.0, 4)  # per num_cpus cores, 4 threads each
    assert plan({"CPU": 6}, replicas="auto", resources_per_replica={"num_cpus": 2}) == (3, 2.0, 0.0, 2)
    assert plan({"CPU": 16, "GPU": 8}, replicas="auto", resources_per_replica={"num_gpus": 0.5})[0] == 16
    with pytest.raises(ExecutorError, match=r"3 replicas x 1 CPUs do not fit .* 2 CPUs.*executor.replicas"):
        plan({"CPU": 2}, replicas=3)
    with pytest.raises(ExecutorError, match="num_gpus"):
        plan({"CPU": 8}, replicas=1, resources_per_replica={"num_gpus": 1})
