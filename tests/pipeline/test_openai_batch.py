"""OpenAI Batch API files: ``batchgen batch``, ``data.format`` / ``output.format: openai_batch``.

Success bodies are checked with the official ``openai`` package's types. The runs share the tiny
random model's engine (``tiny_llm``); the kill-and-resume test runs ``python -m batchgen batch``
in a child process.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from batchgen.cli import main
from batchgen.config import ConfigError, validate_config
from batchgen.openai_batch import LineParser
from batchgen.run.execute import execute
from batchgen.run.plan import plan
from batchgen.sampling.params import BeamSearchParams, SamplingParams

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def line(custom_id: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(custom_id: str, content: str = "Tell me a story.", **body: Any) -> dict[str, Any]:
    return line(custom_id, CHAT, messages=[{"role": "user", "content": content}], **body)


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in lines))
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(text) for text in path.read_text().splitlines()] if path.exists() else []


def run_batch(tiny_llm: Any, source: Path, out: Path, aliases: tuple[str, ...] = (), **output: Any) -> dict[str, Any]:
    """Run a batch file on the shared tiny engine (the config's engine section is not used)."""
    config = validate_config({
        "model": {"name": tiny_llm.model_name, "device": "cpu", "dtype": "float32", "aliases": list(aliases)},
        "data": {"source": str(source), "format": "openai_batch"},
        "output": {"path": str(out), **output},
    })
    return execute(plan(config), quiet=True, llm=tiny_llm)


def by_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {entry["custom_id"]: entry for entry in lines if entry["custom_id"] is not None}


def error_of(entry: dict[str, Any]) -> dict[str, Any]:
    error = entry["response"]["body"]["error"]
    assert entry["response"]["status_code"] == (404 if error["code"] == "model_not_found" else 400)
    assert entry["error"] is None
    return error


# --------------------------------------------------------------------------- a mixed file


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, tiny_llm: Any) -> dict[str, Any]:
    """One file of chat and completions lines, good and bad, run once with an error file."""
    tmp = tmp_path_factory.mktemp("mixed")
    lines = [
        chat("chat-greedy", temperature=0, max_tokens=6, logprobs=True, top_logprobs=3),
        line("cmpl-text", COMPLETIONS, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2),
        chat("chat-n3", n=3, seed=7, max_completion_tokens=5, top_p=0.9, stop=["\n\n"]),
        line("cmpl-ids", COMPLETIONS, prompt=[504, 3458, 282, 1345], max_tokens=4, best_of=3, n=2, seed=1),
        line("chat-parts", CHAT, max_tokens=4, temperature=0, model=tiny_llm.model_name,
             messages=[{"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                       {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]),
        line("cmpl-beam", COMPLETIONS, prompt="The sea", max_tokens=4, use_beam_search=True, n=2),
        "{not json",
        chat("chat-greedy", max_tokens=3),  # duplicate custom_id
        line("embed", "/v1/embeddings", input="x"),
        chat("typo", max_token=4),
        chat("wrong-type", max_tokens="4"),
        chat("other-model", model="gpt-4o-mini", max_tokens=4),
        line("too-long", COMPLETIONS, prompt=[1] * 300, max_tokens=4),
        {"method": "POST", "url": CHAT, "body": {}},  # no custom_id
    ]
    source = write_lines(tmp / "in.jsonl", lines)
    out, errors = tmp / "out.jsonl", tmp / "errors.jsonl"
    # A job that maps a name answers the names it serves only: "other-model" gets a 404.
    summary = run_batch(tiny_llm, source, out, aliases=("mapped",), error_path=str(errors))
    return {"out": read_lines(out), "errors": read_lines(errors), "summary": summary, "lines": lines}


def test_every_success_validates_with_the_openai_types(mixed: dict[str, Any]) -> None:
    ok = by_id(mixed["out"])
    assert set(ok) == {"chat-greedy", "cmpl-text", "chat-n3", "cmpl-ids", "chat-parts", "cmpl-beam"}
    for custom_id, entry in ok.items():
        assert entry["id"].startswith("batch_req_") and entry["error"] is None
        response = entry["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        if custom_id.startswith("chat"):
            body = ChatCompletion.model_validate(response["body"])
            assert body.object == "chat.completion" and body.id.startswith("chatcmpl-")
            texts = [c.message.content for c in body.choices]
            assert all(c.message.role == "assistant" for c in body.choices)
        else:
            body = Completion.model_validate(response["body"])
            assert body.object == "text_completion" and body.id.startswith("cmpl-")
            texts = [c.text for c in body.choices]
        assert [c.index for c in body.choices] == list(range(len(body.choices)))
        assert all(isinstance(t, str) for t in texts)
        assert all(c.finish_reason in ("stop", "length") for c in body.choices)
        usage = body.usage
        assert usage is not None and usage.prompt_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_choices_usage_and_logprobs(mixed: dict[str, Any], smollm2_tokenizer: Any) -> None:
    ok = by_id(mixed["out"])
    n3 = ChatCompletion.model_validate(ok["chat-n3"]["response"]["body"])
    assert len(n3.choices) == 3
    ids = Completion.model_validate(ok["cmpl-ids"]["response"]["body"])
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 4  # best_of=3, n=2: the best two
    beam = Completion.model_validate(ok["cmpl-beam"]["response"]["body"])
    assert len(beam.choices) == 2

    greedy = ChatCompletion.model_validate(ok["chat-greedy"]["response"]["body"])
    content = greedy.choices[0].logprobs.content
    assert len(content) == greedy.usage.completion_tokens
    # The tokens' bytes rebuild the text exactly (special tokens are left out of the text).
    special = set(smollm2_tokenizer.all_special_tokens)
    data = b"".join(bytes(t.bytes) for t in content if t.token not in special)
    assert data.decode("utf-8", "replace") == greedy.choices[0].message.content
    for token in content:  # greedy: the chosen token is the most likely one
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token and token.top_logprobs[0].logprob == token.logprob

    cmpl = Completion.model_validate(ok["cmpl-text"]["response"]["body"])
    logprobs = cmpl.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == cmpl.usage.completion_tokens
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)  # the chosen token and up to 2 others
    assert cmpl.usage.prompt_tokens == len(smollm2_tokenizer("Once upon a time")["input_ids"])



def test_bad_lines_become_their_own_400_lines(mixed: dict[str, Any]) -> None:
    errors = mixed["errors"]
    assert all(entry["id"].startswith("batch_req_") for entry in errors)
    codes = {(entry["custom_id"], error_of(entry)["code"]) for entry in errors}
    assert codes == {
        (None, "invalid_json"),
        ("chat-greedy", "duplicate_custom_id"),
        ("embed", "invalid_url"),
        ("typo", "unknown_parameter"),
        ("wrong-type", "invalid_type"),
        ("other-model", "model_not_found"),
        ("too-long", "context_length_exceeded"),
        (None, "invalid_value"),  # no custom_id
    }
    messages = {entry["custom_id"]: error_of(entry) for entry in errors if entry["custom_id"]}
    assert messages["typo"]["message"] == "Unrecognized request argument supplied: max_token (did you mean 'max_tokens'?)"
    assert messages["typo"]["param"] == "max_token" and messages["typo"]["type"] == "invalid_request_error"
    assert "line 8" in messages["chat-greedy"]["message"] and "line 1" in messages["chat-greedy"]["message"]
    assert "maximum context length is 256 tokens" in messages["too-long"]["message"]
    assert "--model gpt-4o-mini=" in messages["other-model"]["message"]
    keyless = [error_of(e)["message"] for e in errors if e["custom_id"] is None]
    assert any(m.startswith("line 7: the line is not valid JSON") for m in keyless)
    assert any(m.startswith("line 14: 'custom_id' is missing") for m in keyless)
    # Every input line is answered exactly once, in one of the two files.
    assert len(mixed["out"]) + len(errors) == len(mixed["lines"])
    summary = mixed["summary"]
    assert summary["status"] == "completed"
    assert summary["request_counts"] == {"total": 14, "completed": 6, "failed": 8}


# --------------------------------------------------------------------------- the engine's own answers


def test_use_beam_search_equals_the_engines_beam_search(tmp_path: Path, tiny_llm: Any, smollm2_tokenizer: Any) -> None:
    prompt = "A long time ago in a galaxy"
    source = write_lines(tmp_path / "in.jsonl", [
        line("beam", COMPLETIONS, prompt=prompt, max_tokens=8, use_beam_search=True, n=3, length_penalty=0.5),
    ])
    run_batch(tiny_llm, source, tmp_path / "out.jsonl")
    body = Completion.model_validate(read_lines(tmp_path / "out.jsonl")[0]["response"]["body"])
    ids = smollm2_tokenizer(prompt)["input_ids"]
    (expected,) = tiny_llm.generate([ids], BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5))
    ranked = sorted(expected.outputs, key=lambda c: -c.score)
    assert [c.text for c in body.choices] == [c.text for c in ranked]
    assert body.usage.completion_tokens == sum(len(c.token_ids) for c in ranked)


def test_greedy_chat_line_equals_batchgen_run(tmp_path: Path, tiny_llm: Any) -> None:
    messages = [{"role": "system", "content": "You answer in French."},
                {"role": "user", "content": "What is the capital of Italy?"}]
    source = write_lines(tmp_path / "in.jsonl", [line("q", CHAT, messages=messages, max_tokens=10, temperature=0)])
    run_batch(tiny_llm, source, tmp_path / "batch.jsonl")
    batch = ChatCompletion.model_validate(read_lines(tmp_path / "batch.jsonl")[0]["response"]["body"])

    rows = write_lines(tmp_path / "rows.jsonl", [{"qid": "q", "messages": messages}])
    config = validate_config({
        "model": {"name": tiny_llm.model_name, "device": "cpu", "dtype": "float32"},
        "data": {"source": str(rows), "id_column": "qid"},
        "prompt": {"column": "messages"},
        "generation": {"mode": "greedy", "max_tokens": 10},
        "output": {"path": str(tmp_path / "run.jsonl")},
    })
    execute(plan(config), quiet=True, llm=tiny_llm)
    (record,) = read_lines(tmp_path / "run.jsonl")
    assert batch.choices[0].message.content == record["generations"][0]["text"]
    assert batch.usage.prompt_tokens == record["usage"]["prompt_tokens"]
    assert batch.usage.completion_tokens == record["generations"][0]["num_tokens"]


def test_sampling_seeds_follow_the_custom_id(tmp_path: Path, tiny_llm: Any) -> None:
    """Without a seed, a line's samples depend on its custom_id only: reruns and resumes repeat."""
    first = write_lines(tmp_path / "a.jsonl", [chat("x", max_tokens=6), chat("y", "Hello", max_tokens=6, n=2)])
    second = write_lines(tmp_path / "b.jsonl", [chat("z", "Other", max_tokens=3), chat("y", "Hello", max_tokens=6, n=2),
                                                chat("x", max_tokens=6)])
    run_batch(tiny_llm, first, tmp_path / "a.out")
    run_batch(tiny_llm, second, tmp_path / "b.out")

    def texts(path: Path) -> dict[str, list[str]]:
        return {e["custom_id"]: [c["message"]["content"] for c in e["response"]["body"]["choices"]] for e in read_lines(path)}

    a, b = texts(tmp_path / "a.out"), texts(tmp_path / "b.out")
    assert a["x"] == b["x"] and a["y"] == b["y"]
    assert a["y"][0] != a["y"][1]  # two samples, not one repeated


# --------------------------------------------------------------------------- other combinations


def test_dataset_rows_written_as_openai_lines(tmp_path: Path, tiny_llm: Any, job_config: Any) -> None:
    """``output.format: openai_batch`` over an ordinary dataset job; resume keys on custom_id."""
    from batchgen.config import load_config

    path = job_config(metrics=[], generation={"mode": "sample", "n": 2, "max_tokens": 4, "logprobs": 1},
                      output={"path": str(tmp_path / "out.jsonl"), "format": "openai_batch"})
    execute(plan(load_config(path)), quiet=True, llm=tiny_llm)
    lines = read_lines(tmp_path / "out.jsonl")
    assert sorted(e["custom_id"] for e in lines) == [f"q{i:02d}" for i in range(12)]
    for entry in lines:
        body = Completion.model_validate(entry["response"]["body"])  # no chat template in this job
        assert len(body.choices) == 2 and all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in body.choices)
    summary = execute(plan(load_config(path, ["output.if_exists=resume"])), quiet=True, llm=tiny_llm)
    assert summary["records"]["resumed"] == 12 and summary["records"]["this_run"] == 0
    assert len(read_lines(tmp_path / "out.jsonl")) == 12


def test_batch_file_written_as_batchgen_records(tmp_path: Path, tiny_llm: Any) -> None:
    source = write_lines(tmp_path / "in.jsonl", [chat("a", max_tokens=3, temperature=0), "oops",
                                                 line("b", COMPLETIONS, prompt="Hi", max_tokens=2, use_beam_search=True, n=2)])
    summary = run_batch(tiny_llm, source, tmp_path / "out.jsonl", format="jsonl")
    records = {r["id"]: r for r in read_lines(tmp_path / "out.jsonl")}
    assert set(records) == {"a", "b", None}
    assert records["a"]["error"] is None and records["a"]["generations"][0]["num_tokens"] == 3
    assert len(records["b"]["generations"]) == 2 and "score" in records["b"]["generations"][0]
    assert records[None]["error"].startswith("line 2: the line is not valid JSON")
    assert summary["records"]["ok"] == 2 and "request_counts" not in summary


def test_cli_maps_model_names_and_splits_errors(tmp_path: Path, tiny_llama: str, tiny_engine: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    source = write_lines(tmp_path / "in.jsonl", [chat("a", model="gpt-4o-mini", max_tokens=2), chat("b", model="gpt-4o", max_tokens=2)])
    out, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    engine = [f"--set=engine.{k}={v}" for k, v in tiny_engine.items()]
    argv = ["batch", str(source), "-o", str(out), "--model", f"gpt-4o-mini={tiny_llama}", "--error-file", str(errors),
            "--set", "model.device=cpu", *engine]
    assert main(argv) == 0
    assert [e["custom_id"] for e in read_lines(out)] == ["a"]
    assert [(e["custom_id"], error_of(e)["code"]) for e in read_lines(errors)] == [("b", "model_not_found")]
    # Each file named with its own count: the ok line in OUTPUT, the failed one in the error file.
    assert f"wrote 1 record(s) to {out}, 1 error to {errors} (0 already there)" in capsys.readouterr().out
    # Two models for one job, and a key a batch file makes meaningless, are usage errors.
    assert main(["batch", str(source), "-o", str(out), "--model", "a=x", "--model", "y", "--overwrite"]) == 2
    assert "one job runs one model" in capsys.readouterr().err
    assert main(["batch", str(source), "-o", str(out), "--set", "generation.max_tokens=5", "--overwrite"]) == 2
    assert "drop 'generation.max_tokens'" in capsys.readouterr().err


def test_validate_previews_the_first_lines(tmp_path: Path, tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_lines(tmp_path / "in.jsonl", [chat("a"), "nope", chat("a"), chat("b", max_token=3)])
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"model": {"name": tiny_llama}, "data": {"source": str(source), "format": "openai_batch"},
                               "output": {"path": str(tmp_path / "out.jsonl")}}))
    assert main(["validate", str(job)]) == 0
    out = capsys.readouterr().out
    assert "note: line 2: the line is not valid JSON" in out
    assert 'note: line 3 (custom_id "a"): duplicate custom_id: it was first used on line 1' in out
    assert 'note: line 4 (custom_id "b"): Unrecognized request argument supplied: max_token' in out
    assert "ok (4 lines in" in out and not (tmp_path / "out.jsonl").exists()


