"""The command line: exit codes and the message of every bad-input path.

All of these fail (or succeed) before any model runs, so they are quick.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from batchgen.cli import main
from batchgen.quiet import say


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_validate_accepts_a_good_config(job_config, capsys) -> None:
    code, out, err = _cli(capsys, "validate", str(job_config()))
    assert (code, err) == (0, "")
    assert "ok (12 rows from" in out and "template renders on the first 5" in out and "is writable" in out
    assert "model '" in out and "' found" in out  # the ok line says that the model was checked


def test_unknown_key(job_config, capsys) -> None:
    code, _, err = _cli(capsys, "validate", str(job_config(generation={"max_token": 4})))
    assert code == 2
    assert "generation.max_token: unknown key (did you mean 'max_tokens'?)" in err


def test_wrong_type_and_all_errors_at_once(job_config, capsys) -> None:
    path = job_config(engine={"block_size": "sixteen"}, data={"limit": -1})
    code, _, err = _cli(capsys, "run", str(path))
    assert code == 2
    assert "invalid config (2 errors)" in err
    assert "data.limit: Input should be greater than 0 (got -1)" in err
    assert "engine.block_size: expected an integer, got 'sixteen'" in err


def test_missing_column(job_config, capsys) -> None:
    path = job_config(prompt={"template": "Q: {{ questoin }}", "chat_template": False})
    code, _, err = _cli(capsys, "validate", str(path))
    assert code == 2
    assert (
        "prompt.template: column 'questoin' is not in the dataset (did you mean 'question'?); "
        "columns: 'qid', 'question', 'answer'"
    ) in err
    path = job_config(prompt={"column": "text", "template": None})
    for command in ("validate", "run"):  # found after validation: the same prefix as every config error
        code, _, err = _cli(capsys, command, str(path))
        assert code == 2 and err.startswith(f"batchgen: error: {path}: invalid config: prompt.column: column 'text' "
                                            "is not in the dataset"), err


def test_metric_needs_its_reference_column(job_config, capsys) -> None:
    path = job_config(metrics=[{"name": "exact_match", "options": {"reference": "gold"}}])
    code, _, err = _cli(capsys, "validate", str(path))
    assert code == 2 and "metrics.0: metric 'exact_match' reads column 'gold' is not in the dataset" in err


def test_unknown_plugin(job_config, capsys) -> None:
    path = job_config(metrics=[{"name": "exact_mach"}], generation={"mode": "sample", "sampler": {"name": "typicl"}})
    code, _, err = _cli(capsys, "validate", str(path))
    assert code == 2
    assert "generation.sampler: unknown sampler plugin 'typicl' (did you mean 'typical'?); installed: " in err
    assert "metrics.0: unknown metric plugin 'exact_mach' (did you mean 'exact_match'?); installed: " in err
    assert "'pass_at_k'" in err  # the installed third-party metric is listed too


def test_unknown_plugin_module(job_config, capsys) -> None:
    code, _, err = _cli(capsys, "validate", str(job_config(plugins=["no_such_plugin_module"])))
    assert code == 2 and "no_such_plugin_module" in err


def test_invalid_plugin_options(job_config, capsys) -> None:
    path = job_config(
        metrics=[{"name": "exact_match", "options": {"reference": "answer", "lowercas": False}}],
        generation={"mode": "sample", "sampler": {"name": "typical", "options": {"mass": 2}}},
    )
    code, _, err = _cli(capsys, "run", str(path))
    assert code == 2
    assert "generation.sampler: invalid options for sampler plugin 'typical': mass: Input should be less than or equal to 1" in err
    assert (
        "metrics.0: invalid options for metric plugin 'exact_match': lowercas: unknown option (did you mean 'lowercase'?)"
        in err
    )


def test_template_error_on_first_rows(job_config, capsys, tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "a", "n": 1}\n{"question": "b", "n": 0}\n')
    path = job_config(
        data={"source": str(data), "id_column": None},
        prompt={"template": "{{ question }} {{ 10 // n }}"},
        metrics=[{"name": "length"}],
    )
    code, _, err = _cli(capsys, "validate", str(path))
    assert code == 2
    assert "prompt: row id '1': prompt template failed: ZeroDivisionError: integer division or modulo by zero" in err
    code, _, err = _cli(capsys, "validate", str(job_config(prompt={"template": "{{ question }"})))
    assert code == 2 and "prompt: template syntax error on line 1: unexpected '}'" in err


def test_unwritable_output(job_config, capsys, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    path = job_config(output={"path": str(blocker / "results.jsonl")})
    for command in ("validate", "run"):
        code, _, err = _cli(capsys, command, str(path))
        assert code == 2
        assert f"output path {blocker / 'results.jsonl'} is not writable: {blocker} is a file, not a folder" in err


def test_existing_output_needs_resume_or_overwrite(job_config, capsys, tmp_path: Path) -> None:
    path = job_config()
    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    out.write_text('{"id": "q00"}\n')
    code, _, err = _cli(capsys, "run", str(path))
    assert code == 2
    assert f"output file {out} already exists; pass --resume" in err and "or --overwrite to start over" in err
    assert out.read_text() == '{"id": "q00"}\n'  # untouched
    code, out_text, _ = _cli(capsys, "validate", str(path))
    assert code == 0 and "will need --resume or --overwrite" in out_text
    with pytest.raises(SystemExit) as info:
        main(["run", str(path), "--resume", "--overwrite"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_set_overrides_and_bad_set(job_config, capsys) -> None:
    path = job_config()
    code, out, _ = _cli(capsys, "validate", str(path), "--set", "data.limit=3")
    assert code == 0 and "ok (3 rows" in out
    code, _, err = _cli(capsys, "validate", str(path), "--set", "data.limit")
    assert code == 2 and "--set: expected KEY.PATH=VALUE, got 'data.limit'" in err
    code, _, err = _cli(capsys, "validate", str(path), "--set", "data.limt=3")
    assert code == 2 and "data.limt: unknown key (did you mean 'limit'?)" in err


def test_missing_config_file(capsys, tmp_path: Path) -> None:
    code, _, err = _cli(capsys, "validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and "config file not found" in err


def test_runtime_failure_exits_1(job_config, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "boom_at_start.py").write_text(
        "from batchgen.plugins import hookimpl\n\n@hookimpl\ndef batchgen_run_start(config):\n    raise OSError('disk on fire')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _cli(capsys, "run", str(job_config(plugins=["boom_at_start"])), "--quiet")
    assert code == 1
    assert "run failed:" in err and "boom_at_start" in err and "OSError: disk on fire" in err
    say("after the run")  # --quiet held for that run only: nothing is left set behind it
    assert capsys.readouterr().err == "batchgen: after the run\n"


def test_plugins_lists_builtins_and_entry_points(capsys) -> None:
    code, out, _ = _cli(capsys, "plugins")
    assert code == 0
    assert "metric  exact_match" in out and "sampler typical" in out and "metric  pass_at_k" in out
    code, out, _ = _cli(capsys, "plugins", "--json")
    entries = json.loads(out)
    sources = {e["name"]: e["source"] for e in entries}
    assert "built-in" in sources.values() and "entry point" in sources.values()


def test_missing_model_folder(job_config, capsys, tmp_path: Path) -> None:
    missing = tmp_path / "no-model-here"
    code, _, err = _cli(capsys, "run", str(job_config(model={"name": str(missing)})))
    assert code == 2
    assert f"model.name: model path '{missing}' does not exist" in err


# --------------------------------------------------------------------------- hardening


def test_version(capsys) -> None:
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"batchgen {metadata.version('batchgen')}\n"


@pytest.mark.parametrize("sections,expected", [
    ({"engine": {"block_size": 1000}}, "engine.block_size: Input should be less than or equal to 256 (got 1000)"),
    ({"engine": {"kv_cache_memory": 0}}, "engine.kv_cache_memory: Input should be greater than 0 (got 0)"),
    ({"generation": {"max_tokens": True}}, "generation.max_tokens: expected an integer, got true; a boolean is not a number"),
    ({"generation": {"ignore_eos": "yes"}}, "generation.ignore_eos: expected true or false, got 'yes'"),
    ({"model": {"name": "smollm2-999m"}}, "model.name: model 'smollm2-999m' is not a built-in model ('smollm2-135m-instruct'), "
     "not a local folder, and not a hub id available here: it is not in the HF cache and HF_HUB_OFFLINE is set"),
])
def test_validate_catches_what_used_to_fail_after_loading(job_config, capsys, tmp_path: Path, monkeypatch, sections, expected) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    path = job_config(**sections)
    for command in ("validate", "run"):
        code, _, err = _cli(capsys, command, str(path))
        assert code == 2 and expected in err, err
    assert not (tmp_path / "out").exists()  # nothing written, not even an empty output file


def test_set_values_keep_their_yaml_types(job_config, capsys) -> None:
    code, out, err = _cli(capsys, "validate", str(job_config()), "--set", "data.limit=5", "--set", "engine.kv_cache_memory=512MiB",
                          "--set", "generation.ignore_eos=true")
    assert code == 0 and "ok (5 rows" in out, err


@pytest.mark.parametrize("content,expected", [
    (b'{"qid": "a", "question": "fine", "answer": "1"}\n{"qid": "b", "question": "caf\xe9", "answer": "2"}\n',
     "line 2 of {path} is not valid UTF-8 (byte 0xe9 at column 30); fix or remove that line"),
    (b'{"qid": "a", "question": "fine", "answer": "1"}\n\n{"qid": "b", "question": "oops" "answer": "2"}\n',
     "line 3 of {path} is not valid JSON: Expecting ',' delimiter (column 33)"),
    # A lone surrogate is valid JSON to Python but not text: the line is named from 1, as the others.
    (b'{"qid": "a", "question": "fine", "answer": "1"}\n{"qid": "b", "question": "bad \\ud800", "answer": "2"}\n',
     "line 2 of {path} is not valid JSON: it holds a lone surrogate \\ud800"),
])
def test_damaged_dataset_names_file_and_line(job_config, capsys, tmp_path: Path, content: bytes, expected: str) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_bytes(content)
    path = job_config(data={"source": str(data), "id_column": "qid"})
    for command in ("validate", "run"):
        code, _, err = _cli(capsys, command, str(path))
        assert code == 2 and expected.format(path=data) in err, err
        assert "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_plugins_lists_options(capsys) -> None:
    code, out, _ = _cli(capsys, "plugins")
    assert code == 0
    assert "epsilon (float, > 0.0, < 1.0; default 0.0003): Drop tokens with probability below this." in out
    assert "mass (float, > 0.0, <= 1.0; default 0.9)" in out
    code, out, _ = _cli(capsys, "plugins", "--json")
    samplers = {s["name"]: s for e in json.loads(out) for s in e["samplers"]}
    (option,) = samplers["top_a"]["options"]
    assert option == {"name": "a", "type": "float", "constraints": "> 0.0, <= 1.0", "required": False, "default": 0.2,
                      "description": "Drop tokens with probability below a * p_max**2."}


def test_output_in_use_is_refused(job_config, capsys, tmp_path: Path) -> None:
    from batchgen.io.lock import OutputLock

    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    out.write_text('{"id": "q00"}\n')
    path = job_config()
    with OutputLock(out):
        for flag in ("--resume", "--overwrite"):
            code, _, err = _cli(capsys, "run", str(path), flag)
            assert code == 2
            assert err.startswith(f"batchgen: error: output file {out} is in use by pid {os.getpid()} (started ")
        code, text, _ = _cli(capsys, "validate", str(path))
        assert code == 0 and f"{out} is in use by pid {os.getpid()}" in text
    assert out.read_text() == '{"id": "q00"}\n'  # --overwrite did not truncate it


def test_resume_with_another_config_is_refused(job_config, capsys, tmp_path: Path) -> None:
    from batchgen.config import load_config, resolved_dict
    from batchgen.io.output_file import write_json_atomic
    from batchgen.plugins import load_registry

    path = job_config()
    registry = load_registry()
    earlier = resolved_dict(load_config(path, ["generation.max_tokens=16"], registry=registry), registry)
    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    out.write_text('{"id": "q00", "error": null}\n')
    write_json_atomic(out.parent / "results.summary.json", {"status": "interrupted", "config": earlier})
    code, _, err = _cli(capsys, "run", str(path), "--resume")
    assert code == 2
    assert "its records were written with a different config" in err
    assert "  - generation.max_tokens: 16 before, 8 now\n" in err and "--force-resume" in err
    assert out.read_text() == '{"id": "q00", "error": null}\n'


def test_every_record_failed_exits_3(job_config, capsys, tmp_path: Path) -> None:
    path = job_config(prompt={"max_prompt_tokens": 1}, data={"limit": 4})
    code, out, err = _cli(capsys, "run", str(path), "--quiet")
    assert code == 3
    assert err.startswith("batchgen: error: no record succeeded: all 4 records in ")
    assert "e.g. id 'q00': prompt too long: " in err
    summary = json.loads((tmp_path / "out" / "results.summary.json").read_text())
    assert summary["status"] == "completed" and summary["records"]["ok"] == 0
    assert summary["records"]["first_error"]["id"] == "q00"


def test_max_error_rate_stops_early(job_config, capsys, tmp_path: Path) -> None:
    path = job_config(prompt={"max_prompt_tokens": 1})
    code, _, err = _cli(capsys, "run", str(path), "--quiet", "--max-error-rate", "0.5")
    assert code == 3
    assert err.startswith("batchgen: error: run stopped: 10 of the 10 records written so far are errors (100%), over --max-error-rate 0.5")
    assert len((tmp_path / "out" / "results.jsonl").read_text().splitlines()) == 10
    summary = json.loads((tmp_path / "out" / "results.summary.json").read_text())
    assert summary["status"] == "failed" and summary["records"]["total"] == 10
    with pytest.raises(SystemExit):
        main(["run", str(path), "--max-error-rate", "2"])
    assert "expected a number between 0 and 1, got '2'" in capsys.readouterr().err


def test_failing_run_end_hook_is_one_line(job_config, capsys, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "boom_at_end.py").write_text(
        "from batchgen.plugins import hookimpl\n\n@hookimpl\ndef batchgen_run_end(summary):\n    raise OSError('bucket gone')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _cli(capsys, "run", str(job_config(plugins=["boom_at_end"], data={"limit": 2})), "--quiet")
    assert code == 1 and "Traceback" not in err
    first, second = err.splitlines()
    assert first == (
        "batchgen: error: run failed: plugin 'boom_at_end' (module) failed in batchgen_run_end: OSError: bucket gone; "
        f"the run itself completed (2 records in {tmp_path / 'out' / 'results.jsonl'})"
    )
    assert second.startswith("batchgen: records written so far are kept")
    summary = json.loads((tmp_path / "out" / "results.summary.json").read_text())
    assert summary["status"] == "completed" and summary["hook_errors"] == [first.split("run failed: ")[1].split("; the run")[0]]


def test_validate_lists_a_bad_model_name_with_the_other_errors(job_config, capsys, tmp_path: Path) -> None:
    """One validate shows every problem: the schema's and the model's, though the model is
    otherwise checked only once the rest of the config is valid."""
    missing = tmp_path / "no-such-model"
    path = job_config(model={"name": str(missing)}, generation={"mode": "greedy", "max_tokens": 0},
                      engine={"block_size": "big"})
    code, out, err = _cli(capsys, "validate", str(path))
    assert code == 2 and out == "", err
    assert "invalid config (3 errors)" in err, err
    assert "generation.max_tokens" in err and "engine.block_size" in err
    assert f"model.name: model path '{missing}'" in err or f"model.name: model '{missing}'" in err, err
    assert "Traceback" not in err


def test_a_run_logs_the_thread_split_and_records_it(job_config, capsys, tmp_path: Path) -> None:
    import re

    path = job_config(data={"limit": 2}, engine={"num_threads": 2})
    code, out, err = _cli(capsys, "run", str(path))
    assert code == 0, err
    split = re.search(r"^batchgen: threads: C kernels on 2 thread\(s\), torch on (\d+)$", err, re.M)
    assert split is not None, err
    summary = json.loads((tmp_path / "out" / "results.summary.json").read_text())
    line = summary["executor"]["per_replica"][0]
    assert (line["threads"], line["torch_threads"]) == (2, int(split.group(1)))


def test_max_error_rate_names_the_last_failed_record(job_config, capsys, tmp_path: Path) -> None:
    """The rate is checked at every record, ok ones too: the message names the last *failed* one."""
    rows = [{"qid": f"q{i}", "text": None if i % 5 < 3 else f"Say {i}."} for i in range(10)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = job_config(data={"source": str(data), "id_column": "qid"}, prompt={"column": "text", "template": None},
                      metrics=[])
    code, _, err = _cli(capsys, "run", str(path), "--quiet", "--max-error-rate", "0.5")
    assert code == 3, err
    assert err.startswith("batchgen: error: run stopped: 6 of the 10 records written so far are errors (60%)"), err
    assert "the last one, id 'q7': column 'text' is empty (null) in this row\n" in err, err


def _leftovers(folder: Path) -> list[str]:
    """The files batchgen would have created beside an output in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".lock", ".resume.json", ".summary.json")))


