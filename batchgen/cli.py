"""The ``batchgen`` command line.

Commands:

* ``batchgen run CONFIG [--set KEY=VALUE ...] [--resume | --force-resume | --overwrite]
  [--max-error-rate RATE] [--quiet]``
* ``batchgen batch INPUT -o OUTPUT [--model M | --model NAME=M] [--error-file FILE]
  [--resume | --force-resume | --overwrite] [--max-error-rate RATE] [--set KEY=VALUE ...] [--quiet]``:
  an OpenAI Batch API file in, OpenAI response lines out.
* ``batchgen validate CONFIG [--set KEY=VALUE ...]``: every check that needs no model run.
* ``batchgen plugins [--json]``: what is installed, what each plugin registers, and its options.
* ``batchgen tokenize MODEL TEXT [--json]``: the token ids of TEXT under MODEL's tokenizer (for
  plugin options such as a banned token id).
* ``batchgen --version``.

Exit status: 0 ok; 1 runtime failure; 2 config or usage error (argparse's own usage errors
included, and an output in use by another run); 3 the run finished but no record succeeded,
``--max-error-rate`` stopped it, or more rows failed than ``--max-failed-rows`` allows (0 by
default for a scoring job; ``validate`` applies it to the rows it samples); 128 + the signal's
number when a signal stopped it (130 for SIGINT / Ctrl-C, 143 for SIGTERM). Errors go to stderr
as one ``batchgen: error: ...`` line, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from batchgen.integrations.lm_eval_command import main as lm_eval_main
from batchgen.quiet import quiet_libraries, quiet_notices

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_RECORDS_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM gives 143

# Rows rendered by ``validate`` to catch template errors before a run.
VALIDATE_ROWS = 5
# Rows a scoring job's ``validate`` checks (its answers against its choices), before the model loads.
VALIDATE_SCORING_ROWS = 20


#: Where ``--help`` sends a reader (docs/ in the source tree, or on the project's page).
_HELP_EPILOG = """\
start with:  batchgen run configs/quickstart.yaml   (an example job; bash scripts/quickstart.sh sets it up)
every key:   docs/config.md        OpenAI batch files: docs/openai-batch.md
evaluation:  docs/evaluation.md    plugins: docs/plugins.md    GGUF files: docs/gguf.md
exit status: 0 ok, 1 runtime failure, 2 config or usage error, 3 no record succeeded, 128+N a signal"""

_RUN_EPILOG = """\
CONFIG is a YAML job: which model (model.name), which rows (data.source), how a row becomes a
prompt (prompt), how to generate (generation) and where the records go (output.path), e.g.

  model: {name: smollm2-135m-instruct}
  data: {source: rows.jsonl}
  prompt: {column: prompt}
  generation: {mode: greedy, max_tokens: 64}
  output: {path: out/results.jsonl}

