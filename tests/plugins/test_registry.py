"""The registry: built-ins through the public hooks, extra modules, and every error path."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from batchgen.plugins import (
    HOOK_NAMES,
    MetricSpec,
    PluginError,
    SamplerSpec,
    builtin_metrics,
    builtin_samplers,
    hookimpl,
    load_registry,
)
from batchgen.plugins.loaders import BUILTIN_METRICS_PLUGIN, BUILTIN_SAMPLERS_PLUGIN
from registry_lookup import plugin_of, safe_score, validate_options

MakeModule = Callable[[str, str], str]

GOOD_PLUGIN = """
from pydantic import BaseModel, ConfigDict, Field
from batchgen.plugins import SamplerSpec, MetricSpec, hookimpl

EVENTS = []

class MaskOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: int = Field(0, ge=0)

class MaskToken:
    def __init__(self, token):
        self.token = token
    def __call__(self, logits, output_token_ids):
        logits[:, self.token] = float("-inf")
        return logits

class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

class FirstChar:
    name = "first_char_is_a"
    def score(self, record, row):
        gens = record["generations"]
        return {"is_a": gens[0]["text"].startswith("a") if gens else None}
    def aggregate(self, scores):
        values = [s["is_a"] for s in scores if s["is_a"] is not None]
        return {"is_a": sum(values) / len(values)}

@hookimpl
def batchgen_register_samplers():
    return [SamplerSpec("mask_token", "Mask one token id.", MaskOptions, lambda o: MaskToken(o.token))]

@hookimpl
def batchgen_register_metrics():
    return [MetricSpec("first_char_is_a", "Starts with a.", NoOptions, lambda o: FirstChar())]

@hookimpl
def batchgen_run_start(config):
    EVENTS.append(("start", config["tag"]))

@hookimpl
def batchgen_record_finished(record):
    EVENTS.append(("record", record["id"]))

@hookimpl
def batchgen_run_end(summary):
    EVENTS.append(("end", summary["n"]))
