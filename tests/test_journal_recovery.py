"""A journal record that became durable without its index row is not lost or overwritten."""

import json

from store.objects import Store
from store.ref import Ref


def test_append_after_unindexed_record(tmp_path):
    store = Store(tmp_path / "s")
    a = Ref(b"\x01" * 32)
    b = Ref(b"\x02" * 32)
    store.append_journal("sess", "WorkspaceCheckpointed", a, trigger="seed",
                         consistency="quiescent")
    # Simulate a crash between the durable record of event 2 and its index row.
    store.backend.put("journal/sess/000000000002.json", json.dumps(
        {"session": "sess", "seq": 2, "time_ns": 5, "epoch": 0, "event": "WorkspaceRestored",
         "ref": str(b), "trigger": None, "consistency": None}, sort_keys=True).encode())
    seq = store.append_journal("sess", "WorkspaceCheckpointed", a, trigger="manual",
                               consistency="quiescent")
    assert seq == 3
    events = store.journal("sess")
    assert [e.seq for e in events] == [1, 2, 3]
    assert events[1].event == "WorkspaceRestored" and events[1].ref == b