configs/quickstart.yaml is a complete one and configs/ holds more; docs/config.md lists every key.
batchgen validate CONFIG checks one without loading the model. Records are written in the order
they finish, one JSON line each; sort them by "id" (or "index") when the order matters."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchgen",
        description="Offline batch generation for LLMs over a paged KV cache: a YAML job in, JSON lines out.",
        epilog=_HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"batchgen {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def config_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", metavar="CONFIG", help="the run's YAML file")
        _failed_rows_arg(p)
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set data.limit=5 (VALUE is parsed as YAML); repeatable",
        )

    def run_args(p: argparse.ArgumentParser, ids: str) -> None:
        mode = p.add_mutually_exclusive_group()
        mode.add_argument("--resume", action="store_true", help=f"skip the {ids} already in the output file")
        mode.add_argument(
            "--force-resume",
            action="store_true",
            help="resume even though the earlier run's generation config differs (records of both kinds end up in one file)",
        )
        mode.add_argument("--overwrite", action="store_true", help="start the output file over")
        p.add_argument(
            "--max-error-rate",
            type=_rate,
            default=None,
            metavar="RATE",
            help="stop (exit 3) once more than this share (0..1) of the records written are errors, "
            "checked from the 10th record on",
        )
        p.add_argument("--quiet", "-q", action="store_true", help="no progress output and no final report")

    run = sub.add_parser("run", help="generate for every row of the dataset",
                         description="Generate (or score) for every row of the job's dataset and write one record per row.",
                         epilog=_RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_args(run)
    run_args(run, "ids")

    batch = sub.add_parser(
        "batch", help="answer an OpenAI Batch API input file (a drop-in for 'vllm run-batch')",
        description="Answer every line of an OpenAI Batch API input file (/v1/chat/completions and "
        "/v1/completions) and write OpenAI-shaped output lines as they finish. A bad line gets its own "
        "status-400 output line; the others run.",
    )
    batch.add_argument("input", metavar="INPUT", help="the batch input file (JSONL)")
    batch.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="the output file (JSONL)")
    batch.add_argument(
        "--model", dest="models", action="append", default=[], metavar="MODEL | NAME=MODEL",
        help="the model to run (default: the embedded SmolLM2-135M-Instruct); NAME=MODEL also answers "
        "lines whose 'model' is NAME with MODEL; repeatable",
    )
    batch.add_argument(
        "--lora", dest="loras", action="append", default=[], metavar="NAME=PATH",
        help="a LoRA adapter (PEFT folder) that lines whose 'model' is NAME run under, as vllm serve "
        "--lora-modules; repeatable",
    )
    batch.add_argument("--error-file", metavar="FILE", help="write failed requests here instead of to OUTPUT")
    batch.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set engine.max_num_seqs=64 (VALUE is parsed as YAML); repeatable",
    )
    _failed_rows_arg(batch)
    run_args(batch, "custom_ids")

    validate = sub.add_parser("validate", help="check a config without running the model")
    config_args(validate)

    sub.add_parser("lm-eval", add_help=False, help="lm-evaluation-harness with batchgen as its model: "
                   "batchgen lm-eval --model batchgen --tasks ... (docs/evaluation.md; 'batchgen lm-eval --help' "
                   "for its options)")
    tokenize = sub.add_parser("tokenize", help="print the token ids of a text under a model's tokenizer",
                              description="Print the token ids of TEXT under MODEL's tokenizer (a built-in name, a "
                              "folder, a .gguf file or a hub id), one id and its token a line, as a prompt is "
                              "encoded without a chat template.")
    tokenize.add_argument("model", metavar="MODEL", help="e.g. smollm2-135m-instruct")
    tokenize.add_argument("text", metavar="TEXT", help="the text to encode")
    tokenize.add_argument("--json", action="store_true", help='print {"ids": [...], "tokens": [...]}')
    tokenize.add_argument("--no-special-tokens", dest="special", action="store_false",
                          help="do not add the tokenizer's special tokens (a BOS, for models that use one)")
    plugins = sub.add_parser("plugins", help="list installed plugins and what they register")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.add_argument("--plugin", dest="modules", action="append", default=[], metavar="MODULE",
                         help="also load this plugin module (as the config's 'plugins:' list does)")
    return parser


def _version() -> str:
    # deferred: importlib.metadata only for --version
    from importlib import metadata

    try:
        return metadata.version("batchgen")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "unknown"


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def _failed_rows_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-failed-rows", type=_count, default=None, metavar="N",
        help="exit 3 when more than N rows failed (their error records are written); default 0 for "
        "a scoring job (generation.mode loglikelihood/perplexity), no limit for a generation job",
    )


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of rows (0 or more), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of rows (0 or more), got {text!r}")
    return value


def _error(message: str, stream: TextIO | None = None) -> None:
    print(f"batchgen: error: {message}", file=stream or sys.stderr)


def _note(message: str) -> None:
    print(f"batchgen: {message}", file=sys.stderr)


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """Read the YAML once, build the plugin registry from its ``plugins:`` and validate it
    (raises SETUP_ERRORS)."""
    # deferred (start-up): the config stack (pydantic, yaml; ~0.7 s) only for the commands that read one
    from batchgen.config import apply_overrides, read_yaml

    return _validated(apply_overrides(read_yaml(args.config), args.overrides), str(args.config))


