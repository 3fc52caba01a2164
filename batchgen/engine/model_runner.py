"""ModelRunner: packs a scheduled step into tensors, runs the HF model, returns logits.

Every scheduled token of every sequence goes into one row (no padding), decodes first, then
prefill chunks. The model sees ``position_ids`` per token and our paged attention through
transformers' attention interface; ``logits_to_keep`` selects the last scheduled token of each
sequence that samples this step. Positions that score prompt tokens (prompt logprobs) are read
from the final hidden states instead, through the output layer a chunk of positions at a time
(:meth:`ModelRunner.execute`), so no step holds logits for all its positions. With
``linear_backend="cpu"`` the model's RMSNorms, gated MLPs and attention layers are replaced
by fused CPU versions where a probe shows them exact (:meth:`ModelRunner._setup_linears`); a
fused attention layer attends over the same paged cache through the same backend.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine import paged_attention, prompt_logprobs
from batchgen.engine.config import EngineConfig
from batchgen.engine.kv_cache import CacheShape, KVCache, num_blocks_for_budget
from batchgen.engine.model_loader import UnsupportedModelError, expected_windows, load_model
from batchgen.engine.sequence import Sequence
from batchgen.sampling.logprobs import chunk_rows_for, reduce_logprobs

logger = logging.getLogger(__name__)

@dataclass
class StepInput:
    """What one forward pass needs, built from the scheduled sequences."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_indices: torch.Tensor
    metadata: paged_attention.AttentionMetadata


def _context_length(asked: int | None, model_len: int) -> int:
    """The engine's context: ``max_model_len`` when set (at most the model's own), as vLLM."""
    if asked is None:
        return model_len
    if asked > model_len:
        raise ValueError(f"max_model_len={asked} is more than this model's context of {model_len} "
                         f"tokens (its max_position_embeddings); use at most {model_len}")
    return asked


class ModelRunner:
    """Owns the HF model and the KV cache; ``execute`` runs one packed step.

    ``ModelRunner(config)`` reads an :class:`~batchgen.engine.config.EngineConfig`: the model
    (resolved and loaded once, by :func:`~batchgen.engine.model_loader.load_model`:
    :attr:`model_path` is where it loaded from), ``dtype``, ``device``,
    ``block_size``, ``kv_cache_memory``, ``attention_backend``, ``linear_backend``
    (the model's ``nn.Linear`` layers through batchgen's C GEMM; see
    :mod:`batchgen.kernels.cpu.linear`), ``num_threads``, ``trust_remote_code`` and
    ``index_checks``. ``ModelRunner(model_path, dtype=..., ...)`` builds the config from
    keywords (a convenience for tests and tools).
    """

    def __init__(self, config: EngineConfig | str, **kwargs: Any) -> None:
        from batchgen import threads

        if not isinstance(config, EngineConfig):
            config = EngineConfig.from_kwargs(config, **kwargs)
        elif kwargs:
            config = config.replace(**kwargs)
        self.engine_config = config
        block_size, num_threads = config.block_size, config.num_threads
        attention_backend = config.attention_backend
        self.num_threads = threads.resolve_num_threads(num_threads)
        loaded = load_model(config)  # resolved, checked, loaded on its device (engine/model_loader.py)
        self.source, self.device, self.dtype, self.model = loaded.source, loaded.device, loaded.dtype, loaded.model
        self.model_path = self.source.path
        self.config = self.model.config
        text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        max_pos = getattr(text_config, "max_position_embeddings", None) or 2048
        self.max_model_len = _context_length(config.max_model_len, max_pos)
        num_heads = text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        head_size = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        self.cache_shape = CacheShape(
            num_layers=text_config.num_hidden_layers, num_kv_heads=num_kv_heads,
            head_size=head_size, block_size=block_size, dtype=self.dtype,
        )
        num_blocks = num_blocks_for_budget(self.cache_shape, self.device, config.kv_cache_memory,
                                           gpu_memory_utilization=config.gpu_memory_utilization)
        self.kv_cache = KVCache(self.cache_shape, num_blocks, self.device)
        self.vocab_size = self.model.get_output_embeddings().out_features  # nn.Linear or QuantizedLinear
        self.attention_backend, self.ops = self._attention_ops(attention_backend, num_heads, num_kv_heads)
        from batchgen.kernels.torch_attention import Workspace

        self.workspace = Workspace()
        self.linear_backend = self._setup_linears(config.linear_backend)
        self.lora = None  # a batchgen.lora.manager.LoRAManager with enable_lora
        if config.enable_lora:
            from batchgen.lora.manager import LoRAManager  # torch-side LoRA, only when asked for

            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank)
        self.threads = threads.plan(self.num_threads, c_kernels=self.linear_backend == "cpu")
        if self.device.type == "cpu":
            threads.apply(self.threads)
            logger.info("threads: %s (%s)", self.threads.describe(),
                        "num_threads=auto: OMP_NUM_THREADS" if num_threads == "auto" and os.environ.get("OMP_NUM_THREADS")
                        else f"num_threads={num_threads}: {threads.available_cpus()} CPUs available")
        self.generation_config = getattr(self.model, "generation_config", None)

    def _attention_ops(self, asked: str, num_heads: int, num_kv_heads: int) -> tuple[str, Any]:
        """The attention backend ``asked`` resolves to for this model (``auto``: the fastest that
        serves it; one that cannot serve it falls back to torch with a warning, or is an error
        when asked for by name) and its ops."""
        from batchgen import kernels

        head_size, block_size = self.cache_shape.head_size, self.cache_shape.block_size
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

    def _setup_linears(self, name: str) -> str:
        """Resolve ``linear_backend`` and, for ``cpu``, fuse what a probe shows exact (RMSNorms,
        gated MLPs and attention layers, over ``nn.Linear`` or ``QuantizedLinear`` layers:
        :func:`batchgen.engine.fusion.fuse_model`), then pack the model's remaining
        ``nn.Linear`` layers for the C GEMM."""
        from batchgen.kernels.cpu import linear as cpu_linear

        backend, why = cpu_linear.resolve(name, self.device, self.dtype)
        if backend == "cpu":
            from batchgen.engine import fusion

            fused = fusion.fuse_model(self.model)  # before packing: it merges gate+up and q+k+v
            count = cpu_linear.pack_linears(self.model)
            path = f", bfloat16 through {cpu_linear.bf16_path()}" if self.dtype == torch.bfloat16 else ""
            logger.info("linear backend cpu: %d layers packed for the C GEMM%s; fused %d RMSNorms, "
                        "%d gated MLPs and %d attention layers (%d candidates left as they were)",
                        count, path, fused["rms_norm"], fused["gated_mlp"], fused["attention"], fused["rejected"])
        elif why is not None and self.device.type == "cpu":
            # the C kernels would have carried the step: say plainly why they do not
            logger.warning("linear backend torch (the C kernels cannot run here): %s", why.splitlines()[0])
        return backend

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
                                 self.compute_logits, num_top, chunk_rows_for(self.vocab_size))
        prompt_logprobs.split_result(result, scores)
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits from its final hidden states: the output layer, then the final
        scaling some models apply (Granite's ``logits_scaling``, Cohere's ``logit_scale``,
        Gemma's ``final_logit_softcapping``)."""
        logits = self.model.get_output_embeddings()(hidden)
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        if getattr(cfg, "logits_scaling", None):
            logits = logits / cfg.logits_scaling
        if getattr(cfg, "logit_scale", None):
            logits = logits * cfg.logit_scale
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
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
