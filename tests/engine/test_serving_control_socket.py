"""Rank 0's control socket at start (serving/ranks.py), with real sockets and the real
`multiprocessing.connection` handshake: a local peer that connects first and stays silent, and one
without the key, never take a child's place; the children are accepted beside them and each
stranger is dropped at its handshake deadline; children that never come fail the start in time."""

from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing.connection import Client

import pytest

import dlo.serving.ranks as ranks
from dlo.engine.ports import free_port
from dlo.serving.control import Hello, RankConfig, WaveError
from dlo.serving.ranks import RankGroup
from dlo.engine.settings import EngineSettings, OffloadSettings, ParallelSettings
from tests.engine.serving_helpers import wait_until


def _group(dp: int = 3) -> RankGroup:
    cfg = RankConfig(model_dir="/nonexistent", master_port=1, control_port=free_port(),
                     settings=EngineSettings(OffloadSettings("resident"), ParallelSettings(dp=dp)))
    group = RankGroup(cfg, 10.0, lambda reason: None)
    for st in group.ranks[1:]:
        st.pid = os.getpid()  # the "children" are threads of this process
    group.listen()
    return group


OPEN: list = []  # the children's connections stay open (a closed one is a dead rank)


def _child(group: RankGroup, rank: int, key: bytes | None = None) -> None:
    conn = Client(("127.0.0.1", group.cfg.control_port), authkey=key or group._authkey)
    conn.send(Hello(rank, os.getpid()))
    OPEN.append(conn)


def test_a_silent_peer_and_a_wrong_key_never_take_a_childs_place(monkeypatch, caplog):
    monkeypatch.setattr(ranks, "HANDSHAKE_S", 1.0)
    group = _group()
    port = group.cfg.control_port
    silent = socket.create_connection(("127.0.0.1", port))  # first in the queue, then nothing
    strangers: list[BaseException] = []

    def wrong_key() -> None:
        try:
            _child(group, 1, key=b"not the key")
        except BaseException as e:  # the server refuses it
            strangers.append(e)

    threading.Thread(target=wrong_key, daemon=True).start()
    t0 = time.monotonic()
    accepting = threading.Thread(target=group._accept_children, daemon=True)
    accepting.start()
    children = [threading.Thread(target=_child, args=(group, r), daemon=True) for r in (1, 2)]
    for c in children:
        c.start()
    accepting.join(timeout=30)
    assert not accepting.is_alive(), "the children were not accepted while a silent peer was connected"
    assert all(st.conn is not None for st in group.ranks[1:])
    assert time.monotonic() - t0 < 20
    silent.settimeout(10)
    data = b""
    while chunk := silent.recv(4096):  # the challenge, then end-of-file at the handshake deadline
        data += chunk
    assert data, "the silent peer was never challenged"
    wait_until(lambda: strangers, 10, "the connection without the key is refused")
    wait_until(lambda: sum("dropped a connection" in r.message for r in caplog.records) >= 2, 10,
               "both strangers are logged as dropped")
    with pytest.raises(OSError):  # nobody is accepted once the children are in
        _child(group, 1)
    group.stopping = True
    for conn in OPEN:
        conn.close()


def test_children_that_never_connect_fail_the_start_in_time(monkeypatch):
    monkeypatch.setattr(ranks, "CONNECT_DEADLINE_S", 1.0)
    group = _group(dp=2)
    t0 = time.monotonic()
    with pytest.raises(WaveError, match=r"rank\(s\) \[1\] did not connect"):
        group._accept_children()
    assert time.monotonic() - t0 < 10
