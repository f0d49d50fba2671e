"""The serving thread on the requester's CPU (``fusefs.affinity``) on real mounts: a process
making requests one after another gets the daemon's serving thread (its main thread, the
event loop's) pinned to its CPU and followed when it moves; two processes taking turns
leave it unpinned; no thread stays SCHED_IDLE and threads started while it is pinned get
the daemon's whole CPU mask; handle mode and a daemon without CAP_SYS_NICE leave it alone
and still serve. What the daemon does is read from ``status`` (its ``affinity`` key) and
from /proc/<daemon>/task/*.

Skipped with fewer than two CPUs allowed, on a binding without idle replies, and where this
user's processes cannot return from SCHED_IDLE (the daemon would not follow either).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fusehelpers as fh
import pyfuse3
import pytest
from ckpt_support import cli, client

from fusefs.affinity import COOL_DOWN_S, ServingAffinity, can_leave_sched_idle

MASK = frozenset(os.sched_getaffinity(0))

pytestmark = [
    pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts"),
    pytest.mark.skipif(len(MASK) < 2, reason="needs two allowed CPUs"),
    pytest.mark.skipif("idle_replies" not in getattr(pyfuse3, "extensions", ()),
                       reason="needs the patched binding's idle replies"),
]

needs_way_back = pytest.mark.skipif(not can_leave_sched_idle(),
                                    reason="needs CAP_SYS_NICE or RLIMIT_NICE 20")

# Runs of a serial requester a test makes at most to see one not starved by other load on
# the machine: a starved window releases the thread for COOL_DOWN_S (module docstring of
# fusefs.affinity), which is the feature at work, not the case under test.
ROUNDS = 8

# argv: CPU, directory, count, "data" or "empty"[, CPU to move to]. Pinned to CPU before it
# touches the mount; creates count files (with a line naming each when "data") and stats
# each; given a CPU to move to, moves there and, after a pause each, looks up MOVED_LOOKUPS
# names that do not exist; then prints "done" and lives on until its stdin is closed.
REQUESTER = r"""
import os, sys, time
cpu, where, n, data = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "data"
os.sched_setaffinity(0, {cpu})
os.makedirs(where, exist_ok=True)
for i in range(n):
    p = os.path.join(where, f"f{i}")
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
    if data:
        os.write(fd, f"{where} {i}\n".encode())
    os.close(fd)
    os.stat(p)
if len(sys.argv) > 5:
    os.sched_setaffinity(0, {int(sys.argv[5])})
    for i in range(int(sys.argv[6])):
        time.sleep(0.02)
        try:
            os.stat(os.path.join(where, f"absent{i}"))
            sys.exit(3)
        except FileNotFoundError:
            pass
print("done", flush=True)
sys.stdin.read()
"""
MOVED_LOOKUPS = 3  # fewer than SAMPLE_EVERY: a sample would seldom fall among them

# argv: CPU, nice. A busy loop on that CPU at that nice value, after it printed "ready".
BUSY_FILES = 2000  # its requests last about 1 s beside HOG: many samples
HOG = r"""
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
os.setpriority(os.PRIO_PROCESS, 0, int(sys.argv[2]))
print("ready", flush=True)
while True:
    pass
"""

# argv: CPU a, CPU b, directory, turns. Two processes, on CPUs a and b, take turns of one
# request each (a LOOKUP of a name that does not exist), passing the turn through pipes.
TAKE_TURNS = r"""
import os, sys
a, b, where, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
mine, theirs = os.pipe(), os.pipe()
child = os.fork()
me, rd, wr = ("b", theirs[0], mine[1]) if child == 0 else ("a", mine[0], theirs[1])
os.sched_setaffinity(0, {b if child == 0 else a})
if child:
    os.write(mine[1], b".")
for i in range(n):
    os.read(rd, 1)
    try:
        os.stat(os.path.join(where, f"{me}{i}"))
        os._exit(3)
    except FileNotFoundError:
        pass
    os.write(wr, b".")
