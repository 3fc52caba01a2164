"""Structured outputs without a model: the params, the up-front check, the config key, and the
stateful-processor contract (bitmask layout, batched application, guarded plugin calls)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from batchgen import BeamSearchParams, SamplingParams, StructuredOutputsParams
from batchgen.config import ConfigError, resolved_dict, validate_config
from batchgen.plugins import PluginError, StatefulLogitsProcessor, allow_only
from batchgen.plugins import GuardedStatefulProcessor
from batchgen.sampling.sampler import Sampler, SamplingRow
from batchgen.sampling.stateful import apply_stateful, unpack_bitmask

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BASE = {"data": {"source": "rows.jsonl"}, "output": {"path": "out.jsonl"}}
needs_xgrammar = pytest.mark.skipif(
    __import__("importlib").util.find_spec("xgrammar") is None, reason="needs pip install 'batchgen[structured]'")


def test_exactly_one_constraint_and_a_canonical_key():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, json_object"):
        StructuredOutputsParams(regex="a", json_object=True)
    with pytest.raises(ValueError, match="choice must be a list of strings"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="JSON schema object"):
        StructuredOutputsParams(json="[1, 2]")
    # A schema as a mapping and as text in another key order is one constraint (one compile).
    assert (StructuredOutputsParams(json=SCHEMA).key
            == StructuredOutputsParams(json=json.dumps(dict(reversed(list(SCHEMA.items()))))).key)
    assert StructuredOutputsParams(json=SCHEMA).key != StructuredOutputsParams(json={"type": "object"}).key
    assert StructuredOutputsParams(choice=["x", "y"]).kind == "choice"


def test_params_take_the_constraint_in_every_mode():
    so = StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert BeamSearchParams(beam_width=2, structured_outputs={"choice": ["a"]}).structured_outputs.choice == ["a"]
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs=so, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        BeamSearchParams(beam_width=2, min_tokens=1, structured_outputs=so)


@needs_xgrammar
@pytest.mark.parametrize("constraint,message", [
    (StructuredOutputsParams(json={"type": "nope"}), "invalid JSON schema: Unsupported type"),
    (StructuredOutputsParams(regex="a(b"), "invalid regex: .*parenthesis"),
    (StructuredOutputsParams(grammar="root ::= "), "invalid grammar: EBNF parser error"),
])
def test_check_names_what_is_invalid(constraint, message):
    from batchgen.structured import check

    with pytest.raises(ValueError, match=message):
        check(constraint)
    check(StructuredOutputsParams(choice=['say "hi"', "back\\slash", "ünï"]))  # escapes compile


def test_a_missing_grammar_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    from batchgen.structured import check

    with pytest.raises(ImportError, match=r"pip install 'batchgen\[structured\]'"):
        check(StructuredOutputsParams(regex="a"))
    with pytest.raises(ConfigError) as err:
        validate_config({**BASE, "generation": {"structured_outputs": {"regex": "a"}}})
    assert "generation.structured_outputs.regex: structured outputs need the grammar library xgrammar" in str(err.value)


@needs_xgrammar
@pytest.mark.parametrize("so,path,message", [
    ({"json": {"type": "nope"}}, "generation.structured_outputs.json", "invalid JSON schema"),
    ({"regex": "(("}, "generation.structured_outputs.regex", "invalid regex"),
    ({"grammar": "root ::= x"}, "generation.structured_outputs.grammar", "invalid grammar"),
    ({"choice": []}, "generation.structured_outputs.choice", "at least 1 item"),
    ({"json": "no/such/schema.json"}, "generation.structured_outputs.json", "does not exist"),
    ({"regex": "a", "choice": ["a"]}, "generation.structured_outputs", "exactly one of"),
    ({"jsn": {}}, "generation.structured_outputs.jsn", "did you mean 'json'"),
])
def test_bad_constraints_are_config_errors_naming_the_key(so, path, message):
    with pytest.raises(ConfigError) as err:
        validate_config({**BASE, "generation": {"structured_outputs": so}})
    (issue,) = err.value.issues
    assert issue.path == path and message in issue.message


@needs_xgrammar
def test_a_schema_file_is_read_and_recorded_as_the_schema(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("schema.json").write_text(json.dumps(SCHEMA))
    for mode in ("greedy", "sample", "beam"):
        config = validate_config({**BASE, "generation": {"mode": mode, "structured_outputs": {"json": "schema.json"}}})
        from batchgen.run.rows import build_params

        assert build_params(config.generation).structured_outputs == StructuredOutputsParams(json=SCHEMA)
    dumped = resolved_dict(config)["generation"]
    assert dumped["structured_outputs"]["json"] == SCHEMA
    assert validate_config({**BASE, "generation": dumped}).generation.structured_outputs.json_ == SCHEMA
    with pytest.raises(ConfigError, match="decides where the output ends: drop 'min_tokens'"):
        validate_config({**BASE, "generation": {"min_tokens": 2, "structured_outputs": {"json_object": True}}})


# ----------------------------------------------------------------------------- the contract


class _Count:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def fork(self) -> _Count:
        return _Count(self.n)

    def accept_token(self, token_id: int) -> None:
        self.n += 1


class _Only(StatefulLogitsProcessor):
    """Allows a fixed set of tokens, and records how it was called."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed
        self.calls: list[list[int]] = []

    def new_state(self, prompt_token_ids, params):
        return _Count()

    def fill_mask(self, states, bitmask, rows):
        self.calls.append(list(rows))
        for row in rows:
            allow_only(bitmask, row, self.allowed)


