"""GGUFFile: one GGUF file opened through the ``gguf`` package, with errors that name it.

The ``gguf`` package's ``GGUFReader`` maps the file into memory and parses its header: the
metadata fields and one entry per tensor (name, block type, shape, offset). This wrapper adds
what the loader needs on top:

- a file that is not a GGUF, or one whose header does not parse, raises :class:`GGUFError`
  naming the file;
- a truncated file raises :class:`GGUFError` saying so: cut inside its header (a field or a
  tensor entry runs past the end), or cut in its data (naming the first tensor that does not
  fit), before any weight is read;
- :meth:`GGUFFile.architecture` is checked against what batchgen builds
  (:data:`SUPPORTED_ARCHITECTURES`) by :meth:`GGUFFile.check_architecture`.

Parsing the header is slow for a big vocabulary (the reader builds numpy views of every token
string: 5-15 s and 160 MB transient for a 49k-token vocabulary on a small CPU), and the loader
needs only the tensor table. :meth:`GGUFFile.table` gives that table as plain data, which
:mod:`batchgen.gguf.metadata` keeps beside the config; :meth:`GGUFFile.from_table` maps the
file with it alone, without the reader.

No torch here: tensors come back as numpy views of the mapped file.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from batchgen.gguf.architectures import ARCHITECTURES

__all__ = ["GGUF_MAGIC", "GGUFError", "GGUFFile", "SUPPORTED_ARCHITECTURES", "TensorInfo", "is_gguf_file"]

GGUF_MAGIC = b"GGUF"
#: GGUF architectures (``general.architecture``) whose tensors the loader maps onto an HF
#: model, and the HF model type each becomes: read from the table
#: (:data:`batchgen.gguf.architectures.ARCHITECTURES`). ``llama`` covers Llama, SmolLM and
#: Mistral files (llama.cpp writes Mistral as ``llama``).
SUPPORTED_ARCHITECTURES: dict[str, str] = {name: row.hf_model_type for name, row in ARCHITECTURES.items()}


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded: not a GGUF, corrupt, truncated, or of an
    architecture batchgen does not build. The message names the file (and the tensor)."""


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _reader_class() -> type:
    # deferred: the gguf package (~0.6 s) only when a file is read, and its reader class with it
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class _CheckedReader(GGUFReader):
        """GGUFReader that checks every tensor's extent against the file before mapping it
        (the package's own reader fails on a truncated file with a reshape error that names
        no tensor), and every header read against the file's end (where it fails with numpy's
        "When changing to a larger dtype" instead)."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            end = int(offset) + int(np.dtype(dtype).itemsize) * int(count)
            if end > len(self.data):
                raise GGUFError(f"its header runs past the end of the file (byte {end} of {len(self.data)}): "
                                "the file is truncated")
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            size = len(self.data)
            for field in fields:
                _name_len, name_data, _n_dims, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise GGUFError(f"tensor {name!r} has an unknown block type {int(raw_dtype[0])}") from None
                block, type_size = GGML_QUANT_SIZES[qtype]
                n_elems = 1
                for dim in dims.tolist():
                    n_elems *= int(dim)
                if n_elems % block:
                    raise GGUFError(f"tensor {name!r} ({qtype.name}) has {n_elems} values, not a "
                                    f"multiple of its block of {block}")
                end = int(start_offs + offset[0]) + n_elems // block * type_size
                if end > size:
                    raise GGUFError(f"tensor {name!r} ({qtype.name}) ends at byte {end}, past the "
                                    f"end of the file ({size} bytes): the file is truncated")
            super()._build_tensors(start_offs, fields)

    return _CheckedReader


class TensorInfo(NamedTuple):
    """One tensor of the file (the fields of ``gguf.ReaderTensor`` that the loader reads)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: innermost dimension first
    n_bytes: int
    data: np.ndarray  # a view of the mapped file: typed for F32/F16, else uint8 [rows, row_bytes]


