"""The GPU check's dry run, in the parts that fit in seconds on a CPU (``GPU_CHECK_DRY_RUN=1``).

On the GPU machine the check installs carried wheels offline, builds its models from carried
configs with seeded random weights, and compares the engine with HF. Here: the offline install
from a wheel set built on the spot (no network attempt, a broken wheel fails fast and says so),
the dry-run environment of the GPU image's packages, the engine stages stopping at their first
CUDA call without a GPU, and the end-to-end stage's own code and checks on the CPU with a shrunk
model (against HF ``generate`` on the same weights: the checks must pass on a correct engine and
fail on wrong tokens or log-probabilities).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import gpu_check as gc  # noqa: E402
from bench import gpu_end_to_end as e2e  # noqa: E402
from bench import gpu_models  # noqa: E402
from bench.gpu_models import image  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}


def _wheel(folder: Path, name: str, version: str, body: str = "VALUE = 42\n") -> Path:
    """A minimal pure-Python wheel (one module), made without a build backend."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", body)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def _setup(tmp_path: Path, wheels: Path) -> tuple[subprocess.CompletedProcess, str]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_PYTHON": sys.executable,
           "GPU_CHECK_WHEELS": str(wheels), "GPU_CHECK_SITE": str(tmp_path / "site"),
           "GPU_CHECK_SETUP_ONLY": "1", "GPU_CHECK_DRY_RUN": "1",
           # any index lookup would fail at once: the offline install must never try one
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_FIND_LINKS": ""}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    return proc, (tmp_path / "out" / "gpu_check_setup.log").read_text()


def test_the_offline_install_takes_the_carried_wheels_and_nothing_else(tmp_path: Path) -> None:
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels, "bgcarried_a", "1.0")
    _wheel(wheels, "bgcarried_b", "2.0", "from bgcarried_a import VALUE\n")
    proc, log = _setup(tmp_path, wheels)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "offline: installing 2 wheels" in log and "failed" not in log
    assert "pip install -e" not in log and "installing torch" not in log  # no online branch
    assert (tmp_path / "site" / "bgcarried_b" / "__init__.py").exists()
    out = subprocess.run([sys.executable, "-c", "import bgcarried_b; print(bgcarried_b.VALUE)"],
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)
    assert out.stdout.strip() == "42"


def test_a_broken_wheel_fails_fast_and_says_so(tmp_path: Path) -> None:
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    proc, log = _setup(tmp_path, wheels)
    assert proc.returncode == 0  # the checks still run; the stages that need it say why
    assert f"offline install from {wheels} failed or timed out" in log
    assert "setup only" in log


def test_the_dry_run_environment_holds_the_image_alone(tmp_path: Path) -> None:
    wanted = {"pyyaml", "tqdm", "no-such-package"}
    out = image.make_env(tmp_path, wanted, carried={"tqdm"})
    assert out["linked"] == ["pyyaml"] and out["absent"] == ["no-such-package", "tqdm"]
    assert (tmp_path / "yaml").is_symlink() and not (tmp_path / "tqdm").exists()
    assert {"torch", "transformers", "cupy-cuda13x", "pytest"} <= image.device_packages()
    carried = image.carried_packages()
    assert "pydantic" in carried and not carried & image.device_packages()  # never carry what is there


def test_the_models_are_the_configs_they_claim() -> None:
    small = gpu_models.model_config("smollm2-135m")
    assert (small["hidden_size"], small["num_hidden_layers"], small["num_attention_heads"],
            small["num_key_value_heads"], small["vocab_size"]) == (576, 30, 9, 3, 49152)
    assert gpu_models.num_parameters("smollm2-135m") == 134_515_008  # SmolLM2-135M's count
    big = gpu_models.model_config("llama-3.2-1b-shape")
    assert (big["hidden_size"], big["intermediate_size"], big["num_hidden_layers"], big["num_attention_heads"],
            big["num_key_value_heads"], big["rope_parameters"]["rope_type"]) == (2048, 8192, 16, 32, 8, "llama3")
    assert 1.0e9 < gpu_models.num_parameters("llama-3.2-1b-shape") < 1.1e9
    with pytest.raises(ValueError, match="unknown GPU-check model"):
        gpu_models.model_config("smollm2-1.7b")


@pytest.mark.slow
def test_the_carried_config_is_the_embedded_models(smollm2_path: str) -> None:
    real = json.loads((Path(smollm2_path) / "config.json").read_text())
    carried = gpu_models.model_config("smollm2-135m")
    real.pop("transformers_version"), carried.pop("transformers_version")
    assert carried == real


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpu_tiny")
    return gpu_models.build("smollm2-135m", folder, seed=0, overrides=TINY)


