"""Structured outputs on SmolLM2 (fp32, CPU): the engine against xgrammar's own HF processor.

The oracle is HF ``generate`` with ``xgrammar.contrib.hf.LogitsProcessor`` over the same compiled
grammar, run one prompt at a time. Sampling and beams are checked by validating every output
(``jsonschema``, ``re.fullmatch``, choice membership); forks, preemption and a third party's
stateful processor each have their own case. One engine serves the module.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("xgrammar", reason="structured outputs need: pip install 'batchgen[structured]'")
import jsonschema  # noqa: E402
import xgrammar as xgr  # noqa: E402

from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams  # noqa: E402
from batchgen.sampling.stateful import unpack_bitmask  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Lagos", "Lima", "Osaka"]},
    },
    "required": ["name", "age", "city"],
}
REGEX = r"[A-Z][a-z]{2,9} (is|was) [0-9]{1,3}"
CHOICES = ["positive", "negative", "neutral"]
QUESTIONS = [
    "Describe a person as JSON.", "Invent a character for a novel.", "Who won the race?",
    "Tell me about your neighbour.", "Give a short profile of a chef.", "Who is the oldest person you know?",
    "Make up a customer record.", "Describe a famous painter.", "Who lives next door?",
    "Write a user profile for a travel site.", "Describe a pilot.", "Who taught you to swim?",
]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny forwards: one intra-op thread is as fast and avoids OpenMP spin-waits on a loaded
    2-core machine (as the beam oracle does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(smollm2_path: str) -> LLM:
    return LLM(smollm2_path, dtype="float32", kv_cache_memory=64 * 2**20)


@pytest.fixture(scope="module")
def hf_model(smollm2_path: str):
    """HF's SmolLM2, loaded on first use only (the references are cached on disk) and shared by
    both oracles; dropped with the module."""
    loaded = []

    def get():
        if not loaded:
            from transformers import AutoModelForCausalLM

            loaded.append(AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval())
        return loaded[0]

    return get


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    texts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                   add_generation_prompt=True) for q in QUESTIONS]
    return [smollm2_tokenizer(t)["input_ids"] for t in texts]


def _texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_greedy_equals_hf_with_xgrammars_logits_processor(kind, llm, prompts, smollm2_path, hf_model, oracle_cache,
                                                          hf_map):
    constraint = StructuredOutputsParams(json=SCHEMA) if kind == "json" else StructuredOutputsParams(regex=REGEX)
    compiled = llm.structured_processor().compiled(constraint)

    def compute() -> list[list[int]]:
        from transformers import LogitsProcessorList

        model = hf_model()

        def one(p: list[int]) -> list[int]:
            with torch.inference_mode():
                out = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     pad_token_id=llm.eos_token_ids[0],
                                     logits_processor=LogitsProcessorList([xgr.contrib.hf.LogitsProcessor(compiled)]))
            ids = out[0, len(p):].tolist()
            return ids[:-1] if ids and ids[-1] in llm.eos_token_ids else ids

        return hf_map(one, prompts)

    weights = Path(smollm2_path, "model.safetensors").stat().st_size
    ref = oracle_cache(["structured-greedy", weights, constraint.key, xgr.__name__, _xgr_version(), prompts,
                        MAX_TOKENS], compute)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constraint))
    ours = [o.outputs[0].token_ids for o in outs]
    differ = [i for i, (a, b) in enumerate(zip(ours, ref)) if a != b]
    assert not differ, f"prompts {differ} differ: ours {ours[differ[0]]} vs HF {ref[differ[0]]}"
    for o in outs:  # and they are what the constraint asks for
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop", text
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text


def _xgr_version() -> str:
    from importlib.metadata import version

    return version("xgrammar")


def test_json_schema_with_n_samples_and_beams_always_validates(llm, prompts):
    constraint = StructuredOutputsParams(json=SCHEMA)
    sampled = llm.generate(prompts[:4], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=MAX_TOKENS,
                                                       structured_outputs=constraint))
    beams = llm.generate(prompts[:3], BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS,
                                                       structured_outputs=constraint))
    assert [len(o.outputs) for o in sampled] == [4] * 4 and [len(o.outputs) for o in beams] == [3] * 3
    for o in sampled + beams:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(set(_texts(sampled))) > 4  # the samples do differ


def test_choice_and_regex_outputs_with_n_samples_and_beams(llm, prompts):
    for constraint, ok in ((StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
                           (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None)):
        sampled = llm.generate(prompts[:4], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24,
                                                           structured_outputs=constraint))
        beams = llm.generate(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=24, structured_outputs=constraint))
        texts = _texts(sampled) + _texts(beams)
        assert len(texts) == 16 + 6
        bad = [t for t in texts if not ok(t)]
        assert not bad, f"{constraint.kind}: {bad}"


def test_unsatisfiable_within_max_tokens_ends_as_length(llm, prompts):
    """A schema whose shortest output is longer than max_tokens: 'length', never a crash; a
    beam that cannot finish ends as 'length' too."""
    long = StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string", "minLength": 40}},
                                         "required": ["s"]})
    for params in (SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=long),
                   SamplingParams(n=2, temperature=1.0, max_tokens=6, structured_outputs=long),
                   BeamSearchParams(beam_width=2, max_tokens=6, structured_outputs=long)):
        (out,) = llm.generate(prompts[:1], params)
        assert out.error is None and out.outputs
        for c in out.outputs:
            assert c.finish_reason == "length" and len(c.token_ids) == 6 and c.text.startswith('{"s": "')


def test_forked_matchers_are_independent(llm, prompts):
    proc = llm.structured_processor()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    tok = llm.tokenizer
    parent = proc.new_state(prompts[0], params)
    early = parent.fork()  # forked before the matcher exists: shares only the pending grammar
    for t in tok.encode('{"name": "Al'):
        parent.accept_token(t)
    child = parent.fork()
    for t in tok.encode('", "age": 3'):
        child.accept_token(t)
    for t in tok.encode('ice", "age": 41, "city": "Lima"}'):
        parent.accept_token(t)
    masks = torch.full((4, (llm.runner.vocab_size + 31) // 32), -1, dtype=torch.int32)
    proc.fill_mask([parent, child, early], masks, [0, 1, 2])
    allowed = unpack_bitmask(masks, llm.runner.vocab_size)
    # The parent completed its object: only EOS; the child is inside "age"; the early fork is
    # at the start (only '{' tokens); row 3 was not filled and stays all-allowed.
    assert allowed[0].nonzero().flatten().tolist() == llm.eos_token_ids
    digit = tok.encode("5")[0]
    assert bool(allowed[1, digit]) and not bool(allowed[1, llm.eos_token_ids[0]])
    assert all(tok.decode([t]).lstrip().startswith("{") for t in allowed[2].nonzero().flatten().tolist())
    assert bool(allowed[3].all())
    with pytest.raises(RuntimeError, match="not allowed"):
        early.accept_token(digit)


def test_bitmask_is_applied_as_xgrammar_applies_it():
    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(3, vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=vocab)
    ours = logits.masked_fill(~unpack_bitmask(bitmask, vocab), -torch.inf)
    assert torch.equal(ours, ref)


def test_preempted_constrained_groups_match_a_roomy_run(llm, prompts, smollm2_path):
    """Preemption by recompute drops every matcher and rebuilds it from the tokens: the same
    outputs as without preemption, for greedy, seeded samples and beams."""
    constraint = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint),
              SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=40, structured_outputs=constraint),
              BeamSearchParams(beam_width=3, max_tokens=40, structured_outputs=constraint)] * 2
    batch = prompts[:6]
    roomy = llm.generate(batch, params)
    bytes_per_token = 2 * 30 * 3 * 64 * 4
    tight = LLM(smollm2_path, dtype="float32", block_size=16, kv_cache_memory=420 * bytes_per_token)
    squeezed = tight.generate(batch, params)
    assert tight.stats().num_preemptions > 0, "the budget was meant to force preemption"
    assert [[c.token_ids for c in o.outputs] for o in squeezed] == [[c.token_ids for c in o.outputs] for o in roomy]
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


PLUGIN = '''
from batchgen.plugins import StatefulLogitsProcessor, hookimpl, SamplerSpec
from pydantic import BaseModel


class ParityState:
    """How many tokens this sequence took, and which."""

    def __init__(self, seen=()):
        self.seen = list(seen)

    def fork(self):
        return ParityState(self.seen)

    def accept_token(self, token_id):
        self.seen.append(token_id)


class Alternate(StatefulLogitsProcessor):
    """Token i of a generation has the parity of i (a mask), and never repeats (a row edit)."""

    def new_state(self, prompt_token_ids, params):
        return ParityState()

    def fill_mask(self, states, bitmask, rows):
        # Bit b of word w is token 32 * w + b: 0x55555555 keeps the even ids, 0xAAAAAAAA
        # (-0x55555556 as an int32) the odd ones.
        for state, row in zip(states, rows):
            bitmask[row] = 0x55555555 if len(state.seen) % 2 == 0 else -0x55555556

    def process(self, logits, states):
        for row, state in enumerate(states):
            logits[row, state.seen] = float("-inf")
        return logits


class NoOptions(BaseModel):
    pass


@hookimpl
def batchgen_register_samplers():
    return [SamplerSpec("alternate", "parity and no repeats", NoOptions, lambda options: Alternate())]
'''


def test_a_third_party_stateful_sampler_with_n_samples_and_beams(llm, prompts, tmp_path, monkeypatch):
    from batchgen.plugins import GuardedStatefulProcessor, load_registry

    (tmp_path / "bg_alternate.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    proc = load_registry(["bg_alternate"]).build_sampler("alternate", {})
    assert isinstance(proc, GuardedStatefulProcessor) and proc.masks and proc.edits
    outs = llm.generate(prompts[:3], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10,
                                                     logits_processors=[proc]))
    outs += llm.generate(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=10, logits_processors=[proc]))
    seqs = [c.token_ids for o in outs for c in o.outputs]
    assert len(seqs) == 12 + 6 and len({tuple(s) for s in seqs}) > 10
    for ids in seqs:
        # A state shared by the forks, or one that missed a token, breaks the alternation.
        assert ids and [t % 2 for t in ids] == [i % 2 for i in range(len(ids))], ids
        assert len(set(ids)) == len(ids), ids
    monkeypatch.delitem(sys.modules, "bg_alternate")


def test_the_stateful_example_of_the_plugin_docs(llm, prompts, tmp_path, monkeypatch):
    """docs/plugins.md's stateful example, loaded as a plugin, with n samples and beams."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text(encoding="utf-8")
    section = docs.split("#### Stateful processors", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    (tmp_path / "bg_doc_one_of.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    from batchgen.plugins import load_registry

    words = [llm.tokenizer.encode(w) for w in ("Yes, always.", "No", "Maybe not today")]
    proc = load_registry(["bg_doc_one_of"]).build_sampler(
        "one_of", {"sequences": words, "eos_token_id": llm.eos_token_ids[0]})
    outs = llm.generate(prompts[:3], SamplingParams(n=4, temperature=1.5, seed=1, max_tokens=16,
                                                     logits_processors=[proc]))
    outs += llm.generate(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=16, logits_processors=[proc]))
    got = [c.token_ids for o in outs for c in o.outputs]
    assert len(got) == 18 and all(ids in words for ids in got), got
    assert len({tuple(ids) for ids in got}) > 1
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    monkeypatch.delitem(sys.modules, "bg_doc_one_of")
