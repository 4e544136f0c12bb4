"""cli/logs.py: text lines or JSON lines, chosen by `--log-format` or `DLO_LOG_FORMAT`, the same fields in
every process; `dlo agent` as a real process (the other processes: tests/engine/test_request_trace.py,
tests/operator/test_operator_observability.py, tests/delivery/test_fetch_json_logs.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dlo.cli import logs
from dlo.cli.logs import LogLines, configure_logging, say

ROOT = Path(__file__).resolve().parents[1]


class Stderr:
    """What this test's logging and `say` wrote to stderr (pytest's capture, read as text)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]):
        self.capsys = capsys

    def getvalue(self) -> str:
        return self.capsys.readouterr().err


@pytest.fixture()
def stderr(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(logs, "_current", logs._current)  # the process's format, as it was
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield Stderr(capsys)
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_json_records_carry_the_fields_of_every_dlo_process(stderr):
    configure_logging("json", "info", fields={"rank": 3})
    logging.getLogger("dlo.test").info("wave %d\nforged line", 7, extra={"request_id": "r-1"})
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("dlo.test").exception("failed")
    say("dlo test: a line for a person")
    lines = stderr.getvalue().splitlines()
    first, second, third = (json.loads(line) for line in lines)  # a newline in a message never splits a record
    assert {k: first[k] for k in ("severity", "logger", "message", "rank", "request_id")} == {
        "severity": "info", "logger": "dlo.test", "message": "wave 7\nforged line", "rank": 3, "request_id": "r-1"}
    assert first["timestamp"].endswith("+00:00")
    assert second["severity"] == "error" and "ValueError: boom" in second["exc_info"]
    assert (third["logger"], third["message"]) == ("dlo", "dlo test: a line for a person")


def test_text_lines_escape_control_characters_and_say_prints_as_is(stderr):
    configure_logging("text", "info", text_format="rank0 %(levelname)s %(name)s %(message)s")
    logging.getLogger("dlo.test").info("a\nb")
    say("dlo test: plain")
    assert stderr.getvalue().splitlines() == ["rank0 INFO dlo.test a\\nb", "dlo test: plain"]


def test_log_lines_turn_printed_lines_into_records(stderr):
    configure_logging("json", "info")
    stream = LogLines("dlo.delivery.progress")
    print("fetch progress bytes=1 total=2", file=stream, flush=True)
    print("half a line", end="", file=stream)
    (record,) = (json.loads(line) for line in stderr.getvalue().splitlines())
    assert (record["logger"], record["message"]) == ("dlo.delivery.progress", "fetch progress bytes=1 total=2")
    assert not stream.isatty()


@pytest.mark.parametrize("argv", [["agent"], ["warm", "/"], ["fetch", "s3://b/m", "/tmp/x"], ["operator", "run"],
                                  ["serve", "/nonexistent-model"]])
def test_a_log_format_that_is_none_is_refused_in_one_line_naming_the_variable(argv):
    proc = subprocess.run([sys.executable, "-m", "dlo.cli.main", *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DLO_LOG_FORMAT": "xml"}, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "'xml' is not a log format: text or json" in proc.stderr
    assert "$DLO_LOG_FORMAT" in proc.stderr


def test_the_agent_logs_json_lines_only(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "dlo.cli.main", "agent", "--port", "0", "--kubernetes", "off",
                             "--models-root", str(tmp_path), "--node-name", "json-node"],
                            env={**os.environ, "DLO_LOG_FORMAT": "json"}, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stderr is not None
    try:
        records = []
        for line in proc.stderr:  # until the agent says where it serves (it has started its loops)
            records.append(json.loads(line))
            if "serving on" in records[-1]["message"]:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert records[-1]["message"].startswith("dlo agent: serving on http://127.0.0.1:")
    records += [json.loads(line) for line in (rest or "").splitlines()]  # what it logged until it stopped
    assert all({"timestamp", "severity", "logger", "message"} <= r.keys() for r in records)