def test_a_seed_draws_the_same_weights(tiny_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    again = gpu_models.build("smollm2-135m", tmp_path / "again", seed=0, overrides=TINY)
    a, b = load_file(tiny_folder / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    norm = a["model.layers.0.input_layernorm.weight"]
    assert torch.all(norm == gpu_models.NORM_SCALE)
    assert (tiny_folder / "tokenizer.json").stat().st_size > 3_000_000  # unpacked


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the stages would run for real")
@pytest.mark.parametrize("stage_fn", ["stage_end_to_end", "stage_throughput"])
def test_the_engine_stages_stop_at_their_first_cuda_call(stage_fn: str, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(e2e, "MODEL_OVERRIDES", TINY)
    stage = gc.Stage(tmp_path / "s.json", budget_s=120)
    with pytest.raises(gc.NoGpu, match="no GPU: stopped before"):
        getattr(e2e, stage_fn)(stage, gc.parse_args(["--prompts", "2"]), {})
    saved = json.loads((tmp_path / "s.json").read_text())  # what it did before is on disk
    assert saved["model"] in gpu_models.MODELS
    if stage_fn == "stage_throughput":
        assert saved["vllm"].startswith(("installed", "not on the GPU machine"))


def test_the_end_to_end_stage_passes_on_a_correct_engine(monkeypatch, tmp_path: Path) -> None:
    for name, value in (("DEVICE", "cpu"), ("ATTENTION_BACKEND", "torch"), ("MODEL_OVERRIDES", TINY),
                        ("E2E_DTYPES", ("bfloat16",)), ("E2E_BLOCK_SIZES", (16,)), ("BEAM_PROMPTS", 1),
                        ("BEAM_TOKENS", 4)):
        monkeypatch.setattr(e2e, name, value)
    stage = gc.Stage(tmp_path / "s.json", budget_s=300)
    e2e.stage_end_to_end(stage, gc.parse_args(["--prompts", "2", "--max-tokens", "6"]), {})
    data = stage.data
    assert data["passed"], data
    (row,) = data["runs"]
    assert row["attention_backend"] == "torch" and row["greedy"]["prompts"] == 2
    assert row["n4_seeded"]["seeded_rerun_identical"] and row["n4_seeded"]["completions"] == 8
    assert row["n4_seeded"]["distinct_completions"] > 1  # peaked but not degenerate weights


def test_the_throughput_stage_times_every_peer_on_the_cpu(monkeypatch, tmp_path: Path) -> None:
    # The stage past its first CUDA call, on the CPU with a tiny model and W32 alone: every peer
    # gets its row, and the ratios are batchgen's rate over each HF peer's.
    for name, value in (("DEVICE", "cpu"), ("ATTENTION_BACKEND", "torch"), ("MODEL_OVERRIDES", TINY),
                        ("MAX_TOKENS", 3), ("WORKLOADS", ("W32",)), ("REPEATS", 1)):
        monkeypatch.setattr(e2e, name, value)
    stage = gc.Stage(tmp_path / "s.json", budget_s=300)
    e2e.stage_throughput(stage, gc.parse_args([]), {})
    data = stage.data
    peers = [r["peer"] for r in data["rows"]]
    assert peers[:2] == ["batchgen", "hf_generate"] and len(peers) == 3, data["rows"]
    assert data["attention_backend"] == "torch"
    rates = {r["peer"]: r["tok_per_s"] for r in data["rows"] if "tok_per_s" in r}
    assert {"batchgen", "hf_generate"} <= rates.keys(), data["rows"]
    assert all(r["tokens"] == 32 * 3 for r in data["rows"] if "tok_per_s" in r)
    assert data["passed"] == (len(rates) == 3), data["rows"]
    assert data["ratios"] == {f"W32 vs {peer}": pytest.approx(rates["batchgen"] / rate)
                              for peer, rate in rates.items() if peer != "batchgen"}


def test_the_checks_fail_on_wrong_tokens_and_logprobs(tiny_folder: Path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    from batchgen.engine.outputs import CompletionOutput, RequestOutput

    monkeypatch.setattr(e2e, "DEVICE", "cpu")
    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    prompt = [1, 9690, 198, 2683, 359]
    (greedy,) = e2e.hf_greedy(model, [prompt], 5)
    assert e2e.compare_greedy(model, [prompt], [greedy], [greedy], 1e-3)["passed"]
    _, logits = e2e._scores(model, prompt, greedy)
    wrong = greedy[:2] + [int(logits[2].argmin())] + greedy[3:]
    bad = e2e.compare_greedy(model, [prompt], [wrong], [greedy], 0.4)
    assert not bad["passed"] and bad["identical"] == 0 and bad["max_top1_gap"] > 1
    lp, _ = e2e._scores(model, prompt, greedy)
    right = [{t: float(lp[i, t])} for i, t in enumerate(greedy)]
    off = [{t: v + 0.5} for entry in right for t, v in entry.items()]

    def out(logprobs, tokens=greedy):
        return RequestOutput(request_id="0", prompt=None, prompt_token_ids=prompt, outputs=[
            CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=logprobs)])

    assert e2e.compare_sampled(model, [prompt], [out(right)], [out(right)], 1e-3)["passed"]
    assert not e2e.compare_sampled(model, [prompt], [out(off)], [out(off)], 0.4)["passed"]
    rerun = e2e.compare_sampled(model, [prompt], [out(right)], [out(right, wrong)], 1e-3)
    assert not rerun["passed"] and not rerun["seeded_rerun_identical"]


def test_throughput_ratios_and_the_dry_run_status() -> None:
    rows = [{"peer": "batchgen", "workload": "W256", "tok_per_s": 3000.0},
            {"peer": "hf_generate", "workload": "W256", "tok_per_s": 1000.0},
            {"peer": "hf_generate_batch", "workload": "W256", "tok_per_s": 1500.0},
            {"peer": "hf_generate", "workload": "W32", "tok_per_s": 900.0},
            {"peer": "hf_generate_batch", "workload": "W32", "error": "boom"}]
    assert e2e.ratios(rows) == {"W256 vs hf_generate": 3.0, "W256 vs hf_generate_batch": 2.0}
    assert gc.status_of({"no_gpu": "no GPU: stopped before x", "passed": True}) == "NOGPU"
    assert gc.status_of({"no_gpu": "x", "passed": False, "error": "Traceback"}) == "FAIL"
    assert "throughput" in gc.STAGES and "end_to_end" in gc.GPU_STAGES
