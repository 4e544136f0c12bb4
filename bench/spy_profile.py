"""A sampling profile of a start by py-spy (attached to the server's pid), and its summary.

Owns: `find_py_spy` (PATH, then a `bin/py-spy` beside any `sys.path` entry: a wheel installed with
`pip --target`), `attach` (py-spy record --pid, every thread, idle samples included, raw collapsed
stacks) and `summarize` (per thread: samples; overall: the heaviest frames inclusive and by self
time, line numbers dropped (importlib's own frames left out), the dlo frames inclusive (which load
step the time is in) and the module bodies inclusive (which imports)).
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_LINE = re.compile(r":\d+\)$")
# dlo's own files: `dlo/...` where installed, the source folders where run from a checkout
_OWN = re.compile(r"\((dlo/)?(engine|agent|cli|operator|delivery)/")


def find_py_spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    return next((str(p) for p in (Path(e) / "bin" / "py-spy" for e in sys.path if e) if p.is_file()), None)


def attach(pid: int, out: Path, seconds: int, rate: int = 100) -> subprocess.Popen | None:
    exe = find_py_spy()
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--threads", "--idle", "--nonblocking",
                             "--rate", str(rate), "--duration", str(seconds), "--format", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _frame(f: str) -> str:
    return _LINE.sub(")", f.strip())


def summarize(path: Path, top: int = 25, rate: int = 100) -> dict[str, Any]:
    """Seconds (samples / rate) per thread, and the `top` heaviest frames inclusive, by self time,
    among dlo's own frames (inclusive) and among module bodies (the imports, inclusive)."""
    threads: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    modules: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        head, *frames = stack.split(";")
        threads[head.split(":", 1)[-1].strip()] += n
        names = [_frame(f) for f in frames]
        for name in set(names):
            if name.startswith("<module> ("):
                modules[name[len("<module> ("):-1]] += n  # a module body: its import, children included
            elif "<frozen" not in name:
                inclusive[name] += n
            if _OWN.search(name):
                own[name] += n
        if names:
            leaf[names[-1]] += n

    def secs(c: collections.Counter) -> list[list[Any]]:
        return [[name, round(n / rate, 2)] for name, n in c.most_common(top)]

    return {"rate_hz": rate, "threads_seconds": dict(secs(threads)), "inclusive": secs(inclusive),
            "self": secs(leaf), "dlo_inclusive": secs(own), "module_imports": secs(modules)}
