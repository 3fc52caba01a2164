"""GGUF files load as stored: each block format against the de-quantized fp32 HF model, the
memory they take, and the errors a bad file or path gives.

The files are tiny random Llamas written with the ``gguf`` package's writer
(:mod:`tiny_gguf`); the oracle is an HF ``LlamaForCausalLM`` holding the values the ``gguf``
package de-quantizes the file to.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_gguf import LOGIT_BOUND, QTYPE_NAMES, TOP1_BOUND, write_llama_gguf

from batchgen.gguf.hf_model import load_gguf_model
from batchgen.gguf.metadata import metadata_folder
from batchgen.model_resolver import ModelError, ModelFormatError, ModelNotFoundError, resolve_model



def _ids(vocab: int = 320, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("qtype", QTYPE_NAMES)
def test_each_format_matches_its_dequantized_model(tmp_path: Path, cache: Path, qtype: str) -> None:
    """Every projection and the (tied) embedding in ``qtype``: ``none`` gives the oracle's
    logits, ``gguf`` keeps the blocks (QuantizedLinear; the embedding and lm_head share them)
    and stays within the bound."""
    from batchgen.gguf.embedding import QuantizedEmbedding
    from batchgen.kernels.cpu.quant import QuantizedLinear

    path = tmp_path / f"tiny-{qtype}.gguf"
    oracle = write_llama_gguf(path, linear_type=qtype, embed_type=qtype)
    folder = metadata_folder(path)
    ids = _ids()
    want = _logits(oracle, ids)

    dequantized = load_gguf_model(path, folder, dtype=torch.float32, quantization="none")
    torch.testing.assert_close(_logits(dequantized, ids), want, atol=1e-5, rtol=1e-5)
    assert not any(isinstance(m, QuantizedLinear) for m in dequantized.modules())

    kept = load_gguf_model(path, folder, dtype=torch.float32, quantization="gguf")
    layers = [m for m in kept.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 7 + 1 and {m.qtype.name for m in layers} == {qtype}
    assert not any(type(m) is torch.nn.Linear for m in kept.modules())
    embedding = kept.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding) and kept.get_output_embeddings() is embedding.rows
    got = _logits(kept, ids)
    assert (got - want).abs().max() <= LOGIT_BOUND * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= TOP1_BOUND
    assert kept.batchgen_gguf["kept"] == {qtype: 15} and kept.batchgen_gguf["dequantized"] == {}


def test_other_types_are_dequantized_with_one_line(tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An untied Q6_K output layer, Q4_K projections, and F16 / Q5_1 / F32 weights (not kept):
    those load as float nn.Linear, and one line names them."""
    from batchgen.kernels.cpu.quant import QuantizedLinear

    path = tmp_path / "mixed.gguf"
    oracle = write_llama_gguf(path, linear_type="Q4_K", embed_type="Q8_0", output_type="Q6_K",
                              types={"attn_v": "Q5_1", "attn_output": "F16", "ffn_up": "F32"})
    folder = metadata_folder(path)
    with caplog.at_level(logging.INFO, logger="batchgen.gguf.hf_model"):
        model = load_gguf_model(path, folder, dtype=torch.float32, quantization="gguf")
    lines = [r.getMessage() for r in caplog.records if "de-quantized at load" in r.getMessage()]
    assert len(lines) == 1 and "2 F16" in lines[0] and "2 F32" in lines[0] and "2 Q5_1" in lines[0], lines
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and layer.self_attn.q_proj.qtype.name == "Q4_K"
    assert type(layer.self_attn.v_proj) is torch.nn.Linear and type(layer.mlp.up_proj) is torch.nn.Linear
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.qtype.name == "Q6_K"
    ids = _ids()
    want = _logits(oracle, ids)
    assert (_logits(model, ids) - want).abs().max() <= LOGIT_BOUND * want.abs().max()


def test_bfloat16_activations(tmp_path: Path, cache: Path) -> None:
    """dtype bfloat16: norms and de-quantized rows in bfloat16, the quantized layers' output
    rounded once; within the bound of the fp32 oracle widened by bfloat16's own rounding."""
    path = tmp_path / "bf16.gguf"
    oracle = write_llama_gguf(path, linear_type="Q4_0", embed_type="Q8_0")
    model = load_gguf_model(path, metadata_folder(path), dtype=torch.bfloat16, quantization="gguf")
    assert model.model.norm.weight.dtype == torch.bfloat16
    ids = _ids()
    want = _logits(oracle, ids)
    assert (_logits(model, ids) - want).abs().max() <= 2 * LOGIT_BOUND * want.abs().max()


