"""Log-likelihood requests: lm-eval's tokenisation and windows, as engine requests and back.

Pure Python (no torch). The two lm-evaluation-harness request kinds that score rather than
generate, with lm-eval's meaning (its ``hf`` model, lm-eval 0.4):

* ``loglikelihood``: a ``(context, continuation)`` pair gives the sum of the continuation's
  token logprobs given the context, and whether every continuation token is the argmax
  (``is_greedy``). Text pairs are tokenised as :func:`encode_pair` says.
* ``loglikelihood_rolling``: a text's total logprob, scored in windows of at most
  ``max_length`` tokens that each predict fresh tokens (:func:`rolling_windows`), every token
  scored exactly once.

Each pair becomes one scoring-only engine request (:func:`to_request`): the prompt is
``context + continuation``, ``max_tokens=0``, and prompt logprobs only from the continuation
on, so that the context may come from the prefix cache (or from the prefill of another request
with the same context in the same step) and only the continuation's positions need logits.
:func:`loglikelihood_of` reads the result back from the request's ``RequestOutput``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from batchgen.engine import prompts
from batchgen.engine.outputs import Request, RequestOutput
from batchgen.sampling.params import SamplingParams

__all__ = ["Pair", "prefix_token_id", "encode", "encode_pair", "tokenize_pairs", "rolling_windows",
           "fit_window", "to_request", "loglikelihood_of"]

#: A request of ``LLM.loglikelihood``: ``(context, continuation)``, both text or both token ids.
Pair = tuple[Union[str, Sequence[int]], Union[str, Sequence[int]]]


def prefix_token_id(tokenizer: Any) -> int:
    """The token that stands for an empty context (lm-eval's ``prefix_token_id``): BOS, or EOS
    when the tokenizer has no BOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    token = bos if bos is not None else getattr(tokenizer, "eos_token_id", None)
    if token is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to stand for an empty context")
    return int(token)


def encode(tokenizer: Any, text: str, add_special_tokens: bool | None = None) -> list[int]:
    """Token ids of ``text`` as lm-eval's ``hf`` model encodes it (``tok_encode``): the
    tokenizer's own special-token default, except that a text which already starts with the
    prefix token's text gets no special tokens added."""
    kwargs: dict[str, Any] = {}
    if add_special_tokens is not None:
        kwargs["add_special_tokens"] = add_special_tokens
    else:
        prefix_text = tokenizer.decode([prefix_token_id(tokenizer)])
        if prefix_text and text.startswith(prefix_text):
            kwargs["add_special_tokens"] = False
    return list(tokenizer.encode(text, **kwargs))


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` as lm-eval tokenises a text pair.

    * Trailing spaces of the context move to the start of the continuation.
    * The context is its own encoding; the continuation is the tail of the whole text's
      encoding after as many tokens as the context's encoding has. So a continuation that
      starts mid-word (no space) gets the tokens of the whole text there, exactly as lm-eval
      scores it (and one merged into the context's last token comes out shorter, or empty).
    * An empty context becomes the prefix token (:func:`prefix_token_id`), and the
      continuation is encoded without special tokens; if the continuation already starts
      with the prefix token, that token is the context instead.
    """
    if context == "":
        cont = encode(tokenizer, continuation, add_special_tokens=False)
        prefix = prefix_token_id(tokenizer)
        if cont and cont[0] == prefix:
            return cont[:1], cont[1:]
        return [prefix], cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(tokenizer, context + continuation)
    context_ids = encode(tokenizer, context)
    return context_ids, whole[len(context_ids):]


def tokenize_pairs(tokenizer: Any, pairs: Sequence[Pair], vocab_size: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Token ids of every pair (text pairs through :func:`encode_pair`; id pairs as given,
    an empty context becoming the prefix token).

    Raises:
        ValueError: naming the request index, for a pair that is not two texts or two id
            lists, an id out of the vocabulary, or a continuation with no tokens.
    """
    out: list[tuple[list[int], list[int]]] = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"request {i}: expected a (context, continuation) pair, got {pair!r:.80}")
        context, continuation = (_side(part, i) for part in pair)
        if isinstance(context, str) and isinstance(continuation, str):
            ctx, cont = encode_pair(tokenizer, context, continuation)
        elif not isinstance(context, str) and not isinstance(continuation, str):
            ctx, cont = [int(t) for t in context], [int(t) for t in continuation]
            if not ctx:
                ctx = [prefix_token_id(tokenizer)]
            bad = [t for t in ctx + cont if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise ValueError(f"request {i}: token ids out of the vocabulary: {bad[:5]}")
        else:
            raise ValueError(f"request {i}: context and continuation must both be text or both "
                             "be token ids")
        if not cont:
            raise ValueError(f"request {i}: the continuation is empty (it has no tokens to score)")
        out.append((ctx, cont))
    return out


def _side(part: Any, index: int) -> str | list[int]:
    """One side of a pair as text or ids; a prompt dict (:mod:`batchgen.engine.prompts`) too."""
    text, ids = prompts.parse(part, index, noun="request")
    return ids if ids is not None else text  # type: ignore[return-value]


def rolling_windows(token_ids: Sequence[int], prefix_token: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows (``get_rolling_token_windows`` with a context of 1,
    then ``make_disjoint_window``), as ``(context, continuation)`` pairs.

    The first window predicts the first ``max_length`` tokens after the prefix token; each
    later one predicts the next at most ``max_length`` tokens, conditioned on as many
    preceding tokens as fit, so that ``context + continuation`` is ``max_length + 1`` tokens
    (the model reads all but the last). The continuations partition ``token_ids``.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    tokens = list(token_ids)
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix_token], tokens[:first])]
    done = first
    while done < len(tokens):
        take = min(len(tokens) - done, max_length)
        end = done + take
        windows.append((tokens[end - max_length - 1:end - take], tokens[end - take:end]))
        done = end
    return windows


def fit_window(context: list[int], continuation: list[int], max_length: int,
               truncate: bool) -> tuple[list[int], list[int]] | str:
    """The pair as the model reads it within ``max_length`` tokens, or why it cannot be.

    The model reads ``context + continuation`` but its last token, so a pair fits when it has
    at most ``max_length + 1`` tokens. With ``truncate``, a longer pair loses tokens from the
    left of its context, as lm-eval does; a continuation longer than ``max_length`` never fits.
    """
    total = len(context) + len(continuation)
    if len(continuation) > max_length:
        return (f"the continuation has {len(continuation)} tokens; the model reads at most "
                f"{max_length} (max_length)")
    if total <= max_length + 1:
        return context, continuation
    if not truncate:
        return (f"context plus continuation have {total} tokens; the model scores at most "
                f"{max_length + 1} (max_length {max_length}, plus the last token, which is not "
                "read); truncation drops the context's first tokens")
    keep = max_length + 1 - len(continuation)
    return context[len(context) - keep:], continuation


def to_request(request_id: str, context: list[int], continuation: list[int], num_top: int = 0) -> Request:
    """The scoring-only engine request of one tokenised pair: prompt ``context +
    continuation``, no generated token, prompt logprobs (with ``num_top`` alternatives) from
    the continuation's first token on."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=num_top, prompt_logprobs_start=len(context))
    return Request(request_id, list(context) + list(continuation), params)


def loglikelihood_of(output: RequestOutput) -> tuple[float, bool]:
    """``(sum of the scored prompt tokens' logprobs, whether each was the most likely token)``
    of a scoring request's output (see :func:`to_request`).

    Raises:
        ValueError: the request failed (its ``error``), or it has no prompt logprobs.
    """
    if output.error is not None:
        raise ValueError(f"request {output.request_id}: {output.error}")
    if output.prompt_logprobs is None:
        raise ValueError(f"request {output.request_id}: the output has no prompt logprobs")
    total = 0.0
    greedy = True
    for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
        if entry is None:
            continue
        logprob = entry[token]
        total += logprob.logprob
        greedy = greedy and logprob.rank == 1
    return total, greedy