def _validated(data: dict[str, Any], source: str) -> tuple[Any, Any]:
    """The registry of ``data``'s plugin modules, and ``data`` validated against it."""
    # deferred (start-up): the config and plugin stacks (pydantic, pluggy; ~1 s) only when a config is read
    from batchgen.config import validate_config
    from batchgen.plugins import load_registry

    modules = data.get("plugins") if isinstance(data.get("plugins"), list) else []
    registry = load_registry([m for m in modules if isinstance(m, str)])
    return registry, validate_config(data, registry=registry, source=source)


def _batch_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """The job of ``batchgen batch``: a config built from its flags, then ``--set`` applied."""
    # deferred (start-up): the config stack (~0.7 s) only when a config is read
    from batchgen.config import ConfigError, ConfigIssue, apply_overrides

    output: dict[str, Any] = {"path": args.output, "format": "openai_batch"}
    if args.error_file:
        output["error_path"] = args.error_file
    raw: dict[str, Any] = {"data": {"source": args.input, "format": "openai_batch"}, "output": output}
    targets, aliases = [], []
    for spec in args.models:
        name, sep, target = spec.partition("=")
        if sep and not (name and target):
            raise ConfigError([ConfigIssue("--model", f"expected MODEL or NAME=MODEL, got '{spec}'")])
        targets.append(target if sep else name)
        aliases += [name] if sep else []
    if len(set(targets)) > 1:
        raise ConfigError([ConfigIssue("--model", f"one job runs one model; got {', '.join(sorted(set(targets)))}")])
    if targets:
        raw["model"] = {"name": targets[0], "aliases": aliases}
    loras = [spec.partition("=") for spec in args.loras]
    bad = [f"{n}{s}{p}" for n, s, p in loras if not (n and s and p)]
    if bad:
        raise ConfigError([ConfigIssue("--lora", f"expected NAME=PATH, got '{bad[0]}'")])
    if loras:
        raw.setdefault("model", {})["adapters"] = {name: path for name, _, path in loras}
    return _validated(apply_overrides(raw, args.overrides), "batchgen batch")


def _cmd_run(args: argparse.Namespace) -> int:
    # deferred (start-up): the run layer (~1.4 s) only for run and batch
    from batchgen.run.signals import STOP

    STOP.install()
    try:
        with quiet_notices(bool(args.quiet)):
            return _run(args, STOP)
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", None) or STOP.received or signal.SIGINT
        _error(f"interrupted by {signal.Signals(signum).name}; nothing was started")
        return 128 + signum
    finally:
        # On the command line the exit status is settled now: later signals are ignored.
        STOP.uninstall(ignore=args.console)


def _run(args: argparse.Namespace, stop: Any) -> int:
    # deferred (start-up): the run layer (~1.4 s) only for run and batch
    from batchgen.io.output_file import OutputWriteError
    from batchgen.run.errors import SETUP_ERRORS, RunFailed, TooManyErrors
    from batchgen.run.execute import execute
    from batchgen.run.plan import plan

    if args.quiet or not sys.stderr.isatty():
        quiet_libraries()  # before plan: converting the embedded model draws bars too
    try:
        with stop.interruptible():
            registry, config = _batch_config(args) if args.command == "batch" else _load(args)
            config = _with_if_exists(config, args)
            job = plan(config, registry, config_path=getattr(args, "config", None), force_resume=args.force_resume)
    except SETUP_ERRORS as exc:
        _error(_in_file(exc, getattr(args, "config", None) or "batchgen batch"))
        return EXIT_USAGE
    except OutputWriteError as exc:  # the sidecar could not be written (a full disk): nothing generated
        _error(str(exc))
        return EXIT_FAILED
    try:
        summary = execute(job, quiet=args.quiet, max_error_rate=args.max_error_rate)
    except TooManyErrors as exc:
        _error(f"run stopped: {exc}")
        _note(f"the records written so far are kept in {_files(config)}")
        return EXIT_RECORDS_FAILED
    except RunFailed as exc:
        _error(f"run failed: {exc}")
        _note(f"records written so far are kept; fix the cause and rerun with --resume ({config.output.path})")
        return EXIT_FAILED
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", None) or signal.SIGINT
        _error(
            f"interrupted by {signal.Signals(signum).name}; the summary says 'interrupted'; "
            f"rerun with --resume to continue ({config.output.path})"
        )
        return 128 + signum
    if stop.received is not None:
        _note(f"{signal.Signals(stop.received).name} arrived once every record was written: the run is "
              "complete, and the summary says 'completed'")
    if not args.quiet:
        _report(summary, config, job)
    records = summary["records"]
    status = _failed_rows(records, job, args.max_failed_rows, args.quiet)
    if status is not None:
        return status
    if records["total"] and not records["ok"]:
        example = records.get("first_error") or {}
        _error(
            f"no record succeeded: all {records['total']} records in {_files(config)} are errors, "
            f"e.g. {job.records.example(example)}"
        )
        return EXIT_RECORDS_FAILED
    return EXIT_OK