if child == 0:
    os._exit(0)
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def cpus(text: str) -> set[int]:
    """``0-2,5`` (a Cpus_allowed_list) as ``{0, 1, 2, 5}``."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def allowed(pid: int, tid: int | None = None) -> set[int]:
    """The CPUs thread ``tid`` (default: the main thread) of process ``pid`` may run on."""
    with open(f"/proc/{pid}/task/{tid or pid}/status") as f:
        for line in f:
            if line.startswith("Cpus_allowed_list:"):
                return cpus(line.split()[1])
    raise AssertionError(f"no Cpus_allowed_list for {pid}/{tid}")


def threads(pid: int) -> set[int]:
    """The daemon's threads but the binding's watchdog, which lives as long as the mount."""
    out = set()
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                if f.read().strip() == "fuse-watchdog":
                    continue
        except FileNotFoundError:
            continue
        out.add(int(t))
    return out


def policies(pid: int) -> dict[int, int]:
    """``{tid: scheduling policy}`` of every thread of ``pid`` (proc(5) stat field 41;
    0 SCHED_OTHER, 5 SCHED_IDLE); threads that left while being read are left out."""
    out = {}
    for t in threads(pid):
        try:
            with open(f"/proc/{pid}/task/{t}/stat", "rb") as f:
                out[t] = int(f.read().rsplit(b")", 1)[1].split()[38])
        except FileNotFoundError:
            pass
    return out


def affinity(d: fh.Daemon) -> dict[str, Any]:
    """``status``'s ``affinity``, asked through the state directory: a client that goes
    by the mount point would make requests of its own."""
    assert d.state is not None
    return dict(client(d.state).status()["affinity"])


def start_requester(cpu: int, where: Path, n: int = 300, *, data: bool = False,
                    move: int | None = None) -> subprocess.Popen[str]:
    """REQUESTER, once its requests are made (it then waits for ``finish``)."""
    moving = [] if move is None else [str(move), str(MOVED_LOOKUPS)]
    p = subprocess.Popen([sys.executable, "-c", REQUESTER, str(cpu), str(where), str(n),
                          "data" if data else "empty", *moving], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    if p.stdout.readline() != "done\n":
        finish(p)
        raise AssertionError(f"the requester failed: exit {p.returncode}")
    return p


def finish(p: subprocess.Popen[str]) -> None:
    """Let a requester end, and check it ended well."""
    assert p.stdin is not None
    p.stdin.close()
    assert p.wait(120) == 0


def requester(cpu: int, where: Path, n: int = 300, *, data: bool = False) -> int:
    """Run REQUESTER to its end; return its pid."""
    p = start_requester(cpu, where, n, data=data)
    finish(p)
    return p.pid


@contextlib.contextmanager
def following(d: fh.Daemon, cpu: int, where: Path, *, data: bool = False,
              move: int | None = None) -> Iterator[tuple[dict[str, Any], int]]:
    """Run a serial requester on ``cpu`` (files under ``where``/rN; then moving to CPU
    ``move``, if given) until a run of it was not starved (at most ROUNDS); give
    ``affinity`` after its requests and its pid, while it still lives (the daemon releases
    a thread whose requester ended at its next control request)."""
    for n in range(ROUNDS):
        before = affinity(d)["starved"]
        p = start_requester(cpu, where / f"r{n}", data=data, move=move)
        try:
            aff = affinity(d)
            if aff["starved"] == before:
                yield aff, p.pid
                return
        finally:
            finish(p)
        time.sleep(COOL_DOWN_S[1])  # the longest a cool-down can last
    raise AssertionError(f"{ROUNDS} runs on CPU {cpu} were all starved by other load: {aff}")


@contextlib.contextmanager
def pinned_high(d: fh.Daemon, where: str = "k"
                ) -> Iterator[tuple[set[int], int, int, dict[str, Any]]]:
    """Follow a serial requester on the highest CPU of the daemon's mask (files under
    ``where``) and check that the serving thread is pinned there; give the daemon's mask
    before, that CPU, the lowest one and ``affinity`` after the requests."""
    start = allowed(d.pid)
    k = max(start)
    with following(d, k, d.mnt / where) as (aff, _):
        assert aff["cpu"] == k and allowed(d.pid) == {k}, aff
        yield start, k, min(start), aff


def released(d: fh.Daemon, start: set[int]) -> dict[str, Any]:
    """Check that the serving thread follows no one, writes replies normally and has the
    mask ``start`` back; give ``affinity``."""
    aff = affinity(d)
    assert (aff["cpu"], aff["pid"], aff["idle_replies"][0]) == (None, None, False), aff
    assert allowed(d.pid) == start
    return aff


def check_data(where: Path, n: int = 300) -> None:
    for r in where.iterdir():
        for i in range(n):
            assert (r / f"f{i}").read_text() == f"{r} {i}\n"


@needs_way_back
def test_the_serving_thread_follows_a_serial_requester(mounter: fh.Mounter, fuse_store: Path,
                                                       lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    start = allowed(d.pid)
    assert start == MASK
    k, j = max(start), min(start)
    with following(d, k, d.mnt / "k") as (aff, pid):
        assert aff["following"] is True and aff["reason"] is None
        assert (aff["cpu"], aff["pid"], aff["idle_replies"][0]) == (k, pid, True), aff
        assert allowed(d.pid) == {k}
    with following(d, j, d.mnt / "j") as (aff, pid):
        assert (aff["cpu"], aff["pid"], aff["idle_replies"][0]) == (j, pid, True), aff
        assert allowed(d.pid) == {j}
        # what a user reads
        st = json.loads(cli(fuse_store, "status", str(d.state), "--json").stdout)
        assert (st["affinity"]["cpu"], st["affinity"]["following"]) == (j, True)
    # The requester has ended: the next control request finds it gone and unpins.
    released(d, start)


@needs_way_back
def test_a_requester_that_moves_is_followed_at_its_next_request(mounter: fh.Mounter,
                                                                lower_ref: str) -> None:
    # Each of its lookups on the new CPU comes after a pause: the serving thread waited for
    # it, and moves to that CPU at once instead of at its next sample.
    d = mounter.rw(lower_ref)
    start = allowed(d.pid)
    k, j = max(start), min(start)
    with following(d, k, d.mnt / "k", move=j) as (aff, pid):
        assert (aff["cpu"], aff["pid"], aff["idle_replies"][0]) == (j, pid, True), aff
        assert allowed(d.pid) == {j}
    released(d, start)


def busy_cpu_run(d: fh.Daemon, k: int, nice: int, n: int = BUSY_FILES) -> dict[str, Any]:
    """A serial requester on CPU ``k`` beside HOG at ``nice`` there; give ``affinity``
    after (its ``n`` files are checked by ``check_data(d.mnt / "busy", n)``)."""
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(k), str(nice)],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline() == "ready\n"
        requester(k, d.mnt / "busy" / "r0", n, data=True)
        aff = affinity(d)
    finally:
        hog.kill()
        hog.wait()
    # Read after a status request, which the serving thread answered: reading them right
    # after a reply of this process could find it still idle, not yet run again.
    assert set(policies(d.pid).values()) == {0}, policies(d.pid)
    return aff


@needs_way_back
def test_a_busy_cpu_lets_the_pinned_thread_go(mounter: fh.Mounter, lower_ref: str) -> None:
    # Pinned beside a busy loop, the serving thread (SCHED_IDLE while requests keep coming)
    # gets a sliver of that CPU: it is judged starved and let go. The requester, woken by
    # each reply, preempts the loop and does not wait much itself.
    d = mounter.rw(lower_ref)
    start = allowed(d.pid)
    before = affinity(d)["starved"]
    aff = busy_cpu_run(d, max(start), 0)
    assert aff["starved"] > before, json.dumps(aff)
    released(d, start)
    check_data(d.mnt / "busy", BUSY_FILES)


@needs_way_back
@pytest.mark.skipif(not fh.AS_ROOT, reason="a nice -20 loop needs root")
def test_a_requester_waiting_for_its_cpu_is_not_followed_there(mounter: fh.Mounter,
                                                               lower_ref: str) -> None:
    # Beside a nice -20 loop the requester itself waits to run most of the time: the thread
    # is never pinned to that CPU, where it could not get away from the loop.
    d = mounter.rw(lower_ref)
    start = allowed(d.pid)
    before = affinity(d)["pins"]
    aff = busy_cpu_run(d, max(start), -20, 300)  # about 5 s at ~1% of a CPU
    assert aff["pins"] == before, json.dumps(aff)
    released(d, start)
    check_data(d.mnt / "busy", 300)


@needs_way_back
def test_no_thread_stays_idle_and_new_threads_get_the_whole_mask(mounter: fh.Mounter,
                                                                 lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    with pinned_high(d) as (start, k, _j, _aff):
        assert set(policies(d.pid).values()) == {0}, policies(d.pid)
        # The event loop's worker threads leave after 10 s idle (trio); once they have, a
        # checkpoint starts new ones from the pinned thread (its requester still lives).
        deadline = time.monotonic() + 60
        while threads(d.pid) != {d.pid}:
            assert time.monotonic() < deadline, f"daemon threads stay: {threads(d.pid)}"
            time.sleep(0.2)
        assert d.state is not None
        client(d.state).checkpoint()
        assert allowed(d.pid) == {k}  # still pinned: they were started from CPU k
        started = threads(d.pid) - {d.pid}
        assert started, "the checkpoint started no thread"
        assert {t: allowed(d.pid, t) for t in started} == {t: start for t in started}
        assert set(policies(d.pid).values()) == {0}, policies(d.pid)


@needs_way_back
def test_requesters_taking_turns_leave_the_thread_unpinned(mounter: fh.Mounter,
                                                           lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    with pinned_high(d, "serial") as (start, k, j, _aff):
        pass
    # two writers at once, one on each CPU
    ps = [subprocess.Popen([sys.executable, "-c", REQUESTER, str(cpu),
                            str(d.mnt / f"w{cpu}" / "r0"), "300", "data"]) for cpu in (k, j)]
    assert [p.wait(120) for p in ps] == [0, 0]
    os.sync()  # their pages written back now, not by the kernel's flusher below
    pins = affinity(d)["pins"]
    (d.mnt / "turns").mkdir()
    r = subprocess.run([sys.executable, "-c", TAKE_TURNS, str(k), str(j), str(d.mnt / "turns"),
                        "1000"], timeout=120)
    assert r.returncode == 0
    aff = affinity(d)
    assert (aff["cpu"], aff["pid"], aff["pins"], aff["idle_replies"][0]) == \
        (None, None, pins, False), aff
    assert allowed(d.pid) == start
    for cpu in (k, j):
        check_data(d.mnt / f"w{cpu}")


def lookup_from_another_process(where: Path) -> None:
    """One LOOKUP (of a name never looked up) made by a process of its own."""
    subprocess.run([sys.executable, "-c", "import os, sys; os.path.lexists(sys.argv[1])",
                    str(where)], check=True, timeout=60)


@needs_way_back
def test_a_request_of_another_process_releases_the_thread_at_once(
        mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    with pinned_high(d) as (start, _k, _j, aff):
        lookup_from_another_process(d.mnt / "k" / "absent")
        assert released(d, start)["others"] == aff["others"] + 1


@needs_way_back
def test_a_mask_set_from_outside_while_pinned_is_kept(mounter: fh.Mounter,
                                                      lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    with pinned_high(d) as (start, k, j, _aff):
        os.sched_setaffinity(d.pid, {j})  # as `taskset -p` would, on the serving thread
        lookup_from_another_process(d.mnt / "k" / "absent")  # releases it
        assert affinity(d)["cpu"] is None
        assert allowed(d.pid) == {j}  # kept, not the start mask back
    with following(d, k, d.mnt / "again") as (aff, _):
        assert aff["cpu"] is None and allowed(d.pid) == {j}, aff  # k is not in {j}


def check_left_alone(d: fh.Daemon, why: str) -> None:
    """A serial requester on ``d``'s mount leaves the serving thread unpinned, with a
    reason containing ``why``, and its data intact."""
    start = allowed(d.pid)
    requester(max(start), d.mnt / "k" / "r0", data=True)
    aff = affinity(d)
    assert aff["following"] is False and why in aff["reason"], aff
    assert (aff["cpu"], aff["pins"]) == (None, 0)
    assert allowed(d.pid) == start
    check_data(d.mnt / "k")


def test_handle_mode_leaves_the_thread_alone(mounter: fh.Mounter, lower_ref: str) -> None:
    check_left_alone(mounter.rw(lower_ref, extra=["--open-handles"]), "handle mode")


def test_no_follow_cpu_leaves_the_thread_alone(mounter: fh.Mounter, lower_ref: str) -> None:
    check_left_alone(mounter.rw(lower_ref, extra=["--no-follow-cpu"]), "--no-follow-cpu")


@pytest.mark.skipif(not fh.AS_ROOT, reason="drops CAP_SYS_NICE from root")
def test_without_cap_sys_nice_the_mount_serves_unpinned(mounter: fh.Mounter, fuse_store: Path,
                                                        lower_ref: str) -> None:
    base = mounter.base
    d = fh.Daemon(store=fuse_store, mnt=base / "nonice", ref=lower_ref, state=base / "st",
                  log=base / "nonice.log")
    d.command = ["prlimit", "--nice=0:0", "setpriv", "--inh-caps=-sys_nice",
                 "--bounding-set=-sys_nice", *d.argv()]
    mounter.daemons.append(d)
    fh.start(d)
    check_left_alone(d, "SCHED_IDLE")
    assert set(policies(d.pid).values()) == {0}


@needs_way_back
def test_a_pin_the_binding_refuses_is_undone() -> None:
    """Without a mount in this process the binding refuses idle replies: the pin that two
    samples of one process make is undone and the instance is off."""
    cpu = max(MASK)
    child = subprocess.Popen([sys.executable, "-c",
                              "import os, sys, time\n"
                              f"os.sched_setaffinity(0, {{{cpu}}})\n"
                              "print('ready', flush=True)\n"
                              "time.sleep(120)\n"],
                             stdout=subprocess.PIPE, text=True)
    seen: dict[str, Any] = {}
    profile = threading.getprofile()

    def in_a_thread() -> None:
        aff = ServingAffinity(True)
        seen["before"] = aff.info()
        aff.sample(child.pid)
        aff.sample(child.pid)
        seen["after"] = aff.info()
        seen["mask"] = os.sched_getaffinity(0)

    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        t = threading.Thread(target=in_a_thread)
        t.start()
        t.join()
    finally:
        threading.setprofile(profile)
        child.kill()
        child.wait()
    assert seen["before"]["following"] is True
    after = seen["after"]
    assert (after["following"], after["pins"], after["releases"], after["cpu"]) == \
        (False, 1, 1, None), after
    assert "refused idle replies" in after["reason"]
    assert seen["mask"] == MASK


def test_work_beside_a_pinned_thread_runs_on_its_cpu_and_gets_the_mask_back() -> None:
    """The write-behind commit's wrapper: unpinned, the work itself; pinned, the work runs
    on the serving thread's CPU and its thread has the whole mask again afterwards."""
    aff = ServingAffinity(True, wanted=False)
    cpu = max(MASK)
    seen: dict[str, Any] = {}

    def work() -> int:
        seen["in"] = os.sched_getaffinity(0)
        return 7

    def in_a_thread() -> None:
        seen["plain"] = aff.beside(work) is work
        aff.pinned = cpu  # what a pin sets
        seen["result"] = aff.beside(work)()
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert seen == {"plain": True, "in": {cpu}, "result": 7, "after": MASK}
