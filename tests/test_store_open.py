"""Opening a store from several processes at once."""

import subprocess
import sys


def test_concurrent_first_open(tmp_path):
    root = tmp_path / "store"
    code = ("import sys; from store.objects import Store; s = Store(sys.argv[1]); "
            "s.list_snapshots(); print(s.chunk_size)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(6)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == str(1 << 20)


def test_a_finished_threads_index_connection_serves_the_next_thread(tmp_path):
    """Servers answer each request on a new thread: the store hands the connection of a
    finished thread to the next one instead of opening another, but never one a thread
    left inside a transaction (it is closed, so its write lock is released)."""
    import threading

    from store.objects import Store

    store = Store(tmp_path / "store")
    seen = []

    def use(leave_open=False):
        c = store.conn
        seen.append(c)
        c.execute("SELECT 1").fetchone()
        if leave_open:
            c.execute("BEGIN IMMEDIATE")  # a write lock, never committed

    def in_thread(**kw):
        t = threading.Thread(target=use, kwargs=kw)
        t.start()
        t.join()

    in_thread()
    in_thread()
    assert seen[0] is seen[1]  # reused
    in_thread(leave_open=True)
    assert seen[2] is seen[0]
    in_thread()
    assert seen[3] is not seen[2]  # the one left in a transaction was not handed on
    # ... and its write lock is gone: another connection can write at once.
    store.conn.execute("PRAGMA busy_timeout=0")
    store.conn.execute("BEGIN IMMEDIATE")
    store.conn.execute("ROLLBACK")
    store.close()
