"""Leases between processes (CONTRACT 4.2): two processes racing for one exclusive root, and
a holder killed with -9 whose leases are taken over after they expire, with a higher epoch.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from session_support import child, read_line, reap, workspace

from store.lease import Leaser
from store.objects import Store

RACER = """
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, "tests")
    from session_support import workspace
    from fusefs.session import WorkspaceRootBusyError
    ws = workspace(Path(os.environ["T_TMP"]), "exclusive", "fallback",
                   ttl=float(os.environ["T_TTL"]))
    go = Path(os.environ["T_GO"])
    print("waiting", flush=True)
    while not go.exists():
        time.sleep(0.001)
    try:
        s = ws.new_session()
    except WorkspaceRootBusyError as e:
        print("busy", e.root, e.holder_epoch, flush=True)
        sys.exit(e.exit_code)
    lease = ws.config.leaser.current(ws.config.placement.lease_name)
    print("won", s.id, lease.epoch, flush=True)
    sys.stdin.read()
    s.shutdown()
"""


@pytest.mark.parametrize("round_", range(3))
def test_two_processes_race_for_one_exclusive_root(tmp_path: Path, round_: int) -> None:
    go = tmp_path / "go"
    Store(tmp_path / "store").close()  # the race is for the root, not for creating the store
    env = {"T_TMP": str(tmp_path), "T_TTL": "30", "T_GO": str(go)}
    procs = [child(RACER, env=env) for _ in range(2)]
    try:
        for p in procs:
            assert read_line(p) == "waiting"
        go.touch()
        lines = [read_line(p).split() for p in procs]
        winners = [i for i, line in enumerate(lines) if line[0] == "won"]
        assert len(winners) == 1, lines
        loser = 1 - winners[0]
        assert lines[loser][0] == "busy"
        assert lines[loser][1] == str(tmp_path / "ws")
        assert lines[loser][2] == lines[winners[0]][2], "the loser names the holder's epoch"
        assert procs[loser].wait(timeout=60) == 10
        assert procs[winners[0]].poll() is None
        assert procs[winners[0]].stdin is not None
        procs[winners[0]].stdin.close()
        assert procs[winners[0]].wait(timeout=60) == 0
    finally:
        for p in procs:
            reap(p)


HOLDER = """
    import os, sys
    from pathlib import Path
    sys.path.insert(0, "tests")
    from session_support import workspace
    ws = workspace(Path(os.environ["T_TMP"]), "exclusive", "fallback",
                   ttl=float(os.environ["T_TTL"]))
    s = ws.new_session()
    (Path(s.root) / "work").write_text("from the killed holder\\n")
    print(s.id, flush=True)
    sys.stdin.read()
"""


def test_killed_holder_is_taken_over_after_expiry(tmp_path: Path) -> None:
    ttl = 3.0
    p = child(HOLDER, env={"T_TMP": str(tmp_path), "T_TTL": str(ttl)})
    try:
        sid = read_line(p)
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=60) == -signal.SIGKILL
    finally:
        reap(p)
    ws = workspace(tmp_path, "exclusive", "fallback")  # the holder's short ttl expires
    assert ws.config.placement is not None and ws.config.placement.lease_name is not None
    name = ws.config.placement.lease_name
    leaser = Leaser(ws.store)
    # The holder's process is gone from this host, so its leases are taken over at once,
    # whether or not they have expired yet (store.lease.holder_is_dead).
    s = ws.resume_session(sid)
    with s:
        assert s.epoch == 2, "the session lease was taken over with the next epoch"
        cur = leaser.current(name)
        assert cur is not None and cur.epoch == 2
        assert s.root is not None
        assert (Path(s.root) / "work").read_text() == "from the killed holder\n"
        s.checkpoint()
        assert [e.epoch for e in s.log()] == [1, 2]
