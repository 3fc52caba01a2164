"""ModelRunner: packs a scheduled step into tensors, runs the HF model, returns logits.

Every scheduled token of every sequence goes into one row (no padding), decodes first, then
prefill chunks. The model sees ``position_ids`` per token and our paged attention through
transformers' attention interface; ``logits_to_keep`` selects the last scheduled token of each
sequence that samples this step. Positions that score prompt tokens (prompt logprobs) are read
from the final hidden states instead, through the output layer a chunk of positions at a time
(:meth:`ModelRunner.execute`), so no step holds logits for all its positions. With
``linear_backend="cpu"`` the model's RMSNorms, gated MLPs and attention layers are replaced
by fused CPU versions where a probe shows them exact (:func:`batchgen.engine.model_loader.place_linears`); a
fused attention layer attends over the same paged cache through the same backend. The model
comes loaded and placed (:mod:`batchgen.engine.model_loader`), the KV cache allocated.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from batchgen import kernels, threads
from batchgen.engine import decoder_program, paged_attention, prompt_logprobs
from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_cache import KVCache
from batchgen.engine.model_loader import LoadedModel, UnsupportedModelError, expected_windows
from batchgen.engine.sequence import Sequence
from batchgen.kernels.torch_attention import Workspace
from batchgen.lora.manager import LoRAManager
from batchgen.sampling.logprobs import chunk_rows_for, reduce_logprobs

logger = logging.getLogger(__name__)

@dataclass
class StepInput:
    """What one forward pass needs, built from the scheduled sequences."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_indices: torch.Tensor
    metadata: paged_attention.AttentionMetadata


