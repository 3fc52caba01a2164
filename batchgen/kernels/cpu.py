"""The ``cpu`` attention backend: paged decode attention in C, compiled at run time.

The CPU counterpart of the CUDA backend. ``paged_attention_cpu.c`` is compiled by the system C
compiler (``$CC``, else ``cc`` or ``gcc``) once per (head_size, GQA group), both compile-time
constants, for the machine it runs on (``-march=native``), cached on disk under
``$BATCHGEN_CACHE_DIR/cpu_kernels`` (default ``~/.cache/batchgen``) by a hash of the source,
flags and compiler, and loaded with ctypes. It runs on the calling thread: splitting the batch
over a thread pool measured slower (13 % fewer tokens/s with 2 torch threads), because the pool
competed for the cores with torch's OpenMP workers, which spin between the matmuls.

Why: the torch path (``reference.paged_decode_attention``) first gathers every sequence's blocks
into a dense, padded copy and then runs SDPA over it, reading and writing the context three
times. The kernel reads each K/V row once, in place through the block table, only up to the
sequence's own length, and serves a whole GQA group of query heads per read; on SmolLM2's
shapes it measured 3.0× faster than the torch path at 32 sequences and 3.1× at 128.

Numerics: the result equals the torch path within float32 rounding (the kernel sums in another
order, and its vectorised ``exp`` is within about 2e-7 relative). It is never built with
``-ffast-math``, which would switch the whole process to flush-to-zero. Prefill,
``reshape_and_cache`` and ``copy_blocks`` are the torch reference: prefill is matmul-bound, and
its SDPA call is the one HF makes, so prompt logits stay bit-identical.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from batchgen.models import cache_dir

from . import reference

logger = logging.getLogger(__name__)

KERNEL_SOURCE = Path(__file__).resolve().parent / "paged_attention_cpu.c"
MAX_HEAD_SIZE = 512
MAX_GROUP = 16
# Flag sets tried in order; the first that compiles and links is used. Never -ffast-math: a
# shared library linked with it sets flush-to-zero / denormals-are-zero for the whole process.
_FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"),
    ("-O3", "-fopenmp-simd", "-fno-math-errno"),
    ("-O2",),
)
_COMMON_FLAGS = ("-std=c99", "-shared", "-fPIC", "-Wall", "-Werror", "-Wno-unknown-pragmas")


class CpuKernelError(RuntimeError):
    """The CPU kernel cannot be built or loaded here (no compiler, or every flag set failed)."""


def compiler() -> str | None:
    """The C compiler the backend would use (``$CC``, ``cc`` or ``gcc``), or None."""
    env = os.environ.get("CC")
    if env:
        return shutil.which(env) or (env if Path(env).is_file() else None)
    return shutil.which("cc") or shutil.which("gcc")


def unsupported_reason(dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int) -> str | None:
    """Why the kernel cannot serve this model's shape, or None if it can (no compiling)."""
    if dtype != torch.float32:
        return f"dtype {dtype} unsupported; the CPU kernel is float32 only"
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        return f"head_size {head_size} unsupported; at most {MAX_HEAD_SIZE}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads // num_kv_heads} query heads per KV head unsupported; at most {MAX_GROUP}"
    if compiler() is None:
        return "no C compiler found (set CC, or install gcc)"
    return None


def _machine_tag() -> str:
    """CPU model and flags: a build with -march=native is only valid on the same kind of CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return os.uname().machine + "\n" + "\n".join(keep)


def _subnormals_work() -> bool:
    """Whether float arithmetic still produces subnormal numbers (no flush-to-zero mode)."""
    tiny = torch.tensor([1.0e-38], dtype=torch.float32)
    return float(2.2250738585072014e-308 / 4.0) != 0.0 and bool((tiny / 100.0)[0] != 0.0)


_build_lock = threading.Lock()


def _compile(cc: str, source: Path, flags: tuple[str, ...], defines: list[str], out: Path) -> str | None:
    """Compile ``source`` to ``out`` atomically; return the compiler's error text on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        partial = Path(tmp) / out.name
        cmd = [cc, *_COMMON_FLAGS, *flags, *defines, str(source), "-o", str(partial)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return f"{' '.join(cmd)}\n{proc.stderr[-2000:]}"
        os.replace(partial, out)  # concurrent builders never see a half-written file
    return None


def build(what: str, source: Path, defines: list[str], accept: Any = None, tag: str = "") -> tuple[Any, tuple[str, ...]]:
    """Compile ``source`` (``what`` names it in errors) with the first flag set that works,
    cached on disk, and load it.

    The build is cached under ``cache_dir()/cpu_kernels`` by a hash of the source and the
    local headers it includes, compiler version, CPU, flags and ``defines``; ``tag`` goes into the file name. ``accept(lib)`` may return an error string to reject a
    loaded library (it is then skipped, like a failed compile). Call with ``_build_lock`` held.

    Returns:
        ``(library, flags)``.

    Raises:
        CpuKernelError: no compiler, no flag set compiled, or loading changed the FP mode.
    """
    cc = compiler()
    if cc is None:
        raise CpuKernelError("no C compiler found (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    text = source.read_text()
    # Local headers it includes ("..."), so that editing one rebuilds every user.
    headers = [(source.parent / name).read_text() for name in re.findall(r'#include\s+"([^"]+)"', text)]
    identity = [text, *headers, version, _machine_tag(), *_COMMON_FLAGS]
    folder = cache_dir() / "cpu_kernels"
    folder.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _FLAG_SETS:
        digest = hashlib.sha256("\0".join([*identity, *flags, *defines]).encode()).hexdigest()[:20]
        path = folder / f"{source.stem}{'-' + tag if tag else ''}-{digest}.so"
        if not path.exists():
            error = _compile(cc, source, flags, defines, path)
            if error is not None:
                errors.append(error)
                continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        if not _subnormals_work():
            # The load switched this process to flush-to-zero (a compiler that links
            # fast-math start files). Too late to undo for this process; say so plainly.
            raise CpuKernelError(f"loading {path} turned on flush-to-zero for the process; "
                                 "use the torch backends or another compiler (CC)")
        rejected = accept(lib) if accept is not None else None
        if rejected:
            errors.append(f"{path}: {rejected}")
            continue
        return lib, flags
    raise CpuKernelError(f"could not build {what}:\n" + "\n".join(errors))


_loaded: dict[tuple[Path, tuple[str, ...]], Any] = {}


def load_library(what: str, source: Path, declare: Callable[[Any], None], defines: tuple[str, ...] = (),
                 accept: Any = None, tag: str = "") -> Any:
    """Build (or take from the disk cache) and load ``source`` with ``defines``, once per process.

    ``declare(lib)`` sets the ctypes signatures; ``what`` names the library in errors and logs;
    ``accept`` and ``tag`` are passed to :func:`build`.

    Raises:
        CpuKernelError: no compiler, or it would not build here.
    """
    key = (source, defines)
    lib = _loaded.get(key)
    if lib is not None:
        return lib
    with _build_lock:
        lib = _loaded.get(key)
        if lib is None:
            lib, flags = build(what, source, list(defines), accept, tag=tag)
            declare(lib)
            logger.info("%s%s: flags %s", what, f" ({tag})" if tag else "", " ".join(flags))
            _loaded[key] = lib
        return lib


def _declare_attention(lib: Any) -> None:
    fn = lib.batchgen_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p]
                   + [ctypes.c_int64] * 2)