def _with_if_exists(config: Any, args: argparse.Namespace) -> Any:
    """``config`` with ``--resume`` / ``--overwrite`` as its ``output.if_exists``: a copy, the
    validated config itself is left as it is."""
    if args.resume or args.force_resume:
        if_exists = "resume"
    elif args.overwrite:
        if_exists = "overwrite"
    else:
        return config
    return config.model_copy(update={"output": config.output.model_copy(update={"if_exists": if_exists})})


def _in_file(error: Exception, source: str) -> str:
    """The message of a setup error; a config error found after validation (a missing column,
    a model that is not there) gets the config file's name in front, as every config error does."""
    # deferred (start-up): the config stack (~0.7 s) only for a setup error
    from batchgen.config import ConfigError

    if isinstance(error, ConfigError) and error.source is None:
        return str(ConfigError(error.issues, source))
    return str(error)


def _files(config: Any) -> str:
    """The record file(s) of a run, for messages."""
    if config.output.error_path:
        return f"{config.output.path} and {config.output.error_path}"
    return str(config.output.path)


def _failed_rows(records: dict[str, Any], job: Any, given: int | None, quiet: bool) -> int | None:
    """Say how many rows failed and why (an error always, a note unless quiet);
    EXIT_RECORDS_FAILED when they break ``--max-failed-rows``
    (:func:`batchgen.run.failures.verdict`), else None."""
    # deferred (start-up): the run layer (~1.4 s) only once a run has records
    from batchgen.run.failures import verdict

    said = verdict(records, job.scoring is not None, given, job.records.example, _files(job.config))
    if said is None:
        return None
    text, over = said
    if over:
        _error(text)
        return EXIT_RECORDS_FAILED
    if records["ok"] and not quiet:
        _note(text)
    return None


def _report(summary: dict[str, Any], config: Any, job: Any) -> None:
    records = summary["records"]
    speed = summary["throughput"]
    ok, errors = records["this_run_ok"], records["this_run_error"]
    if config.output.error_path:
        # Each file gets its own count: the ok records in one, the failed ones in the other.
        wrote = (f"wrote {ok} record(s) to {config.output.path}, {errors} error{'' if errors == 1 else 's'} to "
                 f"{config.output.error_path} ({records['resumed']} already there)")
    else:
        wrote = (f"wrote {records['this_run']} record(s) to {config.output.path} "
                 f"({ok} ok, {errors} error; {records['resumed']} already there)")
    print(f"{wrote} in {summary['timings']['total_s']:.1f}s")
    if job.scoring is not None:  # nothing is generated: what counts is the prompt tokens scored
        print(f"throughput: {speed['prompt_tokens_per_s']:.1f} tok/s scored, "
              f"{speed['prefill_tokens_per_s']:.1f} tok/s computed (the rest from the prefix cache)")
    else:
        print(
            f"throughput: {speed['generated_tokens_per_s']:.1f} generated tok/s, "
            f"{speed['prompt_tokens_per_s']:.1f} prompt tok/s"
        )
    if job.scoring is not None and summary.get("metrics"):  # an evaluation run: lm-eval's results table
        # deferred (start-up): the scoring records only for an evaluation run's table
        from batchgen.run.scoring_records import results_table

        print(results_table(summary["metrics"], summary.get("metric_rows")))
    if summary.get("metrics_by_adapter"):  # a LoRA sweep: one column per adapter
        from batchgen.run.adapters import adapter_table

        print(adapter_table(summary["metrics_by_adapter"]))
    for key, values in ({} if job.scoring is not None else summary.get("metrics") or {}).items():
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        rows = (summary.get("metric_rows") or {}).get(key)
        print(f"{key}: {shown}" + (f" ({rows['rows']} rows, {rows['failed']} failed)" if rows else ""))
    print(f"summary: {config.output.summary_file}")


