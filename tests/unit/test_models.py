"""Model resolution: stale conversion folders, a quiet conversion, unknown names named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchgen.quiet import quiet_notices
from batchgen.cache import remove_stale_temp_folders
from batchgen.model_resolver import ModelNotFoundError, _convert_gguf, check_model


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_stale_temp_folders_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    target = tmp_path / "smollm2-abc"
    folders = {
        "dead": tmp_path / f"smollm2-abc.tmp-{_dead_pid()}-x1",
        "live": tmp_path / f"smollm2-abc.tmp-{os.getpid()}-x2",
        "live-but-old": tmp_path / f"smollm2-abc.tmp-{os.getpid()}-x3",
        "no-pid-recent": tmp_path / "smollm2-abc.tmp-k2j3h4",
        "no-pid-old": tmp_path / "smollm2-abc.tmp-a8s7d6",
        "other-model": tmp_path / f"other.tmp-{_dead_pid()}-x4",
    }
    for folder in folders.values():
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 16)
    _age(folders["live-but-old"], 7200)
    _age(folders["no-pid-old"], 7200)
    removed = remove_stale_temp_folders(target)
    assert sorted(p.name for p in removed) == sorted(folders[k].name for k in ("dead", "live-but-old", "no-pid-old"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        folders[k].name for k in ("live", "no-pid-recent", "other-model")
    )


def test_conversion_cleans_up_and_is_quiet_when_bars_are_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The conversion itself is transformers' (20 s on the real model); a stand-in that draws a
    bar with plain tqdm, as transformers' GGUF loader does, checks what batchgen adds."""
    import transformers
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    def load_model(*args: object, **kwargs: object) -> SimpleNamespace:
        for _ in tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        save = lambda path, **kw: (Path(path) / "config.json").write_text("{}")  # noqa: E731
        return SimpleNamespace(config=SimpleNamespace(quantization_config={}), save_pretrained=save)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: SimpleNamespace(save_pretrained=lambda p: None))
    models = tmp_path / "models"
    models.mkdir()
    stale = models / f"m-1.tmp-{_dead_pid()}-q"
    stale.mkdir()
    was_enabled = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.disable_progress_bar()  # what --quiet (or stderr off a terminal) does
        with quiet_notices():  # --quiet: nothing at all
            _convert_gguf(Path("model.gguf"), models / "m-1")
        assert capsys.readouterr().err == ""
        assert (models / "m-1" / "config.json").is_file() and not stale.exists()
        assert sorted(p.name for p in models.iterdir()) == ["m-1"]
        # Off a terminal (and after the quiet block): what happens, no bar.
        _convert_gguf(Path("model.gguf"), models / "m-3")
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 5 and lines[0].startswith("batchgen: converting the built-in model's model.gguf")
        assert "once: about 40 s" in lines[0] and re.fullmatch(r"batchgen: converted model\.gguf in \d+\.\d s", lines[4])
        assert lines[1:4] == ["batchgen: [1/3] loading transformers, reading the tokenizer from the GGUF file",
                              "batchgen: [2/3] reading and de-quantizing the weights to float32",
                              "batchgen: [3/3] writing the safetensors folder"]
        hf_logging.enable_progress_bar()
        _convert_gguf(Path("model.gguf"), models / "m-2")
        err = capsys.readouterr().err
        assert "Converting and de-quantizing GGUF tensors" in err and "batchgen: converted model.gguf" in err
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def test_a_long_conversion_step_says_so_every_few_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Reading the GGUF takes most of the conversion, before transformers' bar: a line every
    HEARTBEAT_S seconds says the step still runs (here 0.05 s, against a 0.3 s step)."""
    import time
    from types import SimpleNamespace

    import transformers

    from batchgen import model_resolver

    def slow_tokenizer(*args: object, **kwargs: object) -> SimpleNamespace:
        time.sleep(0.3)
        return SimpleNamespace(save_pretrained=lambda p: None)

    save = lambda path, **kw: (Path(path) / "config.json").write_text("{}")  # noqa: E731
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", slow_tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: SimpleNamespace(
        config=SimpleNamespace(quantization_config={}), save_pretrained=save))
    monkeypatch.setattr(model_resolver, "HEARTBEAT_S", 0.05)
    _convert_gguf(Path("model.gguf"), tmp_path / "m")
    lines = capsys.readouterr().err.splitlines()
    beats = [line for line in lines if "still loading transformers, reading the tokenizer from the GGUF file (" in line]
    assert len(beats) >= 3 and lines.index(beats[0]) == 2, lines
    last = max(i for i, line in enumerate(lines) if line in beats)
    assert lines[last + 1:] == lines[-3:] and not any("still" in line for line in lines[last + 1:]), lines
    with quiet_notices():  # --quiet: the heartbeat thread keeps quiet too
        _convert_gguf(Path("model.gguf"), tmp_path / "m-quiet")
    assert "batchgen:" not in capsys.readouterr().err


def test_unknown_model_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as info:
        check_model("smollm2-999m")
    message = str(info.value)
    assert message.startswith("model 'smollm2-999m' is not a built-in model ('smollm2-135m-instruct')")
    assert "not in the HF cache and HF_HUB_OFFLINE is set" in message
    with pytest.raises(ModelNotFoundError, match="'bad name!' is not a valid hub id"):
        check_model("bad name!")
    for typo in ("smollm2-135m-instruc", "SmolLM2-135M-Instrct"):  # a typo of a built-in name gets a did-you-mean
        with pytest.raises(ModelNotFoundError) as info:
            check_model(typo)
        assert str(info.value).startswith(f"model '{typo}' (did you mean 'smollm2-135m-instruct'?) is not a built-in")


def test_a_missing_model_path_names_the_folder_it_resembles(tmp_path: Path) -> None:
    (tmp_path / "tiny-llama").mkdir()
    with pytest.raises(ModelNotFoundError) as info:
        check_model(f"{tmp_path}/tiny-lama")
    assert str(info.value).startswith(f"model path '{tmp_path}/tiny-lama' does not exist (did you mean "
                                      f"'{tmp_path}/tiny-llama'?); give an existing folder")


def test_hub_that_cannot_be_reached_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    def unreachable(self: object, name: str, **kwargs: object) -> None:
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(ModelNotFoundError, match=r"'org/nope-7b' .* the hub did not provide it \(ConnectionError: Name or service"):
        check_model("org/nope-7b")


def test_quantization_gguf_needs_a_gguf_model(tmp_path: Path) -> None:
    """``gguf`` for an HF folder or a hub id would keep nothing quantized: an error, not a
    summary saying 'gguf' over float weights."""
    from batchgen.model_resolver import ModelError, QuantizationError, resolve_model

    (tmp_path / "config.json").write_text("{}")
    for name in (str(tmp_path), "org/some-model"):
        with pytest.raises(QuantizationError, match=f"model '{name}' is not a GGUF file") as info:
            resolve_model(name, "gguf", "cpu")
        assert isinstance(info.value, ModelError) and isinstance(info.value, ValueError)
        assert resolve_model(name, "none", "cpu").quantization == "none"
