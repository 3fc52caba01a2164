"""Run the CUDA kernels on the CPU: build a ``.cu`` file with g++ against ``cuda_cpu.h``.

The module mirrors the part of cupy's API the kernel loader uses, so the same launch code drives
both::

    mod = CpuModule(path, {"BG_DTYPE": 1, ...}, schedule="warp", poison="nan")
    kern = mod.get_function("paged_decode")
    kern((gx, gy, gz), (bx, by, bz), (tensor, ..., numpy.int32(3), numpy.float32(0.1)),
         shared_mem=nbytes)

Pointer parameters take CPU ``torch.Tensor`` objects; scalar parameters take numpy scalars whose
dtype matches the C type exactly (a mismatch raises, where a GPU would silently misread it).

Each ``extern "C" __global__`` kernel of the file gets a generated thunk that unpacks a
``void**`` argument array, as ``cuLaunchKernel`` does. Builds are cached by a hash of the sources,
header, flags and compiler, under ``$BATCHGEN_CACHE_DIR`` (default ``~/.cache/batchgen``).

With ``sanitizer="thread"`` or ``"address"`` the module is built as an executable instead and
every launch runs in a subprocess (a sanitizer runtime cannot be loaded into a running Python):
buffers travel through files, and the sanitizer's report becomes a :class:`HarnessError`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

HARNESS_DIR = Path(__file__).resolve().parent
HEADER = HARNESS_DIR / "cuda_cpu.h"
DRIVER = HARNESS_DIR / "driver.h"

SCHEDULES = {"warp": 0, "warp_reverse": 1, "round_robin": 2, "random": 3, "threads": 4}
POISONS = {"none": 0, "nan": 1, "huge": 2}
SANITIZERS = {None: [], "thread": ["-fsanitize=thread"], "address": ["-fsanitize=address"]}

# C parameter type -> (numpy dtype, ctypes type, driver tag).
_SCALARS: dict[str, tuple[type, type, str]] = {
    "int": (np.int32, ctypes.c_int32, "i32"),
    "long long": (np.int64, ctypes.c_int64, "i64"),
    "float": (np.float32, ctypes.c_float, "f32"),
}

_KERNEL_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)\s*\{',
    re.S,
)
_locks_guard = threading.Lock()
_build_locks: dict[Path, threading.Lock] = {}


def _lock_for(path: Path) -> threading.Lock:
    """One lock per artifact: the same module is built once, different ones in parallel."""
    with _locks_guard:
        return _build_locks.setdefault(path, threading.Lock())


class HarnessError(RuntimeError):
    """A kernel failed on the CPU harness: divergence, deadlock, sanitizer report, bad launch."""


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its C type (qualifiers kept) and whether it is a pointer."""

    ctype: str
    name: str

    @property
    def is_pointer(self) -> bool:
        return "*" in self.ctype

    @property
    def base(self) -> str:
        """The type without const / __restrict__, e.g. ``long long``."""
        return " ".join(w for w in self.ctype.split() if w not in ("const", "__restrict__"))


def parse_kernels(source: str) -> dict[str, list[Param]]:
    """Return the ``extern "C" __global__`` kernels of a CUDA source and their parameters."""
    text = re.sub(r"//[^\n]*", "", source)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    kernels: dict[str, list[Param]] = {}
    for match in _KERNEL_RE.finditer(text):
        params = []
        for raw in match.group(2).split(","):
            raw = " ".join(raw.split())
            m = re.fullmatch(r"(.*?[\s*])(\w+)", raw)
            if not m:
                raise ValueError(f"cannot parse parameter {raw!r} of kernel {match.group(1)}")
            params.append(Param(" ".join(m.group(1).replace("*", " * ").split()), m.group(2)))
        kernels[match.group(1)] = params
    return kernels


def cache_dir() -> Path:
    """Where built libraries and executables are kept (created on demand)."""
    root = os.environ.get("BATCHGEN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "batchgen"
    )
    path = Path(root) / "cpu_harness"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise HarnessError("the CPU kernel harness needs g++ (set CXX to another C++17 compiler)")
    return cxx


