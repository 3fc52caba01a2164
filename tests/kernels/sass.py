"""Shape of the compiled decode kernel: build an sm_90 cubin, disassemble it, measure its loads.

Used by ``test_sass.py`` (the CI check) and ``python tests/kernels/sass.py`` (the table in
docs/kernels.md). No GPU is involved: nvcc (or NVRTC) compiles, ``nvdisasm`` (the
``nvidia-cuda-nvdisasm`` wheel, in the ``test`` extra) disassembles.

What is measured, in the main loop of ``paged_decode`` (the backward branch whose body holds the
most ``BAR.SYNC``, i.e. the loop over tiles):

* the global loads by width (``LDG.E.128`` is a 16-byte vector load);
* for every 128-bit load, how many 128-bit loads are issued from it up to the first instruction
  that reads one of its four destination registers: the loads a thread has in flight before it
  must wait. The scan follows the loop's back-edge once, so a load issued for the next tile
  counts everything issued until its use at the top of the next iteration;
* the same up to the first dependent FMA (registers derived from the load through conversions
  are followed).

The scan is linear in instruction order and ignores other branches: a shape check of what the
code asks the memory system for, not a simulation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from batchgen.kernels.cuda.cuda_attention import KERNEL_HEADER, KERNEL_SOURCE  # noqa: E402
from cuda_harness import cache_dir  # noqa: E402

ARCH = "90"
NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def find_nvdisasm() -> str | None:
    """``nvdisasm`` on PATH, else from an ``nvidia-cuda-nvdisasm`` wheel (CUDA 12 or 13 layout)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # type: ignore[import-not-found]  (namespace package of the CUDA wheels)
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for rel in ("cu13/bin/nvdisasm", "cuda_nvdisasm/bin/nvdisasm", "cu12/bin/nvdisasm"):
            path = Path(base) / rel
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def skip_reason() -> str | None:
    if NVCC is None:
        return "nvcc not found (install the CUDA toolkit)"
    if find_nvdisasm() is None:
        return "nvdisasm not found (pip install nvidia-cuda-nvdisasm; it is in the 'test' extra)"
    return None


