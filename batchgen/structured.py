"""Structured outputs: a JSON schema, a regex, a choice or an EBNF grammar, enforced every step.

The grammar library is xgrammar (``pip install 'batchgen[structured]'``), imported here only and
only when a constraint is used. It is vLLM's and SGLang's default: it compiles a grammar once
into per-state token masks (adaptive masks: most tokens are decided ahead of time), fills the
bitmask of many matchers in one call (``BatchGrammarMatcher``, C++ threads), and forks a matcher
in O(state), which copy-on-write samples and beams need. Its CPU build runs everywhere torch
does; its HF logits processor is the oracle of the tests.

Structured outputs are built on the public stateful-processor contract
(:class:`batchgen.sampling.processors.StatefulLogitsProcessor`), exactly as a plugin's processor is:

* :class:`StructuredOutputsProcessor`: one per engine, shared by every constrained request, so
  that one ``fill_mask`` call per step fills the bitmask rows of all constrained sequences;
* :class:`GrammarState`: one per sequence, a ``GrammarMatcher`` that forks with its sequence.

Grammars are compiled once per distinct constraint (:attr:`StructuredOutputsParams.key`) on a
background thread, started when the request is added, so compiling overlaps the engine's steps
(xgrammar releases the GIL while it compiles); a sequence waits for its grammar only when it
first samples. The compiled grammars stay cached for the engine's life.

:func:`check` validates a constraint without a tokenizer (the config loader, ``batchgen
validate`` and the OpenAI batch parser call it): ``ValueError`` for a bad schema, regex or
grammar, ``ImportError`` naming the extra when xgrammar is missing.

JSON is generated compact (one space after ``,`` and ``:``, no other whitespace): a model then
cannot spend its ``max_tokens`` on whitespace.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from batchgen.sampling.processors import StatefulLogitsProcessor
from batchgen.sampling.params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

__all__ = ["GrammarState", "StructuredOutputsProcessor", "check", "require"]

INSTALL_HINT = "pip install 'batchgen[structured]'"

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def require() -> Any:
    """The ``xgrammar`` module, or ImportError saying which extra to install."""
    try:
        # deferred: xgrammar (and torch; ~6 s) only when a constraint is compiled
        import xgrammar
    except ImportError as exc:
        raise ImportError(
            f"structured outputs need the grammar library xgrammar, which is not installed: {INSTALL_HINT}"
        ) from exc
    return xgrammar


def _message(exc: BaseException) -> str:
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


def _choice_ebnf(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema_text(params: StructuredOutputsParams) -> str:
    return params.json if isinstance(params.json, str) else json.dumps(params.json)


_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
         "json_object": "json_object"}


def grammar(params: StructuredOutputsParams) -> Any:
    """The ``xgrammar.Grammar`` of a constraint: the one place each kind becomes a grammar
    (both :func:`check` and the processor's compiler start from it).

    Raises:
        Exception: what xgrammar raises for a bad schema, regex or grammar.
    """
    xgr = require()
    kind = params.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(_schema_text(params), any_whitespace=False)
    if kind == "json_object":
        # Any JSON object (vLLM compiles the same schema); strict_mode off lets it have any keys.
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(params.choice or []))
    return xgr.Grammar.from_ebnf(params.grammar)


def describe(params: StructuredOutputsParams, limit: int = 120) -> str:
    """``regex '[a-z]+'``, ``JSON schema '{...}'``: the kind and the constraint, shortened."""
    kind = params.kind
    if kind == "json":
        value = _schema_text(params)
    elif kind == "choice":
        value = json.dumps(params.choice or [], ensure_ascii=False)
    elif kind == "json_object":
        return "json_object"
    else:
        value = params.regex if kind == "regex" else params.grammar
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{_WHAT[kind]} {text!r}"


_checked: dict[str, str | None] = {}  # constraint key -> error message (None: compiles)


def check(params: StructuredOutputsParams) -> None:
    """Check that the constraint compiles, without a tokenizer (cached per constraint).

    Raises:
        ImportError: xgrammar is not installed (the message names the extra).
        ValueError: an invalid schema, regex or grammar; the message says which and why.
    """
    require()
    key = params.key
    if key not in _checked:
        try:
            grammar(params)
            _checked[key] = None
        except Exception as exc:  # xgrammar raises RuntimeError (C++) or ValueError for bad input
            _checked[key] = f"invalid {_WHAT[params.kind]}: {_message(exc)}"
    if _checked[key] is not None:
        raise ValueError(_checked[key])


_matchable: dict[str, bool | None] = {}  # constraint key -> satisfiable()'s answer


def satisfiable(params: StructuredOutputsParams, budget: int = 4096, depth: int = 64) -> bool | None:
    """Whether some output can match a constraint that compiles (cached per constraint).

    A bounded search over one-byte tokens: True when it finds a complete output, False when
    it proves that none exists (e.g. the regex ``[^\\s\\S]``, whose every token is masked from
    the first step), None when it gave up within ``budget`` steps of ``depth`` bytes.
    """
    key = params.key
    if key not in _matchable:
        xgr = require()
        stop = 256
        info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], vocab_type=xgr.VocabType.RAW,
                                 vocab_size=257, stop_token_ids=[stop])
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar(params)))
        steps = 0

        def search(level: int) -> bool | None:
            nonlocal steps
            if matcher.accept_token(stop):
                return True
            if level >= depth:
                return None
            answer: bool | None = False
            for byte in range(256):
                steps += 1
                if steps > budget:
                    return None
                if matcher.accept_token(byte):
                    found = search(level + 1)
                    matcher.rollback(1)
                    if found or steps > budget:
                        return found if found else None
                    answer = None if found is None else answer
            return answer

        _matchable[key] = search(0)
    return _matchable[key]


class GrammarState:
    """One sequence's grammar matcher (see :class:`batchgen.plugins.ProcessorState`).

    The matcher is made when first needed, from the compiled grammar that the processor
    compiles in the background; until then a fork shares the pending grammar and nothing else.
    """

    __slots__ = ("_owner", "_grammar", "_matcher", "constraint")

    def __init__(self, owner: StructuredOutputsProcessor, grammar: Future, matcher: Any = None,
                 constraint: StructuredOutputsParams | None = None) -> None:
        self._owner = owner
        self._grammar = grammar
        self._matcher = matcher
        self.constraint = constraint

    @property
    def matcher(self) -> Any:
        """The ``xgrammar.GrammarMatcher``, waiting for the grammar's compilation if needed."""
        if self._matcher is None:
            self._matcher = self._owner.new_matcher(self._grammar.result())
        return self._matcher

    def fork(self) -> GrammarState:
        matcher = None if self._matcher is None else self._matcher.fork()
        return GrammarState(self._owner, self._grammar, matcher, self.constraint)

    def accept_token(self, token_id: int) -> None:
        if not self.matcher.accept_token(int(token_id)):
            raise RuntimeError(f"token {token_id} is not allowed by the grammar here")

    @property
    def is_terminated(self) -> bool:
        """Whether the matcher accepted a stop token (the output is complete and ended)."""
        return self._matcher is not None and self._matcher.is_terminated()


class StructuredOutputsProcessor(StatefulLogitsProcessor):
    """Enforces every request's ``structured_outputs``; one per engine (see the module doc).

    Args:
        tokenizer: the model's HF tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        stop_token_ids: the ids that end a sequence (the engine's EOS ids); the grammar allows
            them exactly where the output is complete.
        max_threads: threads of the batched bitmask fill and of each compilation.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 max_threads: int = 1) -> None:
        xgr = require()
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-grammar")
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()

    # -- compiling -----------------------------------------------------------------------------

    def _compile_now(self, params: StructuredOutputsParams) -> Any:
        return self.compiler.compile_grammar(grammar(params))

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``params``, as a future: compiled once per distinct
        constraint, on the background thread.

        Raises:
            ValueError: the constraint does not compile (checked at once, without the tokenizer).
        """
        check(params)
        key = params.key
        with self._lock:
            future = self._futures.get(key)
            if future is None:
                future = self._pool.submit(self._compile_now, params)
                self._futures[key] = future
        return future

    def compiled(self, params: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``params`` (waits for its compilation)."""
        return self.compile(params).result()

    def new_matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)

    # -- the stateful contract -----------------------------------------------------------------

    def new_state(self, prompt_token_ids: Sequence[int], params: Any) -> GrammarState:
        constraint = getattr(params, "structured_outputs", None)
        if constraint is None:
            raise ValueError("these params have no structured_outputs")
        return GrammarState(self, self.compile(constraint), constraint=constraint)

    def describe(self, state: GrammarState | None = None) -> str:
        """``structured_outputs regex '...'``: the constraint ``state`` enforces, for errors."""
        constraint = getattr(state, "constraint", None)
        if constraint is None:
            return "structured_outputs"
        return f"structured_outputs {describe(constraint)}"

    def fill_mask(self, states: Sequence[GrammarState], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """All constrained rows in one batched call (xgrammar's threads fill them)."""
        self._batch.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, indices=list(rows))

    def close(self) -> None:
        """Stop the compile thread (pending compilations finish first)."""
        self._pool.shutdown(wait=True)
