"""The backends a model's layers can run on, each choice spelled once.

``AttentionBackend`` (``engine.attention_backend``: the paged attention's kernels, see
:mod:`batchgen.kernels`) and ``LinearBackend`` (``engine.linear_backend``: the linear layers'
GEMM, see :mod:`batchgen.kernels.cpu.linear`) are ``Literal`` types: the engine's settings
(:class:`batchgen.engine.config.EngineConfig`), the YAML schema and the kernels read their
values with ``typing.get_args``. This module sits at the bottom of the package (it imports
nothing of batchgen), so the kernels need not import the engine to know their own names.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["AttentionBackend", "LinearBackend"]

AttentionBackend = Literal["auto", "cpu", "cuda", "torch"]
LinearBackend = Literal["auto", "cpu", "torch"]