class _Shift(StatefulLogitsProcessor):
    def new_state(self, prompt_token_ids, params):
        return _Count()

    def process(self, logits, states):
        return logits - torch.tensor([[float(s.n)] for s in states])


def test_allow_only_packs_bits_as_the_engine_unpacks_them():
    bitmask = torch.full((2, 3), -1, dtype=torch.int32)
    allow_only(bitmask, 1, [0, 31, 32, 63, 70])  # bit 31: the int32 sign bit
    allowed = unpack_bitmask(bitmask, 80)
    assert bool(allowed[0].all())
    assert allowed[1].nonzero().flatten().tolist() == [0, 31, 32, 63, 70]


def test_masks_are_batched_anded_and_leave_other_rows_alone():
    first, second, edit = _Only([1, 2, 3]), _Only([2, 3, 9]), _Shift()
    x = torch.zeros(4, 10)
    states = [[_Count(), _Count()], [], [_Count(), _Count(5)], [_Count(7)]]
    apply_stateful(x, [[first, second], [], [first, edit], [edit]], states)
    # Row 0 has both masks (ANDed), row 2 the first mask and the edit, row 1 nothing at all.
    assert torch.isfinite(x[0]).nonzero().flatten().tolist() == [2, 3]
    assert torch.equal(x[1], torch.zeros(10))
    assert torch.isfinite(x[2]).nonzero().flatten().tolist() == [1, 2, 3] and x[2, 1].item() == -5.0
    assert torch.equal(x[3], torch.full((10,), -7.0))
    assert first.calls == [[0, 1]] and second.calls == [[0]]  # one call per processor and layer


def test_the_sampler_applies_stateful_processors_only_to_their_rows():
    proc = _Only([4])
    logits = torch.randn(3, 10)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None, processors=[proc], states=[_Count()]),
            SamplingRow(SamplingParams(temperature=0.0), [1], [], None),
            SamplingRow(SamplingParams(temperature=1.0, seed=0), [1], [], torch.Generator().manual_seed(0),
                        processors=[proc], states=[_Count()])]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == 4 and out.token_ids[2] == 4
    assert out.token_ids[1] == int(logits[1].argmax())


def test_plugin_failures_in_stateful_calls_name_the_plugin():
    class Broken(_Only):
        def new_state(self, prompt_token_ids, params):
            state = _Count()
            state.accept_token = lambda token_id: 1 / 0  # type: ignore[method-assign]
            return state

    guarded = GuardedStatefulProcessor(Broken([1]), "broken", "plugin 'x' (module)")
    state = guarded.new_state([1], SamplingParams())
    with pytest.raises(PluginError, match=r"sampler 'broken' \(plugin 'x' \(module\)\) failed in accept_token\(3\)"):
        state.accept_token(3)
    assert isinstance(state.fork(), type(state))  # forks stay guarded
    assert guarded.masks and not guarded.edits


IDLE_PLUGIN = """
from pydantic import BaseModel
from batchgen.plugins import SamplerSpec, StatefulLogitsProcessor, hookimpl


class NoOptions(BaseModel):
    pass


class Idle(StatefulLogitsProcessor):
    def new_state(self, prompt_token_ids, params):
        return None


@hookimpl
def batchgen_register_samplers():
    return [SamplerSpec("idle", "does nothing", NoOptions, lambda options: Idle())]
"""


def test_a_stateful_processor_that_acts_in_no_way_is_refused(tmp_path, monkeypatch):
    from batchgen.plugins import load_registry

    (tmp_path / "bg_idle.py").write_text(IDLE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"sampler 'idle' \(plugin 'bg_idle' \(module\)\): Idle overrides neither"):
        load_registry(["bg_idle"]).build_sampler("idle", {})
    monkeypatch.delitem(sys.modules, "bg_idle")
