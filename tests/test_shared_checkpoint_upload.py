"""A checkpoint of a live session mount on a shared store whose S3 server hangs (SeaweedFS
stopped with SIGSTOP: it accepts connections and never answers): the upload of the packs
runs before mutations pause, so the mount keeps taking writes and creates while the
checkpoint waits on S3 (CONTRACT 3.1; issue 13 item 7).

Real FUSE, real SeaweedFS and PostgreSQL of each test alone; the mount is a separate
``rewindfs mount`` process on a local directory configured for the shared store. Every test
resumes SeaweedFS (SIGCONT) on every way out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli, read_in, shared_store_on

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")

REPO = Path(__file__).resolve().parents[1]
AHEAD = "uploading"  # the daemon's log line when the checkpoint starts its upload


@pytest.fixture
def fuse_store(tmp_path: Path, own_seaweed: object, own_postgres: object) -> Path:
    """This host's local directory of a shared store on servers of this test alone."""
    return shared_store_on(tmp_path, own_seaweed, own_postgres)


@contextmanager
def hung(seaweed: object) -> Iterator[None]:
    """SeaweedFS stopped (SIGSTOP) for the block, resumed on every way out."""
    group = seaweed.proc.pid  # type: ignore[attr-defined]
    os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


def start_checkpoint(store: Path, mnt: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "rewindfs", "--store", str(store),
                             "checkpoint", str(mnt), "--json"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def daemon_log(d: fh.Daemon) -> str:
    assert d.state is not None
    return (d.state / "daemon.log").read_text(errors="replace")


def pending(d: fh.Daemon, ck: subprocess.Popen[str]) -> bool:
    """The checkpoint ``ck`` has neither failed in the daemon nor ended (the daemon logs a
    failure before it resumes what waits, and the client exits after that)."""
    return "checkpoint failed" not in daemon_log(d) and ck.poll() is None


def wait_for_upload(d: fh.Daemon, ck: subprocess.Popen[str], after: int = 0) -> None:
    """Return once the daemon's log says the checkpoint started uploading (its line
    number ``after`` + 1: ``after`` such lines were there before; the checkpoint still
    running); fail if the checkpoint ended first."""
    import time

    assert d.state is not None
    log = d.state / "daemon.log"
    deadline = time.monotonic() + 60  # a bound on a hang of the test, not a measure
    while log.read_text(errors="replace").count(AHEAD) <= after:
        assert ck.poll() is None, ck.communicate()
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
        time.sleep(0.05)


def test_a_write_and_a_create_complete_while_the_checkpoint_waits_on_a_hung_s3(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, own_seaweed: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint waits on S3 until its read timeout and fails (exit 11, naming S3);
    a write into a file and the create of a new one complete before that; every change,
    before and during, stays in the mount and is in the checkpoint after SIGCONT."""
    monkeypatch.setenv("REWINDFS_S3_ATTEMPTS", "1")
    monkeypatch.setenv("REWINDFS_S3_READ_TIMEOUT", "15")
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "before.txt").write_text("written before the checkpoint\n")
    (m / "dir" / "a.txt").write_text("changed before\n")
    with hung(own_seaweed):
        ck = start_checkpoint(fuse_store, m)
        try:
            wait_for_upload(d, ck)
            (m / "before.txt").write_text("rewritten during the checkpoint\n")
            (m / "during.txt").write_text("created during the checkpoint\n")
            assert pending(d, ck), "the write waited for the checkpoint"
            out, err = ck.communicate(timeout=120)
        finally:
            if ck.poll() is None:
                ck.kill()
                ck.wait()
    assert ck.returncode == 11, (ck.returncode, out, err)
    assert "s3://" in err, err
    assert (m / "before.txt").read_text() == "rewritten during the checkpoint\n"
    assert (m / "during.txt").read_text() == "created during the checkpoint\n"
    assert (m / "dir" / "a.txt").read_text() == "changed before\n"
    ref = json.loads(cli(fuse_store, "checkpoint", str(m), "--json").stdout)["ref"]
    assert read_in(fuse_store, ref, "before.txt") == b"rewritten during the checkpoint\n"
    assert read_in(fuse_store, ref, "during.txt") == b"created during the checkpoint\n"
    assert read_in(fuse_store, ref, "dir/a.txt") == b"changed before\n"


def test_changes_made_while_the_upload_waits_are_in_the_checkpoint_once_s3_answers(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, own_seaweed: object) -> None:
    """S3 resumes while the checkpoint's upload waits: the checkpoint succeeds and holds
    the changes made before it and those made while it waited (mutations pause only after
    the upload); the mount goes on with nothing left to checkpoint."""
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "before.txt").write_text("written before the checkpoint\n")
    with hung(own_seaweed):
        ck = start_checkpoint(fuse_store, m)
        try:
            wait_for_upload(d, ck)
            with open(m / "before.txt", "a") as f:
                f.write("appended during\n")
            (m / "during.txt").write_text("created during the checkpoint\n")
            assert pending(d, ck), "the write waited for the checkpoint"
        except BaseException:
            ck.kill()
            ck.wait()
            raise
    out, err = ck.communicate(timeout=120)
    assert ck.returncode == 0, err
    ref = json.loads(out)["ref"]
    assert read_in(fuse_store, ref, "before.txt") == \
        b"written before the checkpoint\nappended during\n"
    assert read_in(fuse_store, ref, "during.txt") == b"created during the checkpoint\n"
    again = json.loads(cli(fuse_store, "checkpoint", str(m), "--json").stdout)
    assert again["ref"] == ref and again["unchanged"], again
    (m / "after.txt").write_text("after\n")
    last = json.loads(cli(fuse_store, "checkpoint", str(m), "--json").stdout)["ref"]
    assert read_in(fuse_store, last, "after.txt") == b"after\n"
    assert read_in(fuse_store, last, "during.txt") == b"created during the checkpoint\n"



def start_restore(store: Path, mnt: Path, ref: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "rewindfs", "--store", str(store),
                             "restore", str(mnt), ref, "--json"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_restore_uploads_its_pre_restore_checkpoint_before_it_pauses(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, own_seaweed: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore's pre-restore checkpoint uploads before the restore pauses anything. S3
    hung until the read timeout: the restore fails (exit 11, kind swap_failed) with
    nothing changed, a write made meanwhile kept. S3 hung, then resumed once a write made
    while the restore waits has completed: the restore succeeds, its pre-restore
    checkpoint holding the changes made before and during it."""
    monkeypatch.setenv("REWINDFS_S3_ATTEMPTS", "1")
    monkeypatch.setenv("REWINDFS_S3_READ_TIMEOUT", "15")
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "before.txt").write_text("written before the restore\n")
    with hung(own_seaweed):
        rs = start_restore(fuse_store, m, lower_ref)
        try:
            wait_for_upload(d, rs)
            (m / "during.txt").write_text("created during the failed restore\n")
            out, err = rs.communicate(timeout=120)
        finally:
            if rs.poll() is None:
                rs.kill()
                rs.wait()
    assert rs.returncode == 11, (rs.returncode, out, err)
    assert "swap_failed" in out + err and "s3://" in out + err, (out, err)
    assert (m / "before.txt").read_text() == "written before the restore\n"
    assert (m / "during.txt").read_text() == "created during the failed restore\n"
    with hung(own_seaweed):
        rs = start_restore(fuse_store, m, lower_ref)
        try:
            wait_for_upload(d, rs, after=1)
            (m / "during2.txt").write_text("created while the restore waits\n")
        except BaseException:
            rs.kill()
            rs.wait()
            raise
    out, err = rs.communicate(timeout=120)
    assert rs.returncode == 0, (out, err)
    pre = json.loads(out)["pre_restore"]
    assert read_in(fuse_store, pre, "before.txt") == b"written before the restore\n"
    assert read_in(fuse_store, pre, "during2.txt") == b"created while the restore waits\n"
    assert not (m / "during2.txt").exists() and not (m / "before.txt").exists()