class GGUFFile:
    """A parsed GGUF file.

    Attributes:
        path: the file.
        tensors: ``name -> ReaderTensor`` (``.tensor_type``, ``.shape`` in GGUF order,
            innermost first, ``.data`` a numpy view of the mapped bytes, ``.n_bytes``).

    Raises:
        GGUFError: naming the file, and the tensor where one is at fault.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not is_gguf_file(self.path):
            raise GGUFError(f"{self.path} is not a GGUF file (it does not start with the GGUF "
                            "magic bytes)")
        try:
            self.reader = _reader_class()(str(self.path), "r")
        except GGUFError as exc:
            raise GGUFError(f"{self.path}: {exc}") from None
        except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self.path} is a corrupt GGUF file: its header does not parse "
                            f"({type(exc).__name__}: {exc})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        value = self.field("general.architecture")
        self.architecture = str(value) if value is not None else "?"

    @classmethod
    def from_table(cls, path: str | os.PathLike[str], table: dict[str, Any]) -> GGUFFile:
        """The file mapped with a :meth:`table` made from it earlier (no header parsing).

        Raises:
            GGUFError: the file is shorter than the table says (it changed since).
        """
        # deferred: the gguf package (~0.6 s) only when a file is read
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self = cls.__new__(cls)
        self.path = Path(path)
        self.reader = None
        self.architecture = table["architecture"]
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r")
        typed = {"F32": np.float32, "F16": np.float16}
        self.tensors = {}
        for name, type_id, shape, offset, n_bytes in table["tensors"]:
            qtype = GGMLQuantizationType(type_id)
            if offset + n_bytes > mapped.size:
                raise GGUFError(f"{self.path}: tensor {name!r} ({qtype.name}) ends at byte {offset + n_bytes}, "
                                f"past the end of the file ({mapped.size} bytes): the file is truncated")
            dims = tuple(reversed(shape))
            raw = mapped[offset:offset + n_bytes]
            if qtype.name in typed:
                data = raw.view(typed[qtype.name]).reshape(dims)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(dims, qtype))
            self.tensors[name] = TensorInfo(name, qtype, np.array(shape, dtype=np.uint64), n_bytes, data)
        return self

    def table(self) -> dict[str, Any]:
        """The architecture and tensor table as plain data (JSON): ``[name, type id, shape
        (GGUF order), byte offset, byte count]`` per tensor."""
        return {"architecture": self.architecture,
                "tensors": [[t.name, int(t.tensor_type), [int(d) for d in t.shape.tolist()],
                             int(t.data_offset), int(t.n_bytes)] for t in self.reader.tensors]}

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value ``key`` (a str, number or list), or ``default`` (also when the
        file was mapped :meth:`from_table`, which reads no metadata)."""
        field = self.reader.fields.get(key) if self.reader is not None else None
        return default if field is None else field.contents()

    @property
    def tensor_bytes(self) -> int:
        """The bytes of all tensors as stored (what a loader keeping them quantized holds)."""
        return sum(int(t.n_bytes) for t in self.tensors.values())

    def check_architecture(self) -> str:
        """The HF model type this file builds.

        Raises:
            GGUFError: the architecture is not one of :data:`SUPPORTED_ARCHITECTURES`, or the
                file holds a tensor its row refuses (naming it and why).
        """
        arch = self.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"{self.path}: GGUF architecture {arch!r} is not supported; batchgen "
                            f"loads GGUF files of: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name, why in ARCHITECTURES[arch].refused_tensors.items():
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} holds {why}, which batchgen does not apply "
                                f"to {arch!r} files yet")
        return SUPPORTED_ARCHITECTURES[arch]

    def tensor(self, name: str) -> Any:
        """The tensor ``name``.

        Raises:
            GGUFError: the file has no such tensor.
        """
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing from the file") from None

    def release(self, name: str) -> None:
        """Drop the mapped pages of tensor ``name`` from this process's resident memory (once
        its bytes have been copied out): they stay in the OS page cache, and a later read of
        ``data`` maps them again. Without this every page the loader read would stay resident
        beside its copy, doubling the weights' RSS. The pages at the tensor's two ends, shared
        with its neighbours, are kept. A no-op where ``madvise`` is missing."""
        data = self.tensor(name).data
        whole = data
        while isinstance(whole.base, np.ndarray):  # the map of the whole file, from byte 0
            whole = whole.base
        mapping = getattr(whole, "_mmap", None)
        if not isinstance(mapping, mmap.mmap) or not hasattr(mapping, "madvise"):
            return
        page = mmap.PAGESIZE
        start = data.ctypes.data - whole.ctypes.data
        first = -(-start // page) * page
        last = (start + data.nbytes) // page * page
        if last > first:
            try:
                mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
            except (OSError, ValueError):
                pass
