"""``batchgen tokenize MODEL TEXT`` and ``batchgen plugins``: the two commands that look
something up for a job's author (a text's token ids; what the installed plugins register)
without running one."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from batchgen.cli.interface import EXIT_OK, EXIT_USAGE, error
from batchgen.quiet import quiet_libraries

__all__ = ["add_commands", "cmd_plugins", "cmd_tokenize"]


def add_commands(sub: Any) -> None:
    """Add ``tokenize`` and ``plugins`` to the subcommands ``sub``."""
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


def cmd_tokenize(args: argparse.Namespace) -> int:
    """Print TEXT's token ids under MODEL's tokenizer (or JSON with ``--json``)."""
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
        error(str(exc))
        return EXIT_USAGE
    except (OSError, ValueError) as exc:
        error(f"could not load the tokenizer of '{args.model}': {exc}")
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


def cmd_plugins(args: argparse.Namespace) -> int:
    """Print each installed plugin with what it registers (or JSON with ``--json``)."""
    # deferred (start-up): the plugin stack (pluggy, the built-ins; ~0.8 s) only for the plugins command
    from batchgen.plugins import PluginError, load_registry

    try:
        registry = load_registry(args.modules)
    except PluginError as exc:
        error(str(exc))
        return EXIT_USAGE
    entries = registry.describe()
    if args.json:
        print(json.dumps(entries, indent=2))
        return EXIT_OK
    for entry in entries:
        _print_plugin(entry)
    return EXIT_OK


def _print_plugin(entry: dict[str, Any]) -> None:
    """One plugin's lines: its origin, each sampler and metric with its options, its hooks."""
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
