"""Validation and normalisation of SamplingParams and BeamSearchParams."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.sampling.params import BeamSearchParams, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.logits_processors == []
    assert p.skip_special_tokens and not p.ignore_eos
    assert p.best_of_ranking == "sum"
    assert not p.is_greedy and not p.has_penalties
    assert p.num_sequences == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1"),
        ({"n": 1.5}, "n must be an integer"),
        ({"n": True}, "n must be an integer"),
        ({"n": 3, "best_of": 2}, r"best_of must be >= n \(3\)"),
        ({"best_of_ranking": "max"}, "best_of_ranking must be 'sum' or 'mean'"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("inf")}, "temperature must be finite"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, r"top_k must be 0 or -1 \(disabled\), or >= 1"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"seed": 2**64}, "seed must be an integer in"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"stop": [""]}, "stop must be a string or a list of non-empty strings"),
        ({"stop": ["a", 3]}, "stop must be a string or a list of non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of token ids >= 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 9, "max_tokens": 8}, r"min_tokens must be <= max_tokens \(8\)"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"ignore_eos": 1}, "ignore_eos must be True or False"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be True or False"),
        ({"logits_processors": ["nope"]}, "logits_processors must hold callables"),
    ],
)
def test_sampling_params_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalises() -> None:
    p = SamplingParams(stop="###", stop_token_ids=7, temperature=1, top_k=-1,
                       logits_processors=(lambda logits, ids: logits,))
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7]
    assert isinstance(p.temperature, float)
    assert isinstance(p.logits_processors, list) and len(p.logits_processors) == 1
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []


def test_is_greedy_and_num_sequences() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5, top_k=2).is_greedy
    assert SamplingParams(n=2, best_of=5).num_sequences == 5
    assert SamplingParams(n=3).num_sequences == 3
    assert SamplingParams(frequency_penalty=0.1).has_penalties


def test_beam_params_defaults_and_resolution() -> None:
    b = BeamSearchParams(beam_width=4)
    assert b.num_return_sequences == 4
    assert (b.max_tokens, b.length_penalty, b.early_stopping, b.min_tokens) == (16, 1.0, False, 0)
    b = BeamSearchParams(beam_width=4, num_return_sequences=2, early_stopping="never", stop="\n")
    assert b.num_return_sequences == 2 and b.stop == ["\n"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 0}, "beam_width must be >= 1"),
        ({"beam_width": 2, "num_return_sequences": 3},
         r"num_return_sequences must be in \[1, beam_width \(2\)\]"),
        ({"beam_width": 2, "num_return_sequences": 0}, "num_return_sequences must be in"),
        ({"beam_width": 2, "early_stopping": "always"}, "early_stopping must be True, False or 'never'"),
        ({"beam_width": 2, "length_penalty": float("nan")}, "length_penalty must be finite"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be >= 1"),
        ({"beam_width": 2, "min_tokens": 20}, r"min_tokens must be <= max_tokens \(16\)"),
        ({"beam_width": 2, "stop_token_ids": ["x"]}, "stop_token_ids must be a list of token ids"),
    ],
)
def test_beam_params_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**kwargs)


def test_params_and_package_do_not_import_torch() -> None:
    code = ("import sys; import batchgen.sampling, batchgen.sampling.params; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_package_exports_resolve_lazily_and_unknown_names_fail() -> None:
    import batchgen.sampling as sampling

    assert sampling.SamplingParams is SamplingParams
    from batchgen.sampling.beam_ranking import BeamSearchState

    assert sampling.BeamSearchState is BeamSearchState
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        sampling.Nope  # noqa: B018
