"""Refs people can type (issue 14, point 5): unique hex prefixes, ``@label`` and ``@-N``,
resolved against a real store (snapshot list and session journals in SQLite), and the same
forms through the console script."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from fusehelpers import run_cli as run

from store.errors import InvalidRefError
from store.objects import Store
from store.ref import Ref
from store.resolve import resolve_ref
from store.snapshot import snapshot


def tree(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "f.txt").write_text(text)
    return root


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def test_prefixes_resolve_when_unique(store: Store, tmp_path: Path) -> None:
    a = snapshot(store, tree(tmp_path / "a", "a\n"), label="first")
    b = snapshot(store, tree(tmp_path / "b", "b\n"), label="second")
    for r in (a, b):
        digest = str(r).removeprefix("v1:blake3:")
        assert resolve_ref(store, digest[:8]) == r
        assert resolve_ref(store, "v1:blake3:" + digest[:12]) == r
        assert resolve_ref(store, digest) == r
        assert resolve_ref(store, str(r)) == r
    with pytest.raises(InvalidRefError) as ei:
        resolve_ref(store, str(a).removeprefix("v1:blake3:")[:7])  # under 8 digits
    assert ei.value.value == str(a).removeprefix("v1:blake3:")[:7]
    other = next(c for c in "0123456789abcdef"
                 if not any(str(r)[10:].startswith(c) for r in (a, b)))
    with pytest.raises(InvalidRefError, match="no snapshot or journal Ref"):
        resolve_ref(store, other * 8)


def test_an_ambiguous_prefix_lists_the_candidates(store: Store, tmp_path: Path) -> None:
    # Two journal Refs that share their first 8 hex digits (journals name Refs; a journal
    # row does not need the tree present, which lets the test make such a pair).
    r1 = Ref.parse("v1:blake3:" + "deadbeef" + "1" * 56)
    r2 = Ref.parse("v1:blake3:" + "deadbeef" + "2" * 56)
    store.append_journal("s-1", "WorkspaceCheckpointed", r1, trigger="manual",
                         consistency="quiescent")
    store.append_journal("s-2", "WorkspaceCheckpointed", r2, trigger="manual",
                         consistency="quiescent")
    with pytest.raises(InvalidRefError) as ei:
        resolve_ref(store, "deadbeef")
    assert "ambiguous" in ei.value.reason and str(r1) in ei.value.reason
    assert str(r2) in ei.value.reason
    assert resolve_ref(store, "deadbeef1") == r1


def test_labels_pick_the_newest_and_sessions_scope_them(store: Store, tmp_path: Path) -> None:
    old = snapshot(store, tree(tmp_path / "x", "1\n"), label="green")
    new = snapshot(store, tree(tmp_path / "y", "2\n"), label="green")
    assert resolve_ref(store, "@green") == new
    store.append_journal("sess", "WorkspaceCheckpointed", old, trigger="manual",
                         consistency="quiescent")
    assert resolve_ref(store, "@green", session="sess") == old
    with pytest.raises(InvalidRefError, match="labels, newest first: green;"):
        resolve_ref(store, "@red")


def test_prefixes_are_read_in_either_case_and_short_ones_say_why(store: Store,
                                                                 tmp_path: Path) -> None:
    """README's forms in upper case resolve; a prefix of 7 digits, or text of no form, is
    refused for what it is (both were 'unknown version (want v1:)')."""
    r = snapshot(store, tree(tmp_path / "a", "a\n"))
    digest = str(r).removeprefix("v1:blake3:")
    assert resolve_ref(store, digest[:8].upper()) == r
    assert resolve_ref(store, "V1:BLAKE3:" + digest[:12].upper()) == r
    assert resolve_ref(store, "v1:blake3:" + digest.upper()) == r
    assert resolve_ref(store, digest.upper()) == r
    with pytest.raises(InvalidRefError) as ei:
        resolve_ref(store, digest[:7].upper())
    assert ei.value.reason == "a prefix needs at least 8 hex digits, this has 7"
    with pytest.raises(InvalidRefError) as ei:
        resolve_ref(store, "release-1")
    assert "@label" in ei.value.reason and "version" not in ei.value.reason
    with pytest.raises(InvalidRefError, match="unknown algorithm"):
        resolve_ref(store, "v1:sha1:" + digest)


def test_an_unknown_label_names_a_few_labels_of_its_scope(store: Store, tmp_path: Path) -> None:
    """With a session, only that session's labels (another session's are not its); without,
    at most SHOWN of the store's, newest first, and where to list them all."""
    refs = [snapshot(store, tree(tmp_path / f"t{i}", f"{i}\n"), label=f"other-{i}")
            for i in range(8)]
    mine = snapshot(store, tree(tmp_path / "mine", "m\n"), label="mine")
    store.append_journal("sess", "WorkspaceCheckpointed", mine, trigger="manual",
                         consistency="quiescent")
    store.append_journal("else", "WorkspaceCheckpointed", refs[0], trigger="manual",
                         consistency="quiescent")
    with pytest.raises(InvalidRefError) as ei:
        resolve_ref(store, "@nope", session="sess")
    assert ei.value.reason == ("no snapshot labelled 'nope' in session sess (its labels, "
                               "newest first: mine; the session's log lists them)")
    with pytest.raises(InvalidRefError) as ei:
        resolve_ref(store, "@nope")
    assert ei.value.reason == (
        "no snapshot labelled 'nope' in the snapshot list (its labels, newest first: mine, "
        "other-7, other-6, other-5, other-4 and 4 more; `rewindfs list` lists them)")
    with pytest.raises(InvalidRefError, match="it has no labels"):
        resolve_ref(store, "@nope", session="no-such-session")


