"""The project documents itself: the design documents live in docs/ (architecture.md, contracts.md),
no tracked file points at the copies that used to live outside the repository, every package's map
names every file of its folder, and every relative link of the docs resolves (file and heading).

Reads of the working tree (and `git ls-files` for which files are tracked); the one import is the
torch-free `dlo.plan`, whose JSON the contract shows.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The old names, spelled so that this file does not contain them.
OUTSIDE = ("CONTRACTS" + ".md", "ARCHITECTURE" + ".md", "/".join(("..", "shared")))
# Records of what was true when they were written: they keep the names they had then.
RECORDS = ("bench/results/", "bench/NOTES.md")


def tracked_files(root: Path) -> list[str]:
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def outside_references(root: Path, files: list[str]) -> list[str]:
    """`path:line: text` of every tracked file's line naming a document outside the repo."""
    found = []
    for name in files:
        if name.startswith(RECORDS):
            continue
        path = root / name
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        data = path.read_bytes()
        if not any(word.encode() in data for word in OUTSIDE):
            continue
        for n, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if any(word in line for word in OUTSIDE):
                found.append(f"{name}:{n}: {line.strip()[:120]}")
    return found


def test_no_tracked_file_points_at_documents_outside_the_repo() -> None:
    found = outside_references(ROOT, tracked_files(ROOT))
    assert not found, ("cite docs/contracts.md / docs/architecture.md instead:\n" + "\n".join(found))


# -- module maps ------------------------------------------------------------------------------------

def docstring(root: Path, path: str) -> str:
    return ast.get_docstring(ast.parse((root / path).read_text())) or ""


def doc_section(root: Path, path: str, heading: str) -> str:
    """The table rows of the `## heading...` section of a markdown document ('' if it has none)."""
    rows, inside = [], False
    for line in (root / path).read_text().splitlines():
        if line.startswith("## "):
            inside = line.startswith(heading)
        elif inside and line.startswith("|"):
            rows.append(line)
    return "\n".join(rows)


def unnamed(text: str, folder: Path, *, bare: bool) -> list[str]:
    """The .py files of `folder` (`__init__.py` aside: it holds the map) that `text` does not name,
    as `stem.py` (a path before it allowed), or with `bare` (a package docstring's map of module
    names) as `` `stem` `` too."""
    missing = []
    for f in sorted(folder.glob("*.py")):
        if f.name == "__init__.py":
            continue
        stem = re.escape(f.stem)
        if not re.search(rf"(?<![\w.]){stem}\.py\b" + (rf"|`{stem}`" if bare else ""), text):
            missing.append(f.name)
    return missing


# (where the map is, how to read it, the folders it covers)
MAPS = [
    ("serving/__init__.py", None, ("serving",)),
    ("plan/__init__.py", None, ("plan",)),
    ("pagecache/__init__.py", None, ("pagecache",)),
    ("engine/lora/__init__.py", None, ("engine/lora",)),
    ("bench/__init__.py", None, ("bench",)),
    ("bench/lib/__init__.py", None, ("bench/lib",)),
    ("docs/engine.md", "## Map", ("engine", "engine/families", "engine/lora")),
    ("docs/agent.md", "## Where things live", ("agent",)),
    ("docs/serving.md", "## Map", ("serving",)),
]


def map_gaps(root: Path) -> list[str]:
    gaps = []
    for where, heading, folders in MAPS:
        if not (root / where).is_file():
            gaps.append(f"{where}: no such file")
            continue
        text = docstring(root, where) if heading is None else doc_section(root, where, heading)
        if not text:
            gaps.append(f"{where}: no map")
            continue
        for folder in folders:
            missing = unnamed(text, root / folder, bare=heading is None)
            if missing:
                gaps.append(f"{where} does not name {folder}/: {', '.join(missing)}")
    return gaps


def test_every_module_map_names_every_file_of_its_folder() -> None:
    gaps = map_gaps(ROOT)
    assert not gaps, "\n".join(gaps)


