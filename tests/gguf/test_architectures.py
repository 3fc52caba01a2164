"""Every GGUF architecture row loads what llama.cpp's converter wrote: tiny random models of each
row (:mod:`tiny_arch`), in F32, Q8_0 and Q4_K.

- **The loaded weights.** The model batchgen loads (``quantization: none``) holds the values the
  file means, in HF's layout: q/k un-permuted for Llama only, Gemma's ``1 + w`` norms shifted
  back, Phi-3's fused tensors whole, Llama 3's ``rope_freqs`` applied to the RoPE frequencies.
- **The engine.** batchgen's greedy tokens (paged cache, blocks of 16 and of 1, prompts 3x the
  16-token window) equal HF ``generate``'s on the model the file was written from, and, where
  transformers' own GGUF reader reads the row right, on transformers' load of the same file.
  Engine runs of a model the engine refuses (``UnsupportedModelError``: soft-capping and sliding
  windows before the paged attention applies them) or caps below the prompt skip, saying so.
- **Quantized blocks.** ``quantization: gguf`` keeps the Q8_0 / Q4_K blocks and stays within
  the loader's bound of the de-quantized model.
- **Errors.** A file whose tensors do not match its row, and a template that cannot be rendered,
  fail at load naming the file (and the tensor); the CLI exits 2.

The llama.cpp oracle of every row, in F32, Q8_0, Q4_K and Q5_K, is ``test_llama_cpp_oracle.py``
(the ``gguf-oracle`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny_arch import CASES, WINDOW, write_arch_gguf
from tiny_gguf import LOGIT_BOUND, TOP1_BOUND

from batchgen.gguf.architectures import ARCHITECTURES
from batchgen.gguf.hf_model import load_gguf_model
from batchgen.gguf.metadata import metadata_folder
from batchgen.gguf.reader import GGUFError

#: The cases whose file transformers' GGUF reader (``from_pretrained(gguf_file=)``) reads into
#: the model it was written from; the others, and why not.
TRANSFORMERS_MISREADS = {
    "llama3": "transformers' reader drops the rope_freqs tensor (Llama 3's RoPE scaling)",
    "qwen3": "transformers' reader does not read qwen3.attention.key_length (a head size other than hidden / heads)",
}
QTYPES = ("F32", "Q8_0", "Q4_K")
PROMPT_LEN = 3 * WINDOW + 2
NEW_TOKENS = 8


def _prompts(n: int = 2) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 320, (PROMPT_LEN,), generator=gen).tolist() for _ in range(n)]


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            done = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
            out.append(done[0, len(prompt):].tolist())
    return out


def _engine_greedy(path: Path, prompts: list[list[int]], block_size: int, quantization: str) -> list[list[int]]:
    """batchgen's greedy tokens, or a skip naming why the engine does not run the model."""
    from batchgen import LLM, SamplingParams
    from batchgen.engine.model_runner import UnsupportedModelError

    try:
        llm = LLM(str(path), quantization=quantization, dtype="float32", device="cpu", block_size=block_size,
                  kv_cache_memory=16 * 2**20)
        longest = PROMPT_LEN + NEW_TOKENS
        if llm.max_model_len < longest:
            pytest.skip(f"the engine caps this model's context at {llm.max_model_len} tokens (its sliding "
                        f"window), below {longest}")
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    except UnsupportedModelError as exc:
        pytest.skip(f"the engine refuses this model: {exc}")
    except TypeError as exc:
        if "layer_type" not in str(exc):
            raise
        # issue 34: the engine calls Gemma 3's rotary embedding without the layer type (its local
        # and global layers have separate RoPE tables); the paged-attention work fixes it
        pytest.skip(f"the engine does not run per-layer-type RoPE yet: {exc}")
    return [list(o.outputs[0].token_ids) for o in outs]


