"""The README's figures come from the records: its block (and the table heading bench/NOTES.md) is
what `python -m bench readme` writes from the newest records, no figure stands outside the block, and
its Python example runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench import readme
from bench.readme_figures import latest, newest

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_s_figures_are_what_the_newest_records_give() -> None:
    text = readme.README.read_text()
    assert readme.current_block(text) == readme.block(), "run python -m bench readme"
    assert readme.stray_figures(text) == [], "a figure outside the block has no record behind it"
    assert readme.current_block(readme.NOTES.read_text()) == readme.notes_block(), "run python -m bench readme"


def test_a_figure_outside_the_block_is_found_and_code_or_sizes_are_not() -> None:
    text = (f"intro, ready in 11 s and 0.98x the bound\n{readme.BEGIN}\n| 3.2 ms |\n{readme.END}\n"
            "`--max-device-memory 24GiB` keeps 64x64 images; dp 2\n```\nsleep 5s\n```\n")
    assert readme.stray_figures(text) == ["1: 11 s", "1: 0.98x"]


def test_the_newest_record_of_a_kind_is_the_one_read(tmp_path: Path) -> None:
    """A record's date is its provenance's (else its name's): a newer call's record replaces the figures."""
    for name, date in (("ready-2026-12-01.json", None), ("ready-2026-12-03.json", None),
                       ("ready-2026-12-03-b.json", None), ("ready-x.json", "2026-12-02T10:00:00Z")):
        body = {"provenance": {"date": date}} if date else {}
        (tmp_path / name).write_text(json.dumps(body))
    assert [p.name for p in newest("ready-*.json", root=tmp_path)] == ["ready-2026-12-03-b.json", "ready-2026-12-03.json"]
    assert latest("ready-*.json", root=tmp_path).name == "ready-2026-12-03-b.json"


def test_the_python_example_runs(tmp_path: Path) -> None:
    text = readme.README.read_text()
    section = text[text.index("### The engine from Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    model = tmp_path / "tiny-wan"
    subprocess.run([sys.executable, "-m", "dlo.cli.main", "make-tiny-model", str(model), "--family", "wan"],
                   check=True, capture_output=True, timeout=300)
    r = subprocess.run([sys.executable, "-c", code.replace("/tmp/tiny-wan", str(model))], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank-local" in r.stdout