def disassemble(dtype_code: int, head_size: int, block_size: int, source: Path = KERNEL_SOURCE,
                arch: str = ARCH) -> tuple[str, dict[str, int]]:
    """SASS of ``paged_decode`` for one variant, and its ptxas figures (cached on disk)."""
    nvdisasm = find_nvdisasm()
    assert NVCC and nvdisasm, skip_reason()
    header = source.parent / KERNEL_HEADER.name
    flags = ["-std=c++17", f"-I{source.parent}", f"-DBG_DTYPE={dtype_code}",
             f"-DBG_HEAD_SIZE={head_size}", f"-DBG_BLOCK_SIZE={block_size}", "-cubin",
             f"-arch=sm_{arch}", "-Xptxas", "-v"]
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    tool = subprocess.run([nvdisasm, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), header.read_text(), " ".join(flags),
                                    version, tool]).encode()).hexdigest()[:24]
    cached = cache_dir() / f"sass-{key}.json"
    if cached.exists():
        data = json.loads(cached.read_text())
        return data["sass"], data["ptxas"]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        proc = subprocess.run([NVCC, *flags, "-o", str(cubin), str(source)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed:\n{proc.stderr[-3000:]}")
        dis = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True)
        if dis.returncode != 0:
            raise RuntimeError(f"nvdisasm failed:\n{dis.stderr[-3000:]}")
    sass = function_text(dis.stdout, "paged_decode")
    ptxas = parse_ptxas(proc.stdout + proc.stderr, "paged_decode")
    cached.write_text(json.dumps({"sass": sass, "ptxas": ptxas}))
    return sass, ptxas


def function_text(listing: str, name: str) -> str:
    """The part of an nvdisasm listing that holds the code of function ``name``."""
    m = re.search(rf"^\s*\.section\s+\.text\.{name},.*?$(.*?)(?=^\s*\.section|\Z)", listing,
                  re.M | re.S)
    if not m:
        raise ValueError(f"no .text.{name} section in the listing")
    return m.group(1)


def parse_ptxas(log: str, name: str) -> dict[str, int]:
    m = re.search(rf"Compiling entry function '{name}'.*?(\d+) bytes stack frame, (\d+) bytes spill "
                  rf"stores, (\d+) bytes spill loads.*?Used (\d+) registers", log, re.S)
    if not m:
        raise ValueError(f"no ptxas report for {name}")
    stack, stores, loads, regs = map(int, m.groups())
    return {"registers": regs, "stack": stack, "spill_stores": stores, "spill_loads": loads}


@dataclass
class Instr:
    index: int
    address: int
    opcode: str           # with modifiers, e.g. LDG.E.128.CONSTANT
    operands: list[str]
    target: int | None = None  # branch target address

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    def dests(self) -> set[int]:
        """General registers written (the first operand, except for stores and branches)."""
        if self.base in ("ST", "STG", "STS", "STL", "RED", "BRA", "BAR", "EXIT", "BSYNC", "BSSY",
                         "WARPSYNC", "CALL", "RET") or not self.operands:
            return set()
        return _regs(self.operands[0], self.opcode, dest=True)

    def sources(self) -> set[int]:
        ops = self.operands if not self.dests() else self.operands[1:]
        out: set[int] = set()
        for op in ops:
            out |= _regs(op, self.opcode, dest=False)
        return out


def _width(opcode: str) -> int:
    for w, n in ((".128", 4), (".64", 2)):
        if w in opcode:
            return n
    return 1


def _regs(operand: str, opcode: str, dest: bool) -> set[int]:
    out: set[int] = set()
    in_address = "[" in operand
    for m in re.finditer(r"\bR(\d+)(\.64)?", operand):
        r = int(m.group(1))
        if in_address:
            n = 2 if m.group(2) else 1
        else:
            n = _width(opcode) if (dest or opcode.split(".")[0] in ("STG", "STS", "ST")) else 1
            if m.group(2):
                n = 2
        out |= set(range(r, r + n))
    return out


_LINE_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")


def parse_sass(text: str) -> list[Instr]:
    labels: dict[str, int] = {}
    pending: list[str] = []
    raw: list[tuple[int, str, list[str], str | None]] = []
    for line in text.splitlines():
        lab = re.match(r"^\s*(\.L_\w+):", line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _LINE_RE.match(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for name in pending:
            labels[name] = addr
        pending = []
        ops_text = m.group(4)
        tgt = re.search(r"`\((\.L_\w+)\)", ops_text)
        operands = [o.strip() for o in re.split(r",(?![^\[]*\])", ops_text) if o.strip()]
        raw.append((addr, m.group(3), operands, tgt.group(1) if tgt else None))
    return [Instr(i, a, op, ops, labels.get(t) if t else None)
            for i, (a, op, ops, t) in enumerate(raw)]


@dataclass
class LoopShape:
    """What the tile loop of the decode kernel issues (see the module docstring)."""

    loads_by_width: dict[str, int] = field(default_factory=dict)
    in_flight_first_use: list[int] = field(default_factory=list)   # one entry per 128-bit load
    in_flight_first_fma: list[int] = field(default_factory=list)
    barriers: int = 0

    def summary(self) -> dict[str, object]:
        return {"loads": self.loads_by_width, "barriers": self.barriers,
                "max_in_flight_before_use": max(self.in_flight_first_use, default=0),
                "max_in_flight_before_fma": max(self.in_flight_first_fma, default=0)}


FMA_OPS = ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2", "DFMA")


def tile_loop(instrs: list[Instr]) -> tuple[int, int]:
    """(first, last) instruction index of the tile loop.

    It is the backward branch whose range holds the most barriers; among those, the one that
    follows its last barrier most closely (the loop ends with the end-of-tile barrier).
    Out-of-line code, such as the divergent-shuffle paths that ptxas places after the kernel's
    end, also branches back into the loop, but from far below its last barrier.
    """
    by_addr = {ins.address: ins.index for ins in instrs}
    best = None
    for ins in instrs:
        if ins.base == "BRA" and ins.target is not None and ins.target <= ins.address:
            lo = by_addr[ins.target]
            bars = [j for j in range(lo, ins.index + 1) if instrs[j].base == "BAR"]
            if not bars:
                continue
            key = (len(bars), -(ins.index - bars[-1]))
            if best is None or key > best[0]:
                best = (key, lo, ins.index)
    if best is None:
        raise ValueError("no loop with a barrier found")
    return best[1], best[2]


def load_width(ins: Instr) -> str:
    for w in ("128", "64", "U16", "S16", "U8", "S8"):
        if f".{w}" in ins.opcode:
            return w if w in ("128", "64") else "16" if "16" in w else "8"
    return "32"


def loop_shape(sass: str) -> LoopShape:
    instrs = parse_sass(sass)
    lo, hi = tile_loop(instrs)
    body = instrs[lo:hi + 1]
    shape = LoopShape(barriers=sum(1 for i in body if i.base == "BAR"))
    for ins in body:
        if ins.base == "LDG":
            w = load_width(ins)
            shape.loads_by_width[w] = shape.loads_by_width.get(w, 0) + 1
    # Walk order after a load: the rest of the body, then once around the back-edge.
    for k, ins in enumerate(body):
        if ins.base != "LDG" or load_width(ins) != "128":
            continue
        walk = body[k + 1:] + body[:k]
        loaded = ins.dests()
        tainted = set(loaded)
        count = 1
        first_use = first_fma = None
        for nxt in walk:
            srcs = nxt.sources()
            if first_use is None and srcs & loaded:
                first_use = count
            if srcs & tainted:
                if nxt.base in FMA_OPS and nxt.opcode not in ("HADD2.F32",) and first_fma is None:
                    first_fma = count
                tainted |= nxt.dests()
            else:
                tainted -= nxt.dests()  # overwritten by an unrelated value
            if first_use is not None and first_fma is not None:
                break
            if nxt.base == "LDG" and load_width(nxt) == "128":
                count += 1
        shape.in_flight_first_use.append(first_use or count)
        shape.in_flight_first_fma.append(first_fma or count)
    return shape


def table(variants, source: Path = KERNEL_SOURCE) -> list[dict[str, object]]:
    rows = []
    for d, h, b in variants:
        sass, ptxas = disassemble(d, h, b, source)
        rows.append({"variant": f"{('f32', 'f16', 'bf16')[d]} h{h} b{b}", **ptxas,
                     **loop_shape(sass).summary()})
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=KERNEL_SOURCE)
    args = ap.parse_args()
    vs = [(d, h, 16) for d in (0, 1, 2) for h in (64, 80, 96, 128, 256)]
    for row in table(vs, args.source):
        print(json.dumps(row))
