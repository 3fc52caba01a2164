"""``batchgen validate CONFIG``: every check that needs no model run.

It validates the config (listing a model name's problem beside the others), plans the job
without preparing its output, renders the first rows (a scoring job's answers against their
choices), and says what ``batchgen run`` would meet: an output in use or already there, a
cluster address, rows over ``--max-failed-rows``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from batchgen.cli.interface import EXIT_OK, EXIT_RECORDS_FAILED, EXIT_USAGE, add_config_args, error
from batchgen.cli.jobs import in_file, validated

__all__ = ["VALIDATE_ROWS", "VALIDATE_SCORING_ROWS", "add_command", "cmd_validate"]

# Rows rendered by ``validate`` to catch template errors before a run.
VALIDATE_ROWS = 5
# Rows a scoring job's ``validate`` checks (its answers against its choices), before the model loads.
VALIDATE_SCORING_ROWS = 20


def add_command(sub: Any) -> None:
    """Add ``validate`` to the subcommands ``sub``."""
    validate = sub.add_parser("validate", help="check a config without running the model")
    add_config_args(validate)


def cmd_validate(args: argparse.Namespace) -> int:
    """Check the job; print a note per finding and a closing ``ok`` line, or the error."""
    # deferred (start-up): the config stack and the run layer (~1.4 s) only for validate
    from batchgen.run.errors import SETUP_ERRORS
    from batchgen.run.executors.cluster import check_address

    try:
        config, job, preview, note = _checked(args)
        cluster = check_address(config.executor)
    except SETUP_ERRORS as exc:
        error(in_file(exc, str(args.config)))
        return EXIT_USAGE
    for problem in preview.notes:
        print(f"note: {problem}")
    if note:
        print(f"note: {note}")
    if cluster:
        print(f"note: {cluster}")
    _output_notes(config)
    # deferred (start-up): the run layer (~1.4 s) only for validate
    from batchgen.run.failures import default_limit, over_limit

    checked = preview.checked
    limit = default_limit(job.scoring is not None, args.max_failed_rows)
    if over_limit(preview.failed_rows, limit):
        error(f"{args.config}: {checked}: over --max-failed-rows {limit}, so 'batchgen run' would write "
              f"{'it' if preview.failed_rows == 1 else 'them'} as error records and exit {EXIT_RECORDS_FAILED} "
              "(see the notes above); fix the rows, or pass --max-failed-rows to accept them")
        return EXIT_RECORDS_FAILED
    print(f"{args.config}: ok ({checked}, model '{config.model.name}' found, output {config.output.path} is writable)")
    return EXIT_OK


def _checked(args: argparse.Namespace) -> tuple[Any, Any, Any, str | None]:
    """The validated config, its job (planned, its output not prepared), the preview of its
    first rows and a note on the tokenizer; raises SETUP_ERRORS (a row's issue as a ConfigError)."""
    # deferred (start-up): the config stack and the run layer (~1.4 s) only for validate
    from batchgen.config import ConfigError, ConfigIssue, apply_overrides, read_yaml
    from batchgen.run.plan import plan

    data = apply_overrides(read_yaml(args.config), args.overrides)
    try:
        registry, config = validated(data, str(args.config))
    except ConfigError as exc:
        raise _with_model_issue(exc, data) from None
    job = plan(config, registry, prepare=False, config_path=str(args.config))
    tokenizer, note = _tokenizer_for(config.model.name)
    preview = job.source.preview(tokenizer, VALIDATE_ROWS if job.scoring is None else VALIDATE_SCORING_ROWS)
    if preview.issues:
        raise ConfigError([ConfigIssue(path, message) for path, message in preview.issues], str(args.config))
    return config, job, preview, note


def _output_notes(config: Any) -> None:
    """Notes on the output: in use by another run, or already there."""
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


def _with_model_issue(found: Any, data: dict[str, Any]) -> Any:
    """``found`` (a ConfigError) with the model name's problem added, so that one ``validate``
    lists it beside the others (the model is otherwise checked only once the config is valid)."""
    # deferred (start-up): the config stack and the run layer (~1.4 s) only for validate
    from batchgen.config import ConfigError
    from batchgen.run.plan import check_model_name

    model = data.get("model") if isinstance(data, dict) else None
    name = model.get("name") if isinstance(model, dict) else None
    if not isinstance(name, str) or any(issue.path.startswith("model.name") for issue in found.issues):
        return found
    try:
        check_model_name(name)
    except ConfigError as exc:
        return ConfigError([*found.issues, *exc.issues], found.source)
    except Exception:  # noqa: BLE001 - only a hint beside the real errors
        return found
    return found
