"""The HF config and tokenizer of a GGUF file, read once and kept in a cache folder.

transformers reads a GGUF's metadata (architecture, sizes, RoPE, the vocabulary and its merges,
the chat template) into an HF config and a fast tokenizer (``from_pretrained(folder,
gguf_file=name)``). That takes 10-25 s on a small CPU, mostly parsing the vocabulary, so it runs
once per file: the result is saved as an ordinary HF folder (``config.json`` and the tokenizer
files, no weights) under ``<cache>/gguf/<stem>-<key>``, where the key hashes the file's absolute
path, size and modification time. Every later load, and everything that wants the tokenizer
(``AutoTokenizer.from_pretrained(folder)``), reads that folder. The weights always come from the
GGUF itself (:mod:`batchgen.gguf.loader`).

The folder also keeps the file's tensor table (``tensors.json``: names, block types, shapes
and offsets), so that loading maps the weights without parsing the header again
(:meth:`batchgen.gguf.reader.GGUFFile.from_table`); the key changes when the file does.

The folder is written into ``<target>.tmp-<pid>-*`` and renamed into place, as the embedded
model's conversion is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from batchgen.gguf.reader import GGUFFile

logger = logging.getLogger(__name__)

__all__ = ["TABLE_FILE", "metadata_folder", "metadata_folder_for", "open_gguf"]

#: Written last into a metadata folder: its presence means the folder is complete.
DONE_MARKER = "batchgen-gguf.json"
#: The tensor table of the file (:meth:`GGUFFile.table`).
TABLE_FILE = "tensors.json"


def metadata_folder_for(path: Path) -> Path:
    """Where the metadata folder of the GGUF file ``path`` lives (it may not exist yet)."""
    from batchgen.cache import cache_dir

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
    import json

    target = metadata_folder_for(path)
    if (target / DONE_MARKER).is_file():
        return target
    gguf = GGUFFile(path)
    gguf.check_architecture()
    started = time.perf_counter()
    logger.info("reading the config and tokenizer of %s (once per file: 10-25 s for a 50k-token vocabulary; "
                "then kept in %s)", path.name, target)
    from batchgen.cache import remove_stale_temp_folders
    from batchgen.quiet import quiet_libraries

    quiet_libraries()
    from transformers import AutoConfig, AutoTokenizer

    for stale in remove_stale_temp_folders(target):
        logger.info("removed %s, left by an interrupted read", stale)
    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # the folder holds no weights: the config must not claim a GGUF quantization of its own
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
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
    logger.info("read the config and tokenizer of %s in %.1f s", path.name, time.perf_counter() - started)
    return target


def open_gguf(path: Path, folder: Path) -> GGUFFile:
    """The GGUF file ``path``, mapped with the tensor table kept in its metadata ``folder``
    when that table is there (else parsed with the ``gguf`` reader)."""
    import json

    table = Path(folder) / TABLE_FILE
    if table.is_file():
        return GGUFFile.from_table(path, json.loads(table.read_text()))
    return GGUFFile(path)