def test_config_rules() -> None:
    base = {"data": {"source": "in.jsonl", "format": "openai_batch"}, "output": {"path": "out.jsonl"}}
    assert validate_config(base).output.format == "openai_batch"
    assert validate_config({**base, "data": {"source": "x.jsonl"}}).output.format == "jsonl"
    with pytest.raises(ConfigError, match="drop 'prompt.template'"):
        validate_config({**base, "prompt": {"template": "{{ x }}"}})
    with pytest.raises(ConfigError, match="metrics score batchgen records"):
        validate_config({**base, "metrics": [{"name": "length"}]})
    with pytest.raises(ConfigError, match="'model.aliases' applies to data.format 'openai_batch' only"):
        validate_config({"model": {"aliases": ["gpt"]}, "data": {"source": "x.jsonl"}, "output": {"path": "o.jsonl"}})


# --------------------------------------------------------------------------- the run's guarantees


def batch_cli(capsys: pytest.CaptureFixture[str], source: Path, out: Path, tiny_llama: str, tiny_engine: Any,
              *flags: str) -> tuple[int, str]:
    """``batchgen batch`` in this process on the tiny model: (exit status, stderr)."""
    engine = [f"--set=engine.{k}={v}" for k, v in tiny_engine.items()]
    code = main(["batch", str(source), "-o", str(out), "--model", tiny_llama, "--set", "model.device=cpu",
                 "--quiet", *engine, *flags])
    return code, capsys.readouterr().err


