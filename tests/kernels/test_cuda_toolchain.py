"""NVRTC header discovery on CUDA 12 and 13 layouts, and ``auto``'s fallback when it cannot build.

The layouts are built in temporary directories the way the wheels install them
(``nvidia/cuda_runtime/include`` for ``nvidia-cuda-runtime-cu12``, ``nvidia/cu13/include`` for
CUDA 13's ``nvidia-cuda-runtime``), and cupy/NVRTC are replaced by stand-ins that fail the way
a broken install does.
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from batchgen import kernels
from batchgen.kernels.cuda import toolchain


def _headers(include: Path, cudart_version: int | None) -> Path:
    include.mkdir(parents=True)
    for name in toolchain.HEADERS:
        (include / name).write_text("")
    if cudart_version is not None:
        (include / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION  {cudart_version}\n")
    return include


@pytest.fixture
def no_system_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Hide this machine's CUDA toolkit and site-packages from the search."""
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(toolchain, "DEFAULT_TOOLKIT", tmp_path / "no-toolkit")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty-site")])


def test_both_wheel_layouts_are_found_and_versioned(no_system_cuda, tmp_path: Path) -> None:
    site12, site13 = tmp_path / "site12", tmp_path / "site13"
    cu12 = _headers(site12 / "nvidia" / "cuda_runtime" / "include", 12080)
    cu13 = _headers(site13 / "nvidia" / "cu13" / "include", 13000)
    found = toolchain.find_include_dirs(search_path=[str(site12), str(site13)])
    assert [(d.path, d.cuda_major) for d in found] == [(cu12, 12), (cu13, 13)]
    assert "cu12" in found[0].origin and "CUDA 13" in found[1].origin
    # NVRTC 13 prefers its own headers; NVRTC 12 never gets CUDA 13's.
    assert toolchain.find_include_dirs(13, [str(site12), str(site13)])[0].path == cu13
    assert [d.path for d in toolchain.find_include_dirs(12, [str(site12), str(site13)])] == [cu12]


def test_a_directory_needs_both_headers(no_system_cuda, tmp_path: Path) -> None:
    inc = tmp_path / "site" / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    (inc / "cuda_fp16.h").write_text("")
    assert toolchain.find_include_dirs(search_path=[str(tmp_path / "site")]) == []
    (inc / "cuda_bf16.h").write_text("")
    assert [d.path for d in toolchain.find_include_dirs(search_path=[str(tmp_path / "site")])] == [inc]


def test_search_order_toolkit_env_then_wheels_then_default(monkeypatch, no_system_cuda, tmp_path: Path) -> None:
    home = _headers(tmp_path / "home" / "include", None)  # version unknown
    path = _headers(tmp_path / "path" / "include", 12040)
    wheel = _headers(tmp_path / "site" / "nvidia" / "cuda_runtime" / "include", 12040)
    default = _headers(tmp_path / "usr-cuda" / "include", 12040)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "path"))
    monkeypatch.setattr(toolchain, "DEFAULT_TOOLKIT", tmp_path / "usr-cuda")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    assert toolchain.nvrtc_include_dirs() == [str(p) for p in (path, home, wheel, default)]
    # Known-matching versions rank before the unknown one.
    assert toolchain.nvrtc_include_dirs(12) == [str(p) for p in (path, wheel, default, home)]


def test_the_re_export_keeps_its_old_name(no_system_cuda, monkeypatch, tmp_path: Path) -> None:
    from batchgen.kernels.cuda import cuda_attention as attention

    site = tmp_path / "site"
    inc = _headers(site / "nvidia" / "cu13" / "include", 13000)
    monkeypatch.setattr(sys, "path", [str(site)])
    assert attention.nvrtc_include_dirs() == [str(inc)]


def test_the_machines_own_cuda_13_toolkit_is_found() -> None:
    # This machine's nvcc comes from CUDA 13 wheels laid out under /usr/local/cuda.
    include = Path("/usr/local/cuda/include")
    if not (include / "cuda_fp16.h").is_file():
        pytest.skip("no CUDA toolkit at /usr/local/cuda")
    dirs = toolchain.find_include_dirs()
    assert include in [d.path for d in dirs]
    assert next(d for d in dirs if d.path == include).cuda_major == toolchain.header_cuda_version(include) // 1000


def _fake_cupy(nvrtc_version=None, nvrtc_error: Exception | None = None, compile_error: str | None = None):
    def get_version():
        if nvrtc_error is not None:
            raise nvrtc_error
        return nvrtc_version

    class Module:
        def get_function(self, name: str):
            if compile_error:
                raise RuntimeError(compile_error)
            return object()

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(nvrtc=types.SimpleNamespace(getVersion=get_version),
                                      runtime=types.SimpleNamespace(getDevice=lambda: 0))
    fake.RawModule = lambda code, options: Module()
    return fake