"""


def test_builtins_register_through_the_public_hooks() -> None:
    registry = load_registry()
    # The built-in modules are ordinary pluggy plugins under their own names...
    assert registry.pm.get_plugin(BUILTIN_SAMPLERS_PLUGIN) is builtin_samplers
    assert registry.pm.get_plugin(BUILTIN_METRICS_PLUGIN) is builtin_metrics
    # ...whose hook implementations are the ones pluggy dispatches to...
    sampler_impls = {impl.plugin_name for impl in registry.hook.batchgen_register_samplers.get_hookimpls()}
    metric_impls = {impl.plugin_name for impl in registry.hook.batchgen_register_metrics.get_hookimpls()}
    assert BUILTIN_SAMPLERS_PLUGIN in sampler_impls
    assert BUILTIN_METRICS_PLUGIN in metric_impls
    # ...and a plain pluggy hook call returns exactly what the registry collected from them.
    hooked_samplers = {s.name: s for batch in registry.hook.batchgen_register_samplers() for s in batch}
    hooked_metrics = {m.name: m for batch in registry.hook.batchgen_register_metrics() for m in batch}
    assert {"epsilon", "top_a"} <= set(registry.samplers)
    assert {"exact_match", "contains", "regex_match", "length"} <= set(registry.metrics)
    assert set(hooked_samplers) == set(registry.samplers)
    assert set(hooked_metrics) == set(registry.metrics)
    for name, spec in registry.samplers.items():
        assert hooked_samplers[name].options_model is spec.options_model
    assert plugin_of(registry, "sampler", "epsilon") == BUILTIN_SAMPLERS_PLUGIN
    assert plugin_of(registry, "metric", "exact_match") == BUILTIN_METRICS_PLUGIN
    described = {entry["name"]: entry for entry in registry.describe()}
    assert described[BUILTIN_METRICS_PLUGIN]["source"] == "built-in"
    assert [m["name"] for m in described[BUILTIN_METRICS_PLUGIN]["metrics"]] == [
        "exact_match",
        "contains",
        "regex_match",
        "length",
        "json_valid",
        "json_schema_valid",
        "accuracy",
        "accuracy_norm",
        "perplexity",
    ]


def test_hookimpl_marker_is_pluggys() -> None:
    @hookimpl
    def batchgen_run_end(summary: dict) -> None: ...

    assert getattr(batchgen_run_end, "batchgen_impl") == {
        "wrapper": False,
        "hookwrapper": False,
        "optionalhook": False,
        "tryfirst": False,
        "trylast": False,
        "specname": None,
    }
    assert set(HOOK_NAMES) == {
        "batchgen_register_samplers",
        "batchgen_register_metrics",
        "batchgen_run_start",
        "batchgen_record_finished",
        "batchgen_run_end",
    }


def test_extra_module_contributes_sampler_metric_and_lifecycle(make_module: MakeModule) -> None:
    name = make_module("bg_good_plugin", GOOD_PLUGIN)
    registry = load_registry([name])
    assert plugin_of(registry, "sampler", "mask_token") == name
    proc = registry.build_sampler("mask_token", {"token": 2})
    out = proc(torch.zeros(3, 5), [[], [], []])
    assert torch.isinf(out[:, 2]).all() and torch.isfinite(out[:, [0, 1, 3, 4]]).all()

    metric = registry.build_metric("first_char_is_a", None)
    assert metric.name == "first_char_is_a" and metric.plugin == name
    scores = [
        metric.score({"id": i, "generations": [{"text": t}]}, {}) for i, t in enumerate(["apple", "bear", "avocado"])
    ]
    assert scores == [{"is_a": True}, {"is_a": False}, {"is_a": True}]
    assert metric.aggregate(scores) == pytest.approx({"is_a": 2 / 3})

    module = sys.modules[name]
    registry.notify("batchgen_run_start", config={"tag": "t"})
    registry.notify("batchgen_record_finished", record={"id": "r1"})
    registry.notify("batchgen_run_end", summary={"n": 1})
    assert module.EVENTS == [("start", "t"), ("record", "r1"), ("end", 1)]

    entry = next(e for e in registry.describe() if e["name"] == name)
    assert entry["source"] == "module" and entry["distribution"] is None
    assert entry["samplers"] == [
        {
            "name": "mask_token",
            "qualified_name": f"{name}:mask_token",
            "description": "Mask one token id.",
            "options": [
                {"name": "token", "type": "int", "constraints": ">= 0", "required": False, "default": 0, "description": None}
            ],
            "clash": None,
        }
    ]
    assert entry["hooks"] == ["batchgen_record_finished", "batchgen_run_end", "batchgen_run_start"]


def test_sampler_returning_nan_or_inf_is_named(make_module: MakeModule) -> None:
    name = make_module("bg_nan_plugin", GOOD_PLUGIN)
    proc = load_registry([name]).build_sampler("mask_token", {"token": 2})
    for bad, what in ((float("nan"), "NaN"), (float("inf"), "+inf")):
        logits = torch.zeros(3, 5)
        logits[1, 4] = bad
        with pytest.raises(PluginError) as info:
            proc(logits, [[], [], []])
        assert str(info.value) == (
            f"sampler 'mask_token' (plugin '{name}' (module)) returned {what} logits in row(s) [1]; "
            "a processor may only lower logits (use -inf to mask a token)"
        )
    out = proc(torch.zeros(3, 5), [[], [], []])  # -inf is a mask, not an error
    assert torch.isneginf(out[:, 2]).all()


def test_same_module_listed_twice_registers_once(make_module: MakeModule) -> None:
    name = make_module("bg_twice", GOOD_PLUGIN)
    registry = load_registry([name, name])
    assert [e["name"] for e in registry.describe()].count(name) == 1


def test_missing_module_is_named() -> None:
    with pytest.raises(PluginError) as info:
        load_registry(["bg_no_such_plugin_module"])
    assert str(info.value) == (
        "plugin module 'bg_no_such_plugin_module' (from the config's 'plugins' list) was not found; "
        "install it or put it on PYTHONPATH"
    )
    assert info.value.plugin == "bg_no_such_plugin_module"


def test_module_whose_import_fails_is_named(make_module: MakeModule) -> None:
    name = make_module("bg_broken_import", "import bg_dependency_that_is_not_there\n")
    with pytest.raises(PluginError, match=r"plugin module 'bg_broken_import' failed to import: "
                       r"ModuleNotFoundError: No module named 'bg_dependency_that_is_not_there'"):
        load_registry([name])
    name = make_module("bg_raises_on_import", "raise RuntimeError('no config file')\n")
    with pytest.raises(PluginError, match=r"plugin module 'bg_raises_on_import' failed to import: RuntimeError: no config file"):
        load_registry([name])


def test_misspelt_hook_is_named(make_module: MakeModule) -> None:
    name = make_module(
        "bg_typo",
        """
        from batchgen.plugins import hookimpl
        @hookimpl
        def batchgen_register_metric():
            return []
        """,
    )
    with pytest.raises(PluginError) as info:
        load_registry([name])
    message = str(info.value)
    assert message.startswith("plugin 'bg_typo' (module): unknown hook 'batchgen_register_metric'")
    assert "Known hooks: batchgen_register_samplers, batchgen_register_metrics" in message


def test_hook_with_wrong_arguments_is_named(make_module: MakeModule) -> None:
    name = make_module(
        "bg_bad_args",
        """
        from batchgen.plugins import hookimpl
        @hookimpl
        def batchgen_run_start(cfg):
            pass
        """,
    )
    with pytest.raises(PluginError, match=r"plugin module 'bg_bad_args' has an invalid hook implementation: .*cfg"):
        load_registry([name])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "return [{'name': 'x'}]",
            "plugin 'bg_bad_spec' (module) returned dict instead of a MetricSpec",
        ),
        (
            "return MetricSpec('x', 'd', NoOpts, lambda o: None)",
            "plugin 'bg_bad_spec' (module): batchgen_register_metrics must return a list of MetricSpec, got MetricSpec",
        ),
        (
            "return [MetricSpec(' x', 'd', NoOpts, lambda o: None)]",
            "plugin 'bg_bad_spec' (module) registered a metric with an invalid name ' x'",
        ),
        (
            "return [MetricSpec('x', 'd', dict, lambda o: None)]",
            "plugin 'bg_bad_spec' (module) metric 'x': options_model must be a pydantic BaseModel subclass",
        ),
        (
            "return [MetricSpec('x', 'd', NoOpts, 'not callable')]",
            "plugin 'bg_bad_spec' (module) metric 'x': factory is not callable",
        ),
        (
            "raise KeyError('boom')",
            "plugin 'bg_bad_spec' (module) failed in batchgen_register_metrics: KeyError: 'boom'",
        ),
    ],
)
def test_malformed_registration_is_named(make_module: MakeModule, body: str, expected: str) -> None:
    name = make_module(
        "bg_bad_spec",
        f"""
        from pydantic import BaseModel
        from batchgen.plugins import MetricSpec, hookimpl
        class NoOpts(BaseModel):
            pass
        @hookimpl
        def batchgen_register_metrics():
            {body}
        """,
    )
    with pytest.raises(PluginError) as info:
        load_registry([name])
    assert str(info.value) == expected
    assert info.value.plugin == "bg_bad_spec"


def test_unknown_names_suggest_and_list() -> None:
    registry = load_registry()
    with pytest.raises(PluginError) as info:
        registry.build_sampler("epsilonn", {})
    installed = ", ".join(f"'{name}'" for name in sorted(registry.samplers))
    assert "'epsilon', " in installed and "'top_a'" in installed
    assert str(info.value) == f"unknown sampler plugin 'epsilonn' (did you mean 'epsilon'?); installed: {installed}"
    with pytest.raises(PluginError) as info:
        registry.build_metric("bleu", {})
    assert "did you mean" not in str(info.value)
    assert "; installed: " in str(info.value) and "'exact_match'" in str(info.value)
    # A qualified name is suggested like a bare one.
    with pytest.raises(PluginError, match=r"^unknown metric plugin 'batchgen:exact_mach' \(did you mean 'batchgen:exact_match'\?\)"):
        registry.build_metric("batchgen:exact_mach", {})


def test_invalid_options_name_the_plugin_and_every_field() -> None:
    registry = load_registry()
    with pytest.raises(PluginError) as info:
        registry.build_sampler("epsilon", {"epsilon": 2})
    assert str(info.value) == (
        "sampler 'epsilon' (plugin 'batchgen-builtin-samplers' (built-in)): invalid options:\n"
        "  epsilon: Input should be less than 1 (got 2)"
    )
    assert info.value.plugin == BUILTIN_SAMPLERS_PLUGIN
    with pytest.raises(PluginError) as info:
        registry.build_metric("exact_match", {"referense": "a", "lowercase": "maybe"})
    lines = str(info.value).splitlines()
    assert lines[0] == "metric 'exact_match' (plugin 'batchgen-builtin-metrics' (built-in)): invalid options:"
    assert lines[1] == "  lowercase: Input should be a valid boolean, unable to interpret input (got 'maybe')"
    assert lines[2].startswith("  referense: unknown option (did you mean 'reference'?). Allowed options: lowercase, ")
    assert lines[2].endswith(", reference.")
    with pytest.raises(PluginError, match=r"^metric 'length' \(plugin 'batchgen-builtin-metrics' \(built-in\)\): "
                       r"options must be a mapping, got list$"):
        registry.build_metric("length", [1])
    # Options validate against the model without building the sampler.
    assert validate_options(registry, "sampler", "top_a", {"a": 0.5}).a == 0.5


FAILING = """
from pydantic import BaseModel
from batchgen.plugins import MetricSpec, SamplerSpec, hookimpl

