"""GGUF models as they ship: the file's quantized blocks kept as they are.

- :mod:`batchgen.gguf.architectures`: ``ARCHITECTURES``, one row per GGUF architecture
  batchgen loads (its HF model, its tensor-name map, what llama.cpp's converter did to its
  tensors and which metadata keys complete its config);
- :mod:`batchgen.gguf.reader`: :class:`GGUFFile`, a GGUF parsed by the ``gguf`` package, with
  errors naming the file and the tensor (corrupt, truncated, unsupported architecture);
- :mod:`batchgen.gguf.metadata`: the HF config and tokenizer of a file, read once into a cache
  folder with its tensor table;
- :mod:`batchgen.gguf.embedding`: :class:`QuantizedEmbedding`, a token embedding over GGUF
  blocks;
- :mod:`batchgen.gguf.hf_model`: :func:`load_gguf_model`, the HF model built on the meta device
  and filled from the file (``QuantizedLinear`` layers, or de-quantized ``nn.Linear``).

Where a model name becomes a GGUF file, and what ``quantization: auto`` means, is decided in
:mod:`batchgen.model_resolver`. See ``docs/gguf.md``.
"""