def test_unavailable_reason_names_what_is_missing(monkeypatch, no_system_cuda, tmp_path: Path) -> None:
    def no_cupy():
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(toolchain, "_import_cupy", no_cupy)
    why = toolchain.unavailable_reason()
    assert "cupy cannot be imported" in why and "batchgen[cuda]" in why and "batchgen[cuda13]" in why
    assert toolchain.nvrtc_version() is None

    monkeypatch.setattr(toolchain, "_import_cupy", lambda: _fake_cupy(
        nvrtc_error=OSError("libnvrtc.so.13: cannot open shared object file")))
    why = toolchain.unavailable_reason()
    assert why.startswith("NVRTC cannot be loaded (OSError: libnvrtc.so.13") and "nvidia-cuda-nvrtc" in why

    monkeypatch.setattr(toolchain, "_import_cupy", lambda: _fake_cupy(nvrtc_version=(12, 8)))
    site = tmp_path / "site"
    cu13 = _headers(site / "nvidia" / "cu13" / "include", 13000)
    monkeypatch.setattr(sys, "path", [str(site)])
    why = toolchain.unavailable_reason()
    assert why.startswith("NVRTC needs cuda_fp16.h and cuda_bf16.h of CUDA 12 or older")
    assert f"{cu13} (CUDA 13, newer than NVRTC)" in why

    _headers(site / "nvidia" / "cuda_runtime" / "include", 12080)
    assert toolchain.unavailable_reason() is None


def test_cuda_unavailable_reason_reports_a_failed_build(monkeypatch, no_system_cuda, tmp_path: Path) -> None:
    from batchgen.kernels.cuda import cuda_attention as attention

    site = tmp_path / "site"
    _headers(site / "nvidia" / "cu13" / "include", 13000)
    monkeypatch.setattr(sys, "path", [str(site)])
    fake = _fake_cupy(nvrtc_version=(13, 0), compile_error="catastrophic error: cannot open source file "
                                                          "\"cuda_fp16.h\"\n1 catastrophic error detected")
    monkeypatch.setattr(toolchain, "_import_cupy", lambda: fake)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    backend = attention.CupyBackend()
    monkeypatch.setattr(backend, "launch_context", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(attention, "_ops", {True: attention.KernelOps(backend)})
    why = kernels.cuda_unavailable_reason(torch.float16, 128, 16, torch.device("cuda", 0))
    assert why.startswith("NVRTC could not build the kernels (RuntimeError): catastrophic error")
    # With a working compiler: None, and only the one best header directory goes to NVRTC.
    fake.RawModule = lambda code, options: types.SimpleNamespace(get_function=lambda name: object(),
                                                                 options=options)
    backend._modules.clear()
    assert kernels.cuda_unavailable_reason(torch.float16, 128, 16, torch.device("cuda", 0)) is None
    options = next(iter(backend._modules.values())).options
    assert [o for o in options if o.startswith("-I")] == [f"-I{site / 'nvidia' / 'cu13' / 'include'}"]


def test_auto_falls_back_to_torch_with_the_reason_logged(monkeypatch, tiny_model, caplog) -> None:
    # A model on a (pretend) GPU whose cupy cannot load NVRTC: auto logs why and serves it with
    # the torch backend; asking for cuda by name is an error with the same reason.
    from batchgen.engine.config import EngineConfig
    from batchgen.engine.llm import load_runner

    path = tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=2,
                      num_key_value_heads=1)
    monkeypatch.setattr(kernels, "resolve_backend", lambda name, device: "torch" if name == "torch" else "cuda")
    monkeypatch.setattr(toolchain, "_import_cupy", lambda: _fake_cupy(
        nvrtc_error=RuntimeError("CUDA driver/NVRTC library not found")))
    with caplog.at_level(logging.WARNING, logger="batchgen.engine.model_runner"):
        runner = load_runner(EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory=2**20))
    assert runner.attention_backend == "torch"
    assert "NVRTC cannot be loaded (RuntimeError: CUDA driver/NVRTC library not found)" in caplog.text
    assert "using the torch backend" in caplog.text
    with pytest.raises(ValueError, match=r"attention_backend='cuda' cannot serve this model: NVRTC "
                                         r"cannot be loaded"):
        load_runner(EngineConfig(model=path, dtype="float32", device="cpu", kv_cache_memory=2**20, attention_backend="cuda"))
