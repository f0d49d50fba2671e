"""Background Bash commands of one MCP connection: started by Bash(run_in_background=True),
read by BashOutput, stopped by KillShell.

A job is the same confined (or reaped) process tree a foreground command is, started
without the session's write permit: a checkpoint or restore never waits for it (on a FUSE
mount its writes are still captured by the file system; on the no-FUSE fallback the
binding's ``background_writer`` marks checkpoints taken meanwhile fuzzy). A reader thread
keeps the output not yet read, at most JOB_BUFFER_CAP bytes (the oldest bytes are dropped
and counted). Every job dies with the connection (``Jobs.close``), and with the server
process (bubblewrap's ``--die-with-parent``, the reaper's parent-death signal).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tools.sandbox import ShellRun

JOB_BUFFER_CAP = 1024 * 1024       # bytes of unread output kept per job
MAX_JOBS = 16                      # background commands alive at once per connection


@dataclass
class Job:
    """One background command: ``id`` (``bash_N``), ``command``, its process, whether it
    is ``confined``; output not yet read in ``unread`` (``dropped`` bytes were lost to the
    cap), ``total`` bytes written so far; ``code`` once it ended (negative: a signal),
    ``killed`` when KillShell stopped it, ``stopped``: the covered path whose removal or
    replacement outside the sandbox made the session stop it (``ShellRun.stopped``)."""

    id: str
    command: str
    run: ShellRun
    started: float
    unread: bytearray = field(default_factory=bytearray)
    dropped: int = 0
    total: int = 0
    code: int | None = None
    killed: bool = False
    stopped: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> tuple[bytes, int]:
        """The output written since the last take, and how many bytes of it were dropped."""
        with self.lock:
            data, dropped = bytes(self.unread), self.dropped
            self.unread.clear()
            self.dropped = 0
        return data, dropped

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.run.proc

    @property
    def confined(self) -> bool:
        return self.run.confined

    @property
    def running(self) -> bool:
        return not self.done.is_set()


class Jobs:
    """The background jobs of one connection, by id. ``stop`` is how a job's process tree
    is ended (tools.bash's, shared with foreground commands)."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._next = 1

    def running_count(self) -> int:
        with self._lock:
            return sum(1 for j in self._jobs.values() if j.running)

    def start(self, command: str, start: Callable[[], ShellRun],
              holder: contextlib.AbstractContextManager[object]) -> Job:
        """Start a job with ``start`` (stdout a pipe, stderr merged); ``holder`` is entered
        now and exited when the job ends (the binding's background-writer mark)."""
        with self._lock:
            job_id = f"bash_{self._next}"
            self._next += 1
        holder.__enter__()
        try:
            run = start()
        except BaseException:
            holder.__exit__(None, None, None)
            raise
        job = Job(job_id, command, run, time.monotonic())
        with self._lock:
            self._jobs[job_id] = job
        t = threading.Thread(target=self._pump, args=(job, holder), name=f"job-{job_id}",
                             daemon=True)
        t.start()
        return job

    def _pump(self, job: Job, holder: contextlib.AbstractContextManager[object]) -> None:
        assert job.proc.stdout is not None
        fd = job.proc.stdout.fileno()
        try:
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    break
                if not data:
                    break
                with job.lock:
                    job.total += len(data)
                    job.unread += data
                    over = len(job.unread) - JOB_BUFFER_CAP
                    if over > 0:
                        del job.unread[:over]
                        job.dropped += over
            job.code = job.proc.wait()
            job.stopped = job.run.stopped()
        finally:
            job.proc.stdout.close()
            job.run.close()
            try:
                holder.__exit__(None, None, None)
            finally:
                job.done.set()

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def close(self, stop: Callable[[Job], None] | None = None) -> None:
        """Kill every job still running and wait for its reader."""
        from tools.bash import stop_job
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.running:
                (stop or stop_job)(job)
        for job in jobs:
            job.done.wait(10)
