"""A request whose constraint or sampler leaves it no token fails alone, as an error output
naming the constraint or the sampler's plugin; the requests around it are answered exactly as
they are without it (the oracle: the same engine run on the good requests only)."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen.plugins.guards import GuardedProcessor, GuardedStatefulProcessor
from batchgen.sampling.processors import StatefulLogitsProcessor

PROMPTS = ["The capital of France is", "One, two, three,", "Once upon a time"]


@pytest.fixture(scope="module")
def llm(shared_tiny_model) -> LLM:
    return LLM(shared_tiny_model("llama"), dtype="float32", kv_cache_memory=8 * 2**20, num_threads=1)


def _mask_all(logits: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor:
    return logits.fill_(-torch.inf)


class _State:
    def fork(self) -> _State:
        return _State()

    def accept_token(self, token_id: int) -> None:
        pass


class _AllowNothing(StatefulLogitsProcessor):
    """A stateful processor whose mask allows no token."""

    def new_state(self, prompt_token_ids, params):
        return _State()

    def fill_mask(self, states, bitmask, rows):
        bitmask[list(rows)] = 0


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _check_alone(llm: LLM, bad: SamplingParams | BeamSearchParams, good: SamplingParams | BeamSearchParams,
                 *expected: str) -> None:
    """``good`` must be greedy or seeded: an unseeded request's seed derives from its id."""
    params = [good, bad, good]
    outputs = llm.generate(PROMPTS, params)
    assert [o.error is None for o in outputs] == [True, False, True]
    for text in expected:
        assert text in outputs[1].error
    assert outputs[1].outputs == []
    alone = llm.generate([PROMPTS[0], PROMPTS[2]], good)
    assert _tokens([outputs[0], outputs[2]]) == _tokens(alone)
    assert all(o.error is None and o.outputs[0].token_ids for o in alone)
    # nothing is left behind: every block is back
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("good", [SamplingParams(max_tokens=6, temperature=0.0),
                                  SamplingParams(max_tokens=6, temperature=0.9, seed=3, n=2)])
def test_an_impossible_regex_fails_alone(llm, good):
    pytest.importorskip("xgrammar", reason="structured outputs need: pip install 'batchgen[structured]'")
    bad = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(regex=r"[^\s\S]"))
    _check_alone(llm, bad, good, "structured_outputs regex '[^\\\\s\\\\S]'", "can never match")


def test_an_unsatisfiable_schema_fails_alone_after_its_first_token(llm):
    pytest.importorskip("xgrammar", reason="structured outputs need: pip install 'batchgen[structured]'")
    schema = {"type": "string", "pattern": "[^\\s\\S]"}
    bad = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=1,
                         structured_outputs=StructuredOutputsParams(json=schema))
    _check_alone(llm, bad, SamplingParams(max_tokens=8, temperature=0.0), "structured_outputs JSON schema",
                 "can never match")


def test_an_impossible_constraint_on_beams_fails_alone(llm):
    pytest.importorskip("xgrammar", reason="structured outputs need: pip install 'batchgen[structured]'")
    bad = BeamSearchParams(beam_width=2, max_tokens=5, structured_outputs=StructuredOutputsParams(regex=r"[^\s\S]"))
    _check_alone(llm, bad, BeamSearchParams(beam_width=2, max_tokens=5), "structured_outputs regex", "no token")


def test_a_sampler_plugin_that_masks_everything_is_named(llm):
    proc = GuardedProcessor(_mask_all, "mask_all", "plugin 'test-masks'")
    bad = SamplingParams(max_tokens=6, logits_processors=[proc])
    _check_alone(llm, bad, SamplingParams(max_tokens=6, temperature=0.0), "sampler 'mask_all' (plugin 'test-masks')",
                 "masks every token after 0 generated token(s)")


def test_a_stateful_plugin_that_allows_nothing_is_named(llm):
    proc = GuardedStatefulProcessor(_AllowNothing(), "allow_nothing", "plugin 'test-masks'")
    bad = SamplingParams(max_tokens=6, temperature=0.7, seed=2, logits_processors=[proc])
    _check_alone(llm, bad, SamplingParams(max_tokens=6, temperature=0.7, seed=2),
                 "sampler 'allow_nothing' (plugin 'test-masks') allows no token")


def test_a_plain_processor_is_named_by_its_repr(llm):
    bad = SamplingParams(max_tokens=4, logits_processors=[_mask_all])
    (out,) = llm.generate(["Hello"], bad)
    assert "logits processor <function _mask_all" in out.error


def test_every_request_masked_fails_each_one(llm):
    bad = SamplingParams(max_tokens=4, logits_processors=[_mask_all])
    outputs = llm.generate(PROMPTS, bad)
    assert all("masks every token" in o.error for o in outputs)


def test_the_sampler_gets_the_steps_logits_uncopied_when_it_takes_them_all() -> None:
    """All the rows in order: the logits themselves (no [rows, vocab] copy); any other rows (a
    request that left the batch, a reordering): those rows, copied."""
    from batchgen.engine.core import _rows_of

    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    assert _rows_of(logits, [0, 1, 2]) is logits
    for rows in ([0, 2], [0, 1], [2, 1, 0]):
        got = _rows_of(logits, rows)
        assert torch.equal(got, logits[rows]) and got.data_ptr() != logits.data_ptr()
