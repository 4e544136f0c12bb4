"""`ServerProcess` (the tests' and benches' way to run `dlo serve`): `with` after `start()` runs
one server, never a second one beside an orphaned first."""

import subprocess
import sys

from dlo.serving.launch import ServerProcess


def test_with_after_start_keeps_the_one_process_and_stops_it(tmp_path):
    srv = ServerProcess(tmp_path / "no-model")
    # a real process standing in for the started server (start() would need a model and a /ready)
    srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    first = srv.proc
    with srv as same:
        assert same is srv and srv.proc is first  # no second start
    assert first.poll() is not None  # stopped at the end of the block