class ModelRunner:
    """Owns the HF model and the KV cache; ``execute`` runs one packed step.

    ``ModelRunner(config, loaded, kv_cache)`` takes a ready model (a
    :class:`~batchgen.engine.model_loader.LoadedModel`: resolved, loaded and its linear layers
    placed; :attr:`model_path` is where it loaded from) and its allocated
    :class:`~batchgen.engine.kv_cache.KVCache`, and reads from the
    :class:`~batchgen.engine.config.EngineConfig` what the steps need: ``attention_backend``,
    ``index_checks``, ``num_threads`` and the LoRA settings.
    :func:`batchgen.engine.llm.load_runner` builds all three from a config.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel, kv_cache: KVCache) -> None:
        self.engine_config = config
        self.source, self.device, self.dtype, self.model = loaded.source, loaded.device, loaded.dtype, loaded.model
        self.model_path = self.source.path
        self.config = self.model.config
        self.max_model_len = loaded.max_model_len
        self.kv_cache, self.cache_shape = kv_cache, kv_cache.shape
        self.vocab_size = self.model.get_output_embeddings().out_features  # nn.Linear or QuantizedLinear
        self.attention_backend, self.ops = self._attention_ops(config.attention_backend,
                                                               loaded.text_config.num_attention_heads)
        self.workspace = Workspace()
        self.linear_backend = loaded.linear_backend
        self.lora = None  # a batchgen.lora.manager.LoRAManager with enable_lora
        if config.enable_lora:
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank)
        elif self.attention_backend == "cpu":
            logger.info(decoder_program.install(self.model, self.dtype))  # after the layers are final (LoRA wraps them)
        self.num_threads = threads.resolve_num_threads(config.num_threads)
        self.threads = threads.plan(self.num_threads, c_kernels=self.linear_backend == "cpu")
        if self.device.type == "cpu":
            threads.apply(self.threads)
            logger.info("threads: %s (%s)", self.threads.describe(),
                        "num_threads=auto: OMP_NUM_THREADS" if config.num_threads == "auto" and os.environ.get("OMP_NUM_THREADS")
                        else f"num_threads={config.num_threads}: {threads.available_cpus()} CPUs available")
        self.generation_config = getattr(self.model, "generation_config", None)

    def _attention_ops(self, asked: str, num_heads: int) -> tuple[str, Any]:
        """The attention backend ``asked`` resolves to for this model (``auto``: the fastest that
        serves it; one that cannot serve it falls back to torch with a warning, or is an error
        when asked for by name) and its ops."""
        shape = self.cache_shape
        head_size, block_size, num_kv_heads = shape.head_size, shape.block_size, shape.num_kv_heads
        index_checks = self.engine_config.index_checks
        backend = kernels.resolve_backend(asked, self.device)
        why = None
        if backend == "cuda":
            why = (kernels.cuda_unsupported_reason(self.dtype, head_size, block_size)
                   or kernels.cuda_unavailable_reason(self.dtype, head_size, block_size,
                                                      self.device, index_checks))
        elif backend == "cpu":
            why = kernels.cpu_unsupported_reason(self.dtype, head_size, num_heads, num_kv_heads)
        if why is not None:
            if asked == backend:
                raise ValueError(f"attention_backend={backend!r} cannot serve this model: {why}")
            logger.warning("the %s attention kernel cannot serve this model (%s); using the torch "
                           "backend", backend, why.splitlines()[0])
            backend = "torch"
        return backend, kernels.get_ops(backend, check_indices=index_checks)

    def register_lora(self, request: Any) -> str | None:
        """Check a request's :class:`~batchgen.lora.LoRARequest` adapter; its error, or None."""
        if self.lora is None:
            return (f"LoRA adapter {request.lora_name!r} requested, but the engine runs without LoRA; "
                    "create it with enable_lora=True")
        return self.lora.register(request)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def block_size(self) -> int:
        return self.cache_shape.block_size

    @property
    def kv_window(self) -> int | None:
        """The positions every layer attends over when every layer slides (Mistral, Phi-3):
        the widest of their windows; None when some layer sees the whole context. The block
        manager releases what lies behind it."""
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        windows = expected_windows(cfg)
        return max(windows) if windows and None not in windows else None

    def eos_token_ids(self) -> list[int]:
        """EOS ids from the generation config (falling back to the model config)."""
        for source in (self.generation_config, self.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
        return []

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Run all copy-on-write copies of a step as one batched copy over all layers."""
        if copies:
            mapping = torch.tensor(copies, dtype=torch.int64, device=self.device)
            self.ops.copy_blocks(self.kv_cache.kv_cache, mapping)

    def prepare(self, scheduled: list[tuple[Sequence, int]], sample: list[bool]) -> StepInput:
        """Pack the step. ``scheduled`` must list decodes (1 new token) before prefills.

        ``sample[i]`` says whether sequence ``i`` samples this step (its last scheduled token
        is its last token); logits come back in that order.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        pre_tables: list[list[int]] = []
        pre_starts: list[int] = [0]
        pre_lens: list[int] = []
        num_decode = 0
        for (seq, num_new), samples in zip(scheduled, sample):
            start = seq.num_computed_tokens
            end = start + num_new
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if num_new == 1 and not pre_tables:
                num_decode += 1
                dec_tables.append(table)
                dec_lens.append(end)
            else:
                pre_tables.append(table)
                pre_starts.append(pre_starts[-1] + num_new)
                pre_lens.append(end)
            if samples:
                logits_indices.append(len(input_ids) - 1)
        dev = self.device
        meta = paged_attention.AttentionMetadata(
            kv_cache=self.kv_cache.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=num_decode,
            decode_block_tables=_pad_tables(dec_tables, dev),
            decode_context_lens=torch.tensor(dec_lens, dtype=torch.int32, device=dev),
            prefill_block_tables=_pad_tables(pre_tables, dev),
            prefill_query_start_loc=torch.tensor(pre_starts, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(pre_lens, dtype=torch.int32, device=dev),
            ops=self.ops,
            workspace=self.workspace,
            pools=self.kv_cache.pools,
        )
        return StepInput(
            input_ids=torch.tensor([input_ids], dtype=torch.int64, device=dev),
            position_ids=torch.tensor([positions], dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            metadata=meta,
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], sample: list[bool],
                copies: list[tuple[int, int]], scores: list[Any] | None = None) -> torch.Tensor:
        """Copy-on-write, then one forward pass. Returns float32 logits
        ``[sum(sample), vocab]`` for the sampling sequences, in ``scheduled`` order.

        ``scores`` (None, or one :class:`~batchgen.engine.prompt_logprobs.PromptScore` or None
        per scheduled sequence): each score's ``result`` is set to the
        :class:`~batchgen.sampling.logprobs.TokenLogprobs` of its rows, reduced from the final
        hidden states a bounded chunk of positions at a time.
        """
        self.copy_blocks(copies)
        if self.lora is not None:
            self.lora.begin_step(scheduled)  # each token's adapter slot, in prepare's order
        step = self.prepare(scheduled, sample)
        samples = step.logits_indices.numel() > 0
        if not samples:
            # Nothing samples (only non-final prefill chunks): still write their K/V.
            step.logits_indices = step.logits_indices.new_tensor([step.input_ids.shape[1] - 1])
        if scores is None:
            logits = self._forward(step)
        else:
            logits = self._forward_scored(step, scheduled, scores)
        return logits.float() if samples else torch.empty(0, self.vocab_size)

    def _forward_scored(self, step: StepInput, scheduled: list[tuple[Sequence, int]], scores: list[Any]) -> torch.Tensor:
        """:meth:`_forward`, keeping the decoder's final hidden states to fill ``scores``."""
        captured: list[torch.Tensor] = []

        def keep(_module: Any, _inputs: Any, output: Any) -> None:
            captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

        handle = self.model.get_decoder().register_forward_hook(keep)
        try:
            logits = self._forward(step)
        finally:
            handle.remove()
        hidden = captured[-1][0]
        if not self._output_layer_checked:
            self._check_output_layer(hidden[step.logits_indices[:1]], logits[:1])
        rows, targets, num_top = prompt_logprobs.score_rows(scheduled, scores)
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        result = reduce_logprobs(hidden.index_select(0, index), torch.tensor(targets, dtype=torch.long),
                                 self.compute_logits, num_top, chunk_rows_for(self.vocab_size),
                                 fused=self.linear_backend == "cpu")  # the sampler's logsumexp
        prompt_logprobs.split_result(result, scores)
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits from its final hidden states: the output layer, then the final
        scaling some models apply (Granite's ``logits_scaling``, Cohere's ``logit_scale``).
        Gemma's ``final_logit_softcapping`` is the output layer's own since the load
        (:mod:`batchgen.engine.soft_cap`)."""
        logits = self.model.get_output_embeddings()(hidden)
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        if getattr(cfg, "logits_scaling", None):
            logits = logits / cfg.logits_scaling
        if getattr(cfg, "logit_scale", None):
            logits = logits * cfg.logit_scale
        return logits

    _output_layer_checked = False

    def _check_output_layer(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Once: :meth:`compute_logits` gives the logits the model itself gave, so scored
        positions get the same numbers as sampled ones."""
        ours = self.compute_logits(hidden).float()
        if not torch.allclose(ours, logits.float(), rtol=1e-2, atol=1e-2):
            raise UnsupportedModelError(
                f"model type {getattr(self.config, 'model_type', '?')!r} transforms its logits in a "
                "way batchgen does not repeat, so its prompt logprobs cannot be computed")
        self._output_layer_checked = True

    _windows_checked = False

    def _forward(self, step: StepInput) -> torch.Tensor:
        if not self._windows_checked:
            step.metadata.seen = {}
        out = self.model(
            input_ids=step.input_ids,
            position_ids=step.position_ids,
            use_cache=False,
            logits_to_keep=step.logits_indices,
            batchgen_metadata=step.metadata,
        )
        if not self._windows_checked:
            self._check_windows(step.metadata.seen)
        return out.logits[0]

    def _check_windows(self, seen: dict[int, paged_attention.LayerOptions]) -> None:
        """Once, after the first step: every layer attended with the window HF's masks give it
        (:func:`expected_windows`), so a model that does not pass its window to the attention
        interface is refused rather than run with full attention."""
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        for layer, want in enumerate(expected_windows(cfg)):
            got = seen[layer].sliding_window if layer in seen else "no call"
            if got != want:
                raise UnsupportedModelError(
                    f"model type {getattr(cfg, 'model_type', '?')!r}: layer {layer} attended with sliding "
                    f"window {got}, but its config gives it {want}; the paged attention cannot run it exactly")
        self._windows_checked = True


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    data = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(data, dtype=torch.int32, device=device).reshape(len(tables), width)
