"""Static checks of the kernels with nvcc: sm_80 and sm_90, warnings as errors, no spills, no
local memory, no fp64 in the PTX. Prints each kernel's registers and shared memory.

Nine variants cover every dtype, head size and block size (and head_size 256, the most
registers, in every dtype); set ``BATCHGEN_STATIC_FULL=1`` for the full cross product (45). Results are cached by a hash
of the sources, flags and nvcc version, so unchanged kernels are not recompiled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cuda_harness import cache_dir

from batchgen.kernels.cuda.cuda_attention import (
    BLOCK_SIZES,
    DTYPE_CODES,
    HEAD_SIZES,
    KERNEL_HEADER,
    KERNEL_SOURCE,
    decode_smem_bytes,
)

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
ARCHS = ("80", "90")
KERNELS = ("paged_decode", "paged_decode_reduce", "reshape_and_cache", "copy_blocks")

if os.environ.get("BATCHGEN_STATIC_FULL"):
    STATIC_VARIANTS = [(d, h, b) for d in range(3) for h in HEAD_SIZES for b in BLOCK_SIZES]
else:  # every dtype, head size and block size at least once; head 256 (most registers) per dtype
    STATIC_VARIANTS = [(0, 64, 8), (0, 128, 16), (0, 256, 32),
                       (1, 80, 16), (1, 96, 32), (1, 256, 8),
                       (2, 64, 32), (2, 128, 8), (2, 256, 16)]

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit)")

_FUNC_RE = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_FP64_RE = re.compile(r"^\s*[\w.]*\.f64\b|\bcvt\.\w*f64|%fd\d", re.M)


def parse_ptxas(log: str) -> dict[tuple[str, str], dict[str, int]]:
    """ptxas -v output -> {(kernel, arch): {registers, smem, stack, spill_stores, spill_loads}}."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    current: tuple[str, str] | None = None
    for line in log.splitlines():
        if m := _FUNC_RE.search(line):
            current = (m.group(1), m.group(2))
            out[current] = {"registers": -1, "smem": 0, "stack": 0, "spill_stores": 0,
                            "spill_loads": 0, "cumulative_stack": 0}
        elif current and (m := _PROPS_RE.search(line)):
            out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                spill_loads=int(m.group(3)))
        elif current and (m := _USED_RE.search(line)):
            out[current]["registers"] = int(m.group(1))
            out[current]["smem"] = int(m.group(2) or 0)
            if c := re.search(r"(\d+) bytes cumulative stack size", line):
                out[current]["cumulative_stack"] = int(c.group(1))
    return out


def compile_variant(dtype_code: int, head_size: int, block_size: int) -> dict:
    """nvcc the kernel file for both archs (cached); returns the parsed report."""
    flags = ["-std=c++17", f"-I{KERNEL_SOURCE.parent}", f"-DBG_DTYPE={dtype_code}",
             f"-DBG_HEAD_SIZE={head_size}", f"-DBG_BLOCK_SIZE={block_size}",
             "-Werror", "all-warnings",
             "-Xptxas", "-v,--warn-on-spills,--warn-on-local-memory-usage,--warning-as-error"]
    for arch in ARCHS:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([KERNEL_SOURCE.read_text(), KERNEL_HEADER.read_text(),
                                    " ".join(flags), version]).encode()).hexdigest()[:24]
    cached = cache_dir() / f"static-{key}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([NVCC, *flags, "-fatbin", "--keep", "--keep-dir", tmp,
                               "-o", os.path.join(tmp, "k.fatbin"), str(KERNEL_SOURCE)],
                              capture_output=True, text=True)
        ptx = {p.name: p.read_text() for p in Path(tmp).glob("*.ptx")}
    report = {"returncode": proc.returncode, "log": proc.stdout + proc.stderr,
              "functions": {f"{k}@sm_{a}": v for (k, a), v in parse_ptxas(proc.stdout + proc.stderr).items()},
              "fp64": {name: _FP64_RE.findall(text)[:5] for name, text in ptx.items()},
              "ptx_files": sorted(ptx)}
    if proc.returncode == 0:  # cache successes only: a failure is re-run and re-reported
        cached.write_text(json.dumps(report))
    return report