def test_steps_back_count_checkpoints_of_the_session(store: Store, tmp_path: Path) -> None:
    refs = [snapshot(store, tree(tmp_path / f"t{i}", f"{i}\n")) for i in range(3)]
    for r in refs:
        store.append_journal("sess", "WorkspaceCheckpointed", r, trigger="manual",
                             consistency="quiescent")
    store.append_journal("sess", "WorkspaceRestored", refs[0])
    assert resolve_ref(store, "@-1", session="sess") == refs[2]
    assert resolve_ref(store, "@-3", session="sess") == refs[0]
    with pytest.raises(InvalidRefError, match="has 3 checkpoint"):
        resolve_ref(store, "@-4", session="sess")
    with pytest.raises(InvalidRefError, match="name the session"):
        resolve_ref(store, "@-1")
    with pytest.raises(InvalidRefError):
        resolve_ref(store, "@-0", session="sess")


def test_the_cli_takes_prefixes_and_labels(tmp_path: Path) -> None:
    st = tmp_path / "store"
    ref = json.loads(run(st, "snapshot", str(tree(tmp_path / "p", "hello\n")), "--label",
                         "release", "--json").stdout)["ref"]
    short = ref.removeprefix("v1:blake3:")[:8]
    assert run(st, "cat", short, "f.txt").stdout == "hello\n"
    assert run(st, "cat", short.upper(), "f.txt").stdout == "hello\n"
    seven = run(st, "ls", short[:7], "--json")
    assert seven.returncode == 3 and "at least 8 hex" in json.loads(seven.stdout)["reason"]
    out = run(st, "materialize", "@release", str(tmp_path / "out"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ref"] == ref
    assert (tmp_path / "out" / "f.txt").read_text() == "hello\n"
    bad = run(st, "ls", "@nope", "--json")
    assert bad.returncode == 3 and json.loads(bad.stdout)["type"] == "InvalidRefError"


def test_session_commands_take_steps_back_and_prefixes(tmp_path: Path) -> None:
    st = tmp_path / "store"
    seed = json.loads(run(st, "snapshot", str(tree(tmp_path / "p", "seed\n")),
                          "--json").stdout)["ref"]
    new = run(st, "session", "new", "--no-fuse", "--seed", seed[10:20], "--base",
              str(tmp_path / "ws"), "--json")
    assert new.returncode == 0, new.stderr
    s = json.loads(new.stdout)
    try:
        root = Path(s["root"])
        assert (root / "f.txt").read_text() == "seed\n"
        (root / "f.txt").write_text("changed\n")
        ck = run(st, "session", "checkpoint", s["id"], "--label", "edited", "--json")
        assert ck.returncode == 0, ck.stderr
        log = json.loads(run(st, "log", s["id"], "--json").stdout)
        assert [e.get("label") for e in log] == [None, "edited"]
        assert run(st, "log", s["id"]).stdout.splitlines()[-1].endswith("  'edited'")
        bad = run(st, "session", "restore", s["id"], "@nope")
        assert bad.returncode == 3 and "its labels, newest first: edited;" in bad.stderr
        r = run(st, "session", "restore", s["id"], "@-2", "--json")  # @-1 is the checkpoint
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["ref"] == seed
        assert (root / "f.txt").read_text() == "seed\n"
    finally:
        run(st, "session", "shutdown", s["id"])


@pytest.mark.skipif(not os.access("/dev/fuse", os.R_OK | os.W_OK), reason="needs /dev/fuse")
def test_live_commands_inside_a_session_mount_name_refs_as_typed(tmp_path: Path) -> None:
    """From inside a session's FUSE root, with no ``--store`` (the default store is
    ``./agent-data/store``, relative to the cwd): ``checkpoint . --label`` keeps the label,
    and ``restore . @label`` / ``@-N`` resolve against the session's own store, creating
    no store inside the mount."""
    st = tmp_path / "store"
    new = run(st, "session", "new", "--seed", str(tree(tmp_path / "p", "seed\n")), "--base",
              str(tmp_path / "ws"), "--json")
    assert new.returncode == 0, new.stderr
    s = json.loads(new.stdout)
    root = Path(s["root"])

    def here(*args: str) -> subprocess.CompletedProcess[str]:
        return run(None, *args, cwd=root)

    try:
        (root / "f.txt").write_text("good\n")
        ck = here("checkpoint", ".", "--label", "good", "--json")
        assert ck.returncode == 0, ck.stderr
        good = json.loads(ck.stdout)["ref"]
        listed = json.loads(run(st, "list", "--json").stdout)
        assert [x["label"] for x in listed if x["ref"] == good] == ["good"]
        (root / "f.txt").write_text("broken\n")
        r = here("restore", ".", "@good", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["ref"] == good
        assert (root / "f.txt").read_text() == "good\n"
        r = here("restore", ".", "@-1", "--json")  # the pre_restore checkpoint: broken
        assert r.returncode == 0, r.stderr
        assert (root / "f.txt").read_text() == "broken\n"
        r = here("restore", ".", "v1:blake3:" + good[10:22].upper(), "--json")  # a prefix
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["ref"] == good
        short = here("restore", ".", good[10:17], "--json")
        assert short.returncode == 3 and "at least 8" in json.loads(short.stdout)["reason"]
        bad = here("restore", ".", "@nope", "--json")
        assert bad.returncode == 3 and json.loads(bad.stdout)["type"] == "InvalidRefError"
        assert not (root / "agent-data").exists()
    finally:
        run(st, "session", "shutdown", s["id"], "--force")


HAS_FUSE = os.access("/dev/fuse", os.R_OK | os.W_OK)


@pytest.mark.parametrize("backend", ["fallback"] + (["fuse"] if HAS_FUSE else []))
def test_each_session_checkpoint_keeps_its_own_label(tmp_path: Path, backend: str) -> None:
    """Labelled checkpoints of an unchanged tree give the same Ref, and each keeps the label
    it was given: ``log`` shows each its own, ``@label`` finds every one of them, and a
    later unlabelled checkpoint of that Ref shows none."""
    st = tmp_path / "store"
    seed = json.loads(run(st, "snapshot", str(tree(tmp_path / "p", "seed\n")),
                          "--json").stdout)["ref"]
    new = run(st, "session", "new", "--seed", seed, "--base", str(tmp_path / "ws"), "--json",
              *(["--no-fuse"] if backend == "fallback" else []))
    assert new.returncode == 0, new.stderr
    s = json.loads(new.stdout)
    try:
        root = Path(s["root"])
        (root / "f.txt").write_text("changed\n")
        refs = []
        for label in ("L1", "L2", None):
            ck = run(st, "session", "checkpoint", s["id"], "--json",
                     *(["--label", label] if label else []))
            assert ck.returncode == 0, ck.stderr
            refs.append(json.loads(ck.stdout)["ref"])
        assert refs[0] == refs[1] == refs[2] != seed
        log = json.loads(run(st, "log", s["id"], "--json").stdout)
        assert [e.get("label") for e in log] == [None, "L1", "L2", None]
        text = run(st, "log", s["id"]).stdout.splitlines()
        assert text[1].endswith("  'L1'") and text[2].endswith("  'L2'"), text
        assert not text[3].endswith("'"), text
        (root / "f.txt").write_text("broken\n")
        for label in ("L1", "L2"):
            r = run(st, "session", "restore", s["id"], f"@{label}", "--json")
            assert r.returncode == 0, (label, r.stderr)
            assert json.loads(r.stdout)["ref"] == refs[0]
            assert (root / "f.txt").read_text() == "changed\n"
        bad = run(st, "session", "restore", s["id"], "@nope")
        assert bad.returncode == 3 and "its labels, newest first: L2, L1;" in bad.stderr
    finally:
        run(st, "session", "shutdown", s["id"], "--force")


def test_labels_of_a_store_from_before_every_label_was_kept_stay_found(tmp_path: Path) -> None:
    """An index at schema 7 (one label per listed Ref, no label table) opened now: each
    listed Ref's label is found by ``@label`` and a new label adds to it."""
    import sqlite3

    st = Store(tmp_path / "store")
    a = snapshot(st, tree(tmp_path / "a", "a\n"), label="old")
    index = st.index_path
    st.close()
    c = sqlite3.connect(index)
    c.execute("DROP TABLE snapshot_labels")
    c.execute("UPDATE config SET value='7' WHERE key='schema_version'")
    c.commit()
    c.close()
    st = Store(tmp_path / "store")
    assert resolve_ref(st, "@old") == a
    st.add_snapshot(a, "checkpoint", "new")
    assert resolve_ref(st, "@old") == resolve_ref(st, "@new") == a
    assert [label for _, label, _ in st.snapshot_labels()] == ["old", "new"]
