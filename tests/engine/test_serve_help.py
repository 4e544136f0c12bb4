"""`dlo serve --help`: the flags in groups, in a fixed order, every flag in exactly one group and with
help, no flag's default said twice; docs/serving.md's "Options" grouped the same.

The parser is the one `dlo.cli.modules.run_module` builds for `dlo serve` (its formatter,
`ArgumentDefaultsHelpFormatter`, appends "(default: X)" to every optional's help that does not name
`%(default)` itself), caught just before it parses; the text is the real `dlo serve --help`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlo.cli.args import Parser
from dlo.cli.modules import run_module

ROOT = Path(__file__).resolve().parents[2]

GROUPS = [
    "model and API",
    "limits",
    "device and memory",
    "parallelism",
    "LoRA",
    "start-up",
    "tuning: measured defaults, change only to benchmark",
]
ARGPARSE_GROUPS = ["positional arguments", "options"]  # argparse's own, for what no group took
DEFAULT_WORD = re.compile(r"\bdefault\b", re.IGNORECASE)  # not "defaults", not "default_size"


class _Built(Exception):
    pass


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    """The parser `dlo serve` runs with: `run_module`'s, stopped at its `parse_args`."""
    built: list[argparse.ArgumentParser] = []

    def stop(self, args=None, namespace=None):
        built.append(self)
        raise _Built

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Parser, "parse_args", stop)
        with pytest.raises(_Built):
            run_module("serve", "dlo.serving.serve", [])
    assert built[0].formatter_class is argparse.ArgumentDefaultsHelpFormatter
    return built[0]


@pytest.fixture(scope="module")
def help_text() -> str:
    r = subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", "--help"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "COLUMNS": "100"}, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _names(action: argparse.Action) -> list[str]:
    return list(action.option_strings) or [action.dest]


def test_groups_in_order(parser, help_text):
    assert [g.title for g in parser._action_groups] == ARGPARSE_GROUPS + GROUPS
    assert all(g.description for g in parser._action_groups[len(ARGPARSE_GROUPS):])
    titles = [line[:-1] for line in help_text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == ["options"] + GROUPS  # "usage:" starts a longer line; no positional left ungrouped


def test_every_flag_in_exactly_one_group(parser):
    where: dict[str, list[str]] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            for name in _names(action):
                where.setdefault(name, []).append(group.title)
    every = {name for action in parser._actions for name in _names(action)}
    assert set(where) == every
    assert {n: t for n, t in where.items() if len(t) != 1} == {}
    assert sorted(n for n, (t,) in where.items() if t in ARGPARSE_GROUPS) == ["--help", "-h"]
    # the groups hold what their titles say (a spot check of each, the rest is judgement)
    for name, title in [("model_dir", "model and API"), ("--log-level", "model and API"),
                        ("--video-dir", "model and API"), ("--max-size", "limits"),
                        ("--max-device-memory", "device and memory"), ("--dp", "parallelism"),
                        ("--lora-dir", "LoRA"), ("--warmup", "start-up"),
                        ("--gather", GROUPS[-1]), ("--register-early", GROUPS[-1])]:
        assert where[name] == [title], name


def test_every_flag_has_help(parser):
    formatter = parser._get_formatter()
    missing = [_names(a)[0] for a in parser._actions
               if not a.help or a.help is argparse.SUPPRESS or not formatter._expand_help(a).strip()]
    assert missing == []


def test_no_default_said_twice(parser):
    formatter = parser._get_formatter()
    twice = {_names(a)[0]: text for a in parser._actions
             if len(DEFAULT_WORD.findall(text := formatter._expand_help(a))) > 1}
    assert twice == {}
    # a default of None, False or [] only means "not given": the help says what that does instead
    meaningless = {_names(a)[0]: text for a in parser._actions
                   if re.search(r"\(default: (None|False|\[\])\)", text := formatter._expand_help(a))
                   and not isinstance(a, argparse.BooleanOptionalAction)}
    assert meaningless == {}


def _flag_blocks(help_text: str, described: set[str]) -> dict[str, str]:
    """Each entry of the help (a flag or positional line and its indented continuation), joined; the
    groups titled in `described` open with a description paragraph, skipped."""
    blocks: dict[str, str] = {}
    current, in_description = None, False
    for line in help_text.split("\n\n", 1)[1].splitlines():  # after the usage
        if line and not line.startswith(" "):  # a group's title (its description follows), or the epilog
            current, in_description = None, line.endswith(":") and line[:-1] in described
        elif not line.strip():
            current, in_description = None, False
        elif in_description:
            continue
        elif re.match(r"^  \S", line):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current:
            blocks[current] += " " + line.strip()
    return blocks


def test_help_text_says_no_default_twice(parser, help_text):
    blocks = _flag_blocks(help_text, {g.title for g in parser._action_groups if g.description})
    firsts = {_names(a)[0] for a in parser._actions}
    assert set(blocks) == firsts  # every flag printed, each parsed as one block
    assert {f: b for f, b in blocks.items() if len(DEFAULT_WORD.findall(b)) > 1} == {}
    assert "(default: None)" not in help_text and "(default: [])" not in help_text


def test_docs_group_the_flags_the_same(parser):
    """docs/serving.md "## Options": one "### TITLE" table per group, in order, holding exactly that
    group's flags (the `--no-` forms aside)."""
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### (.+)$", section, flags=re.MULTILINE)
    assert parts[1::2] == GROUPS
    for title, body in zip(parts[1::2], parts[2::2]):
        documented = set()
        for row in body.splitlines():
            if row.startswith("| `"):
                first = row[2:].split(" | ", 1)[0]
                documented |= set(re.findall(r"--[a-z0-9][a-z0-9-]*|\bmodel_dir\b", first))
        group = next(g for g in parser._action_groups if g.title == title)
        flags = {n for a in group._group_actions for n in _names(a)}
        assert {n for n in documented if not n.startswith("--no-")} == \
            {n for n in flags if not n.startswith("--no-")}, title