def test_resident_weights_stay_the_files_bytes(tmp_path: Path, cache: Path) -> None:
    """A 40 MB Q4_K file: the model's tensors take the file's tensor bytes (one copy: the
    loader drops the mapping of the file and its own copies), and in a fresh process the
    resident memory grows by at most 1.1x that once loaded (the loader hands its freed
    transient copies back itself), and by at most 1.3x at its peak while loading (the pages
    of the file it has read do not stay resident beside their copies)."""
    path = tmp_path / "wide.gguf"
    write_llama_gguf(path, linear_type="Q4_K", embed_type="Q8_0", hidden=1024, intermediate=2816,
                     layers=6, heads=16, kv_heads=4, oracle=False)
    folder = metadata_folder(path)
    script = f"""
import ctypes, gc, json, sys
import torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from batchgen.gguf.hf_model import load_gguf_model
from tiny_gguf import write_llama_gguf

def anon(what="Anonymous:"):
    gc.collect()
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(what))

def peak():  # resident high-water mark since reset_peak()
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

write_llama_gguf({str(tmp_path / "warm.gguf")!r}, linear_type="Q4_K")  # imports and kernels warm
from batchgen.gguf.metadata import metadata_folder
load_gguf_model({str(tmp_path / "warm.gguf")!r}, metadata_folder(__import__("pathlib").Path({str(tmp_path / "warm.gguf")!r})), dtype=torch.float32)
ctypes.CDLL("libc.so.6").malloc_trim(0)
before, rss_before = anon(), anon("Rss:")
reset_peak()
model = load_gguf_model({str(path)!r}, {str(folder)!r}, dtype=torch.float32)
after = anon()
storages = {{t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.buffers(), *model.parameters()]}}
print(json.dumps({{"rss": after - before, "peak": peak() - rss_before, "storage": sum(storages.values()),
                  "file": model.batchgen_gguf["tensor_bytes"]}}))
"""
    env = {**os.environ, "BATCHGEN_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["file"] > 35e6
    # the K-quant layers pad to whole panels of 16 rows: a fraction of a percent here
    assert figures["storage"] <= 1.01 * figures["file"], figures
    assert figures["rss"] <= 1.1 * figures["file"], figures
    assert figures["peak"] <= 1.3 * figures["file"], figures


# ---- resolution and errors ---------------------------------------------------------------


def test_a_gguf_file_and_a_folder_with_one_resolve_to_it(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "only" / "model-Q8_0.gguf"
    path.parent.mkdir()
    write_llama_gguf(path)
    for name in (str(path), str(path.parent)):
        resolved = resolve_model(name, "auto", "cpu")
        assert resolved.gguf_file == str(path.resolve()) and resolved.quantization == "gguf"
        assert (Path(resolved.path) / "config.json").is_file() and (Path(resolved.path) / "tokenizer.json").is_file()
    assert resolve_model(str(path), "auto", "cuda").quantization == "none"  # blocks run on the CPU only
    assert resolve_model(str(path), "none", "cpu").quantization == "none"
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ModelNotFoundError, match="has no config.json and 2 GGUF files .*model-Q8_0.gguf, other.gguf"):
        resolve_model(str(path.parent))


def test_files_that_are_not_models_say_what_they_are(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text("version https://git-lfs.github.com/spec/v1\n")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 64)
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    cases = {fake: "is named .gguf but is not a GGUF file", weights: "is a safetensors weights file, not a model: "
             "give the folder that holds it and its config.json", notes: "is a file, not a model"}
    for path, expected in cases.items():
        with pytest.raises(ModelError) as info:
            resolve_model(str(path))
        assert expected in str(info.value) and "does not exist" not in str(info.value)
        # A file named .gguf that is not one exists: a format error, not a missing model.
        assert isinstance(info.value, ModelFormatError if path == fake else ModelNotFoundError), info.value
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="holds neither an HF model .config.json. nor a .gguf file"):
        resolve_model(str(empty))