# ---- the loaded weights ------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_the_loaded_weights_are_the_files_meaning(tmp_path: Path, cache: Path, case: str, qtype: str) -> None:
    path = tmp_path / f"{case}-{qtype}.gguf"
    oracle = write_arch_gguf(path, case, qtype)
    model = load_gguf_model(path, metadata_folder(path), dtype=torch.float32, quantization="none")
    row = ARCHITECTURES[CASES[case][0]]
    # a Mistral file builds HF's Llama, as transformers' reader builds it: the same layers
    assert model.config.model_type == row.hf_model_type
    want, got = oracle.state_dict(), model.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        if "rotary_emb" in name:  # buffers: Llama 3's frequencies from rope_freqs, HF's from its formula
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=0)
        elif row.norm_offset and name.endswith("norm.weight"):  # (1 + w) - 1 in float32: w to 1 ulp of 1
            torch.testing.assert_close(got[name], value, rtol=0, atol=2**-23)
        else:
            assert torch.equal(got[name], value), name
    ids = torch.tensor(_prompts(1))
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, oracle(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_only_llama_files_are_unpermuted() -> None:
    """The trap: un-permuting q/k of a file the converter did not permute scrambles attention."""
    assert {name for name, row in ARCHITECTURES.items() if row.permute_qk} == {"llama"}


# ---- the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_equals_hf_on_the_written_model(tmp_path: Path, cache: Path, case: str) -> None:
    """F32 file, quantization gguf (F32 loads as float): blocks of 16 and of 1."""
    path = tmp_path / f"{case}.gguf"
    oracle = write_arch_gguf(path, case, "F32")
    prompts = _prompts()
    want = _hf_greedy(oracle, prompts)
    for block_size in (16, 1):
        assert _engine_greedy(path, prompts, block_size, "gguf") == want, block_size


@pytest.mark.parametrize("case", [c for c in CASES if c not in TRANSFORMERS_MISREADS])
def test_engine_greedy_equals_transformers_gguf_load(tmp_path: Path, cache: Path, case: str) -> None:
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{case}.gguf"
    write_arch_gguf(path, case, "F32", seed=1)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = _prompts()
    assert _engine_greedy(path, prompts, 16, "gguf") == _hf_greedy(hf, prompts)


@pytest.mark.parametrize("case", [c for c in CASES if c not in TRANSFORMERS_MISREADS])
def test_transformers_reads_the_same_model(tmp_path: Path, cache: Path, case: str) -> None:
    """transformers' own GGUF load of the file (Gemma included, where the engine cannot run
    yet) gives the logits of the model batchgen loads."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{case}.gguf"
    write_arch_gguf(path, case, "Q8_0", seed=2)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_gguf_model(path, metadata_folder(path), dtype=torch.float32, quantization="none")
    assert type(ours).__name__ == type(hf).__name__
    ids = torch.tensor(_prompts(1))
    with torch.inference_mode():
        torch.testing.assert_close(ours(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(TRANSFORMERS_MISREADS))
def test_transformers_misreads_what_batchgen_reads(tmp_path: Path, cache: Path, case: str) -> None:
    """The rows listed as misread by transformers are: its load fails or gives other logits
    (so that the list stays true when transformers learns them)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{case}.gguf"
    oracle = write_arch_gguf(path, case, "F32")
    ids = torch.tensor(_prompts(1))
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    except (RuntimeError, ValueError) as exc:
        assert "size" in str(exc) or "shape" in str(exc), exc
        return
    with torch.inference_mode():
        assert (hf(input_ids=ids).logits - oracle(input_ids=ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "phi3", "gemma3"])
def test_quantized_blocks_stay_within_the_bound(tmp_path: Path, cache: Path, case: str, qtype: str) -> None:
    from batchgen.kernels.cpu.quant import QuantizedLinear

    path = tmp_path / f"{case}-{qtype}.gguf"
    oracle = write_arch_gguf(path, case, qtype)
    model = load_gguf_model(path, metadata_folder(path), dtype=torch.float32, quantization="gguf")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and {m.qtype.name for m in layers} == {qtype}
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    ids = torch.tensor(_prompts(2))
    with torch.inference_mode():
        want, got = oracle(input_ids=ids).logits, model(input_ids=ids).logits
    assert (got - want).abs().max() <= LOGIT_BOUND * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= TOP1_BOUND


# ---- chat templates -----------------------------------------------------------------------

#: Each family's template shape (shortened: the turn markers and the generation prompt).
TEMPLATES = {
    "llama3": "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
              " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    "qwen2": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "gemma2": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('System role not supported') }}{% endif %}<start_of_turn>"
              "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
              "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "phi3": "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
}


@pytest.mark.parametrize("case", list(TEMPLATES))
def test_the_files_chat_template_renders_as_hf_renders_it(tmp_path: Path, cache: Path, case: str) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / f"{case}.gguf"
    write_arch_gguf(path, case, "F32", chat_template=TEMPLATES[case])
    ours = AutoTokenizer.from_pretrained(metadata_folder(path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    chat = [{"role": "user", "content": "Name a colour. "}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"}]
    want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == want
    assert want.count("Another?") == 1 and want != "Another?"


def test_a_template_that_cannot_render_fails_at_load(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "broken.gguf"
    write_arch_gguf(path, "qwen2", "F32", chat_template="{% for m in messages %}{{ m['content'] | nosuchfilter }}{% endfor %}")
    with pytest.raises(GGUFError) as info:
        metadata_folder(path)
    assert str(path) in str(info.value) and "chat template" in str(info.value)


# ---- errors --------------------------------------------------------------------------------


def _rewrite(path: Path, target: Path, copy: dict[str, str] | None = None, drop: tuple[str, ...] = (),
             architecture: str | None = None, numbers: dict[str, int] | None = None) -> None:
    """Copy the GGUF ``path`` to ``target``, dropping tensors, adding copies of some under new
    names (``{new: existing}``), setting integer metadata values (``numbers``), or relabelling
    its architecture (its metadata keys follow)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    new_arch = architecture or arch
    writer = gguf.GGUFWriter(str(target), new_arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (numbers or {}).get(key, field.contents())
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key.replace(f"{arch}.", f"{new_arch}.", 1), value, kind, sub_type=sub)
    tensors = {t.name: t for t in reader.tensors}
    names = [n for n in tensors if n not in drop] + list(copy or {})
    for name in names:
        tensor = tensors[(copy or {}).get(name, name)]
        quantized = tensor.tensor_type.name not in ("F32", "F16")
        writer.add_tensor(name, np.array(tensor.data), raw_dtype=tensor.tensor_type if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_whose_tensors_do_not_match_its_row(tmp_path: Path, cache: Path) -> None:
    """A Qwen2 file without a q bias, a Llama file labelled phi3 (no fused attn_qkv), and a
    tensor with no place in the model: each names the file and the tensor."""
    source = tmp_path / "qwen2.gguf"
    write_arch_gguf(source, "qwen2", "Q8_0")
    cases = {
        "no-bias": ({"drop": ("blk.0.attn_q.bias",)}, "'blk.0.attn_q.bias' is missing"),
        "stray": ({"copy": {"blk.1.attn_gate.bias": "blk.1.attn_q.bias"}}, "'blk.1.attn_gate.bias' has no place"),
    }
    for label, (change, expected) in cases.items():
        target = tmp_path / f"{label}.gguf"
        _rewrite(source, target, **change)
        with pytest.raises(GGUFError) as info:
            metadata_folder(target)
        assert str(target) in str(info.value) and expected in str(info.value), info.value
    llama = tmp_path / "llama.gguf"
    write_arch_gguf(llama, "llama", "F32")
    as_phi3 = tmp_path / "labelled-phi3.gguf"
    _rewrite(llama, as_phi3, architecture="phi3")
    with pytest.raises(GGUFError) as info:
        metadata_folder(as_phi3)
    assert str(as_phi3) in str(info.value) and "'blk.0.attn_qkv.weight' is missing" in str(info.value), info.value


def test_the_vocabulary_is_the_embeddings_rows(tmp_path: Path, cache: Path) -> None:
    """A file whose metadata counts more tokens than its embedding has rows (Gemma 3's converter
    drops the padding rows of the embedding) loads with the embedding's rows."""
    source = tmp_path / "qwen2.gguf"
    write_arch_gguf(source, "qwen2", "F32")
    padded = tmp_path / "padded.gguf"
    _rewrite(source, padded, numbers={"qwen2.vocab_size": 336})
    model = load_gguf_model(padded, metadata_folder(padded), dtype=torch.float32, quantization="none")
    assert model.config.vocab_size == 320 and model.get_output_embeddings().out_features == 320


def test_a_longrope_phi3_file_is_refused_naming_the_tensor(tmp_path: Path, cache: Path) -> None:
    source = tmp_path / "phi3.gguf"
    write_arch_gguf(source, "phi3", "F32")
    longrope = tmp_path / "phi3-128k.gguf"
    _rewrite(source, longrope, copy={"rope_factors_long.weight": "output_norm.weight",
                                     "rope_factors_short.weight": "output_norm.weight"})
    with pytest.raises(GGUFError) as info:
        metadata_folder(longrope)
    assert str(longrope) in str(info.value) and "'rope_factors_long.weight' holds LongRoPE" in str(info.value)


def test_cli_exit_2_for_an_unknown_architecture_and_a_mismatched_file(tmp_path: Path, cache: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from batchgen.cli import main

    source = tmp_path / "qwen2.gguf"
    write_arch_gguf(source, "qwen2", "F32")
    unknown = tmp_path / "unknown.gguf"
    _rewrite(source, unknown, architecture="starcoder2")
    mismatched = tmp_path / "mismatched.gguf"
    _rewrite(source, mismatched, drop=("blk.1.ffn_down.weight",))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "r0", "q": "hello"}) + "\n")
    for path, expected in ((unknown, "architecture 'starcoder2' is not supported"),
                           (mismatched, "tensor 'blk.1.ffn_down.weight' is missing")):
        job = tmp_path / f"{path.stem}.yaml"
        job.write_text(yaml.safe_dump({
            "model": {"name": str(path), "device": "cpu"}, "data": {"source": str(data), "id_column": "id"},
            "prompt": {"template": "{{ q }}", "chat_template": False}, "generation": {"max_tokens": 2},
            "output": {"path": str(tmp_path / "out" / f"{path.stem}.jsonl")}}))
        for command in ("validate", "run"):
            assert main([command, str(job)]) == 2
            err = capsys.readouterr().err
            assert str(path) in err and expected in err and "Traceback" not in err, err
        if path is unknown:
            assert all(name in err for name in ARCHITECTURES), err
