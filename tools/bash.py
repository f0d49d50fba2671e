"""Bash(command, timeout=120): run a shell command in the workspace root (CONTRACT 5).

``bash -c`` with the root as working directory, stdin from /dev/null, stdout and stderr
merged into one stream, of which the first and last halves of BASH_OUTPUT_CAP bytes are
kept. Confined by the sandbox of tools.sandbox (the context's SandboxPolicy); where no
sandbox can be built the call is refused naming the cause, unless the operator allowed
running unconfined (then the answer says so). On timeout, or when the command exits, every
process it started dies, including those that left its session or process group. The binding's write permit is held
for the whole run, so a checkpoint requested meanwhile waits for the command.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time

from tools import messages as M
from tools import sandbox
from tools.binding import PermitError
from tools.context import ToolContext
from tools.result import ToolResult, error, ok

NAME = "Bash"
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


def run_bash(ctx: ToolContext, command: str,
             timeout: float = M.BASH_DEFAULT_TIMEOUT_S) -> ToolResult:
    """Run ``command``; the answer holds its output (capped), exit code and notes."""
    if not command.strip():
        return error(NAME, M.BASH_EMPTY, kind="empty")
    if not (0 < timeout <= M.BASH_MAX_TIMEOUT_S):
        return error(NAME, M.BASH_BAD_TIMEOUT.format(maximum=M.BASH_MAX_TIMEOUT_S,
                                                     value=timeout), kind="timeout_arg")
    root = ctx.root.real
    hidden = [os.path.realpath(h) for h in ctx.binding.hidden_paths()]
    cap = _Capture(M.BASH_OUTPUT_CAP)
    timed_out = False
    started = time.monotonic()
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(ctx.binding.write_permit())
        except PermitError as e:
            return error(NAME, M.PERMIT_FAILED.format(reason=e), kind="permit")
        try:
            run = sandbox.start_shell(ctx.sandbox, root, root, hidden, command,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      close_fds=True)
        except sandbox.SandboxUnavailable as e:
            return error(NAME, M.BASH_NO_SANDBOX.format(reason=e.reason), kind="sandbox")
        except OSError as e:
            return error(NAME, M.BASH_START_FAILED.format(reason=e.strerror or e),
                         kind="start")
        held.callback(run.close)
        proc, confined = run.proc, run.confined
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
    elapsed = time.monotonic() - started
    out = cap.text()
    parts = [out.rstrip("\n") if out else M.BASH_NO_OUTPUT]
    if timed_out:
        parts.append(M.BASH_TIMEOUT.format(seconds=timeout))
    elif code < 0:
        parts.append(M.BASH_KILLED.format(signal=-code))
    else:
        parts.append(M.BASH_EXIT.format(code=code))
    if not confined:
        parts.append(M.BASH_UNCONFINED)
    return ok(NAME, "\n".join(parts), exit_code=None if timed_out else code,
              timed_out=timed_out, confined=confined, output_bytes=cap.total,
              elapsed_s=round(elapsed, 3))
