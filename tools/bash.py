"""Bash(command, timeout=120, run_in_background=False): run a shell command (CONTRACT 5).

``bash -c`` in the connection's working directory (the workspace root at first; a ``cd``
persists to the next call: the shell reports its final directory on a side channel, a pipe
written by an EXIT trap, and a directory outside the root or gone resets it to the root),
stdin from /dev/null, stdout and stderr merged into one stream, of which the first and last
halves of BASH_OUTPUT_CAP bytes are kept. Confined by bubblewrap when it works here (see
tools.sandbox), else run unconfined and the answer says so. On timeout, or when the command
exits, every process it started dies, including those that left its session or process
group. A foreground command holds the binding's write permit for the whole run, so a
checkpoint requested meanwhile waits for it. ``run_in_background`` starts the command as a
job (tools.jobs) without the permit and answers at once with its id; BashOutput reads its
output, KillShell stops it. The session's path policy (hide, protect) applies inside the
sandbox to the paths matching when the command starts (tools.policyview).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import selectors
import signal
import subprocess
import time
from typing import Any

from tools import messages as M
from tools import sandbox
from tools.binding import GuardsSandboxes, PermitError, background_writer
from tools.context import ToolContext
from tools.jobs import MAX_JOBS, Job
from tools.paths import PathError, locate
from tools.policyview import PolicyView, policy_view
from tools.result import ToolResult, error, ok

NAME = "Bash"
OUTPUT_NAME = "BashOutput"
KILL_NAME = "KillShell"
_KILL_GRACE_S = 5.0      # wait for a told-to-stop process tree before SIGKILL of the leader
_DRAIN_S = 2.0           # read what is left in the pipe after the tree died


class _Capture:
    """Keeps the first and the last ``cap // 2`` bytes of a stream and counts the rest."""

    def __init__(self, cap: int) -> None:
        self.half = cap // 2
        self.cap = cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.half:
                del self.tail[:len(self.tail) - self.half]

    def text(self) -> str:
        if self.total <= self.cap:
            body = bytes(self.head + self.tail)
            return body.decode("utf-8", errors="replace")
        tail = bytes(self.tail[-self.half:])
        omitted = self.total - len(self.head) - len(tail)
        return (bytes(self.head).decode("utf-8", errors="replace")
                + M.BASH_OMITTED.format(omitted=omitted)
                + tail.decode("utf-8", errors="replace"))