def load(head_size: int, group: int) -> Any:
    """The compiled kernel library for this shape (built on first use, then cached).

    Raises:
        CpuKernelError: no compiler, or no flag set compiled; the message has the last error.
    """
    def accept(lib: Any) -> str | None:
        ok = lib.batchgen_head_size() == head_size and lib.batchgen_group() == group
        return None if ok else "built for another shape"

    return load_library("the CPU attention kernel", KERNEL_SOURCE, _declare_attention,
                        (f"-DHEAD_SIZE={head_size}", f"-DGROUP={group}"), accept,
                        tag=f"h{head_size}-g{group}")


class CpuOps:
    """The ``cpu`` backend's ops, with :mod:`reference`'s signatures."""

    reshape_and_cache = staticmethod(reference.reshape_and_cache)
    copy_blocks = staticmethod(reference.copy_blocks)
    paged_prefill_attention = staticmethod(reference.paged_prefill_attention)

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        workspace: reference.Workspace | None = None,
    ) -> torch.Tensor:
        """See :func:`reference.paged_decode_attention`; float32 CPU tensors only.

        Raises:
            ValueError: inputs outside the contract (the kernel reads raw memory, so every
                index it would follow is checked first).
        """
        num_seqs, num_heads, head_size = query.shape
        num_blocks, block_size, num_kv_heads, cache_head = k_cache.shape
        for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ValueError(f"paged_decode_attention (cpu): {name} must be a float32 CPU tensor, "
                                 f"got {t.dtype} on {t.device}")
        if v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("paged_decode_attention (cpu): k_cache and v_cache must be contiguous "
                             "and of one shape")
        if cache_head != head_size or num_heads % num_kv_heads:
            raise ValueError(f"paged_decode_attention (cpu): query {tuple(query.shape)} does not fit "
                             f"the cache {tuple(k_cache.shape)}")
        out = torch.empty(num_seqs, num_heads, head_size, dtype=torch.float32)
        if num_seqs == 0:
            return out
        if query.stride(2) != 1:
            query = query.contiguous()
        tables = block_tables.to(torch.int32).contiguous()  # no copies for the engine's own
        lens = context_lens.to(torch.int32).contiguous()
        if tables.dim() != 2 or tables.shape[0] != num_seqs or lens.shape != (num_seqs,):
            raise ValueError(f"paged_decode_attention (cpu): {num_seqs} queries but block_tables "
                             f"{tuple(tables.shape)} and context_lens {tuple(lens.shape)}")
        max_blocks = tables.shape[1]
        group = num_heads // num_kv_heads
        fn = load(head_size, group).batchgen_paged_decode_f32
        # Room for the longest context the tables allow, so no reduction over lens is needed.
        shape = (max(max_blocks, 1) * block_size * group,)
        scratch = (workspace.get("cpu_scores", shape, torch.float32, k_cache.device)
                   if workspace is not None else torch.empty(shape, dtype=torch.float32))
        # The kernel checks every index it would follow before computing anything.
        status = fn(out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                    tables.data_ptr(), lens.data_ptr(), num_seqs, num_kv_heads, block_size, max_blocks,
                    query.stride(0), query.stride(1), float(scale), scratch.data_ptr(), num_blocks,
                    shape[0])
        if status == 1:
            raise ValueError(f"paged_decode_attention (cpu): context_lens must be in [1, "
                             f"{max_blocks * block_size}] (the block tables' width)")
        if status == 2:
            # Only entries a sequence reads must be valid; padding past them is never read.
            raise ValueError(f"paged_decode_attention (cpu): block table entries must be in [0, {num_blocks})")
        return out


_ops: CpuOps | None = None


def get_cpu_ops() -> CpuOps:
    """The ``cpu`` backend's ops (one shared instance)."""
    global _ops
    if _ops is None:
        _ops = CpuOps()
    return _ops