def test_the_output_is_never_the_input_dataset(job_config, capsys, tmp_path: Path, qa_file: Path) -> None:
    """The same file, a symlink to it, or a file inside a dataset folder: refused with exit 2
    whatever the flags, at validate too, and nothing is touched."""
    data = tmp_path / "data" / "qa.jsonl"
    data.parent.mkdir()
    data.write_bytes(qa_file.read_bytes())
    (tmp_path / "link.jsonl").symlink_to(data)
    before = data.read_bytes()
    for output in (str(data), str(tmp_path / "link.jsonl"), str(tmp_path / "data" / ".." / "data" / "qa.jsonl")):
        path = job_config(data={"source": str(data)}, output={"path": output})
        for argv in (("validate",), ("run", "--overwrite"), ("run", "--resume"), ("run", "--force-resume"), ("run",)):
            code, _, err = _cli(capsys, argv[0], str(path), *argv[1:])
            assert code == 2, (output, argv, err)
            assert err == (f"batchgen: error: the output is the input dataset: output.path {output} and data.source "
                           f"{data} are the same file; write the output to another file\n"), err
    os.link(data, tmp_path / "hard.jsonl")  # another name for the same inode
    path = job_config(data={"source": str(data)}, output={"path": str(tmp_path / "hard.jsonl")})
    code, _, err = _cli(capsys, "run", str(path), "--overwrite")
    assert code == 2 and "the output is the input dataset" in err
    (tmp_path / "hard.jsonl").unlink()
    path = job_config(data={"source": str(tmp_path / "link.jsonl")}, output={"path": str(data), "error_path": None})
    code, _, err = _cli(capsys, "run", str(path), "--overwrite")
    assert code == 2 and "the output is the input dataset" in err
    path = job_config(data={"source": str(data)}, output={"path": str(tmp_path / "ok.jsonl"), "error_path": str(data)})
    code, _, err = _cli(capsys, "run", str(path), "--overwrite")
    assert code == 2 and "the output is the input dataset: output.error_path" in err
    path = job_config(data={"source": str(data.parent)}, output={"path": str(data.parent / "results.jsonl")})
    code, _, err = _cli(capsys, "run", str(path), "--overwrite")
    assert code == 2 and "the output is inside the input dataset" in err and "would read it as rows" in err
    assert data.read_bytes() == before and _leftovers(data.parent) == [] and _leftovers(tmp_path) == []