def test_batch_holds_the_lock_and_checks_the_job_on_resume(tmp_path: Path, tiny_llama: str, tiny_engine: Any,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from batchgen.io.lock import OutputLock

    source = write_lines(tmp_path / "in.jsonl", [chat("a", max_tokens=2, temperature=0), chat("b", max_tokens=2, temperature=0)])
    out, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    run = functools.partial(batch_cli, capsys, source, out, tiny_llama, tiny_engine, "--error-file", str(errors))
    for held in (out, errors):  # a second job on the output, or on the error file, is refused
        with OutputLock(held):
            code, err = run()
        assert code == 2 and err.startswith(f"batchgen: error: output file {held} is in use by pid {os.getpid()} (started ")
    assert not out.exists() and not errors.exists()

    assert run("--set", "data.limit=1")[0] == 0  # answers 'a'
    # A resume whose job answers differently is refused, naming what changed.
    code, err = run("--resume", "--set", "engine.seed=7")
    assert code == 2 and "  - engine.seed: 0 before, 7 now\n" in err and "--force-resume" in err
    code, err = run("--resume", "--model", f"gpt-4o={tiny_llama}")
    assert code == 2 and '  - model.aliases: [] before, ["gpt-4o"] now\n' in err
    assert [e["custom_id"] for e in read_lines(out)] == ["a"]
    assert run("--force-resume", "--set", "engine.seed=7")[0] == 0
    assert sorted(e["custom_id"] for e in read_lines(out)) == ["a", "b"]


def test_counts_read_back_from_openai_lines(tmp_path: Path, tiny_llama: str, tiny_engine: Any,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Error lines carry ``"error": null`` and a 400 status: the summary, --max-error-rate and
    the exit status read them as failures, across a resume."""
    source = write_lines(tmp_path / "in.jsonl", [chat(f"bad{i:02d}", max_token=2) for i in range(11)])
    out = tmp_path / "out.jsonl"
    run = functools.partial(batch_cli, capsys, source, out, tiny_llama, tiny_engine)
    code, err = run("--max-error-rate", "0.5")
    assert code == 3 and err.startswith("batchgen: error: run stopped: 10 of the 10 records written so far are errors "
                                        "(100%), over --max-error-rate 0.5; the last one, custom_id 'bad09': "
                                        "Unrecognized request argument supplied: max_token")
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["status"] == "failed" and summary["request_counts"] == {"total": 10, "completed": 0, "failed": 10}

    code, err = run("--resume")
    assert code == 3 and err.startswith(f"batchgen: error: no record succeeded: all 11 records in {out} are errors, "
                                        "e.g. custom_id 'bad00': Unrecognized request argument supplied: max_token")
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    records = summary["records"]
    assert (records["total"], records["ok"], records["error"], records["resumed"]) == (11, 0, 11, 10)
    assert (records["this_run"], records["this_run_error"]) == (1, 1)
    assert records["first_error"]["custom_id"] == "bad00"
    assert summary["request_counts"] == {"total": 11, "completed": 0, "failed": 11}


def test_a_failed_background_fsync_is_the_full_disk_error(tmp_path: Path, tiny_llama: str, tiny_engine: Any,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC from the group commit's fsync (a file system that reports a full disk only then)
    stops the job with the one error a failed write gives."""
    source = write_lines(tmp_path / "in.jsonl", [chat(f"r{i}", max_tokens=2, temperature=0) for i in range(4)])
    out = tmp_path / "out.jsonl"
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(out):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    code, err = batch_cli(capsys, source, out, tiny_llama, tiny_engine)
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[0] == f"batchgen: error: run failed: cannot write to {out}: no space left on device"
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == f"cannot write to {out}: no space left on device"
    assert out.read_bytes() == b"" and summary["records"]["total"] == 0  # no fsync covered a line: none is kept


# --------------------------------------------------------------------------- one line -> request


@pytest.fixture(scope="module")
def parser(smollm2_tokenizer: Any) -> LineParser:
    return LineParser(smollm2_tokenizer, 2048, ["m", "alias"])


def parsed(parser: LineParser, url: str = CHAT, **body: Any) -> Any:
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": "Hi"}])
    else:
        body.setdefault("prompt", "Hi")
    return parser.parse({"custom_id": "c", "method": "POST", "url": url, "body": body}, "c", 0)


def test_openai_defaults_and_field_mapping(parser: LineParser) -> None:
    default = parsed(parser)
    params = default.params
    assert isinstance(params, SamplingParams) and params.temperature == 1.0 and params.top_p == 1.0 and params.n == 1
    assert params.max_tokens == 2048 - len(default.prompt_token_ids)  # chat: the rest of the context
    assert parsed(parser, COMPLETIONS).params.max_tokens == 16  # completions: OpenAI's 16
    full = parsed(parser, temperature=0.5, top_p=0.9, n=2, stop="END", seed=3, presence_penalty=0.5,
                  frequency_penalty=-0.5, max_completion_tokens=7, top_k=20, min_p=0.1, repetition_penalty=1.2,
                  min_tokens=2, ignore_eos=True, stop_token_ids=[5], logprobs=True, top_logprobs=4, user="u",
                  metadata={"k": "v"}, model="alias").params
    assert (full.temperature, full.top_p, full.n, full.stop, full.seed, full.max_tokens) == (0.5, 0.9, 2, ["END"], 3, 7)
    assert (full.top_k, full.min_p, full.repetition_penalty, full.min_tokens, full.ignore_eos) == (20, 0.1, 1.2, 2, True)
    assert (full.presence_penalty, full.frequency_penalty, full.stop_token_ids, full.logprobs) == (0.5, -0.5, [5], 4)
    cmpl = parsed(parser, COMPLETIONS, prompt=[1, 2, 3], logprobs=3, best_of=4, n=2)
    assert cmpl.prompt_token_ids == [1, 2, 3] and cmpl.top_logprobs == 3
    assert (cmpl.params.best_of, cmpl.params.n, cmpl.params.logprobs) == (4, 2, 3)
    beam = parsed(parser, COMPLETIONS, use_beam_search=True, n=3, length_penalty=0.7, temperature=0, max_tokens=5)
    assert isinstance(beam.params, BeamSearchParams)
    assert (beam.params.beam_width, beam.params.length_penalty, beam.params.max_tokens) == (3, 0.7, 5)
    assert parsed(parser, stop="END", include_stop_str_in_output=True).params.include_stop_str_in_output
    assert not parsed(parser, stop="END").params.include_stop_str_in_output
    developer = parsed(parser, messages=[{"role": "developer", "content": "Rules"}, {"role": "user", "content": "Hi"}])
    system = parsed(parser, messages=[{"role": "system", "content": "Rules"}, {"role": "user", "content": "Hi"}])
    assert developer.prompt == system.prompt and developer.error is None


@pytest.mark.parametrize(
    ("body", "url", "param", "code", "words"),
    [
        ({"stream": True}, CHAT, "stream", "unsupported_parameter", "answered whole"),
        ({"top_logprobs": 2}, CHAT, "top_logprobs", "invalid_value", "needs 'logprobs': true"),
        ({"use_beam_search": True, "top_p": 0.5}, CHAT, "top_p", "unsupported_parameter", "use_beam_search"),
        ({"length_penalty": 2.0}, CHAT, "length_penalty", "invalid_value", "use_beam_search"),
        ({"temperature": -1}, CHAT, "temperature", "invalid_value", "temperature must be >= 0"),
        ({"max_tokens": 0}, CHAT, "max_tokens", "invalid_value", ">= 1"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, CHAT, "max_completion_tokens", "invalid_value", "not both"),
        ({"tools": [{"type": "function"}]}, CHAT, "tools", "unsupported_parameter", "tool calling"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, CHAT,
         "messages.0.content.0", "unsupported_value", "text parts only"),
        ({"messages": [{"role": "robot", "content": "x"}]}, CHAT, "messages.0.role", "invalid_value", "expected one of"),
        ({"messages": []}, CHAT, "messages", "invalid_value", "at least one message"),
        ({"response_format": {"type": "xml"}}, CHAT, "response_format.type", "invalid_value", "expected 'text'"),
        ({"prompt": ["a", "b"]}, COMPLETIONS, "prompt", "invalid_value", "one prompt per line"),
        ({"prompt": []}, COMPLETIONS, "prompt", "invalid_value", "empty"),
        ({"use_beam_search": True, "include_stop_str_in_output": True}, CHAT, "include_stop_str_in_output",
         "unsupported_parameter", "not supported with 'use_beam_search'"),
        ({"echo": True, "use_beam_search": True}, COMPLETIONS, "echo", "unsupported_parameter",
         "'echo' is not supported with 'use_beam_search'"),
        ({"max_tokens": 0}, COMPLETIONS, "max_tokens", "invalid_value", "0 with 'echo': true scores the prompt only"),
        ({"best_of": 1, "n": 2}, COMPLETIONS, "best_of", "invalid_value", "best_of must be >= n"),
        ({"logprobs": 21}, COMPLETIONS, "logprobs", "invalid_value", "between 0 and 20"),
        ({"n": True}, COMPLETIONS, "n", "invalid_type", "valid integer"),
        ({"max_tokens": 2048}, COMPLETIONS, "prompt", "context_length_exceeded", "maximum context length is 2048"),
    ],
)
def test_invalid_bodies(parser: LineParser, body: dict[str, Any], url: str, param: str, code: str, words: str) -> None:
    prompt = parsed(parser, url, **body)
    assert (prompt.error_param, prompt.error_code) == (param, code), prompt.error
    assert words in prompt.error and prompt.params is None


def test_response_format_maps_onto_structured_outputs(parser: LineParser) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    by_schema = parsed(parser, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    by_object = parsed(parser, COMPLETIONS, response_format={"type": "json_object"})
    assert parsed(parser, response_format={"type": "text"}).error is None
    assert by_schema.error is None and by_schema.params.structured_outputs.json == schema
    assert by_object.error is None and by_object.params.structured_outputs.json_object is True
    broken = parsed(parser, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
    assert (broken.error_param, broken.error_code) == ("response_format.json_schema.schema", "invalid_value")


# --------------------------------------------------------------------------- kill and resume


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_then_resume_answers_every_line_once(tmp_path: Path, tiny_llama: str, sigkill_after_records: Any) -> None:
    lines: list[Any] = []
    for i in range(18):
        lines.append(chat(f"r{i:02d}", f"Item {i}", max_tokens=24, ignore_eos=True, temperature=0))
        if i % 6 == 2:
            lines.append("{broken")
        if i % 6 == 4:
            lines.append(chat(f"r{i - 1:02d}", "again", max_tokens=2))  # a duplicate
    source = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "batchgen", "batch", str(source), "-o", str(out), "--model", tiny_llama,
               "--set", "model.device=cpu", "--set", "engine.kv_cache_memory=8MiB", "--quiet"]

    # Two sequences at a time: answers land two by two, one wave every 24 steps.
    killed = sigkill_after_records([*command, "--set", "engine.max_num_seqs=2"], out, 6)
    complete = killed[: killed.rfind(b"\n") + 1]
    before = len(complete.splitlines())
    assert 3 <= before < len(lines)

    resumed = subprocess.run([*command, "--resume", "--set", "engine.max_num_seqs=8"], capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = out.read_bytes()
    assert final.startswith(complete)
    entries = [json.loads(text) for text in final.splitlines()]
    good = sorted(e["custom_id"] for e in entries if e["response"]["status_code"] == 200)
    assert good == [f"r{i:02d}" for i in range(18)]  # every custom_id answered exactly once
    bad = [error_of(e)["code"] for e in entries if e["response"]["status_code"] != 200]
    assert sorted(bad) == ["duplicate_custom_id"] * 3 + ["invalid_json"] * 3  # and every bad line once
    texts = {e["custom_id"]: e["response"]["body"]["choices"][0]["message"]["content"] for e in entries
             if e["response"]["status_code"] == 200}
    assert all(e["response"]["body"]["usage"]["completion_tokens"] == 24 for e in entries if e["response"]["status_code"] == 200)
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["request_counts"] == {"total": len(lines), "completed": 18, "failed": 6}
    assert summary["records"]["resumed"] == before
    assert len(texts) == 18


# --------------------------------------------------------------------------- names and models


def test_every_unknown_field_is_named(parser: LineParser) -> None:
    prompt = parsed(parser, max_token=3, temprature=0.5, frobnicate=1)
    assert prompt.error == ("Unrecognized request arguments supplied: max_token (did you mean 'max_tokens'?), "
                            "temprature (did you mean 'temperature'?), frobnicate")
    assert (prompt.error_param, prompt.error_code) == ("max_token", "unknown_parameter")
    line = parser.parse({"custom_id": "x", "method": "POST", "url": CHAT, "body": {"messages": []}, "extra": 1, "more": 2},
                        "x", 0)
    assert line.error.startswith("Unrecognized fields in the request line: extra, more; ")
    message = parsed(parser, messages=[{"role": "user", "content": "Hi", "nmae": "a", "mood": "b"}])
    assert message.error == "Unrecognized arguments in 'messages.0' supplied: mood, nmae (did you mean 'name'?)"
    assert message.error_param == "messages.0.mood"


def test_one_served_model_answers_any_model_with_one_warning(smollm2_tokenizer: Any,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    single = LineParser(smollm2_tokenizer, 2048, ["smollm2-135m-instruct"])
    with caplog.at_level("WARNING", logger="batchgen.openai_batch"):
        prompts = [parsed(single, model=name) for name in ("gpt-4o-mini", "gpt-4o", "smollm2-135m-instruct")]
    assert [p.error for p in prompts] == [None, None, None] and all(p.params is not None for p in prompts)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert warnings == ["batchgen: warning: lines ask for model 'gpt-4o-mini'; this job serves one model, "
                        "'smollm2-135m-instruct', which answers every line (map names with "
                        "--model NAME=smollm2-135m-instruct to answer only those)"]
    # A job that maps names (several served names) answers those only: another name is a 404 line.
    mapped = LineParser(smollm2_tokenizer, 2048, ["smollm2-135m-instruct", "gpt-4o-mini"])
    assert parsed(mapped, model="gpt-4o-mini").error is None
    other = parsed(mapped, model="gpt-4o")
    assert (other.error_param, other.error_code) == ("model", "model_not_found")


def docs_input_lines() -> list[dict[str, Any]]:
    """The input lines docs/openai-batch.md shows first, as written there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "openai-batch.md").read_text(encoding="utf-8")
    block = text.split("## Input lines", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    decoder, lines, at = json.JSONDecoder(), [], 0
    while block[at:].strip():
        while block[at].isspace():
            at += 1
        value, at = decoder.raw_decode(block, at)
        lines.append(value)
    return lines


def test_the_docs_example_runs_as_written(tmp_path: Path, tiny_llama: str, tiny_engine: Any,
                                          capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    lines = docs_input_lines()
    assert lines[0]["body"]["model"] == "gpt-4o-mini"  # the model the example names, which this job does not run
    source, out = write_lines(tmp_path / "requests.jsonl", lines), tmp_path / "responses.jsonl"
    with caplog.at_level("WARNING", logger="batchgen.openai_batch"):
        code, err = batch_cli(capsys, source, out, tiny_llama, tiny_engine)
    assert code == 0, err
    answers = {a["custom_id"]: a for a in read_lines(out)}  # in finish order
    assert {k: a["response"]["status_code"] for k, a in answers.items()} == {"req-1": 200, "req-2": 200}
    assert ChatCompletion.model_validate(answers["req-1"]["response"]["body"]).choices[0].message.content is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= 30 and "gpt-4o-mini" in r.getMessage()]
    assert len(warnings) == 1 and "serves one model" in warnings[0]


def test_a_schema_nothing_can_match_fails_its_line_alone(parser: LineParser, tmp_path: Path, tiny_llm: Any) -> None:
    pytest.importorskip("xgrammar", reason="structured outputs need the 'structured' extra")
    never = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": r"[^\s\S]"}}}
    prompt = parsed(parser, response_format=never)
    assert (prompt.error_param, prompt.error_code) == ("response_format.json_schema.schema", "invalid_value")
    assert "can never be matched" in prompt.error and prompt.params is None
    # The 3-line file: line 2 gets its own 400 line, lines 1 and 3 are answered.
    source = write_lines(tmp_path / "in.jsonl", [chat("one", max_tokens=2, temperature=0),
                                                 chat("two", max_tokens=2, response_format=never),
                                                 chat("three", max_tokens=2, temperature=0)])
    run_batch(tiny_llm, source, tmp_path / "out.jsonl")
    status = {line["custom_id"]: line["response"]["status_code"] for line in read_lines(tmp_path / "out.jsonl")}
    assert status == {"one": 200, "two": 400, "three": 200}


# --------------------------------------------------------------------------- echo: the prompt's logprobs


def test_echo_scores_the_prompt_as_hf_log_softmax_does(tmp_path: Path, tiny_llm: Any, tiny_llama: str,
                                                        smollm2_tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    text = "The capital of France is Paris, and the capital of Italy is Rome."
    token_prompt = [17, 4453, 288, 2366, 314, 12281]
    source = write_lines(tmp_path / "in.jsonl", [
        line("score", COMPLETIONS, prompt=text, echo=True, logprobs=3, max_tokens=0),
        line("score-ids", COMPLETIONS, prompt=token_prompt, echo=True, logprobs=0, max_tokens=0),
        line("echo-only", COMPLETIONS, prompt=text, echo=True, max_tokens=0),
        line("echo-and-generate", COMPLETIONS, prompt=text, echo=True, logprobs=1, max_tokens=3, temperature=0),
        line("zero-without-echo", COMPLETIONS, prompt=text, max_tokens=0),
    ])
    run_batch(tiny_llm, source, tmp_path / "out.jsonl")
    answers = {a["custom_id"]: a for a in read_lines(tmp_path / "out.jsonl")}
    assert error_of(answers["zero-without-echo"])["param"] == "max_tokens"

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()

    def oracle(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    # OpenAI answers None for the first prompt token, which the openai package's types do not allow:
    # the bodies are checked as the types see them without it, and the logprobs as written.
    def body_of(custom_id: str) -> tuple[Completion, Any]:
        body = json.loads(json.dumps(answers[custom_id]["response"]["body"]))
        lp = body["choices"][0]["logprobs"]
        if lp is not None:
            lp = SimpleNamespace(**lp)
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                body["choices"][0]["logprobs"][key] = getattr(lp, key)[1:]
        return Completion.model_validate(body), lp

    for custom_id, ids, k in (("score", smollm2_tokenizer(text)["input_ids"], 3), ("score-ids", token_prompt, 0)):
        body, lp = body_of(custom_id)
        choice, expected = body.choices[0], oracle(ids)
        assert (body.usage.prompt_tokens, body.usage.completion_tokens, choice.finish_reason) == (len(ids), 0, "length")
        assert choice.text == (text if custom_id == "score" else smollm2_tokenizer.decode(token_prompt))
        assert lp.tokens == [smollm2_tokenizer.decode([t]) for t in ids]
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        want = [expected[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
        for i in range(1, len(ids)):
            top = torch.topk(expected[i - 1], k)
            wanted = {smollm2_tokenizer.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
            wanted[lp.tokens[i]] = want[i - 1]  # the token's own entry is always listed
            assert lp.top_logprobs[i] == pytest.approx(wanted, abs=2e-4)

    only = answers["echo-only"]["response"]["body"]["choices"][0]
    assert (only["text"], only["logprobs"]) == (text, None)
    both, lp = body_of("echo-and-generate")
    ids = smollm2_tokenizer(text)["input_ids"]
    assert both.choices[0].text.startswith(text) and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(
        [oracle(ids)[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=2e-4)
