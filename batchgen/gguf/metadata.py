"""The HF config and tokenizer of a GGUF file, read once and kept in a cache folder.

transformers reads a GGUF's metadata (architecture, sizes, RoPE, the vocabulary and its merges,
the chat template) into an HF config and a fast tokenizer (``from_pretrained(folder,
gguf_file=name)``). That takes 10-25 s on a small CPU, mostly parsing the vocabulary, so it runs
once per file: the result is saved as an ordinary HF folder (``config.json`` and the tokenizer
files, no weights) under ``<cache>/gguf/<stem>-<key>``, where the key hashes the file's absolute
path, size and modification time. Every later load, and everything that wants the tokenizer
(``AutoTokenizer.from_pretrained(folder)``), reads that folder. The weights always come from the
GGUF itself (:mod:`batchgen.gguf.hf_model`).

The folder also keeps the file's tensor table (``tensors.json``: names, block types, shapes
and offsets), so that loading maps the weights without parsing the header again
(:meth:`batchgen.gguf.reader.GGUFFile.from_table`); the key changes when the file does.

Before the folder is written, the file is checked: the HF config transformers reads is
completed from the metadata transformers' reader leaves out, per the architecture's row
(:data:`batchgen.gguf.architectures.ARCHITECTURES`: soft-capping, sliding-window layers,
per-layer-type RoPE); the file's tensors are checked against the model that config builds
(:func:`batchgen.gguf.tensor_map.check_tensors`); and the chat template
(``tokenizer.chat_template``) is rendered once. Each failure is a
:class:`~batchgen.gguf.reader.GGUFError` naming the file (and the tensor), so ``batchgen
validate`` refuses it (exit 2) rather than the first row of a run.

The folder is written into ``<target>.tmp-<pid>-*`` and renamed into place, as the embedded
model's conversion is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from batchgen.cache import cache_dir, remove_stale_temp_folders
from batchgen.gguf.architectures import ARCHITECTURES
from batchgen.gguf.reader import GGUFError, GGUFFile
from batchgen.quiet import libraries_quiet

logger = logging.getLogger(__name__)

__all__ = ["TABLE_FILE", "hf_config", "metadata_folder", "metadata_folder_for", "open_gguf"]

#: The conversation a chat template is rendered with once, at load.
_PROBE_CHAT = [{"role": "user", "content": "Hello"}]

#: Written last into a metadata folder: its presence means the folder is complete.
DONE_MARKER = "batchgen-gguf.json"
#: The tensor table of the file (:meth:`GGUFFile.table`).
TABLE_FILE = "tensors.json"


def metadata_folder_for(path: Path) -> Path:
    """Where the metadata folder of the GGUF file ``path`` lives (it may not exist yet)."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


def metadata_folder(path: Path) -> Path:
    """The HF folder (config + tokenizer) of the GGUF file ``path``, made on first use.

    The file's header is parsed and its architecture checked first, so that a corrupt file or
    an unsupported architecture fails here with a :class:`~batchgen.gguf.reader.GGUFError`
    naming the file, before transformers reads it.
    """
    target = metadata_folder_for(path)
    if (target / DONE_MARKER).is_file():
        return target
    gguf = GGUFFile(path)
    gguf.check_architecture()
    started = time.perf_counter()
    logger.info("reading the config and tokenizer of %s (once per file: 10-25 s for a 50k-token vocabulary; "
                "then kept in %s)", path.name, target)
    with libraries_quiet():  # transformers' bars and info logs, for the read only
        _write_folder(path, gguf, target)
    logger.info("read the config and tokenizer of %s in %.1f s", path.name, time.perf_counter() - started)
    return target


def _write_folder(path: Path, gguf: GGUFFile, target: Path) -> None:
    """Write ``target``, the metadata folder of ``path`` (``gguf``, its parsed header):
    transformers' config and tokenizer of the file, and its tensor table, into a temporary
    folder renamed into place last."""
    # deferred: transformers (~3 s, and torch) only to convert a file once; this module stays torch-free
    from transformers import AutoConfig, AutoTokenizer

    for stale in remove_stale_temp_folders(target):
        logger.info("removed %s, left by an interrupted read", stale)
    folder, name = str(path.parent), path.name
    config = hf_config(gguf, AutoConfig.from_pretrained(folder, gguf_file=name))
    from batchgen.gguf.tensor_map import check_tensors  # torch: this module stays torch-free

    check_tensors(gguf, config)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _check_chat_template(path, tokenizer)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / TABLE_FILE).write_text(json.dumps(gguf.table()))
        (tmp / DONE_MARKER).write_text(json.dumps({"gguf_file": str(path.resolve()),
                                                   "architecture": gguf.architecture}))
        try:
            os.replace(tmp, target)
        except OSError:
            # another process wrote the same folder first; theirs is as good as ours
            if not (target / DONE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def hf_config(gguf: GGUFFile, config: Any) -> Any:
    """``config`` (transformers' reading of ``gguf``'s metadata) completed with what its
    architecture's row reads from the metadata besides, its vocabulary the token embedding's
    rows, and without a GGUF ``quantization_config`` (the folder holds no weights)."""
    from transformers import AutoConfig  # deferred: transformers (and torch); this module stays torch-free

    arch = gguf.architecture
    updates = ARCHITECTURES[arch].config(lambda key: gguf.field(f"{arch}.{key}"))
    values = config.to_dict()
    values.pop("quantization_config", None)
    model_type = values.pop("model_type")
    values.pop("transformers_version", None)
    values.update(updates)
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is not None:  # the rows the file has (Gemma 3's converter drops the padding rows)
        values["vocab_size"] = int(embedding.shape.tolist()[-1])
    if (values.get("pad_token_id") or 0) >= values.get("vocab_size", 0) > 0:
        values["pad_token_id"] = None  # a class default (Phi-3's 32000) the file's vocabulary lacks
    return AutoConfig.for_model(model_type, **values)


def _check_chat_template(path: Path, tokenizer: Any) -> None:
    """Render the file's chat template once, so that one that cannot be rendered fails here.

    Raises:
        GGUFError: naming the file and the template's error.
    """
    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template(_PROBE_CHAT, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2's syntax and undefined errors, a template's own raise_exception
        raise GGUFError(f"{path}: its chat template (tokenizer.chat_template) cannot be rendered: "
                        f"{type(exc).__name__}: {exc}") from None


def open_gguf(path: Path, folder: Path) -> GGUFFile:
    """The GGUF file ``path``, mapped with the tensor table kept in its metadata ``folder``
    when that table is there (else parsed with the ``gguf`` reader)."""
    table = Path(folder) / TABLE_FILE
    if table.is_file():
        return GGUFFile.from_table(path, json.loads(table.read_text()))
    return GGUFFile(path)
