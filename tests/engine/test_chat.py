"""LLM.chat against the tokenizer's own apply_chat_template, and a quiet model load."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchgen import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"}],
]


@pytest.fixture(scope="module")
def tiny(shared_tiny_model) -> tuple[LLM, object]:
    from transformers import AutoTokenizer

    path = shared_tiny_model("llama")
    return LLM(path, dtype="float32", kv_cache_memory=8 * 2**20, num_threads=1), AutoTokenizer.from_pretrained(path)


def _hf_ids(tokenizer, conversation, **kwargs) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_renders_with_the_tokenizers_template_and_generates_as_generate(tiny):
    llm, tokenizer = tiny
    params = SamplingParams(max_tokens=5)
    outputs = llm.chat(CONVERSATIONS, params)
    want = [_hf_ids(tokenizer, c, add_generation_prompt=True) for c in CONVERSATIONS]
    assert [o.prompt_token_ids for o in outputs] == want
    assert [o.prompt for o in outputs] == [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVERSATIONS]
    assert outputs[0].prompt.endswith("<|im_start|>assistant\n")
    plain = llm.generate(want, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]


def test_one_conversation_and_template_options(tiny):
    llm, tokenizer = tiny
    params = SamplingParams(max_tokens=3)
    (one,) = llm.chat(CONVERSATIONS[0], params)
    assert one.prompt_token_ids == _hf_ids(tokenizer, CONVERSATIONS[0], add_generation_prompt=True)
    (no_header,) = llm.chat(CONVERSATIONS[0], params, add_generation_prompt=False)
    assert no_header.prompt_token_ids == _hf_ids(tokenizer, CONVERSATIONS[0], add_generation_prompt=False)
    open_reply = CONVERSATIONS[0] + [{"role": "assistant", "content": "It is"}]
    (cont,) = llm.chat(open_reply, params, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt_token_ids == _hf_ids(tokenizer, open_reply, continue_final_message=True)
    assert cont.prompt.endswith("It is")
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    (custom,) = llm.chat(CONVERSATIONS[0], params, chat_template=template)
    assert custom.prompt == "[user] What is the capital of France?\n"


def test_malformed_conversation_is_named(tiny):
    llm, _ = tiny
    with pytest.raises(ValueError, match="conversation 1 must be a list"):
        llm.chat([CONVERSATIONS[0], [{"content": "no role"}]])


def test_loading_prints_no_progress_bar_and_leaves_the_setting_as_it_was(shared_tiny_model):
    path = shared_tiny_model("llama")
    code = (
        "from transformers.utils import logging as l\n"
        "from batchgen import LLM\n"
        f"LLM({path!r}, dtype='float32', kv_cache_memory=2**22, num_threads=1)\n"
        "assert l.is_progress_bar_enabled()\n"
    )
    # a fresh process's defaults: a quiet run earlier in this process (quiet_libraries) leaves
    # HF_HUB_DISABLE_PROGRESS_BARS=1 in os.environ, which would start the child with bars off
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Loading weights" not in proc.stderr
    assert "it/s" not in proc.stderr