def _tokenizer_for(model_name: str) -> tuple[Any, str | None]:
    """The model's tokenizer when it is available locally; else (None, why not)."""
    try:
        # deferred (start-up): the model resolver only when validate checks a chat template
        from batchgen.model_resolver import resolve_model

        resolved = resolve_model(model_name)
        if not Path(resolved.path).is_dir():
            return None, f"model '{model_name}' is not a local folder; chat template not checked"
        # deferred: transformers (~3 s) only when validate checks a chat template
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(resolved.path), None
    except Exception as exc:  # validate must not fail on what only a run can settle
        return None, f"could not load the tokenizer of '{model_name}' ({type(exc).__name__}: {exc}); chat template not checked"


def _cmd_validate(args: argparse.Namespace) -> int:
    # deferred (start-up): the config stack and the run layer (~1.4 s) only for validate
    from batchgen.config import ConfigError, ConfigIssue, apply_overrides, read_yaml
    from batchgen.run.errors import SETUP_ERRORS
    from batchgen.run.executors.cluster import check_address
    from batchgen.run.plan import plan

    try:
        data = apply_overrides(read_yaml(args.config), args.overrides)
        try:
            registry, config = _validated(data, str(args.config))
        except ConfigError as exc:
            raise _with_model_issue(exc, data) from None
        job = plan(config, registry, prepare=False, config_path=str(args.config))
        tokenizer, note = _tokenizer_for(config.model.name)
        preview = job.source.preview(tokenizer, VALIDATE_ROWS if job.scoring is None else VALIDATE_SCORING_ROWS)
        if preview.issues:
            raise ConfigError([ConfigIssue(path, message) for path, message in preview.issues], str(args.config))
        notes, checked = preview.notes, preview.checked
        cluster = check_address(config.executor)
    except SETUP_ERRORS as exc:
        _error(_in_file(exc, str(args.config)))
        return EXIT_USAGE
    for problem in notes:
        print(f"note: {problem}")
    if note:
        print(f"note: {note}")
    if cluster:
        print(f"note: {cluster}")
    # deferred (start-up): the output lock only for validate
    from batchgen.io.lock import OutputLock

    holder = OutputLock(config.output.path).holder()
    if holder is not None:
        print(f"note: {config.output.path} is in use by {holder}; 'batchgen run' will refuse it until that run ends")
    output = Path(config.output.path)
    if output.exists() and output.stat().st_size > 0:
        if config.output.if_exists == "error":
            print(f"note: {output} exists; 'batchgen run' will need --resume or --overwrite")
        else:
            print(f"note: {output} exists; 'batchgen run' will {config.output.if_exists} it")
    # deferred (start-up): the run layer (~1.4 s) only for validate
    from batchgen.run.failures import default_limit, over_limit

    limit = default_limit(job.scoring is not None, args.max_failed_rows)
    if over_limit(preview.failed_rows, limit):
        _error(f"{args.config}: {checked}: over --max-failed-rows {limit}, so 'batchgen run' would write "
               f"{'it' if preview.failed_rows == 1 else 'them'} as error records and exit {EXIT_RECORDS_FAILED} "
               "(see the notes above); fix the rows, or pass --max-failed-rows to accept them")
        return EXIT_RECORDS_FAILED
    print(f"{args.config}: ok ({checked}, model '{config.model.name}' found, output {config.output.path} is writable)")
    return EXIT_OK


