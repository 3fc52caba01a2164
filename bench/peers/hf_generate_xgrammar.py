"""HF transformers ``generate`` constrained by xgrammar's own logits processor.

Setup: :class:`bench.peers.hf_generate.HFGenerate` (static left-padded batch of the whole
workload, SDPA, ``DynamicCache``), plus ``xgrammar.TokenizerInfo.from_huggingface(tokenizer,
vocab_size=<the model's>, stop_token_ids=<the model's EOS ids>)`` built once when the peer
starts. Every timed run compiles the JSON schema afresh (a ``GrammarCompiler`` without its
cache, so each repeat pays what the first one does) and passes
``xgrammar.contrib.hf.LogitsProcessor(compiled)`` to ``generate`` (one processor per call: it
keeps one matcher per row and cannot be reused). The compile time is inside the timed
seconds and is also reported on its own.
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench.peers import UnsupportedMode
from bench.peers.hf_generate import HFGenerate


class HFGenerateXGrammar(HFGenerate):
    """See the module docstring. ``grammar`` holds the keyword arguments of
    ``GrammarCompiler.compile_json_schema`` (whitespace handling), so that they match batchgen's."""

    name = "hf_generate_xgrammar"

    def __init__(self, model_path: str, json_schema: dict, grammar: dict | None = None) -> None:
        import xgrammar as xgr
        from transformers import AutoConfig, AutoTokenizer

        self.schema_text = json.dumps(json_schema)
        self.grammar = dict(grammar or {})
        tok = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
        eos = getattr(config, "eos_token_id", None) or tok.eos_token_id
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=config.vocab_size, stop_token_ids=[eos] if isinstance(eos, int) else list(eos))
        self.compile_seconds: list[float] = []
        super().__init__(model_path)  # its warm-up request runs constrained too

    def setup(self) -> dict:
        from importlib.metadata import version

        return {**super().setup(), "peer": self.name, "xgrammar": version("xgrammar"),
                "processor": "xgrammar.contrib.hf.LogitsProcessor", "compile_json_schema": self.grammar,
                "stop_token_ids": list(self.tokenizer_info.stop_token_ids)}

    def _kwargs(self, mode: dict, max_tokens: int) -> dict:
        import xgrammar as xgr
        from transformers import LogitsProcessorList

        if mode["kind"] == "beam":
            raise UnsupportedMode("xgrammar's HF processor keeps one matcher per row and does not follow "
                                  "beam reordering")
        kw = super()._kwargs(mode, max_tokens)
        t0 = time.perf_counter()
        compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        compiled = compiler.compile_json_schema(self.schema_text, **self.grammar)
        self.compile_seconds.append(time.perf_counter() - t0)
        kw["logits_processor"] = LogitsProcessorList([xgr.contrib.hf.LogitsProcessor(compiled)])
        return kw

    def run(self, prompts: list[list[int]], mode: dict, max_tokens: int, seed: int) -> dict[str, Any]:
        self.compile_seconds.clear()
        result = super().run(prompts, mode, max_tokens, seed)
        result["compile_seconds"] = sum(self.compile_seconds)
        return result
