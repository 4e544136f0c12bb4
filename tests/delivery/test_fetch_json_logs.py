"""`dlo fetch --log-format json` (delivery/cli.py, cli/logs.py) against moto's S3 server: every line on
stderr is one JSON object, progress lines included (the operator still reads the last one), and a
failure is one error record."""

from __future__ import annotations

import json

import pytest

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
