"""Builds and loads batchgen's C kernels for the CPU: compiled at run time, cached on disk.

Each C source here (``paged_attention.c``, ``linear.c``, ``fused.c``) is compiled by the system C
compiler (``$CC``, else ``cc`` or ``gcc``) for the machine it runs on (``-march=native``), with
its compile-time constants as ``-D`` defines, cached under ``$BATCHGEN_CACHE_DIR/cpu_kernels``
(default ``~/.cache/batchgen``) by a hash of the source, the local headers it includes, the
flags, the compiler and the CPU, and loaded once per process with ctypes
(:func:`load_library`).

Never ``-ffast-math``: a shared library linked with it switches the whole process to
flush-to-zero, and a library whose load changes the FP mode is refused.

Threads: one pool per process (``pool.h``, built from ``pool.c`` as a library of its own).
Every library that includes ``pool.h`` exports ``batchgen_pool_attach``, and is handed the
process's pool when it is loaded; :func:`set_num_threads` sizes that pool, for the libraries
loaded so far and those loaded later.
"""

from __future__ import annotations

import ctypes
import functools
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

from batchgen.cache import cache_dir

logger = logging.getLogger(__name__)

# Flag sets tried in order; the first that compiles and links is used. Never -ffast-math: a
# shared library linked with it sets flush-to-zero / denormals-are-zero for the whole process.
_FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"),
    ("-O3", "-fopenmp-simd", "-fno-math-errno"),
    ("-O2",),
)
_COMMON_FLAGS = ("-std=c99", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror", "-Wno-unknown-pragmas")

#: ``$BATCHGEN_CPU_ISA``: what of this CPU the kernels may use. ``native`` (the default) is all of
#: it; ``avx2`` builds every kernel as for a CPU without AVX-512 and AVX-VNNI (those flags after
#: ``-march=native``) and hides those features from the checks (:func:`cpu_flags`): the AVX2
#: path, measured or debugged on a newer CPU (its caches and clock stay this CPU's). Each row:
#: the compiler flags, and the prefixes of the ``/proc/cpuinfo`` features hidden.
CPU_ISA_CAPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "native": ((), ()),
    "avx2": (("-mno-avx512f", "-mno-avxvnni"), ("avx512", "avx_vnni", "amx")),
}


@functools.lru_cache(maxsize=1)
def cpu_isa_cap() -> str:
    """The :data:`CPU_ISA_CAPS` row ``$BATCHGEN_CPU_ISA`` names (``native`` when unset).

    Raises:
        CpuKernelError: a value with no row.
    """
    cap = os.environ.get("BATCHGEN_CPU_ISA", "native").strip().lower() or "native"
    if cap not in CPU_ISA_CAPS:
        raise CpuKernelError(f"BATCHGEN_CPU_ISA={cap!r} is not one of {', '.join(CPU_ISA_CAPS)}; "
                             "unset it to use all of this CPU")
    return cap


class CpuKernelError(RuntimeError):
    """The CPU kernel cannot be built or loaded here (no compiler, or every flag set failed)."""


def compiler() -> str | None:
    """The C compiler the backend would use (``$CC``, ``cc`` or ``gcc``), or None."""
    env = os.environ.get("CC")
    if env:
        return shutil.which(env) or (env if Path(env).is_file() else None)
    return shutil.which("cc") or shutil.which("gcc")


