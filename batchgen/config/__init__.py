"""The run configuration: YAML in, a validated :class:`RunConfig` out.

Contract:

* YAML is read with ``yaml.safe_load`` only; the top level must be a mapping.
* ``--set a.b=value`` overrides are applied to the raw mapping before validation; the value
  is parsed with ``yaml.safe_load`` so ``--set data.limit=5`` gives an int and
  ``--set prompt.system_prompt=null`` gives ``None``.
* Every section forbids unknown keys and is strict about types: an int, a float or a bool must
  be written as one (``max_tokens: true`` or ``max_tokens: "8"`` is an error; an int is a fine
  float). Byte sizes take an int or a string such as ``"512MiB"``. Validation collects *all* problems and raises one
  :class:`ConfigError` whose :attr:`ConfigError.issues` each carry a dotted key path (the same
  spelling ``--set`` accepts, e.g. ``metrics.0.options``), a message, and, for unknown keys and
  bad choices, a did-you-mean suggestion and the valid choices.
* Plugin names and options are checked too when a plugin registry is passed (duck-typed: its
  ``resolve(kind, name)`` gives the registration a bare or ``PLUGIN:NAME`` name picks, whose
  ``spec`` has an ``options_model``, or raises a ``PluginError``). The registry
  travels in pydantic's validation context so that plugin problems are reported together with
  schema problems.

The package, one noun a module: :mod:`~batchgen.config.errors`, the sections
(:mod:`~batchgen.config.sections`, :mod:`~batchgen.config.generation`,
:mod:`~batchgen.config.engine_section`), :mod:`~batchgen.config.run_config`,
:mod:`~batchgen.config.messages` (pydantic's errors in YAML's words),
:mod:`~batchgen.config.formats` (the one reader of ``data.format`` and ``output.format``:
``kinds(config)`` picks the prompt source's and the record format's kinds),
:mod:`~batchgen.config.overrides` (``--set``) and :mod:`~batchgen.config.loading`.

This package imports neither torch nor the engine: ``batchgen validate`` must stay cheap.
"""

from batchgen.config.engine_section import EngineSection, ExecutorSection, ResourcesSection
from batchgen.config.errors import ConfigError, ConfigIssue
from batchgen.config.generation import GenerationMode, GenerationSection, StructuredOutputsSection
from batchgen.config.loading import load_config, plugin_modules, read_yaml, resolved_dict, validate_config
from batchgen.config.overrides import apply_overrides, parse_override
from batchgen.config.run_config import RunConfig
from batchgen.config.sections import (
    DEFAULT_MODEL,
    DataSection,
    IfExists,
    MetricRef,
    ModelSection,
    OutputSection,
    PluginRef,
    PromptSection,
    SamplerRef,
)
from batchgen.suggest import did_you_mean

__all__ = [
    "DEFAULT_MODEL",
    "ConfigError",
    "ConfigIssue",
    "DataSection",
    "EngineSection",
    "ExecutorSection",
    "GenerationMode",
    "GenerationSection",
    "IfExists",
    "MetricRef",
    "ModelSection",
    "OutputSection",
    "PluginRef",
    "PromptSection",
    "ResourcesSection",
    "RunConfig",
    "SamplerRef",
    "StructuredOutputsSection",
    "apply_overrides",
    "did_you_mean",
    "load_config",
    "parse_override",
    "plugin_modules",
    "read_yaml",
    "resolved_dict",
    "validate_config",
]
