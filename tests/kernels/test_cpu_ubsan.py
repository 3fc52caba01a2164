"""No undefined behaviour in the fused ops and the shared ``exp`` (``kernels/cpu/exp.h``) on NaN,
infinities and extreme inputs: a harness built with ``-fsanitize=undefined`` runs them and must
exit cleanly (UBSan aborts on the first report)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from batchgen.kernels.cpu import c_build

HARNESS = Path(__file__).resolve().parent / "data" / "ubsan_harness.c"
KERNELS = Path(c_build.__file__).resolve().parent
FLAGS = ["-std=c99", "-O1", "-g", "-march=native", "-fsanitize=undefined", "-fno-sanitize-recover=all",
         "-fopenmp-simd", "-pthread"]


def test_the_fused_ops_and_exp_have_no_undefined_behaviour(tmp_path) -> None:
    cc = c_build.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    binary = tmp_path / "harness"
    build = subprocess.run([cc, *FLAGS, f"-I{KERNELS}", str(HARNESS), "-o", str(binary), "-lm"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert "runtime error" not in run.stderr, run.stderr[-2000:]
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-2000:]