def _machine_tag() -> str:
    """CPU model and flags: a build with -march=native is only valid on the same kind of CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return os.uname().machine + "\n" + "\n".join(keep)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as the kernel reports them (``/proc/cpuinfo``), less those
    ``$BATCHGEN_CPU_ISA`` hides (:data:`CPU_ISA_CAPS`), or None where they cannot be read (then
    only the build, and each library's own check, decide)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    hidden = CPU_ISA_CAPS[cpu_isa_cap()][1]
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(f for f in line.partition(":")[2].split() if not f.startswith(hidden))
    return None


def missing_cpu_features(*names: str) -> str | None:
    """Why this CPU cannot run code that needs ``names`` (``/proc/cpuinfo`` spellings, e.g.
    ``avx2``, ``fma``, ``avx512_bf16``), or None when it has them all or its flags are unknown."""
    flags = cpu_flags()
    if flags is None:
        return None
    missing = [name for name in names if name not in flags]
    if not missing:
        return None
    cap = cpu_isa_cap()
    source = "flags from /proc/cpuinfo" + (f", less those BATCHGEN_CPU_ISA={cap} hides" if cap != "native" else "")
    return f"this CPU lacks {', '.join(n.upper() for n in missing)} ({source})"


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


_LOCAL_INCLUDE = re.compile(r'#include\s+"([^"]+)"')


def local_headers(source: Path) -> list[Path]:
    """The local headers (``#include "..."``, beside the file that includes them) that ``source``
    includes, directly or through another of them: each once, in the order first included."""
    found: list[Path] = []

    def scan(path: Path) -> None:
        for name in _LOCAL_INCLUDE.findall(path.read_text()):
            header = path.parent / name
            if header not in found:
                found.append(header)
                scan(header)

    scan(source)
    return found


def runs_here(symbol: str) -> Any:
    """An ``accept`` for :func:`build`: the library's own ``int symbol(void)`` cpuid check says
    whether this CPU runs the instructions it was built for (else the reason to refuse it)."""
    def accept(lib: Any) -> str | None:
        check = getattr(lib, symbol)
        check.restype = ctypes.c_int
        return None if check() else "built for instructions this CPU lacks"

    return accept


def build(what: str, source: Path, defines: list[str], accept: Any = None, tag: str = "") -> tuple[Any, tuple[str, ...]]:
    """Compile ``source`` (``what`` names it in errors) with the first flag set that works,
    cached on disk, and load it.

    The build is cached under ``cache_dir()/cpu_kernels`` by a hash of the source and the
    local headers it includes (:func:`local_headers`), compiler version, CPU, flags and ``defines``
    (with ``$BATCHGEN_CPU_ISA``'s flags last, :data:`CPU_ISA_CAPS`); ``tag`` goes into the file name. ``accept(lib)`` may return an error string to reject a
    loaded library (it is then skipped, like a failed compile). Call with ``_build_lock`` held.

    Returns:
        ``(library, flags)``.

    Raises:
        CpuKernelError: no compiler, no flag set compiled, or loading changed the FP mode.
    """
    cc = compiler()
    if cc is None:
        raise CpuKernelError("no C compiler found (set CC, or install gcc)")
    cap = cpu_isa_cap()
    if cap != "native":  # after the library's own flags: the cap wins
        defines, tag = [*defines, *CPU_ISA_CAPS[cap][0]], f"{tag}-{cap}" if tag else cap
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    text = source.read_text()
    # Local headers it includes ("...", nested ones too), so that editing one rebuilds every user.
    headers = [header.read_text() for header in local_headers(source)]
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
POOL_SOURCE = Path(__file__).resolve().parent / "pool.c"
_pool: Any = None  # the pool library once loaded; False if it cannot be built here
_num_threads = 1


def _pool_library() -> Any:
    """The pool library (built on first use), or None where it cannot be built (the kernels
    then run on the calling thread). Call with ``_build_lock`` held."""
    global _pool
    if _pool is None:
        try:
            lib, _ = build("the CPU thread pool", POOL_SOURCE, [])
        except CpuKernelError as exc:
            logger.warning("the CPU kernels run on one thread: %s", str(exc).splitlines()[0])
            _pool = False
            return None
        lib.batchgen_pool_ops.restype = ctypes.c_void_p
        lib.batchgen_pool_ops.argtypes = []
        lib.batchgen_set_num_threads.restype = None
        lib.batchgen_set_num_threads.argtypes = [ctypes.c_int]
        lib.batchgen_num_threads.restype = ctypes.c_int
        lib.batchgen_num_threads.argtypes = []
        lib.batchgen_set_num_threads(_num_threads)
        _pool = lib
    return _pool or None


def _attach_pool(lib: Any, what: str) -> None:
    """Hand the process's pool to ``lib`` if it includes ``pool.h``."""
    attach = getattr(lib, "batchgen_pool_attach", None)
    if attach is None:
        return
    pool = _pool_library()
    if pool is None:
        return
    attach.restype = ctypes.c_int
    attach.argtypes = [ctypes.c_void_p]
    if attach(pool.batchgen_pool_ops()) != 0:
        logger.warning("%s was built against another thread pool; it runs on one thread", what)


def set_num_threads(n: int) -> None:
    """Run the C kernels on ``n`` threads (the caller included; 1 = the calling thread only),
    in every library loaded now or later. Call between kernel calls, not during one.

    Raises:
        ValueError: ``n`` below 1.
    """
    global _num_threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the CPU kernels' thread count must be an integer >= 1, got {n!r}")
    with _build_lock:
        _num_threads = n
        if _pool:
            _pool.batchgen_set_num_threads(n)


def num_threads() -> int:
    """The thread count the C kernels run on (see :func:`set_num_threads`)."""
    return _num_threads


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
            _attach_pool(lib, what)
            logger.info("%s%s: flags %s", what, f" ({tag})" if tag else "", " ".join(flags))
            _loaded[key] = lib
        return lib