class NoOpts(BaseModel):
    pass

def bad_factory(options):
    raise ValueError("needs a GPU")

class Crashy:
    name = "crashy"
    def score(self, record, row):
        return {"ratio": 1 / len(record["generations"])}
    def aggregate(self, scores):
        raise RuntimeError("nothing to fold")

class Weird:
    name = "weird"
    def score(self, record, row):
        return {"label": "yes"}
    def aggregate(self, scores):
        return {"nan": float("nan")}

def crash_proc(logits, output_token_ids):
    raise IndexError("token 99999 out of range")

def shrink_proc(logits, output_token_ids):
    return logits[:, :2]

@hookimpl
def batchgen_register_samplers():
    return [
        SamplerSpec("crash_proc", "d", NoOpts, lambda o: crash_proc),
        SamplerSpec("shrink_proc", "d", NoOpts, lambda o: shrink_proc),
        SamplerSpec("not_callable", "d", NoOpts, lambda o: 42),
    ]

@hookimpl
def batchgen_register_metrics():
    return [
        MetricSpec("bad_factory", "d", NoOpts, bad_factory),
        MetricSpec("crashy", "d", NoOpts, lambda o: Crashy()),
        MetricSpec("weird", "d", NoOpts, lambda o: Weird()),
        MetricSpec("not_a_metric", "d", NoOpts, lambda o: object()),
    ]

