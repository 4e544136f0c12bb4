"""The README's figures, written from the records: `python -m bench readme` rewrites the block between
the markers in README.md; `python -m bench readme --check` (and tests/bench/test_readme.py) fails
when the block is not what the newest records give, or when the README states a figure outside it.

Owns: `block` (every topic of `bench.readme_figures` and `bench.readme_pipelines` as a table, with
the card the records name and a link to each record; the same tables head bench/NOTES.md:
`notes_block`), `replace` (a document with a new block),
`stray_figures` (figures in the README's prose outside the block: a figure there has no record
behind it).
Must never: write a figure by hand, or edit the README outside its markers.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bench import readme_figures, readme_pipelines
from bench.readme_figures import Topic

README = Path(__file__).resolve().parents[1] / "README.md"
NOTES = Path(__file__).resolve().parent / "NOTES.md"  # the same tables at the top of the notes
BEGIN = "<!-- figures: begin (written by python -m bench readme from bench/results; do not edit by hand) -->"
END = "<!-- figures: end -->"
# a number with a unit of time, size, rate or ratio: a figure
FIGURE = re.compile(r"(?<![\w.-])\d[\d,]*(?:\.\d+)?\s?(?:ms|s|seconds|minutes|GB|GiB|MB|MiB|TB|GB/s|MB/s|x|%)(?![\w/])")
FENCE = re.compile(r"^\s*```")


def topics() -> list[Topic]:
    return [make() for make in (*readme_figures.TOPICS, *readme_pipelines.TOPICS)]


def table(t: Topic, results: str) -> list[str]:
    lines = ["| " + " | ".join(t.header) + " |", "|" + "---|" * len(t.header)]
    lines += ["| " + " | ".join(row) + " |" for row in t.rows]
    links = ", ".join(f"[{r.removesuffix('.json')}]({results}/{r})" for r in t.records)
    lines += ["", f"Card: {', '.join(t.cards)}. Record{'s' if len(t.records) > 1 else ''}: {links}."
              + (f" {t.note}" if t.note else "")]
    return lines


def block(results: str = "bench/results", level: str = "####") -> str:
    """The figures' tables, the records linked under `results` (relative to the document)."""
    out = [BEGIN, ""]
    for t in topics():
        out += [f"{level} {t.title}", "", *table(t, results), ""]
    return "\n".join(out + [END])


def notes_block() -> str:
    return block("results", "###")


def replace(text: str, new_block: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + new_block + text[end:]


def current_block(text: str) -> str:
    return text[text.index(BEGIN):text.index(END) + len(END)]


def stray_figures(text: str) -> list[str]:
    """`line: figure` of every figure in the README's prose outside the block and code."""
    outside = text[:text.index(BEGIN)] + "\n" * current_block(text).count("\n") + text[text.index(END) + len(END):]
    found, fenced = [], False
    for n, line in enumerate(outside.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            prose = re.sub(r"`[^`]*`", "", line)
            found += [f"{n}: {m.group(0)}" for m in FIGURE.finditer(prose)]
    return found


def main(tool: str, argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m bench {tool}", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check: exit 1 when the README is not what the records give")
    args = ap.parse_args(argv)
    text, notes = README.read_text(), NOTES.read_text()
    fresh, fresh_notes = block(), notes_block()
    if args.check:
        problems = [f"{doc.name}: the figures block is not what the newest records give (python -m bench readme)"
                    for doc, body, want in ((README, text, fresh), (NOTES, notes, fresh_notes))
                    if current_block(body) != want]
        problems += [f"a figure with no record behind it, line {s}" for s in stray_figures(text)]
        print("\n".join(problems) or "README figures match the records")
        return 1 if problems else 0
    README.write_text(replace(text, fresh))
    NOTES.write_text(replace(notes, fresh_notes))
    print(f"wrote the figures block of {README} ({len(topics())} topics)")
    stray = stray_figures(README.read_text())
    if stray:
        print("figures outside the block (put them in a record):\n" + "\n".join(stray), file=sys.stderr)
    return 0