def _thunk_source(source: Path, kernels: Mapping[str, list[Param]]) -> str:
    lines = [f'#include "{source}"', f'#include "{DRIVER}"']
    for name, params in kernels.items():
        unpack = ", ".join(
            f"*static_cast<{p.ctype.replace('__restrict__', '')}*>(a[{i}])"
            for i, p in enumerate(params)
        )
        lines.append(f'extern "C" void bgh_thunk_{name}(void** a) {{ {name}({unpack}); }}')
    table = ", ".join(f'{{"{n}", &bgh_thunk_{n}}}' for n in kernels)
    lines += [
        f"static const BghKernelEntry bgh_table[] = {{{table}}};",
        'extern "C" int bgh_launch(void (*thunk)(void**), void** args, unsigned gx, unsigned gy,',
        "    unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned long smem, int schedule,",
        "    int poison, unsigned seed, char* err, unsigned long errlen) {",
        "  return ::bgh::launch(thunk, args, dim3{gx, gy, gz}, dim3{bx, by, bz}, smem, schedule,",
        "                       poison, seed, err, errlen);",
        "}",
        "#ifdef BGH_DRIVER",
        "int main(int argc, char** argv) {",
        f"  return bgh_driver_main(argc, argv, bgh_table, {len(kernels)});",
        "}",
        "#endif",
    ]
    return "\n".join(lines) + "\n"