@hookimpl
def batchgen_run_end(summary):
    raise OSError("disk full")
"""


def test_crashing_plugin_code_is_named(make_module: MakeModule) -> None:
    name = make_module("bg_failing", FAILING)
    registry = load_registry([name])
    where = "(plugin 'bg_failing' (module))"

    with pytest.raises(PluginError) as info:
        registry.build_metric("bad_factory", {})
    assert str(info.value) == f"metric 'bad_factory' {where} could not be built: ValueError: needs a GPU"
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(PluginError, match=r"factory returned object, expected an object with score\(\) and aggregate\(\)"):
        registry.build_metric("not_a_metric", {})
    with pytest.raises(PluginError, match=r"factory returned int, expected a callable logits processor"):
        registry.build_sampler("not_callable", {})

    crashy = registry.build_metric("crashy", {})
    record = {"id": "q-7", "generations": []}
    with pytest.raises(PluginError) as info:
        crashy.score(record, {})
    assert str(info.value) == f"metric 'crashy' {where} failed on record 'q-7': ZeroDivisionError: division by zero"
    # safe_score (tests' registry_lookup) gives the same message, also for a metric object built by hand.
    with pytest.raises(PluginError, match="failed on record 'q-7': ZeroDivisionError"):
        safe_score(crashy, record, {})
    with pytest.raises(PluginError, match=r"^metric 'crashy' \(metric object Crashy\) failed on record 'q-7'"):
        safe_score(sys.modules[name].Crashy(), record, {})
    with pytest.raises(PluginError, match=f"^metric 'crashy' {where.replace('(', '[(]').replace(')', '[)]')} "
                       "failed to aggregate: RuntimeError: nothing to fold$"):
        crashy.aggregate([])

    weird = registry.build_metric("weird", {})
    with pytest.raises(PluginError) as info:
        weird.score({"id": 1, "generations": []}, {})
    assert str(info.value) == (
        f"metric 'weird' {where} returned str 'yes' for key 'label', expected float, int, bool or None"
    )
    assert weird.aggregate([]) == {"nan": None}  # non-finite values never reach the JSON output

    with pytest.raises(PluginError) as info:
        registry.build_sampler("crash_proc", {})(torch.zeros(1, 4), [[]])
    assert str(info.value) == f"sampler 'crash_proc' {where} failed: IndexError: token 99999 out of range"
    with pytest.raises(PluginError) as info:
        registry.build_sampler("shrink_proc", {})(torch.zeros(2, 4), [[], []])
    assert str(info.value) == (
        f"sampler 'shrink_proc' {where} returned torch.Size([2, 2]), expected a tensor of shape (2, 4)"
    )

    with pytest.raises(PluginError) as info:
        registry.notify("batchgen_run_end", summary={})
    assert str(info.value) == f"plugin 'bg_failing' (module) failed in batchgen_run_end: OSError: disk full"
    with pytest.raises(ValueError, match="'batchgen_register_metrics' is not a lifecycle hook"):
        registry.notify("batchgen_register_metrics")


def test_notify_calls_plugins_in_pluggy_order(make_module: MakeModule) -> None:
    source = """
    from batchgen.plugins import hookimpl
    LOG = []
    @hookimpl
    def batchgen_run_start(config):
        LOG.append(__name__)
    """
    first, second = make_module("bg_order_a", source), make_module("bg_order_b", source)
    registry = load_registry([first, second])
    registry.notify("batchgen_run_start", config={})
    # pluggy calls the last registered plugin first; notify keeps that order.
    assert sys.modules[first].LOG == [first] and sys.modules[second].LOG == [second]
    order = [impl.plugin_name for impl in reversed(registry.hook.batchgen_run_start.get_hookimpls())]
    assert order == [second, first]


def test_no_torch_import_when_loading_and_scoring() -> None:
    code = (
        "import sys\n"
        "import batchgen.metrics\n"
        "from batchgen.plugins import load_registry\n"
        "r = load_registry()\n"
        "r.build_sampler('epsilon', {}); r.build_sampler('typical', {})\n"
        "m = r.build_metric('exact_match', {})\n"
        "m.score({'id': 1, 'generations': [{'text': 'x'}]}, {'answer': 'x'})\n"
        "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_specs_are_frozen_records() -> None:
    spec = SamplerSpec("s", "d", builtin_samplers.EpsilonOptions, builtin_samplers._epsilon)
    with pytest.raises(AttributeError):
        spec.name = "t"  # type: ignore[misc]
    assert MetricSpec("m", "d", builtin_metrics.LengthOptions, lambda o: None).name == "m"


def test_entry_point_plugins_carry_their_distribution(make_module: MakeModule, make_distribution) -> None:
    make_module("bg_ep_good", GOOD_PLUGIN)
    make_distribution("bg-ep-good", "2.3.4", "epgood = bg_ep_good")
    registry = load_registry()
    entry = next(e for e in registry.describe() if e["name"] == "epgood")
    assert (entry["source"], entry["distribution"], entry["version"], entry["module"]) == (
        "entry point", "bg-ep-good", "2.3.4", "bg_ep_good",
    )
    with pytest.raises(PluginError) as info:
        registry.build_sampler("mask_token", {"token": -1})
    assert str(info.value).startswith(
        "sampler 'mask_token' (plugin 'epgood' from bg-ep-good 2.3.4): invalid options:\n  token: "
    )


def test_entry_point_that_fails_to_load_is_named(make_module: MakeModule, make_distribution) -> None:
    make_module("bg_ep_broken", "raise ImportError('libfoo.so: cannot open shared object file')\n")
    make_distribution("bg-ep-broken", "0.9", "epbroken = bg_ep_broken")
    with pytest.raises(PluginError) as info:
        load_registry()
    assert str(info.value) == (
        "plugin 'epbroken' (entry point 'bg_ep_broken' from bg-ep-broken 0.9) failed to load: "
        "ImportError: libfoo.so: cannot open shared object file"
    )
    assert info.value.plugin == "epbroken"


def test_two_distributions_with_one_plugin_name_both_load(make_module: MakeModule, make_distribution,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    masker = """
    from pydantic import BaseModel
    from batchgen.plugins import SamplerSpec, hookimpl
    class O(BaseModel):
        pass
    @hookimpl
    def batchgen_register_samplers():
        return [SamplerSpec("mask_{t}", "", O, lambda o: lambda logits, ids: logits)]
    """
    make_module("bg_ep_one", masker.replace("{t}", "one"))
    make_module("bg_ep_two", masker.replace("{t}", "two"))
    make_distribution("bg-ep-one", "1.0", "clash = bg_ep_one")
    make_distribution("bg-ep-two", "1.0", "clash = bg_ep_two")
    with caplog.at_level("WARNING", logger="batchgen.plugins"):
        registry = load_registry()
    # Which one entry point is found first is importlib's order; the other goes by its distribution's name.
    entries = {e["name"]: e for e in registry.describe() if e["distribution"] in ("bg-ep-one", "bg-ep-two")}
    (first,) = [e for e in entries.values() if e["name"] == "clash"]
    (second,) = [e for e in entries.values() if e["name"] != "clash"]
    assert second["name"] == second["distribution"] and second["source"] == "entry point"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == 30]
    assert warning.startswith("batchgen: warning: plugin 'clash' (entry point 'bg_ep_")
    assert f"is registered as '{second['name']}', so write '{second['name']}:NAME'" in warning
    for entry in (first, second):
        (sampler,) = entry["samplers"]
        assert plugin_of(registry, "sampler", sampler["name"]) == entry["name"]
        assert plugin_of(registry, "sampler", f"{entry['distribution']}:{sampler['name']}") == entry["name"]