def _stop(proc: subprocess.Popen[bytes], confined: bool) -> None:
    """End the command's whole process tree."""
    if confined:
        # bwrap's death ends the PID namespace's init; the kernel kills the rest.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    else:
        try:
            proc.send_signal(signal.SIGTERM)    # the reaper kills its descendants, then exits
        except ProcessLookupError:
            pass
        try:
            proc.wait(_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_job(job: Job) -> None:
    """End a background job's whole process tree."""
    _stop(job.proc, job.confined)


def _start_shell(ctx: ToolContext, script: str, cwd: str,
                 pass_fds: tuple[int, ...] = ()) -> sandbox.ShellRun:
    """Start ``script`` in ``cwd`` (canonical, inside the root), stdout and stderr into one
    pipe: the one place Bash asks tools.sandbox for a shell. ``pass_fds`` are inherited by
    the shell. The session's path policy (hide, protect) covers the paths matching now
    (tools.policyview): where ``sandbox.covers_in_sandbox``, scanned while bwrap builds the
    sandbox and covered in it before the command runs; else scanned first and covered by
    bwrap's binds. Raises SandboxUnavailable, NetworkUnavailable, OSError."""
    hidden = [os.path.realpath(h) for h in ctx.binding.hidden_paths()]
    guard = ctx.binding if isinstance(ctx.binding, GuardsSandboxes) \
        and sandbox.unavailable_reason() is None else None
    reg = None

    def started(pid: int) -> None:
        if reg is None:
            return
        changed = reg.bind(pid)
        if changed is not None:
            raise OSError(errno.ESTALE, M.BASH_COVER_CHANGED.format(path=changed))

    def start(fds: tuple[int, ...], **how: Any) -> sandbox.ShellRun:
        try:
            run = sandbox.start_shell(ctx.sandbox, ctx.root.real, cwd, hidden, script,
                                      pass_fds=fds, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True, close_fds=True, **how)
        except BaseException:
            if reg is not None:
                reg.close()
            raise
        run.guard = reg
        return run

    pol = ctx.root.policy
    if (pol.hide or pol.protect) and sandbox.covers_in_sandbox():
        def covers() -> sandbox.CoverSet | None:
            nonlocal reg
            view = policy_view(ctx.root)
            view.close()
            if guard is not None:
                reg = guard.guard_sandbox(_guarded(ctx, view))
            return view.cover_set()

        return start(pass_fds, covers=covers,
                     on_start=started if guard is not None else None)
    view = policy_view(ctx.root)
    try:
        if guard is not None:
            reg = guard.guard_sandbox(_guarded(ctx, view))
        return start(pass_fds + tuple(view.fds), view=view.argv,
                     on_start=started if reg is not None else None)
    finally:
        view.close()

def _guarded(ctx: ToolContext, view: PolicyView) -> list[tuple[int, str]]:
    """What the sandbox covers as (inode number, workspace path) pairs, for the session's
    guard (``tools.binding.GuardsSandboxes``): the covers made in the sandbox, else the
    objects at the paths bwrap covers."""
    if view.covers:
        return [(c.ino, os.fsdecode(c.rel)) for c in view.covers]
    out = []
    for rel in (*view.hidden, *view.protected):
        with contextlib.suppress(OSError):
            out.append((os.lstat(os.path.join(ctx.root.real, rel)).st_ino, rel))
    return out


def _start_dir(ctx: ToolContext) -> tuple[str, str, str | None]:
    """(absolute directory, workspace-relative form, note) where the next command starts:
    the connection's working directory, or the root (with a note) when it is gone."""
    rel = ctx.cwd
    if rel != ".":
        try:
            with locate(ctx.root, rel) as loc:
                if loc.is_dir:
                    return f"{ctx.root.real}/{loc.rel}", loc.rel, None
        except PathError:
            pass
        ctx.cwd = "."
        return ctx.root.real, ".", M.BASH_CWD_GONE.format(cwd=rel)
    return ctx.root.real, ".", None


def _track_cwd(ctx: ToolContext, reported: bytes) -> str | None:
    """Take the directory the shell reported at exit as the connection's working directory;
    a note when it had to be reset to the root."""
    lines = reported.decode("utf-8", errors="surrogateescape").strip().splitlines()
    if not lines:
        return None                     # no report (exec, a replaced trap): keep it
    path = lines[-1]
    for base in (ctx.root.real, ctx.root.path):
        if path == base:
            ctx.cwd = "."
            return None
        if path.startswith(base.rstrip("/") + "/"):
            ctx.cwd = path[len(base.rstrip("/")) + 1:]
            return None
    ctx.cwd = "."
    return M.BASH_CWD_OUTSIDE.format(cwd=path)


def run_bash(ctx: ToolContext, command: str, timeout: float = M.BASH_DEFAULT_TIMEOUT_S,
             run_in_background: bool = False) -> ToolResult:
    """Run ``command``; the answer holds its output (capped), exit code and notes. The
    data holds ``exit_code`` (None on timeout), ``timed_out``, ``confined``,
    ``output_bytes``, ``elapsed_s`` and ``cwd`` (the working directory after the command,
    workspace-relative); for a background start ``bash_id`` instead."""
    if not command.strip():
        return error(NAME, M.BASH_EMPTY, kind="empty")
    if not (0 < timeout <= M.BASH_MAX_TIMEOUT_S):
        return error(NAME, M.BASH_BAD_TIMEOUT.format(maximum=M.BASH_MAX_TIMEOUT_S,
                                                     value=timeout), kind="timeout_arg")
    if run_in_background:
        return _start_background(ctx, command)
    cwd, _, cwd_note = _start_dir(ctx)
    side_r, side_w = os.pipe()
    try:
        return _run_foreground(ctx, command, cwd, timeout, side_r, side_w, cwd_note)
    finally:
        os.close(side_r)


_START_ERRORS = (sandbox.SandboxUnavailable, sandbox.NetworkUnavailable, OSError)


def _not_started(e: Exception) -> ToolResult:
    """The answer for a command that did not start (``e`` one of ``_START_ERRORS``):
    kind ``sandbox`` (no sandbox here), ``network`` (no network for it here) or
    ``start``."""
    if isinstance(e, sandbox.SandboxUnavailable):
        return error(NAME, M.BASH_NO_SANDBOX.format(reason=e.reason), kind="sandbox")
    if isinstance(e, sandbox.NetworkUnavailable):
        return error(NAME, M.BASH_NO_NETWORK.format(reason=e.reason), kind="network")
    assert isinstance(e, OSError)
    return error(NAME, M.BASH_START_FAILED.format(reason=e.strerror or e), kind="start")


def _start_background(ctx: ToolContext, command: str) -> ToolResult:
    if ctx.jobs.running_count() >= MAX_JOBS:
        return error(NAME, M.BASH_TOO_MANY_JOBS.format(maximum=MAX_JOBS), kind="jobs")
    cwd, rel, cwd_note = _start_dir(ctx)
    try:
        job = ctx.jobs.start(command, lambda: _start_shell(ctx, command, cwd),
                             background_writer(ctx.binding))
    except _START_ERRORS as e:
        return _not_started(e)
    except PermitError as e:
        return error(NAME, M.PERMIT_FAILED.format(reason=e), kind="permit")
    parts = [M.BASH_STARTED.format(id=job.id)]
    if cwd_note:
        parts.append(cwd_note)
    if not job.confined:
        parts.append(M.BASH_UNCONFINED)
    return ok(NAME, "\n".join(parts), bash_id=job.id, confined=job.confined, cwd=rel)


def _run_foreground(ctx: ToolContext, command: str, cwd: str, timeout: float, side_r: int,
                    side_w: int, cwd_note: str | None) -> ToolResult:
    cap = _Capture(M.BASH_OUTPUT_CAP)
    timed_out = False
    started = time.monotonic()
    script = f"trap 'pwd -P >&{side_w} 2>/dev/null' EXIT; {command}"
    with contextlib.ExitStack() as held:
        try:                            # the write end is the shell's alone once it runs
            try:
                held.enter_context(ctx.binding.write_permit())
            except PermitError as e:
                return error(NAME, M.PERMIT_FAILED.format(reason=e), kind="permit")
            try:
                run = _start_shell(ctx, script, cwd, (side_w,))
            except _START_ERRORS as e:
                return _not_started(e)
        finally:
            os.close(side_w)
        held.callback(run.close)
        proc, confined = run.proc, run.confined
        os.set_blocking(side_r, False)
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        deadline = started + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    _stop(proc, confined)
                    deadline = time.monotonic() + _DRAIN_S   # drain what is left
                    while sel.select(max(0.0, deadline - time.monotonic())):
                        chunk = os.read(fd, 65536)
                        if not chunk:
                            break
                        cap.feed(chunk)
                        if time.monotonic() > deadline:
                            break
                    break
                if sel.select(left):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        break
                    cap.feed(chunk)
            try:
                code = proc.wait(_KILL_GRACE_S if timed_out else None)
            except subprocess.TimeoutExpired:
                _stop(proc, True)
                code = proc.wait()
        finally:
            sel.close()
            proc.stdout.close()
            if proc.returncode is None:
                _stop(proc, confined)
                proc.wait()
        stopped = run.stopped()
    elapsed = time.monotonic() - started
    try:
        reported = b"" if timed_out else os.read(side_r, 8192)
    except BlockingIOError:
        reported = b""
    cwd_after = None if timed_out else _track_cwd(ctx, reported)
    out = cap.text()
    parts = [out.rstrip("\n") if out else M.BASH_NO_OUTPUT]
    if stopped is not None:
        parts.append(M.BASH_COVER_STOPPED.format(path=stopped))
        return error(NAME, "\n".join(parts), kind="cover_changed", path=stopped,
                     exit_code=code, timed_out=timed_out, confined=confined,
                     output_bytes=cap.total, elapsed_s=round(elapsed, 3), cwd=ctx.cwd)
    if timed_out:
        parts.append(M.BASH_TIMEOUT.format(seconds=timeout))
    elif code < 0:
        parts.append(M.BASH_KILLED.format(signal=-code))
    else:
        parts.append(M.BASH_EXIT.format(code=code))
    for note in (cwd_note, cwd_after):
        if note:
            parts.append(note)
    if not confined:
        parts.append(M.BASH_UNCONFINED)
        if ctx.root.policy.hide or ctx.root.policy.protect:
            parts.append(M.BASH_POLICY_UNENFORCED)
    return ok(NAME, "\n".join(parts), exit_code=None if timed_out else code,
              timed_out=timed_out, confined=confined, output_bytes=cap.total,
              elapsed_s=round(elapsed, 3), cwd=ctx.cwd)


def _job_status(job: Job) -> str:
    if job.running:
        return M.BASH_JOB_RUNNING
    if job.killed:
        return M.BASH_JOB_KILLED
    if job.stopped is not None:
        return M.BASH_COVER_STOPPED.format(path=job.stopped)
    code = job.code if job.code is not None else -1
    if code < 0:
        return M.BASH_KILLED.format(signal=-code)
    return M.BASH_EXIT.format(code=code)


def bash_output(ctx: ToolContext, bash_id: str, filter: str | None = None,
                wait: float = 0) -> ToolResult:
    """The output background job ``bash_id`` wrote since the last call (head and tail of
    BASH_OUTPUT_CAP bytes kept), and its status; ``filter``: a Python regular expression,
    only matching lines are shown (the others are consumed); ``wait``: seconds to wait for
    the job to end first (at most BASH_MAX_TIMEOUT_S). The data holds ``bash_id``,
    ``status`` (running, exited, killed), ``exit_code``, ``output_bytes`` (new bytes) and
    ``dropped_bytes`` (lost to the job's buffer cap)."""
    job = ctx.jobs.get(bash_id) if bash_id else None
    if job is None:
        return error(OUTPUT_NAME, M.BASH_JOB_UNKNOWN.format(id=bash_id,
                                                            ids=", ".join(ctx.jobs.ids())
                                                            or "none"), kind="unknown_job")
    if not (0 <= wait <= M.BASH_MAX_TIMEOUT_S):
        return error(OUTPUT_NAME, M.BASH_BAD_WAIT.format(maximum=M.BASH_MAX_TIMEOUT_S,
                                                         value=wait), kind="wait_arg")
    rx = None
    if filter:
        try:
            rx = re.compile(filter)
        except re.error as e:
            return error(OUTPUT_NAME, M.BASH_BAD_FILTER.format(filter=filter, reason=e),
                         kind="filter")
    if wait:
        job.done.wait(wait)
    running = job.running                   # before the take: no output is lost between
    data, dropped = job.take()
    if rx is not None:
        kept = [ln for ln in data.split(b"\n")
                if rx.search(ln.decode("utf-8", errors="replace"))]
        data = b"\n".join(kept)
    cap = _Capture(M.BASH_OUTPUT_CAP)
    cap.feed(data)
    out = cap.text().rstrip("\n")
    parts = [out if out else M.BASH_NO_NEW_OUTPUT]
    if dropped:
        parts.insert(0, M.BASH_JOB_DROPPED.format(dropped=dropped))
    if running:
        parts.append(M.BASH_JOB_RUNNING)
    else:
        parts.append(_job_status(job))
    status = "running" if running else ("killed" if job.killed or job.stopped else "exited")
    return ok(OUTPUT_NAME, "\n".join(parts), bash_id=job.id, status=status,
              exit_code=None if running else job.code, output_bytes=len(data),
              dropped_bytes=dropped)


def kill_shell(ctx: ToolContext, shell_id: str) -> ToolResult:
    """Stop background job ``shell_id`` and every process it started. The data holds
    ``bash_id``, ``status`` and ``exit_code``."""
    job = ctx.jobs.get(shell_id) if shell_id else None
    if job is None:
        return error(KILL_NAME, M.BASH_JOB_UNKNOWN.format(id=shell_id,
                                                          ids=", ".join(ctx.jobs.ids())
                                                          or "none"), kind="unknown_job")
    if not job.running:
        return ok(KILL_NAME, M.BASH_JOB_ALREADY_DONE.format(id=job.id,
                                                           status=_job_status(job)),
                  bash_id=job.id, status="killed" if job.killed else "exited",
                  exit_code=job.code)
    job.killed = True
    stop_job(job)
    job.done.wait(_KILL_GRACE_S + _DRAIN_S)
    return ok(KILL_NAME, M.BASH_JOB_STOPPED.format(id=job.id), bash_id=job.id,
              status="killed", exit_code=job.code)
