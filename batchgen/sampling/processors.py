"""The logits-processor contracts: the stateless :class:`LogitsProcessor`, and the stateful
:class:`StatefulLogitsProcessor` with its per-sequence :class:`ProcessorState`.

The engine's sampler and beam search apply them; structured outputs
(:mod:`batchgen.structured`) are built on the stateful one, exactly as a sampler plugin's
processor is (plugins receive these names through :mod:`batchgen.plugins`, which re-exports
them). :func:`describe_processor` names a processor in an error (a plugin's sampler by its
name and plugin, a constraint by what it constrains).

This module imports no torch (only for type checkers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["LogitsProcessor", "ProcessorState", "StatefulLogitsProcessor", "allow_only",
           "describe_processor"]


class LogitsProcessor(Protocol):
    """A per-step logits transform contributed by a sampler plugin.

    ``proc(logits, output_token_ids)`` receives float32 ``logits[rows, vocab]`` (after penalties
    and temperature, before top-k / top-p / min-p) and, for each row, the token ids generated so
    far. It returns a tensor of the same shape (it may modify ``logits`` in place and return it).
    It masks a token by setting its logit to ``-inf`` and must leave at least one finite logit per
    row that had one. It is called on every decoding step, so it must be cheap and must not call
    any hook.
    """

    def __call__(self, logits: torch.Tensor, output_token_ids: list[list[int]]) -> torch.Tensor: ...


class ProcessorState(Protocol):
    """One sequence's state of a :class:`StatefulLogitsProcessor` (whatever the processor
    needs: a grammar matcher, a counter, the tokens seen...).

    * ``fork()`` returns an independent copy: the engine calls it when a sequence is forked
      copy-on-write (the ``n`` samples or ``best_of`` of a request, a beam with several
      surviving children), before either side accepts another token. Changing the copy must
      not change the original, nor the other way round.
    * ``accept_token(token_id)`` tells the state the token its sequence just took. It is called
      for every generated token except the one that ends the sequence (EOS or a stop id).
    """

    def fork(self) -> ProcessorState: ...

    def accept_token(self, token_id: int) -> None: ...


class StatefulLogitsProcessor:
    """A logits processor with per-sequence state that follows copy-on-write forks.

    Subclass it and implement :meth:`new_state`, and :meth:`fill_mask` or :meth:`process` (or
    both). One processor object serves many sequences, possibly of many requests; everything
    that belongs to one sequence lives in its :class:`ProcessorState`.

    The engine's contract, per sequence:

    1. ``new_state(prompt_token_ids, params)`` when the request is added (``params`` is the
       request's ``SamplingParams`` or ``BeamSearchParams``); after a preemption by recompute
       the engine drops the states and builds them again the same way, then replays the
       generated tokens through ``accept_token``.
    2. Each step the sequence samples, the processor acts on its row: ``fill_mask`` first (all
       masking processors of the batch, into one shared bitmask, applied to the logits in one
       op), then ``process``. Rows are batched: one call per processor per step covers every
       row that uses it.
    3. ``state.accept_token(t)`` for the token taken; ``state.fork()`` when the sequence forks.

    Where it acts: on sampled and greedy rows, after penalties and temperature and before
    top-k / top-p / min-p, like a stateless processor; on beams, on each beam's log-softmax
    scores before the candidates are ranked. A processor must leave every row at least one
    allowed token. Calls run on every step, so they must be cheap and must not call any hook.
    """

    def new_state(self, prompt_token_ids: Sequence[int], params: Any) -> ProcessorState:
        """A fresh state for one sequence of a request with these prompt tokens and params."""
        raise NotImplementedError(f"{type(self).__name__} must implement new_state()")

    def fill_mask(self, states: Sequence[ProcessorState], bitmask: torch.Tensor,
                  rows: Sequence[int]) -> None:
        """Write each state's allowed next tokens into its row of ``bitmask``.

        ``bitmask`` is an int32 tensor ``[batch_rows, ceil(vocab / 32)]`` on the CPU, in
        xgrammar's and vLLM's layout: bit ``b`` of word ``w`` set means token ``32 * w + b`` is
        allowed. ``states[i]`` owns row ``rows[i]``, which arrives with every bit set; clear the
        bits of the tokens to forbid (or overwrite the whole row). Not overriding this method
        means the processor does not mask.
        """

    def process(self, logits: torch.Tensor, states: Sequence[ProcessorState]) -> torch.Tensor:
        """Edit the rows: ``logits[i]`` (float32) belongs to ``states[i]``; return a tensor of the
        same shape (``logits`` changed in place is fine), with ``-inf`` for a forbidden token.
        Not overriding this method means the processor does not edit rows."""
        return logits

    @property
    def masks(self) -> bool:
        """Whether this processor fills a mask (it overrides :meth:`fill_mask`)."""
        return _overrides(self, "fill_mask")

    @property
    def edits(self) -> bool:
        """Whether this processor edits rows (it overrides :meth:`process`)."""
        return _overrides(self, "process")


def allow_only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Set row ``row`` of a ``fill_mask`` bitmask so that exactly ``token_ids`` are allowed
    (a helper for plugins; it packs the bits as the engine reads them)."""
    # deferred: torch (~5 s); sampling/processors.py stays torch-free
    import torch

    allowed = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
    allowed[list(token_ids)] = True
    words = (allowed.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(dim=1)
    bitmask[row] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _overrides(obj: object, name: str) -> bool:
    return getattr(type(obj), name) is not getattr(StatefulLogitsProcessor, name)


def describe_processor(proc: object, state: object = None) -> str:
    """Name ``proc`` (acting for ``state``) in an error message.

    A processor that has a ``describe(state)`` method says itself (structured outputs name the
    constraint); a plugin's guarded processor is ``sampler 'NAME' (PLUGIN)``; any other one is
    its ``repr``.
    """
    describe = getattr(proc, "describe", None)
    if callable(describe):
        return str(describe(state))
    name, label = getattr(proc, "name", None), getattr(proc, "label", None)
    if isinstance(name, str):
        return f"sampler '{name}'" + (f" ({label})" if label else "")
    return f"logits processor {proc!r}"