def _with_model_issue(error: Any, data: dict[str, Any]) -> Any:
    """``error`` (a ConfigError) with the model name's problem added, so that one ``validate``
    lists it beside the others (the model is otherwise checked only once the config is valid)."""
    # deferred (start-up): the config stack and the run layer (~1.4 s) only for validate
    from batchgen.config import ConfigError, ConfigIssue
    from batchgen.run.plan import check_model_name

    model = data.get("model") if isinstance(data, dict) else None
    name = model.get("name") if isinstance(model, dict) else None
    if not isinstance(name, str) or any(issue.path.startswith("model.name") for issue in error.issues):
        return error
    try:
        check_model_name(name)
    except ConfigError as exc:
        return ConfigError([*error.issues, *exc.issues], error.source)
    except Exception:  # noqa: BLE001 - only a hint beside the real errors
        return error
    return error


def _cmd_tokenize(args: argparse.Namespace) -> int:
    # deferred (start-up): the model resolver only for tokenize
    from batchgen.model_resolver import ModelError, check_model

    if not sys.stderr.isatty():
        quiet_libraries()  # a first use converts the built-in model: its steps, without the bars
    try:
        resolved = check_model(args.model)
        # deferred: transformers (~3 s) only for the tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    except ModelError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except (OSError, ValueError) as exc:
        _error(f"could not load the tokenizer of '{args.model}': {exc}")
        return EXIT_USAGE
    ids = list(tokenizer(args.text, add_special_tokens=args.special)["input_ids"])
    tokens = tokenizer.convert_ids_to_tokens(ids)
    if args.json:
        print(json.dumps({"ids": ids, "tokens": tokens}, ensure_ascii=False))
        return EXIT_OK
    print(json.dumps(ids))
    for token_id, token in zip(ids, tokens):
        print(f"{token_id:>8}  {token!r}")
    return EXIT_OK


def _cmd_plugins(args: argparse.Namespace) -> int:
    # deferred (start-up): the plugin stack (pluggy, the built-ins; ~0.8 s) only for the plugins command
    from batchgen.plugins import PluginError, load_registry

    try:
        registry = load_registry(args.modules)
    except PluginError as exc:
        _error(str(exc))
        return EXIT_USAGE
    entries = registry.describe()
    if args.json:
        print(json.dumps(entries, indent=2))
        return EXIT_OK
    for entry in entries:
        origin = entry["source"]
        if entry.get("distribution"):
            origin += f", {entry['distribution']} {entry.get('version') or ''}".rstrip()
        print(f"{entry['name']} ({origin}; module {entry['module']})")
        for kind in ("samplers", "metrics"):
            for item in entry[kind]:
                print(f"  {kind[:-1]:<7} {item['name']:<16} {item['description']}")
                if item.get("clash"):  # another plugin registers this name (see docs/plugins.md, "Names")
                    print(f"{'':<10}clash: {item['clash']}")
                for option in item.get("options", ()):
                    kind_text = option["type"] + (f", {option['constraints']}" if option.get("constraints") else "")
                    default = "required" if option["required"] else f"default {json.dumps(option['default'])}"
                    line = f"{'':<10}{option['name']} ({kind_text}; {default})"
                    if option.get("description"):
                        line += f": {option['description']}"
                    print(line)
        if entry["hooks"]:
            print(f"  hooks   {', '.join(entry['hooks'])}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it).

    Called without ``argv`` (the process's own command line), a run leaves SIGINT and SIGTERM
    ignored once its exit status is settled; with ``argv`` (a library call) it puts back the
    caller's handlers.
    """
    console = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:  # lm-eval's own CLI parses the rest (batchgen.integrations.lm_eval_command)
        return lm_eval_main(argv[1:])
    args = _parser().parse_args(argv)
    args.console = console
    handler = {"run": _cmd_run, "batch": _cmd_run, "validate": _cmd_validate, "plugins": _cmd_plugins,
               "tokenize": _cmd_tokenize}[args.command]
    try:
        return handler(args)
    except BrokenPipeError:  # e.g. `batchgen plugins | head`: the reader left, nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
