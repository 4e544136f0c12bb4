"""`dlo fetch --log-format json` (delivery/cli.py, cli/logs.py) against moto's S3 server: every line on
stderr is one JSON object, progress lines included (the operator still reads the last one), and a
failure is one error record; `dlo serve URI`'s fetch (delivery/fetch.py `serving_folder`) the same."""

from __future__ import annotations

import json
import logging

import pytest

from dlo.cli import logs
from dlo.delivery.fetch import serving_folder
from dlo.delivery.progress import parse_progress_line
from tests.delivery.conftest import dlo_fetch, files_of, upload

pytestmark = pytest.mark.slow


def _records(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines()]


def test_a_fetch_logs_json_lines_only_and_its_progress_stays_readable(s3, tiny_model, tmp_path):
    upload(s3.client(), tiny_model, "models", "json/tiny-wan")
    dest = tmp_path / "tiny-wan"
    proc = dlo_fetch("s3://models/json/tiny-wan", str(dest), "--endpoint", s3.url, "--log-format", "json",
                     env=s3.env(DLO_LOG_LEVEL="INFO"))
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.stderr)
    progress = [r for r in records if r["logger"] == "dlo.delivery.progress"]
    total = sum(len(b) for b in files_of(tiny_model).values())
    assert progress and all(r["severity"] == "info" for r in progress)
    done, whole, files_done, files = parse_progress_line(proc.stderr)  # as the operator reads a Job's log
    assert (done, whole) == (total, total) and files_done == files
    assert any(r["logger"].startswith("dlo.delivery.") and r["logger"] != "dlo.delivery.progress" for r in records)


def test_a_failed_fetch_is_one_error_record(s3, tmp_path):
    proc = dlo_fetch("s3://models/json/missing", str(tmp_path / "missing"), "--endpoint", s3.url,
                     "--log-format", "json", env=s3.env())
    assert proc.returncode != 0
    (record,) = [r for r in _records(proc.stderr) if r["severity"] == "error"]
    assert record["logger"] == "dlo" and record["message"].startswith("dlo fetch: ")


def test_the_fetch_of_dlo_serve_uri_logs_its_progress_as_records_under_json_logs(s3, tiny_model, tmp_path,
                                                                               monkeypatch, capsys):
    upload(s3.client(), tiny_model, "models", "json/served")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(name, s3.env()[name])
    monkeypatch.setattr(logs, "_current", logs._current)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)
    logs.configure_logging("json", "info")  # as `dlo serve --log-format json` has, before it fetches
    folder, name = serving_folder("s3://models/json/served", {"XDG_CACHE_HOME": str(tmp_path),
                                                              "AWS_ENDPOINT_URL_S3": s3.url})
    err = capsys.readouterr().err
    assert name == "served" and files_of(folder) == files_of(tiny_model)
    progress = [r for r in _records(err) if r["logger"] == "dlo.delivery.progress"]  # every line a record
    total = sum(len(b) for b in files_of(tiny_model).values())
    assert progress and parse_progress_line(progress[-1]["message"])[:2] == (total, total)
