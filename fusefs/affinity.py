"""The serving thread's CPU: the CPU of the process whose requests it is answering.

A FUSE request is a round trip: the requester sleeps in the kernel until the daemon's reply
wakes it. When the two run on different CPUs, each round trip wakes a CPU twice, and on a
virtual machine waking an idle vCPU is the dearest part of a small request. On the 2-vCPU
benchmark VM (Linux 6.18) an untar of the Django tree into a session mount took 6.2 s with
the daemon and tar free to run anywhere and 1.24 s with both pinned to one CPU (the same
71,630 requests); with the daemon alone pinned, tar moved to the other CPU and it took
7.3 s. The scheduler does not put them together by itself: waking the requester, it picks
an idle CPU over the one the daemon is busy replying on.

``ServingAffinity`` does, in no-open mode with the patched binding's idle replies
(``pyfuse3.set_idle_replies``, scripts/pyfuse3/README.md): the binding writes replies
under SCHED_IDLE, and keeps the thread so until it waits for a request, so the CPU looks
idle to the requester's wake-up and the requester runs there at once, and the serving
thread is pinned to that CPU, so the next request wakes it there too. Every
``SAMPLE_EVERY`` requests the thread looks at two requests in a row and,
when one requester (a thread id: the binding's ``last_request_pid``, which READ and WRITE
have too) sent both, samples it: reads its CPU (``/proc/PID/stat`` field 39,
``processor``, proc(5)):

- two samples in a row from one requester pin the serving thread to its CPU, unless the
  requester waited to run for over ``STARVED`` of its runnable time between them (its
  CPU is busy with other work, which would starve the thread there too), within the
  CPUs the thread was allowed when it was last unpinned (the daemon's start mask, or one
  set since from outside, e.g. ``taskset -p``, which is then kept), and turn idle replies
  on;
- while pinned, any request of another process unpins the thread at once, for
  ``COOL_DOWN_S[0]`` (that process would wait for the followed one's CPU, which the
  followed one may keep busy between its requests); so do two requests in a row from two
  requesters at a sample, a requester on a CPU outside the mask, and the followed one's
  end (``release_if_gone``: before each control request, which never runs idle
  (``control_work``), and every second);
- while pinned, a wait for the followed one's request (the binding's ``request_waits``)
  moves the thread to that one's CPU at once: it ran elsewhere meanwhile;
- a window of ``WINDOW_S`` in which the pinned thread waited to run over ``STARVED`` of
  the wall time, not counting the requester's own CPU time (``/proc/thread-self/
  schedstat`` run delay less ``/proc/PID/schedstat`` CPU time, the kernel's sched stats),
  unpins it for a cool-down (``COOL_DOWN_S``, doubling while it recurs): other work
  shares that CPU, and leaves an idle thread little time. Judged at each sample and at
  the first request after each window; so is a rescue by the binding's watchdog, which
  puts an idle thread that waits to run for three quarters of 10 ms back to SCHED_OTHER
  (``pyfuse3.idle_rescues``): beside a heavier thread an idle one might not run at all.

While pinned, the write-behind commits run on the same CPU (``beside``).

Threads that the serving thread starts while pinned (trio's worker threads) would inherit
its one CPU; a ``threading.setprofile`` hook gives each new thread the daemon's mask back
before it runs. Going back from SCHED_IDLE to SCHED_OTHER needs CAP_SYS_NICE or a
RLIMIT_NICE of 20 (sched(7)); it is tried once in a throwaway thread, and without it, on a
stock binding, in handle mode or with one allowed CPU, nothing here changes anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pyfuse3

log = logging.getLogger("rewindfs.affinity")
T = TypeVar("T")

SAMPLE_EVERY = 32  # requests between two samples of the requester's CPU
STARVED = 0.25  # share of a window's wall time spent waiting to run that unpins
WINDOW_S = 0.05  # seconds over which waiting to run is judged
COOL_DOWN_S = (0.25, 4.0)  # seconds without pinning after a starved window: the first,
# doubled for each starved window that follows the cool-down, up to the second
_OFF = 1 << 62  # countdown of a disabled instance: never reaches 0


class ProcFiles:
    """Small ``/proc`` files read again and again, each through one descriptor kept open:
    ``pread`` at 0 gives the current contents, and a descriptor of a task that ended
    answers ESRCH, so a reused pid is never read through it. Spares each read the open,
    fstat, ioctl, lseek and close of a Python ``open()`` (5 system calls; 3,300 of them
    per untar of the Django tree). At most ``KEEP`` descriptors, the oldest closed."""

    KEEP = 4

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def read(self, path: str) -> bytes | None:
        """The contents of ``path`` (at most 4 KiB), or None if it cannot be read."""
        fd = self._fds.get(path)
        try:
            if fd is None:
                if len(self._fds) >= self.KEEP:
                    self.close(next(iter(self._fds)))
                fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, 4096, 0)
        except OSError:
            self.close(path)
            return None

    def close(self, path: str | None = None) -> None:
        """Close the descriptor of ``path`` (None: of every path)."""
        for p in list(self._fds) if path is None else [path]:
            fd = self._fds.pop(p, None)
            if fd is not None:
                os.close(fd)


def requester_cpu(stat: bytes | None) -> int | None:
    """The CPU a thread last ran on, from its ``/proc/PID/stat`` (proc(5) field 39,
    ``processor``), or None when unreadable."""
    try:
        return int(stat.rsplit(b")", 1)[1].split()[36]) if stat else None
    except (ValueError, IndexError):
        return None


def schedstat(text: bytes | None) -> tuple[float, float] | None:
    """``(seconds on a CPU, seconds runnable but waiting for one)`` from a thread's
    ``/proc/.../schedstat``, or None where unreadable (no sched stats in the kernel, or
    the thread is gone)."""
    try:
        fields = text.split() if text else []
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (ValueError, IndexError):
        return None


def can_leave_sched_idle() -> bool:
    """Whether a thread of this process can go to SCHED_IDLE and back to SCHED_OTHER
    (tried in a throwaway thread, which stays idle if the way back is closed)."""
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        return False
    ok: list[bool] = []

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            return
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=attempt, name="rewindfs-sched-probe")
    t.start()
    t.join()
    return bool(ok)


def unavailable(mask: frozenset[int] | None = None) -> str | None:
    """Why this process's mounts cannot follow a requester's CPU (None: they can, in
    no-open mode): the binding lacks idle replies, one CPU is allowed (``mask``, default
    the calling thread's), or no way back from SCHED_IDLE. ``rewindfs doctor`` says it."""
    if "idle_replies" not in getattr(pyfuse3, "extensions", ()):
        return "needs the patched binding's idle replies"
    if len(mask if mask is not None else os.sched_getaffinity(0)) < 2:
        return "one CPU allowed"
    policy = os.sched_getscheduler(0)
    if policy != os.SCHED_OTHER:
        names = {os.SCHED_BATCH: "SCHED_BATCH", os.SCHED_IDLE: "SCHED_IDLE",
                 os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
        return f"the daemon runs under {names.get(policy, f'policy {policy}')}, " \
               "not SCHED_OTHER"
    if not can_leave_sched_idle():
        return "no way back from SCHED_IDLE (needs CAP_SYS_NICE or RLIMIT_NICE 20)"
    return None


class ServingAffinity:
    """Pins the serving thread to a serial requester's CPU (module docstring).

    Created and called on the thread that answers requests (the event loop's): each
    request decrements ``countdown``, and ``note()`` is called when it reaches 0.
    ``reason`` says why it is off, if it is."""

    def __init__(self, no_open: bool, wanted: bool = True) -> None:
        self.mask = frozenset(os.sched_getaffinity(0))
        self.countdown = _OFF
        self.reason = self._unavailable(no_open, wanted)
        self.pinned: int | None = None  # the CPU the thread is pinned to
        self.pid = 0  # requester of the last sample
        self._first = 0  # requester of the first request of a pair being looked at
        self.pins = self.releases = self.starved = 0
        self.others = 0  # releases for a request of another process (``request``)
        self._own = 0  # the last thread of this daemon seen making a request
        self._waits = 0  # the binding's request_waits() at the last request
        self._control = 0  # control requests in progress (``control_work``)
        # (requester, its (run time s, run delay s)) at the last sample
        self._req_delay: tuple[int, tuple[float, float]] = (0, (0.0, 0.0))
        self._rescues = pyfuse3.idle_rescues() if self.reason is None else 0
        # When the window began: (monotonic s, this thread's run delay s, requester,
        # its CPU time s); see _starved.
        self._window: tuple[float, float, int, float] = (0.0, 0.0, 0, 0.0)
        self._cool_until = 0.0
        self._cool_s = COOL_DOWN_S[0]
        self._proc = ProcFiles()  # on the serving thread: thread-self is that thread
        if self.reason is None:
            self.countdown = SAMPLE_EVERY
            threading.setprofile(self._thread_started)

    def _unavailable(self, no_open: bool, wanted: bool) -> str | None:
        if not wanted:
            return "turned off by --no-follow-cpu"
        if not no_open:
            return "off in handle mode"
        return unavailable(self.mask)

    def _thread_started(self, frame: Any, event: str, arg: Any) -> None:
        sys.setprofile(None)
        try:
            if os.sched_getaffinity(0) != self.mask:
                os.sched_setaffinity(0, self.mask)
        except OSError:
            pass

    def request(self) -> None:
        """Count a request (call for each, on the serving thread, while ``reason`` is
        None). A request from another process than the one followed releases the thread
        at once, for ``COOL_DOWN_S[0]``: its requester would otherwise wait for the
        followed one's CPU, which that one may keep busy between its requests."""
        if self.pinned is not None:
            pid = pyfuse3.last_request_pid()
            if pid and pid != self.pid and not self._own_thread(pid):
                self.others += 1
                self._first = self.pid = 0
                self._cool_until = time.monotonic() + COOL_DOWN_S[0]
                self.release()
                return
            waits = pyfuse3.request_waits()
            if waits != self._waits:
                self._waits = waits
                self._moved(pid)
            else:
                now = time.monotonic()
                if now - self._window[0] >= WINDOW_S:
                    self._judge(now, self.pid)
        self.countdown -= 1
        if self.countdown <= 0:
            self.note()

    def _moved(self, pid: int) -> None:
        """The pinned thread waited for a request of ``pid``, the requester followed: that
        one ran on another CPU meanwhile (the binding's ``request_waits``), most often
        moved there by the scheduler's load balancing. The thread moves to its CPU at once
        rather than at the next samples: until then each round trip wakes two CPUs."""
        cpu = requester_cpu(self._proc.read(f"/proc/{pid}/stat"))
        if cpu is None or cpu == self.pinned or cpu not in self.mask:
            return
        if os.sched_getaffinity(0) != {self.pinned}:
            self._adopt_mask()  # changed by someone else
            return
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError as e:
            self.disable(f"sched_setaffinity failed: {e}")
            return
        self.pinned = cpu
        self.pins += 1

    def _own_thread(self, tid: int) -> bool:
        """Whether ``tid`` is a thread of this daemon (its own syncfs, say): its requests
        do not count as another process's."""
        if tid == self._own:
            return True
        if os.path.exists(f"/proc/self/task/{tid}"):
            self._own = tid
            return True
        return False

    def note(self) -> None:
        """A look is due: the requester of the request being answered (the binding's
        ``last_request_pid``) is noted, and compared with that of the next request: from
        one requester, it is sampled; from two, the thread is released (two requesters
        taking turns would otherwise be sampled as one, the same one each time, when
        their turns divide ``SAMPLE_EVERY``)."""
        pid = pyfuse3.last_request_pid()
        if not pid:
            self.countdown = 1  # not in the mount's pid namespace: try the next request
            return
        if not self._first:
            self._first = pid
            self.countdown = 1
            return
        first, self._first = self._first, 0
        self.countdown = SAMPLE_EVERY - 1
        if pid != first:
            self.pid = 0
            self.release()
            return
        self.sample(pid)

    def sample(self, pid: int) -> None:
        """Pin to, stay on or leave ``pid``'s CPU (module docstring)."""
        if self.pinned is not None and not self._control and not pyfuse3.idle_replies()[0]:
            # The binding turned them off: a change of policy failed (not expected once
            # can_leave_sched_idle said yes); the thread may be left SCHED_IDLE.
            err = pyfuse3.idle_replies()[2]
            self.disable("writing a reply under SCHED_IDLE failed: "
                         f"{os.strerror(err) if err else 'unknown error'}")
            return
        now = time.monotonic()
        if self.pinned is not None:
            self._judge(now, pid)
        same, self.pid = pid == self.pid, pid
        waits = self.pinned is None and self._requester_waits(now, pid)
        if now < self._cool_until:
            return
        if self.pinned is not None and os.sched_getaffinity(0) != {self.pinned}:
            self._adopt_mask()  # changed by someone else (taskset -p, a cpuset)
        elif self.pinned is None:
            self.mask = frozenset(os.sched_getaffinity(0))
        cpu = requester_cpu(self._proc.read(f"/proc/{pid}/stat")) if same else None
        if cpu is None or cpu not in self.mask or len(self.mask) < 2:
            self.release()
            return
        if waits:
            return
        if cpu != self.pinned:
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError as e:
                self.disable(f"sched_setaffinity failed: {e}")
                return
            if self.pinned is None:
                self._begin(now, pid)
            self.pinned = cpu
            self.pins += 1
            if not self._control and not pyfuse3.set_idle_replies(True):
                self.disable("the binding refused idle replies (no mount serving them, "
                             "or the serving thread is not SCHED_OTHER)")

    def _requester_waits(self, now: float, pid: int) -> bool:
        """Whether the requester ``pid``, since the last sample, waited to run for over
        ``STARVED`` of the time it was runnable (its ``/proc/PID/schedstat``: run delay
        against run time): its CPU is busy with other work, which would starve the
        serving thread there too (an idle one most, and beside a heavier thread a pinned
        one cannot leave), so it is not pinned there. False when not known (the first
        sample of this requester)."""
        st = schedstat(self._proc.read(f"/proc/{pid}/schedstat"))
        last, self._req_delay = self._req_delay, (pid, st) if st else (0, (0.0, 0.0))
        if st is None or last[0] != pid:
            return False
        ran, waited = st[0] - last[1][0], st[1] - last[1][1]
        return ran + waited > 0 and waited / (ran + waited) > STARVED

    def _judge(self, now: float, pid: int) -> None:
        """Unpin for a cool-down if the pinned thread was starved (``_starved``); judged at
        each sample and whenever a window has passed, so that a thread left SCHED_IDLE
        among busy threads is let go within about ``WINDOW_S``, not 32 slow requests."""
        verdict = self._starved(now, pid)
        rescues = pyfuse3.idle_rescues()
        if rescues != self._rescues:  # the binding's watchdog found it starved meanwhile
            self._rescues, verdict = rescues, True
        if verdict:
            self.starved += 1
            self._cool_until = now + self._cool_s
            self._cool_s = min(2 * self._cool_s, COOL_DOWN_S[1])
            self.release()
        elif verdict is False:
            self._cool_s = COOL_DOWN_S[0]

    def beside(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` made to run, in the worker thread that calls it, on the CPU the serving
        thread is pinned to now, and on the whole mask again afterwards (``fn`` itself
        when unpinned). For the write-behind commits: on another CPU their thread takes the
        interpreter lock in turns with the serving thread, each handover a wake-up of the
        other CPU (an rm -rf's unlink took 28 us in its handler instead of 9 us)."""
        cpu, mask = self.pinned, self.mask
        if cpu is None:
            return fn

        def run() -> T:
            try:
                os.sched_setaffinity(0, {cpu})
            except OSError:
                return fn()
            try:
                return fn()
            finally:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, mask)

        return run

    def _starved(self, now: float, pid: int) -> bool | None:
        """Whether (None: not judged now), over the last ``WINDOW_S`` or more, this
        thread waited to run for other threads than the requester ``pid`` over
        ``STARVED`` of the time. It waits for the requester as a matter of course (a
        reply under SCHED_IDLE lets the requester run first), so the requester's own CPU
        time is taken off the thread's run delay. Windows shorter than ``WINDOW_S`` are
        too noisy to judge (one kernel worker's millisecond); one with another requester
        is not judged. Each judged window begins the next (``_begin``)."""
        t0, d0, pid0, c0 = self._window
        if pid0 == pid and now - t0 < WINDOW_S:
            return None
        own, theirs = self._begin(now, pid)
        if own is None or theirs is None or pid0 != pid:
            return None
        share = ((own[1] - d0) - (theirs[0] - c0)) / (now - t0)
        log.debug("affinity: on CPU %s for pid %d, waited for others %.0f%% of %.0f ms",
                  self.pinned, pid, 100 * share, 1000 * (now - t0))
        return share > STARVED

    def _begin(self, now: float, pid: int) -> tuple[tuple[float, float] | None,
                                                   tuple[float, float] | None]:
        """Begin a starvation window at ``now`` for requester ``pid``; the sched stats
        read (this thread's, the requester's), None where unreadable."""
        own = schedstat(self._proc.read("/proc/thread-self/schedstat"))
        theirs = schedstat(self._proc.read(f"/proc/{pid}/schedstat"))
        self._window = (now, own[1] if own else 0.0, pid, theirs[0] if theirs else 0.0)
        return own, theirs

    def release_if_gone(self) -> None:
        """Before control work (and before ``status`` reports whom the thread follows):
        unpin if the requester followed has ended, so that the work runs unpinned; and in
        any case leave SCHED_IDLE, which a reply may have left the thread in (a handler
        waiting in the middle lets other tasks run before the thread waits for the
        device): control work never runs at idle weight."""
        if self.pinned is None:
            return
        if self._proc.read(f"/proc/{self.pid}/stat") is None:
            self.release()
        else:
            pyfuse3.leave_idle()

    @contextlib.contextmanager
    def control_work(self) -> Iterator[None]:
        """Around a control request (a checkpoint, a restore, ``status``): replies are
        written normally while any is in progress, so that the thread is never left
        SCHED_IDLE when the control work goes on after one of its waits (the requests
        answered meanwhile would otherwise leave it so). Pinning goes on as before."""
        self.release_if_gone()
        self._control += 1
        if self._control == 1 and self.pinned is not None:
            pyfuse3.set_idle_replies(False)
        try:
            yield
        finally:
            self._control -= 1
            if (self._control == 0 and self.pinned is not None and self.reason is None
                    and not pyfuse3.set_idle_replies(True)):
                self.disable("the binding refused idle replies after control work")

    def _adopt_mask(self) -> None:
        """The pinned thread's CPUs were changed from outside: they become the mask to
        keep (and to give new threads), and the thread counts as unpinned."""
        self.mask = frozenset(os.sched_getaffinity(0))
        pyfuse3.set_idle_replies(False)
        self.pinned = None
        self.releases += 1

    def release(self) -> None:
        """Unpin the thread (the daemon's mask back) and write replies normally; a mask
        changed from outside while it was pinned is kept instead (``_adopt_mask``)."""
        if self.pinned is None:
            return
        if os.sched_getaffinity(0) != {self.pinned}:
            self._adopt_mask()
            return
        pyfuse3.set_idle_replies(False)
        self.pinned = None
        self.releases += 1
        try:
            os.sched_setaffinity(0, self.mask)
        except OSError as e:
            self.disable(f"sched_setaffinity failed: {e}")

    def disable(self, reason: str) -> None:
        """Off for the rest of the mount, unpinned."""
        self.reason = reason
        self.countdown = _OFF
        self.release()
        self._proc.close()

    def info(self) -> dict[str, Any]:
        """What ``status`` reports: ``{following, reason, pid, cpu, pins, releases,
        starved, others, idle_replies, rescues}`` (``others``: releases for another
        process's request); ``idle_replies`` is the binding's ``[on, failures, errno]``
        (None on a binding without them; ``on`` also while a control request, such as
        this ``status``, pauses them), ``rescues`` its watchdog's count (0 without)."""
        idle = getattr(pyfuse3, "idle_replies", None)
        rescues = getattr(pyfuse3, "idle_rescues", None)
        return {"following": self.reason is None, "reason": self.reason,
                "pid": self.pid if self.pinned is not None else None,
                "cpu": self.pinned, "pins": self.pins, "releases": self.releases,
                "starved": self.starved, "others": self.others,
                "idle_replies": ([idle()[0] or bool(self._control and self.pinned is not None),
                                  *idle()[1:]] if callable(idle) else None),
                "rescues": rescues() if callable(rescues) else 0}