def test_an_unsupported_architecture_is_refused_at_resolution(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "tiny-bert.gguf"
    write_llama_gguf(path, architecture="bert")
    with pytest.raises(ModelFormatError) as info:
        resolve_model(str(path))
    message = str(info.value)
    assert str(path) in message and "architecture 'bert' is not supported" in message and "llama" in message


def test_a_truncated_file_names_the_file_and_the_tensor(tmp_path: Path, cache: Path) -> None:
    """Cut before loading, and cut after its metadata was cached (the cache key changes with
    the size, so the header is checked again)."""
    path = tmp_path / "cut.gguf"
    write_llama_gguf(path, linear_type="Q8_0")
    whole = path.read_bytes()
    resolve_model(str(path))
    path.write_bytes(whole[: len(whole) * 3 // 4])
    for _ in range(2):
        with pytest.raises(ModelFormatError) as info:
            resolve_model(str(path))
        message = str(info.value)
        assert str(path) in message and "tensor 'blk." in message and "truncated" in message, message
    for cut in (8, 30, 200, 600):  # inside the header: its counts, a key, a value, the tensor table
        path.write_bytes(whole[:cut])
        with pytest.raises(ModelFormatError) as info:
            resolve_model(str(path))
        message = str(info.value)
        assert message.startswith(f"{path}: its header runs past the end of the file") and message.endswith(
            "the file is truncated"), message
        assert "dtype" not in message and not isinstance(info.value, ModelNotFoundError)


def _job(tmp_path: Path, model: str) -> Path:
    import yaml

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "q": f"hello {i}"}) + "\n" for i in range(3)))
    config = {"model": {"name": model, "device": "cpu"}, "data": {"source": str(data), "id_column": "id"},
              "prompt": {"template": "{{ q }}", "chat_template": False},
              "generation": {"mode": "greedy", "max_tokens": 4},
              "engine": {"kv_cache_memory": "16MiB", "max_num_seqs": 4},
              "output": {"path": str(tmp_path / "out" / "results.jsonl")}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_cli_validates_and_runs_a_gguf_and_refuses_a_bad_one(tmp_path: Path, cache: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.cli import main

    good = tmp_path / "folder" / "tiny.gguf"
    good.parent.mkdir()
    write_llama_gguf(good, linear_type="Q4_0")
    assert main(["validate", str(_job(tmp_path, str(good.parent)))]) == 0, capsys.readouterr().err
    assert main(["run", str(_job(tmp_path, str(good))), "--quiet"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r.get("error") is None for r in records), records
    capsys.readouterr()
    bert = tmp_path / "bert.gguf"
    write_llama_gguf(bert, architecture="bert")
    for command in ("validate", "run"):
        assert main([command, str(_job(tmp_path, str(bert)))]) == 2
        err = capsys.readouterr().err
        assert "architecture 'bert' is not supported" in err and "Traceback" not in err, err
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:100])  # inside the header
    for command in ("validate", "run"):
        assert main([command, str(_job(tmp_path, str(cut)))]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith(": the file is truncated\n") and "model.name: " in err, err


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_K"])
def test_the_5_bit_types_stay_quantized_and_keep_the_greedy_tokens(tmp_path: Path, cache: Path, qtype: str) -> None:
    """Q5_0 and Q5_K (what Q5_K_M files hold) load kept as stored; HF greedy decoding on them
    gives the de-quantized fp32 oracle's first 6 tokens, and teacher-forced on 12 of the
    oracle's tokens the top-1 agreement holds its bound. (On these random models the logits
    are flat: over 12 tokens Q5_K's int8 activations broke a near tie at the 8th of one row.)"""
    from batchgen.kernels.cpu.quant import QuantizedLinear

    path = tmp_path / f"tiny-{qtype}.gguf"
    oracle = write_llama_gguf(path, linear_type=qtype, embed_type="Q8_0")
    kept = load_gguf_model(path, metadata_folder(path), dtype=torch.float32, quantization="gguf")
    assert kept.batchgen_gguf["kept"] == {qtype: 14, "Q8_0": 1}
    assert isinstance(kept.model.layers[1].mlp.down_proj, QuantizedLinear)
    ids = _ids(length=8, seed=3)
    with torch.inference_mode():
        settings = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
        want = oracle.generate(ids, max_new_tokens=12, **settings)
        got = kept.generate(ids, max_new_tokens=6, **settings)
    assert torch.equal(got, want[:, :ids.shape[1] + 6])
    steps = slice(ids.shape[1] - 1, -1)  # the logits that chose want's new tokens
    agree = _logits(kept, want)[:, steps].argmax(-1) == _logits(oracle, want)[:, steps].argmax(-1)
    assert agree.float().mean() >= TOP1_BOUND


def test_reading_a_files_metadata_quiets_the_libraries_for_the_read_only(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' bars and info logs are off while a GGUF file's config and tokenizer are
    read, and after the read the process's settings are the ones it had: a Python API user's
    bars, verbosity and ``HF_HUB_DISABLE_PROGRESS_BARS`` (unset, or their own value)."""
    from transformers.utils import logging as hf_logging

    from batchgen.gguf import metadata

    seen = []
    real = metadata.hf_config

    def spy(gguf, config):  # noqa: ANN001, ANN202 - inside the read
        seen.append((hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity(),
                     os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")))
        return real(gguf, config)

    monkeypatch.setattr(metadata, "hf_config", spy)
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    try:
        for name, env, level in (("a", None, hf_logging.WARNING), ("b", "0", hf_logging.INFO)):
            path = tmp_path / f"{name}.gguf"
            write_llama_gguf(path, layers=1, oracle=False)
            if env is None:
                monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
            else:
                monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", env)
            hf_logging.enable_progress_bar()
            hf_logging.set_verbosity(level)
            metadata_folder(path)
            assert seen.pop() == (False, hf_logging.ERROR, env or "1")
            assert hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == level
            assert os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == env
    finally:
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
