"""Where NVRTC's headers come from, and whether the ``cuda`` backend can build here.

NVRTC compiles ``paged_attention.cu`` at run time; the source includes ``cuda_fp16.h`` and
``cuda_bf16.h``, which NVRTC does not ship. They come from a CUDA toolkit or from NVIDIA's
runtime wheel, whose layout changed with CUDA 13:

=============================  ======================================  ====================
where                          directory                               installed by
=============================  ======================================  ====================
``$CUDA_PATH``, ``$CUDA_HOME``  ``<root>/include``                      a CUDA toolkit
CUDA 13 wheels                 ``site-packages/nvidia/cu13/include``   ``nvidia-cuda-runtime`` 13.x
CUDA 12 wheels                 ``site-packages/nvidia/cuda_runtime/include``  ``nvidia-cuda-runtime-cu12``
default toolkit                ``/usr/local/cuda/include``             a CUDA toolkit
=============================  ======================================  ====================

Each candidate's CUDA version is read from its ``cuda_runtime_api.h`` (``CUDART_VERSION``).
Headers of NVRTC's own major version are preferred; headers newer than NVRTC are skipped (a
CUDA 13 header can use what a CUDA 12 NVRTC does not know). Only the best directory is passed
to NVRTC, so two installs never mix.

:func:`unavailable_reason` says why the backend cannot compile here (no cupy, no NVRTC library,
no headers), so that ``attention_backend: auto`` falls back to ``torch`` with that reason
logged instead of failing at the first launch. cupy is imported only inside the functions.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HEADERS = ("cuda_fp16.h", "cuda_bf16.h")
# (sub-directory of a site-packages entry, what installs it), best first.
WHEEL_LAYOUTS = (
    ("nvidia/cu13/include", "the nvidia-cuda-runtime wheel (CUDA 13)"),
    ("nvidia/cuda_runtime/include", "the nvidia-cuda-runtime-cu12 wheel (CUDA 12)"),
)
DEFAULT_TOOLKIT = Path("/usr/local/cuda")
INSTALL_HINT = ("pip install 'batchgen[cuda]' (CUDA 12: cupy-cuda12x, nvidia-cuda-runtime-cu12, "
                "nvidia-cuda-nvrtc-cu12) or 'batchgen[cuda13]' (CUDA 13), or set CUDA_PATH to a "
                "CUDA toolkit")


@dataclass(frozen=True)
class IncludeDir:
    """A directory that may hold NVRTC's headers."""

    path: Path
    origin: str
    cuda_version: int | None = None  # CUDART_VERSION, e.g. 12040; None: unknown

    @property
    def has_headers(self) -> bool:
        return all((self.path / h).is_file() for h in HEADERS)

    @property
    def cuda_major(self) -> int | None:
        return None if self.cuda_version is None else self.cuda_version // 1000


def header_cuda_version(include: Path) -> int | None:
    """``CUDART_VERSION`` of the headers in ``include`` (e.g. 13000), or None if unknown."""
    try:
        text = (include / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(m.group(1)) if m else None


def candidate_dirs(search_path: Iterable[str] | None = None) -> list[IncludeDir]:
    """Every place looked in, in order, whether or not it holds the headers.

    Args:
        search_path: the directories searched for the wheel layouts (default ``sys.path``).
    """
    found: list[tuple[Path, str]] = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            found.append((Path(os.environ[var]) / "include", f"${var}"))
    for entry in sys.path if search_path is None else search_path:
        for sub, origin in WHEEL_LAYOUTS:
            found.append((Path(entry or ".") / sub, origin))
    found.append((DEFAULT_TOOLKIT / "include", str(DEFAULT_TOOLKIT)))
    seen: set[Path] = set()
    out = []
    for path, origin in found:
        key = path.resolve() if path.exists() else path
        if key in seen:
            continue
        seen.add(key)
        out.append(IncludeDir(path, origin, header_cuda_version(path)))
    return out


def find_include_dirs(nvrtc_major: int | None = None,
                      search_path: Iterable[str] | None = None) -> list[IncludeDir]:
    """The directories holding both headers that NVRTC of ``nvrtc_major`` can use, best first.

    With ``nvrtc_major`` known, headers of that major version come first, then those of
    unknown version, then older ones; newer ones are left out.
    """
    dirs = [d for d in candidate_dirs(search_path) if d.has_headers]
    if nvrtc_major is None:
        return dirs

    def rank(d: IncludeDir) -> int:
        return 0 if d.cuda_major == nvrtc_major else 1 if d.cuda_major is None else 2

    usable = [d for d in dirs if d.cuda_major is None or d.cuda_major <= nvrtc_major]
    return sorted(usable, key=rank)  # stable: the search order breaks ties


def nvrtc_include_dirs(nvrtc_major: int | None = None) -> list[str]:
    """Paths of :func:`find_include_dirs`, best first (the first one is passed to NVRTC)."""
    return [str(d.path) for d in find_include_dirs(nvrtc_major)]


def missing_headers_reason(nvrtc_major: int | None, search_path: Iterable[str] | None = None) -> str:
    """What to install when no directory fits (names the places looked in)."""
    version = f" of CUDA {nvrtc_major} or older" if nvrtc_major else ""
    looked = "; ".join(f"{d.path}" + (f" (CUDA {d.cuda_major}, newer than NVRTC)"
                                      if d.has_headers and nvrtc_major and d.cuda_major
                                      and d.cuda_major > nvrtc_major else "")
                       for d in candidate_dirs(search_path)
                       if d.path.parent.exists() or d.origin.startswith("$"))
    return (f"NVRTC needs cuda_fp16.h and cuda_bf16.h{version}; none found (looked in: "
            f"{looked or 'no candidate directory exists'}). {INSTALL_HINT}")


def _import_cupy() -> ModuleType:
    import cupy  # optional dependency, imported only here and in CupyBackend

    return cupy


def nvrtc_version() -> tuple[int, int] | None:
    """NVRTC's (major, minor) through cupy, or None when cupy or NVRTC cannot be loaded."""
    try:
        from_cupy = _import_cupy().cuda.nvrtc.getVersion()
        return int(from_cupy[0]), int(from_cupy[1])
    except Exception:  # noqa: BLE001 - any failure means: unknown
        return None


def unavailable_reason() -> str | None:
    """Why cupy cannot compile the kernels here (no cupy, no NVRTC, no headers), or None.

    Does not compile anything; a compile failure with everything present is reported by the
    first build (see :func:`batchgen.kernels.cuda_unavailable_reason`).
    """
    try:
        cupy = _import_cupy()
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install's OSError
        return f"cupy cannot be imported ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    try:
        major, _minor = cupy.cuda.nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - a missing libnvrtc surfaces as several types
        return f"NVRTC cannot be loaded ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    if not find_include_dirs(int(major)):
        return missing_headers_reason(int(major))
    return None