@pytest.fixture(scope="module")
def reports() -> dict[tuple[int, int, int], dict]:
    with ThreadPoolExecutor(max_workers=4) as pool:  # nvcc mostly waits on its sub-processes
        results = list(pool.map(lambda v: compile_variant(*v), STATIC_VARIANTS))
    return dict(zip(STATIC_VARIANTS, results))


def test_every_variant_compiles_clean_for_sm80_and_sm90(reports) -> None:
    dtype_names = {code: str(dt)[6:] for dt, code in DTYPE_CODES.items()}
    lines = []
    for (d, h, b), rep in reports.items():
        assert rep["returncode"] == 0, f"nvcc failed for {dtype_names[d]} h{h} b{b}:\n{rep['log'][-3000:]}"
        assert len(rep["ptx_files"]) == len(ARCHS)
        for kernel in KERNELS:
            for arch in ARCHS:
                f = rep["functions"].get(f"{kernel}@sm_{arch}")
                assert f is not None, f"{kernel} missing for sm_{arch}"
                where = f"{kernel} {dtype_names[d]} h{h} b{b} sm_{arch}"
                assert f["spill_stores"] == 0 and f["spill_loads"] == 0, f"{where} spills: {f}"
                assert f["stack"] == 0 and f["cumulative_stack"] == 0, f"{where} uses local memory: {f}"
                dyn = decode_smem_bytes(h, 4 if d == 0 else 2) if kernel == "paged_decode" else 0
                lines.append(f"{where:<48} {f['registers']:>3} regs  static smem {f['smem']:>5} B"
                             f"  dynamic smem {dyn:>6} B")
        for name, hits in rep["fp64"].items():
            assert not hits, f"fp64 in {name} ({dtype_names[d]} h{h} b{b}): {hits}"
    print("\n" + "\n".join(lines))


def test_parser_reads_spills_and_stack() -> None:
    # The check is only as good as the parser: feed it a spilling ptxas report.
    log = ("ptxas info    : Compiling entry function 'paged_decode' for 'sm_90'\n"
           "ptxas info    : Function properties for paged_decode\n"
           "    32 bytes stack frame, 44 bytes spill stores, 92 bytes spill loads\n"
           "ptxas info    : Used 56 registers, used 1 barriers, 32 bytes cumulative stack size, "
           "1024 bytes smem\n")
    f = parse_ptxas(log)[("paged_decode", "90")]
    assert f == {"registers": 56, "smem": 1024, "stack": 32, "spill_stores": 44, "spill_loads": 92,
                 "cumulative_stack": 32}
    assert _FP64_RE.findall("\tadd.f64 \t%fd1, %fd2, %fd3;\n")
    assert not _FP64_RE.findall("\tfma.rn.f32 \t%f64, %f1, %f2, %f3;\n")


def test_fp64_and_spills_are_caught_by_nvcc(tmp_path: Path) -> None:
    # A kernel that uses a double and a dynamically indexed local array must fail the check.
    src = tmp_path / "bad.cu"
    src.write_text('extern "C" __global__ void bad(float* o, int i) {\n'
                   '  float a[256];\n  for (int k = 0; k < 256; ++k) a[k] = o[k];\n'
                   '  a[i & 255] += 1.0f;\n  double d = o[i];\n'
                   '  o[0] = (float)(d / 3.0 + 1e-20) + a[(i * 7) & 255];\n}\n')
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([NVCC, "-gencode", "arch=compute_90,code=sm_90", "-fatbin", "--keep",
                               "--keep-dir", tmp, "-o", os.path.join(tmp, "b.fatbin"), "-Xptxas",
                               "-v", str(src)], capture_output=True, text=True)
        ptx = next(Path(tmp).glob("*.ptx")).read_text()
    assert proc.returncode == 0
    f = parse_ptxas(proc.stdout + proc.stderr)[("bad", "90")]
    assert f["stack"] > 0
    assert _FP64_RE.findall(ptx)