def test_a_missing_file_is_found() -> None:
    """The check itself: a map that leaves a file out is caught, a path or backticks name it."""
    folder = ROOT / "pagecache"
    assert unnamed("`tree` (...), `residency`", folder, bare=True) == ["warm.py"]
    assert unnamed("| x | `pagecache/tree.py`, `residency.py`, `warm` |", folder, bare=True) == []
    assert unnamed("`tree`, `residency`, `warmer`, warm up", folder, bare=True) == ["warm.py"]
    # a document's map names files: `warm` there is a word, not the module
    assert unnamed("| x | `pagecache/tree.py`, `residency.py`, `warm` |", folder, bare=False) == ["warm.py"]


# -- links ------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, inline code removed."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", lambda m: m.group(0).replace("[", "").replace("]", ""), line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text only
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(root: Path, documents: list[Path]) -> list[str]:
    broken = []
    for doc in documents:
        for line in prose_lines(doc.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (doc.parent / file).resolve() if file else doc
                where = f"{doc.relative_to(root)}: ({target})"
                if not dest.exists():
                    broken.append(f"{where}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return broken


def documents(root: Path) -> list[Path]:
    return [root / "README.md", root / "charts" / "dlo" / "README.md", *sorted((root / "docs").glob("*.md"))]


def test_every_relative_link_of_the_docs_resolves() -> None:
    broken = broken_links(ROOT, documents(ROOT))
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    """The check itself: a missing file or heading is caught; code, URLs and good links are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## The plan (dlo.plan)\n")
    doc = tmp_path / "docs" / "b.md"
    doc.write_text("[ok](a.md) [ok](a.md#the-plan-dloplan) [ok](#b) [web](https://x.org/y.md)\n# B\n"
                   "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
                   "[gone](../elsewhere/a.md) [bad anchor](a.md#nope)\n")
    assert broken_links(tmp_path, [doc]) == [
        "docs/b.md: (../elsewhere/a.md): no such file",
        "docs/b.md: (a.md#nope): no heading #nope in docs/a.md",
    ]


def documented_plan(root: Path) -> dict:
    """The `DeploymentPlan.to_dict()` example of docs/contracts.md section 7."""
    text = (root / "docs" / "contracts.md").read_text()
    section = text[text.index("## 7."):text.index("## 8.")]
    start = section.find("`DeploymentPlan.to_dict()`")
    block = re.search(r"```json\n(.*?)```", section[start:], re.S) if start >= 0 else None
    assert block, "docs/contracts.md section 7 shows no DeploymentPlan.to_dict() example"
    return json.loads(block.group(1))


def key_tree(value: object) -> object:
    """The keys of a JSON object, nested objects' too (the open maps, whose keys are names: none)."""
    if not isinstance(value, dict):
        return None
    return {k: key_tree(v) if k in ("vae", "lora") else None for k, v in value.items()}


def test_the_contract_shows_the_deployment_plan_json_the_code_gives() -> None:
    from dlo.plan.deployment import PlanAsk, plan
    from dlo.plan.facts import ModelFacts
    from dlo.plan.profile import NodeProfile

    made = plan(PlanAsk(), profile=NodeProfile(),
                transformer=ModelFacts(bytes=10**9, largest_block_bytes=10**8, blocks=10)).to_dict()
    assert key_tree(documented_plan(ROOT)) == key_tree(made)


def test_the_design_documents_are_in_the_repo_and_linked() -> None:
    for name in ("architecture.md", "contracts.md"):
        assert (ROOT / "docs" / name).is_file()
        assert f"(docs/{name})" in (ROOT / "README.md").read_text()


def test_slugs_follow_github() -> None:
    assert slug("LoRA adapters: `--lora-dir DIR`") == "lora-adapters---lora-dir-dir"
    assert slug("4. Slot layout") == "4-slot-layout"
    assert slug("The deployment plan (dlo.plan)") == "the-deployment-plan-dloplan"
