"""Dockerfile: linted with hadolint; targets, non-root users and the slim image without torch."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return found


def stages() -> dict[str, list[str]]:
    """target name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = m.group(1) or "(final)"
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def test_hadolint_finds_nothing():
    proc = subprocess.run([hadolint(), "--failure-threshold", "style", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_would_catch_a_problem(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("USER 10001:10001", "USER root", 1) + "\nRUN cd /tmp\n")
    proc = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0


def test_targets_run_dlo_as_non_root():
    s = stages()
    assert {"build", "slim", "engine", "vllm-omni"} <= set(s)
    for target in ("slim", "engine", "vllm-omni"):
        users = [i for i in s[target] if i.startswith("USER")]
        assert users and users[-1] == "USER 10001:10001", target
    assert 'ENTRYPOINT ["dlo"]' in s["slim"] and 'ENTRYPOINT ["dlo"]' in s["engine"]


def test_slim_target_has_no_torch_and_engine_base_is_a_build_arg():
    s = stages()
    assert not any("torch" in i for i in s["slim"] + s["build"])
    # the engine installs the committed lock, hash-checked, and nothing beside it
    assert any("--require-hashes -r" in i and "engine.lock" in i for i in s["engine"])
    assert re.search(r"^ARG ENGINE_BASE=", DOCKERFILE.read_text(), re.M)
    assert re.search(r"^FROM \$\{ENGINE_BASE\} AS engine", DOCKERFILE.read_text(), re.M)