def build(
    source: Path, defines: Mapping[str, int], sanitizer: str | None = None
) -> tuple[Path, dict[str, list[Param]]]:
    """Compile ``source`` for the CPU; returns the artifact and the parsed kernels.

    Without a sanitizer the artifact is a shared library exporting ``bgh_launch`` and one
    ``bgh_thunk_<kernel>`` per kernel; with one it is an executable driven by a request file.
    Compiler diagnostics are errors (-Wall -Werror): the kernel must be clean C++ as well.
    """
    if sanitizer not in SANITIZERS:
        raise ValueError(f"sanitizer must be one of {sorted(map(str, SANITIZERS))}, got {sanitizer!r}")
    source = Path(source).resolve()
    text = source.read_text()
    kernels = parse_kernels(text)
    if not kernels:
        raise HarnessError(f'{source} defines no extern "C" __global__ kernel')
    cxx = _compiler()
    flags = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
             "-Wno-unknown-pragmas",
             "-fno-strict-aliasing", "-pthread", f"-I{source.parent}", f"-include{HEADER}"]
    flags += [f"-D{k}={int(v)}" for k, v in sorted(defines.items())]
    if sanitizer:
        flags += SANITIZERS[sanitizer] + ["-g", "-DBGH_DRIVER", "-fno-omit-frame-pointer"]
    else:
        flags += ["-fPIC", "-shared"]
    digest = hashlib.sha256()
    for part in (text, HEADER.read_text(), DRIVER.read_text(), " ".join(flags), cxx):
        digest.update(part.encode())
        digest.update(b"\0")
    for inc in sorted(source.parent.glob("*.cuh")):
        digest.update(inc.read_bytes())
    key = digest.hexdigest()[:24]
    out = cache_dir() / f"{source.stem}-{key}{'.' + sanitizer if sanitizer else '.so'}"
    if out.exists():
        return out, kernels
    with _lock_for(out), tempfile.TemporaryDirectory() as tmp:
        if out.exists():  # built by another thread while this one waited
            return out, kernels
        thunk = Path(tmp) / "thunks.cpp"
        thunk.write_text(_thunk_source(source, kernels))
        partial = Path(tmp) / out.name
        cmd = [cxx, *flags, str(thunk), "-o", str(partial)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise HarnessError(f"g++ failed to build {source.name} for the CPU:\n{proc.stderr[-4000:]}")
        os.replace(partial, out)  # atomic: concurrent builders never see a half-written file
    return out, kernels


class CpuModule:
    """A kernel file built for the CPU; ``get_function`` returns launchable kernels."""

    def __init__(
        self,
        source: Path | str,
        defines: Mapping[str, int],
        *,
        schedule: str = "warp",
        poison: str = "nan",
        seed: int = 0,
        sanitizer: str | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if poison not in POISONS:
            raise ValueError(f"poison must be one of {sorted(POISONS)}, got {poison!r}")
        if sanitizer is not None and schedule != "threads":
            raise ValueError("sanitizer runs use schedule='threads' (real threads, real races)")
        self.schedule, self.poison, self.seed, self.sanitizer = schedule, poison, seed, sanitizer
        self.path, self.kernels = build(Path(source), defines, sanitizer)
        self._lib = None if sanitizer else ctypes.CDLL(str(self.path))

    def get_function(self, name: str) -> CpuKernel:
        if name not in self.kernels:
            raise HarnessError(f"no kernel named {name!r}; the module has {sorted(self.kernels)}")
        return CpuKernel(self, name, self.kernels[name])


class CpuKernel:
    """One kernel; called like ``cupy.RawKernel``: ``kernel(grid, block, args, shared_mem=0)``."""

    def __init__(self, module: CpuModule, name: str, params: list[Param]) -> None:
        self.module, self.name, self.params = module, name, params

    def _check_args(self, args: Sequence[Any]) -> None:
        if len(args) != len(self.params):
            raise HarnessError(
                f"{self.name} takes {len(self.params)} arguments, got {len(args)}"
            )
        for i, (arg, p) in enumerate(zip(args, self.params)):
            where = f"{self.name} argument {i} ({p.ctype} {p.name})"
            if p.is_pointer:
                if not isinstance(arg, torch.Tensor) or arg.device.type != "cpu":
                    raise HarnessError(f"{where} expects a CPU tensor, got {type(arg).__name__}")
                if not arg.is_contiguous():
                    raise HarnessError(f"{where} must be contiguous")
            else:
                if p.base not in _SCALARS:
                    raise HarnessError(f"{where}: unsupported scalar type")
                want = _SCALARS[p.base][0]
                if not isinstance(arg, np.generic) or arg.dtype != want:
                    raise HarnessError(
                        f"{where} expects numpy.{want.__name__}, got {type(arg).__name__}"
                    )

    def __call__(
        self,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: Sequence[Any],
        *,
        shared_mem: int = 0,
    ) -> None:
        self._check_args(args)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        block3 = tuple(block) + (1,) * (3 - len(block))
        m = self.module
        if m.sanitizer:
            self._run_driver(grid3, block3, args, shared_mem)
            return
        values = []
        for arg, p in zip(args, self.params):
            if p.is_pointer:
                values.append(ctypes.c_void_p(arg.data_ptr()))
            else:
                values.append(_SCALARS[p.base][1](arg.item()))
        argv = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        )
        err = ctypes.create_string_buffer(2048)
        thunk = getattr(m._lib, f"bgh_thunk_{self.name}")
        launch = m._lib.bgh_launch
        launch.restype = ctypes.c_int
        rc = launch(
            ctypes.cast(thunk, ctypes.c_void_p), argv,
            *[ctypes.c_uint(x) for x in grid3], *[ctypes.c_uint(x) for x in block3],
            ctypes.c_ulong(shared_mem), ctypes.c_int(SCHEDULES[m.schedule]),
            ctypes.c_int(POISONS[m.poison]), ctypes.c_uint(m.seed), err, ctypes.c_ulong(len(err)),
        )
        if rc != 0:
            raise HarnessError(f"{self.name}: {err.value.decode()}")

    def _run_driver(self, grid3: tuple, block3: tuple, args: Sequence[Any], shared_mem: int) -> None:
        m = self.module
        with tempfile.TemporaryDirectory() as tmp:
            lines = [f"kernel {self.name}", "grid %d %d %d" % grid3, "block %d %d %d" % block3,
                     f"smem {shared_mem}", f"schedule {SCHEDULES[m.schedule]}",
                     f"poison {POISONS[m.poison]}", f"seed {m.seed}"]
            buffers: list[tuple[torch.Tensor, Path]] = []
            for i, (arg, p) in enumerate(zip(args, self.params)):
                if p.is_pointer:
                    path = Path(tmp) / f"arg{i}.bin"
                    raw = arg.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
                    raw.tofile(path)
                    lines.append(f"arg buf {path} {raw.size}")
                    buffers.append((arg, path))
                else:
                    tag = _SCALARS[p.base][2]
                    val = int(arg.view(np.uint32)) if tag == "f32" else int(arg)
                    lines.append(f"arg {tag} {val}")
            req = Path(tmp) / "request.txt"
            req.write_text("\n".join(lines) + "\n")
            env = dict(os.environ)
            env.setdefault("TSAN_OPTIONS", "halt_on_error=1 second_deadlock_stack=1")
            env.setdefault("ASAN_OPTIONS", "detect_leaks=1 halt_on_error=1")
            proc = subprocess.run([str(m.path), str(req)], capture_output=True, text=True, env=env,
                                  timeout=600)
            if proc.returncode != 0 or "WARNING: ThreadSanitizer" in proc.stderr:
                raise HarnessError(
                    f"{self.name} under {m.sanitizer} sanitizer (exit {proc.returncode}):\n"
                    f"{proc.stderr[-6000:]}"
                )
            for arg, path in buffers:
                data = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
                arg.view(torch.uint8).reshape(-1).copy_(data)
