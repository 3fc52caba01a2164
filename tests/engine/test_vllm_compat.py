"""vLLM's offline API on batchgen: its examples run with only the import line and the model
changed, every prompt form of vLLM's ``PromptType`` gives the plain API's tokens, and every
bad form fails before running with a message naming the prompt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchgen import LLM, BeamSearchParams, SamplingParams, TextPrompt, TokensPrompt
from batchgen.engine import prompts as prompt_forms

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)

# vLLM's examples/offline_inference/basic/basic.py, as a user runs it: only the import line and
# the model name differ.
BASIC = '''
from batchgen import LLM, SamplingParams

prompts = {prompts!r}
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model="smollm2-135m-instruct")
    outputs = llm.generate(prompts, sampling_params)
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {{prompt!r}}")
        print(f"Output:    {{generated_text!r}}")
        print("-" * 60)


if __name__ == "__main__":
    main()
'''.format(prompts=PROMPTS)

# A vLLM script over pre-tokenised prompts, with the keyword names.
TOKENS = '''
from batchgen import LLM, SamplingParams, TokensPrompt

llm = LLM(model="smollm2-135m-instruct")
tokenizer = llm.get_tokenizer()
prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(p)) for p in {prompts!r}]
outputs = llm.generate(prompts=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8), use_tqdm=True)
for output in outputs:
    print(list(output.outputs[0].token_ids))
'''.format(prompts=PROMPTS)


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, dtype="float32", block_size=16, kv_cache_memory=128 * 2**20)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _run_script(tmp_path: Path, source: str) -> str:
    script = tmp_path / "example.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


# ----------------------------------------------------------------------------- acceptance
def test_vllm_basic_example_runs_and_gives_the_plain_api_text(llm, tmp_path):
    stdout = _run_script(tmp_path, BASIC)
    printed = [eval(line.split(":", 1)[1].strip()) for line in stdout.splitlines() if line.startswith("Output:")]
    shown = [eval(line.split(":", 1)[1].strip()) for line in stdout.splitlines() if line.startswith("Prompt:")]
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.8, top_p=0.95))
    assert shown == PROMPTS
    assert printed == [o.outputs[0].text for o in plain]


def test_vllm_tokens_prompt_example_runs_and_gives_the_plain_api_tokens(llm, tmp_path):
    stdout = _run_script(tmp_path, TOKENS)
    printed = [eval(line) for line in stdout.splitlines() if line.startswith("[")]
    assert printed == _tokens(llm.generate(PROMPTS, GREEDY))


# ----------------------------------------------------------------------------- the forms
def test_every_prompt_form_alone_and_mixed_gives_the_plain_api_tokens(llm):
    ids = [llm.get_tokenizer()(p)["input_ids"] for p in PROMPTS]
    plain = _tokens(llm.generate(PROMPTS, GREEDY))
    assert llm.get_tokenizer() is llm.tokenizer
    forms = [
        list(PROMPTS),
        ids,
        [TextPrompt(prompt=p) for p in PROMPTS],
        [TokensPrompt(prompt_token_ids=i) for i in ids],
        [{"prompt": PROMPTS[0]}, ids[1], TokensPrompt(prompt_token_ids=ids[2]), PROMPTS[3]],
        [tuple(ids[0]), np.array(ids[1]).tolist(), [np.int64(t) for t in ids[2]], {"prompt_token_ids": ids[3], "prompt": "x"}],
    ]
    for form in forms:
        assert _tokens(llm.generate(form, GREEDY)) == plain, form
    mixed = llm.generate([{"prompt": PROMPTS[0]}, ids[1], {"prompt_token_ids": ids[2], "prompt": "shown"}], GREEDY)
    assert [o.prompt for o in mixed] == [PROMPTS[0], None, "shown"]
    assert [o.prompt_token_ids for o in mixed] == ids[:3]


def test_one_prompt_not_in_a_list_is_one_prompt(llm):
    plain = _tokens(llm.generate([PROMPTS[2]], GREEDY))
    for one in (PROMPTS[2], {"prompt": PROMPTS[2]}, TokensPrompt(prompt_token_ids=llm.tokenizer(PROMPTS[2])["input_ids"]),
                llm.tokenizer(PROMPTS[2])["input_ids"]):
        outs = llm.generate(one, GREEDY)
        assert len(outs) == 1 and _tokens(outs) == plain, one
    assert llm.generate({"prompt": "Hello"}, GREEDY)[0].prompt == "Hello"  # not the key 'prompt'
    assert llm.generate([], GREEDY) == []


@pytest.mark.parametrize(("bad", "error", "message"), [
    ([{"prompt": "a", "multi_modal_data": {"image": None}}], ValueError,
     r"prompt 0: 'multi_modal_data' is not supported \(batchgen runs text-only models\)"),
    (["ok", "ok", {"prompt": "a", "mm_processor_kwargs": {}}], ValueError, r"prompt 2: 'mm_processor_kwargs' is not supported"),
    (["ok", {"prompt_embeds": [[0.1]]}], ValueError, r"prompt 1: 'prompt_embeds' is not supported \(batchgen takes text or token ids"),
    ([{"encoder_prompt": "a", "decoder_prompt": "b"}], ValueError, r"prompt 0: 'encoder_prompt' is not supported \(batchgen runs decoder-only"),
    ([{"prompt": "a", "lora": 1}], ValueError, r"prompt 0: unknown prompt key 'lora'; a prompt dict takes 'prompt'"),
    ([{}], ValueError, r"prompt 0: a prompt dict needs 'prompt' \(text\) or 'prompt_token_ids'"),
    (["ok", 3.5], TypeError, r"prompt 1: expected a string, a list of token ids, \{'prompt': str\} or "
                             r"\{'prompt_token_ids': \[\.\.\.\]\}, got float"),
    (["ok", None], TypeError, r"prompt 1: expected .* got NoneType"),
    (["ok", b"bytes"], TypeError, r"prompt 1: expected .* got bytes"),
    ([[1, "2"]], TypeError, r"prompt 0: token ids must be integers, got str '2'"),
    ([[1, True]], TypeError, r"prompt 0: token ids must be integers, got bool True"),
    ([{"prompt_token_ids": "1 2"}], TypeError, r"prompt 0: 'prompt_token_ids' must be a list of token ids, got str"),
    ([{"prompt": 5}], TypeError, r"prompt 0: 'prompt' must be a string, got int"),
    (5, TypeError, r"prompts must be a prompt or a list of prompts, got int"),
])
def test_a_bad_prompt_form_names_its_index(llm, bad, error, message):
    steps = llm.stats().num_steps
    with pytest.raises(error, match=message):
        llm.generate(bad, GREEDY)
    assert llm.stats().num_steps == steps and not llm.has_unfinished_requests()


@pytest.mark.parametrize(("prompts", "params", "message"), [
    (["Hello", ""], GREEDY, r"^prompt 1: the prompt is empty$"),
    ([[1, 2], [3, 10**7]], GREEDY, r"^prompt 1: prompt token ids out of the vocabulary \(0\.\.49151\): \[10000000\]$"),
    ([[-1]], GREEDY, r"^prompt 0: prompt token ids out of the vocabulary"),
    (["Hello"], SamplingParams(stop_token_ids=[10**9]), r"^prompt 0: stop_token_ids out of the vocabulary \(0\.\.49151\): \[1000000000\]$"),
    (["Hello"], SamplingParams(logprobs=21), r"^prompt 0: logprobs=21 is more than max_logprobs=20"),
    (["Hello"], SamplingParams(prompt_logprobs=10**9), r"^prompt 0: prompt_logprobs=1000000000 is more than max_logprobs=20"),
    ([[1] * 9000], GREEDY, r"^prompt 0: the prompt has 9000 tokens; the model takes at most 8192"),
])
def test_generate_refuses_what_can_never_run_before_running(llm, prompts, params, message):
    steps = llm.stats().num_steps
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params)
    assert llm.stats().num_steps == steps and not llm.has_unfinished_requests()


def test_the_stream_keeps_per_request_errors_for_the_pipeline(llm):
    from batchgen import Request

    good = Request("good", "Hello", GREEDY)
    bad = [Request("empty", "", GREEDY), Request("oov", [10**7], GREEDY),
           Request("stop", "Hello", SamplingParams(stop_token_ids=[10**9])),
           Request("logprobs", "Hello", SamplingParams(logprobs=99)),
           Request("dict", {"prompt": "Hello"}, GREEDY)]
    outs = {o.request_id: o for o in llm.stream([*bad, good])}
    assert outs["empty"].error == "the prompt is empty"
    assert "out of the vocabulary" in outs["oov"].error and "stop_token_ids" in outs["stop"].error
    assert "max_logprobs=20" in outs["logprobs"].error
    assert outs["dict"].error is None and _tokens([outs["dict"]]) == _tokens([outs["good"]])


# ----------------------------------------------------------------------------- keywords
def test_vllm_keywords(llm):
    plain = _tokens(llm.generate(PROMPTS, GREEDY))
    assert _tokens(llm.generate(prompts=PROMPTS, sampling_params=GREEDY)) == plain
    assert _tokens(llm.generate(PROMPTS, params=GREEDY)) == plain
    with pytest.raises(TypeError, match="give sampling_params or params, not both"):
        llm.generate(PROMPTS, GREEDY, params=GREEDY)
    with pytest.raises(TypeError, match=r"sampling_params 1: expected SamplingParams or BeamSearchParams, got dict"):
        llm.generate(PROMPTS[:2], [GREEDY, {"temperature": 0}])

    class Bar:  # a tqdm-like class, as vLLM's use_tqdm takes
        made: list = []

        def __init__(self, total, **kwargs):
            self.total, self.done = total, 0
            Bar.made.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=Bar)) == plain
    (bar,) = Bar.made
    assert bar.total == bar.done == 4 and bar.closed


def test_sampling_params_vllm_fields(llm):
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    assert "." in full.text
    cut = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, stop=["."]))[0].outputs[0]
    kept = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, stop=["."],
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == cut.text + "." and full.text.startswith(kept.text)
    silent = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, detokenize=False))[0].outputs[0]
    assert silent.text == "" and silent.token_ids == full.token_ids
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)
    assert SamplingParams().max_tokens == 16  # vLLM's default
    assert SamplingParams(max_tokens=None, min_tokens=3).max_tokens is None


def test_beam_search_has_vllm_signature_and_the_engine_beams(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    engine = llm.generate([PROMPTS[0]], params)[0]
    (out,) = llm.beam_search([TextPrompt(prompt=PROMPTS[0])], params)
    ids = engine.prompt_token_ids
    assert [s.tokens for s in out.sequences] == [ids + c.token_ids for c in engine.outputs]
    assert [s.cum_logprob for s in out.sequences] == [c.cumulative_logprob for c in engine.outputs]
    assert out.sequences[0].text == llm.tokenizer.decode(out.sequences[0].tokens)
    scores = [s.score for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    assert llm.beam_search(PROMPTS[0], params)[0].sequences[0].tokens == out.sequences[0].tokens
    with pytest.raises(TypeError, match="beam_search takes one BeamSearchParams, got SamplingParams"):
        llm.beam_search([PROMPTS[0]], GREEDY)
    with pytest.raises(ValueError, match="temperature must be 0 for beam search"):
        BeamSearchParams(beam_width=2, temperature=0.7)
    with pytest.raises(ValueError, match="include_stop_str_in_output is not supported for beam search"):
        BeamSearchParams(beam_width=2, include_stop_str_in_output=True)


# ----------------------------------------------------------------------------- scoring
def test_loglikelihood_rolling_requests(llm):
    text = "The capital of France is Paris."
    ids = llm.tokenizer.encode(text)
    (alone,) = llm.loglikelihood_rolling(text)  # one request, not one per character
    listed = llm.loglikelihood_rolling([text, {"prompt": text}, TokensPrompt(prompt_token_ids=ids), ids])
    assert listed == [alone] * 4
    (space,) = llm.loglikelihood_rolling([" "])  # whitespace that tokenizes is scored
    assert space < 0
    for bad, error, message in [
        ([None], TypeError, r"^request 0: expected a string, .* got NoneType$"),
        ([5], TypeError, r"^request 0: expected .* got int \(a list of token ids is one request: put it in a list\)$"),
        ([text, ""], ValueError, r"^request 1: the text is empty \(it has no tokens to score\)$"),
        ([[]], ValueError, r"^request 0: the text is empty"),
        ([[10**7]], ValueError, r"^request 0: token ids out of the vocabulary: \[10000000\]$"),
        ([{"prompt": text, "multi_modal_data": {}}], ValueError, r"^request 0: 'multi_modal_data' is not supported"),
    ]:
        with pytest.raises(error, match=message):
            llm.loglikelihood_rolling(bad)


def test_loglikelihood_takes_prompt_dicts_as_either_side(llm):
    plain = llm.loglikelihood([("The capital of France is", " Paris")])
    ctx, cont = llm.tokenizer.encode("The capital of France is"), llm.tokenizer.encode(" Paris")
    assert llm.loglikelihood([({"prompt": "The capital of France is"}, TextPrompt(prompt=" Paris"))]) == plain
    by_ids = llm.loglikelihood([(ctx, cont)])
    assert llm.loglikelihood([(TokensPrompt(prompt_token_ids=ctx), {"prompt_token_ids": cont})]) == by_ids
    with pytest.raises(TypeError, match=r"^request 0: expected .* got NoneType"):
        llm.loglikelihood([(None, " Paris")])


# ----------------------------------------------------------------------------- engine args
@pytest.fixture(scope="module")
def short(smollm2_path) -> LLM:
    return LLM(model=smollm2_path, tokenizer=smollm2_path, dtype="float32", kv_cache_memory=64 * 2**20,
               max_model_len=24, max_logprobs=2, tensor_parallel_size=1)


def test_max_model_len_caps_the_context_as_vllm(short, llm):
    ids = short.tokenizer("The capital of France is")["input_ids"]
    assert short.max_model_len == 24 and short.config.tokenizer
    whole = short.generate([ids], SamplingParams(temperature=0.0, max_tokens=None))[0].outputs[0]
    assert whole.finish_reason == "length" and len(ids) + len(whole.token_ids) == 24
    # the same tokens the model's full context gives, up to the cap
    longer = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    capped = short.generate([ids], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert capped.token_ids == longer.token_ids[:24 - len(ids)] and capped.finish_reason == "length"
    with pytest.raises(ValueError, match=r"^prompt 0: the prompt has 24 tokens; the model takes at most 24"):
        short.generate([[1] * 24], GREEDY)
    with pytest.raises(ValueError, match=r"^prompt 0: logprobs=3 is more than max_logprobs=2"):
        short.generate(["Hi"], SamplingParams(logprobs=3))
    assert len(short.generate(["Hi"], SamplingParams(logprobs=2, max_tokens=1))[0].outputs[0].logprobs[0]) == 3


def test_engine_args_of_vllm_scripts_are_checked():
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.model_loader import context_length

    assert EngineConfig(tensor_parallel_size=1).tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not supported: batchgen runs one model per "
                                         r"device; to use several devices run data-parallel replicas on Ray \(a job's "
                                         r"executor.backend: ray"):
        EngineConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="give one of gpu_memory_utilization .* and kv_cache_memory"):
        EngineConfig(gpu_memory_utilization=0.5, kv_cache_memory=2**20)
    for bad, message in [({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be a fraction in"),
                         ({"max_model_len": 0}, "max_model_len must be an integer >= 1"),
                         ({"max_logprobs": -2}, "max_logprobs must be an integer >= 0"),
                         ({"tokenizer": ""}, "tokenizer must be a folder or hub id")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="max_model_len=9000 is more than this model's context of 8192"):
        context_length(9000, 8192)
    assert context_length(None, 8192) == 8192 and context_length(100, 8192) == 100


def test_gpu_memory_utilization_on_the_cpu_names_kv_cache_memory():
    import torch

    from batchgen.engine.kv_cache import CacheShape, num_blocks_for_budget

    shape = CacheShape(num_layers=2, num_kv_heads=2, head_size=8, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 applies to a GPU; on the CPU the KV cache "
                                         r"takes kv_cache_memory bytes \(default 512 MiB\)"):
        num_blocks_for_budget(shape, torch.device("cpu"), None, gpu_memory_utilization=0.5)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_utilization_sizes_the_kv_cache_from_the_gpu_memory(smollm2_path):
    import torch

    llm = LLM(smollm2_path, device="cuda", gpu_memory_utilization=0.3)
    free, total = torch.cuda.mem_get_info()
    # the cache took what 0.3 of the GPU left after the model: now about 0.3 of it is in use
    used = (total - free) / total
    assert 0.25 < used < 0.35, used
    assert llm.runner.kv_cache.num_bytes > 0
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.01 allows"):
        LLM(smollm2_path, device="cuda", gpu_memory_utilization=0.01)


def test_request_error_is_one_rule():
    ok = SamplingParams(logprobs=5)
    assert prompt_forms.request_error([1, 2], ok, 100, 10, 5) is None
    assert prompt_forms.request_error([1, 2], ok, 100, 10, -1) is None  # -1: no cap
    assert "max_logprobs=4" in prompt_forms.request_error([1, 2], ok, 100, 10, 4)
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=0)
    assert prompt_forms.request_error([1] * 11, scoring, 100, 10, 20) is None  # the last token is only a target
    assert "scores at most 11" in prompt_forms.request_error([1] * 12, scoring, 100, 10, 20)
    assert prompt_forms.as_list("a") == ["a"] and prompt_forms.as_list([1, 2]) == [[1, 2]]
    assert prompt_forms.as_list([1, 2], ids_alone=False) == [1, 2]


def test_gpu_memory_utilization_on_the_cpu_is_refused_before_the_weights_load(smollm2_path, monkeypatch):
    from batchgen.engine import model_loader

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the setting was refused")

    monkeypatch.setattr(model_loader, "_causal_lm_class", no_load)  # the first step of reading the model
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 applies to a GPU; on the CPU .*set kv_cache_memory"):
        LLM(smollm2_path, device="cpu", gpu_memory_utilization=0.9)