def test_batch_refuses_to_answer_into_its_own_input(capsys, tmp_path: Path, tiny_llama: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m", "prompt": "Hi", "max_tokens": 2}}) + "\n")
    before = source.read_bytes()
    for flag in ("--overwrite", "--resume", "--force-resume"):
        code, _, err = _cli(capsys, "batch", str(source), "-o", str(source), "--model", tiny_llama, flag)
        assert code == 2 and "the output is the input dataset: output.path" in err, err
    assert source.read_bytes() == before and _leftovers(tmp_path) == []


def test_a_non_regular_output_is_refused_before_anything_runs(job_config, capsys, tmp_path: Path) -> None:
    """/dev/null passes no check: refused at validate and at run, and nothing is left beside it."""
    for key in ("path", "summary_path"):
        path = job_config(output={key: "/dev/null"} if key == "path" else {key: "/dev/null"})
        for command in ("validate", "run"):
            code, _, err = _cli(capsys, command, str(path), "--overwrite") if command == "run" else _cli(
                capsys, command, str(path))
            assert code == 2, err
            assert err == ("batchgen: error: output path /dev/null is not a regular file (a character device); "
                           "records and summaries go to regular files: give a file path such as results.jsonl\n")
    assert not Path("/dev/null.resume.json").exists() and not Path("/dev/null.summary.json").exists()
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    code, _, err = _cli(capsys, "validate", str(job_config(output={"path": str(fifo)})))
    assert code == 2 and "is not a regular file (a named pipe)" in err


@pytest.mark.parametrize("companion", [".resume.json", ".lock"])
def test_a_folder_where_batchgen_keeps_its_files_is_one_error_line(job_config, capsys, tmp_path: Path,
                                                                  companion: str) -> None:
    out = tmp_path / "out" / "results.jsonl"
    folder = out.with_name(out.name + companion)
    folder.mkdir(parents=True)
    for argv in (("validate",), ("run",), ("run", "--overwrite")):
        code, _, err = _cli(capsys, argv[0], str(job_config()), *argv[1:])
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith(f"batchgen: error: {folder} is a folder, but batchgen keeps "), err
    assert not out.exists() and folder.is_dir()


def test_the_sidecar_that_cannot_be_written_is_one_error_line(job_config, capsys, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while writing the records' config, before the first record: exit 1, one line."""
    import errno

    from batchgen.io import output_file

    def full(*args: object, **kwargs: object) -> None:
        raise output_file.OutputWriteError("cannot write results.jsonl.resume.json: no space left on device", errno.ENOSPC)

    monkeypatch.setattr("batchgen.run.plan.write_json_atomic", full)
    code, _, err = _cli(capsys, "run", str(job_config()))
    assert (code, err) == (1, "batchgen: error: cannot write results.jsonl.resume.json: no space left on device\n")


def test_quantization_gguf_on_a_model_that_is_not_gguf(job_config, capsys, tiny_llama: str) -> None:
    path = job_config(engine={"quantization": "gguf"})
    for command in ("validate", "run"):
        code, _, err = _cli(capsys, command, str(path))
        assert code == 2
        assert err == (f"batchgen: error: {path}: invalid config: engine.quantization: quantization 'gguf' keeps a "
                       f"GGUF file's quantized blocks, but model '{tiny_llama}' is not a GGUF file (its weights load "
                       "as stored); set engine.quantization to 'auto' or 'none', or give a .gguf model\n"), err


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"]])
def test_help_points_to_the_docs_and_an_example(capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "docs/config.md" in out and "configs/quickstart.yaml" in out
    assert "main()" not in out and "hands it" not in out
    if argv[0] == "run":  # the example job in the epilog is a valid config
        import yaml

        from batchgen.config import validate_config

        block = out[out.index("  model:"):out.index("configs/quickstart.yaml is")]
        validate_config(yaml.safe_load(block))
        assert 'sort them by "id"' in out


def test_tokenize_prints_the_ids_a_prompt_gets(capsys, tiny_llama: str, smollm2_tokenizer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the typo below is not looked up on the hub
    expected = smollm2_tokenizer("Hello world", add_special_tokens=True)["input_ids"]
    code, out, err = _cli(capsys, "tokenize", tiny_llama, "Hello world")
    lines = out.splitlines()
    assert (code, err) == (0, "") and json.loads(lines[0]) == expected and len(lines) == 1 + len(expected)
    assert lines[1].split()[0] == str(expected[0]) and "'Hello'" in lines[1]
    code, out, _ = _cli(capsys, "tokenize", tiny_llama, "Hello world", "--json")
    assert code == 0 and json.loads(out) == {"ids": expected, "tokens": smollm2_tokenizer.convert_ids_to_tokens(expected)}
    code, _, err = _cli(capsys, "tokenize", "smollm2-135m-instruc", "Hello")
    assert code == 2 and err.startswith("batchgen: error: model 'smollm2-135m-instruc' (did you mean "
                                        "'smollm2-135m-instruct'?) is not a built-in model"), err
