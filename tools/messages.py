"""Every text the agent tools show a model, in one place.

These texts are part of the tools' interface: models read them and tests pin them (golden
tests in tests/test_tools_messages.py). Change one only on purpose, together with its test.
Templates use ``str.format`` fields; the field names are the contract of each template.
"""

from __future__ import annotations

# --- caps and defaults (CONTRACT 5) -------------------------------------------------------
READ_DEFAULT_LIMIT = 2000          # lines
READ_LINE_CHARS = 2000             # characters kept of one line
READ_MAX_BYTES = 100_000           # bytes of one answer's text (about 25,000 tokens)
READ_HASH_WHOLE_MAX = 16 * 1024 * 1024   # text files up to this size are hashed whole
READ_LONG_LINE_SCAN = 1024 * 1024  # bytes of one line scanned in a larger file
READ_IMAGE_MAX = 3_750_000         # bytes of an image returned (5 MB once base64-encoded)
GLOB_MAX_RESULTS = 500             # paths
GREP_HEAD_LIMIT = 200              # output lines (entries in files/count modes)
GREP_LINE_CHARS = 64 * 1024        # characters kept of one matched or context line
GREP_TIMEOUT_S = 30.0              # seconds
GREP_OUTPUT_CAP = 100_000          # bytes of one answer's text (about 25,000 tokens)
GREP_RAW_CAP = 32 * 1024 * 1024    # bytes of ripgrep output read before it is stopped
BASH_DEFAULT_TIMEOUT_S = 120       # seconds
BASH_MAX_TIMEOUT_S = 600           # seconds
BASH_OUTPUT_CAP = 32 * 1024        # bytes of combined stdout+stderr shown (head + tail)
EDIT_DIFF_MAX_LINES = 60           # lines of the diff shown after an edit
EDIT_LINES_LISTED = 20             # line numbers listed when ``old`` occurs several times

# --- rendering ----------------------------------------------------------------------------
ERROR_PREFIX = "error: "

# --- paths (containment) ------------------------------------------------------------------
PATH_ESCAPE = "{path}: outside the workspace root; use a path inside it"
PATH_NOT_FOUND = "{path}: no such file or directory"
PATH_NOT_DIR = "{path}: not a directory"
PATH_IS_DIR = "{path}: is a directory"
PATH_NOT_REGULAR = "{path}: not a regular file"
PATH_LOOP = "{path}: too many levels of symbolic links"
PATH_INVALID = "{path}: invalid path ({reason})"
PATH_TILDE = ("{path}: '~' is not expanded here (no home directory); use a path relative "
              "to the workspace root")
PATH_CHANGED = "{path}: changed while being opened; try again"
PATH_DENIED = ("{path}: permission denied: its owner and mode keep this user out (or the "
               "file system refuses it)")
PATH_TOO_LONG = "{path}: a name in it is too long (255 bytes at most per name)"
PATH_IO = ("{path}: input/output error: the file system could not read or write it (on a "
           "rewindfs mount, its daemon's log says why)")
PATH_DISCONNECTED = ("{path}: the file system is not connected: a FUSE mount whose daemon "
                     "is gone (unmount it, then mount again)")
PATH_OS_ERROR = "{path}: {reason}"
PATH_PROTECTED = ("{path}: permission denied (EACCES): protected by the session's path policy; "
                  "the agent may read it but not change it")

# --- ReadFile -----------------------------------------------------------------------------
READ_LINE_CUT = " [... line cut at {chars} characters]"
READ_MORE = "[lines {first}-{last} of {total}; continue with offset={next}]"
READ_EMPTY = "{path}: empty file"
READ_PAST_END = "{path}: offset {offset} is past the end of the file ({total} lines)"
READ_BINARY = "{path}: binary file ({size} bytes); not shown"
READ_IMAGE = "{path}: {kind} image ({size} bytes), attached"
READ_IMAGE_TOO_LARGE = ("{path}: {kind} image of {size} bytes, larger than the {cap} bytes an "
                        "answer can carry; not shown")
READ_CAPPED = ("[lines {first}-{last} of {total}; the answer is capped at {cap} bytes; "
               "continue with offset={next}]")
READ_MORE_OPEN = "[lines {first}-{last}; the file goes on; continue with offset={next}]"
READ_CAPPED_OPEN = ("[lines {first}-{last}; the answer is capped at {cap} bytes and the file "
                    "goes on; continue with offset={next}]")
READ_LONG_LINE = ("{path}: line {line} is longer than {scan} bytes; the file cannot be "
                  "shown past it (use Grep or Bash to look inside)")
READ_BAD_ARGS = "offset must be >= 1 and limit >= 1 (got offset={offset}, limit={limit})"

# --- WriteFile / EditFile freshness -------------------------------------------------------
STALE_NOT_READ = "{path}: exists but has not been read; read it with ReadFile before changing it"
STALE_CHANGED = ("{path}: changed since it was last read; read it again with ReadFile "
                 "before changing it")
STALE_CREATED = ("{path}: was created by someone else meanwhile; read it with ReadFile "
                 "before changing it")
WRITE_CREATED = "created {path} ({lines} lines, {size} bytes)"
WRITE_UPDATED = "wrote {path} ({lines} lines, {size} bytes)"
WRITE_CRLF_KEPT = "[CRLF line breaks kept, as in the file before]"

# --- EditFile -----------------------------------------------------------------------------
EDIT_SAME = "old and new are identical; nothing to change"
EDIT_EMPTY_OLD = "old must not be empty; use WriteFile to create or replace a whole file"
EDIT_NOT_TEXT = "{path}: not UTF-8 text; cannot edit it"
EDIT_NO_MATCH = "{path}: old text not found. Closest lines:\n{closest}"
EDIT_NO_MATCH_NONE = "{path}: old text not found, and no line resembles its first line"
EDIT_CLOSEST_LINE = "{number:>6}\t{text}"
EDIT_MULTIPLE = ("{path}: old text occurs {count} times (lines {lines}); include more "
                 "context to make it unique, or set replace_all")
EDIT_LINES_MORE = " and {more} more"
EDIT_DONE = "edited {path}: {count} replacement{s}"
EDIT_DIFF_CUT = "[... diff cut: {omitted} more lines]"

# --- Glob ---------------------------------------------------------------------------------
GLOB_NONE = "no files match {pattern!r} under {path}"
GLOB_CAPPED = "[showing the newest {shown} of {total} matches; narrow the pattern or path]"
GLOB_BAD_PATTERN = "invalid glob pattern {pattern!r}: {reason}"

# --- Grep ---------------------------------------------------------------------------------
GREP_NONE = "no matches for {pattern!r} under {path}"
GREP_CAPPED = ("[showing {shown} of {total} {unit}; narrow the search, raise head_limit, "
               "or continue with offset={next}]")
GREP_BYTES_CAPPED = ("[showing {shown} of {total} {unit}: the answer is capped at {cap} bytes; "
                     "narrow the search or continue with offset={next}]")
GREP_PAST_OFFSET = "offset {offset} is past the end of the answer ({total} entries)"
GREP_RAW_STOPPED = ("[search stopped after {cap} bytes of matches; results are incomplete: "
                    "narrow the search]")
GREP_NO_RG = ("ripgrep (rg) is not installed: Grep needs it (scripts/setup.sh installs the "
              "Debian package ripgrep)")
GREP_NEEDS_MULTILINE = ("pattern {pattern!r} matches a line break: set multiline to true "
                        "to let matches span lines")
GREP_BAD_TYPE = "unknown file type {type!r}: {reason}"
GREP_TIMEOUT = "[search stopped after {seconds:g} s; results are incomplete]"
GREP_LINE_CUT = " [... line cut at {chars} characters]"
GREP_BAD_PATTERN = "invalid regular expression {pattern!r}: {reason}"
GREP_BAD_MODE = ("output_mode must be one of files_with_matches, content, count "
                 "(got {mode!r})")
GREP_BAD_NUMBER = "{name} must be >= {minimum} (got {value})"
GREP_FAILED = "search failed: {reason}"

# --- Bash ---------------------------------------------------------------------------------
BASH_EXIT = "[exit code: {code}]"
BASH_KILLED = "[killed by signal {signal}]"
BASH_TIMEOUT = ("[timed out after {seconds:g} s: the command and every process it started "
                "were killed]")
BASH_COVER_STOPPED = ("[stopped: {path} was removed, replaced or linked outside the sandbox "
                      "while the command ran; the session's path policy covers it, so the "
                      "command and every process it started were killed before the change "
                      "(they never saw what is there now). Run it again to see the path as "
                      "it is now]")
BASH_COVER_CHANGED = ("{path} was removed or replaced while the command started; the "
                      "session's path policy could not be applied; nothing ran")
BASH_OMITTED = "\n[... {omitted} bytes of output omitted ...]\n"
BASH_NO_OUTPUT = "(no output)"
BASH_UNCONFINED = ("[note: ran unconfined (no sandbox available here): the command could "
                   "read and write outside the workspace]")
BASH_POLICY_UNENFORCED = ("[note: unconfined, so the session's hidden and protected paths "
                          "were not enforced for this command]")
BASH_NO_SANDBOX = ("refused: no sandbox can be built here ({reason}); the operator may run "
                   "`rewindfs mcp` with --unsafe-no-sandbox to allow unconfined commands")
BASH_NO_NETWORK = ("refused: the sandbox's network cannot be set up here ({reason}); the "
                   "operator may fix that (`rewindfs doctor` says how) or run `rewindfs mcp` "
                   "without --network")
BASH_BAD_TIMEOUT = "timeout must be between 1 and {maximum} seconds (got {value})"
BASH_EMPTY = "command must not be empty"
BASH_START_FAILED = "could not start the command: {reason}"
BASH_CWD_GONE = ("[note: the working directory {cwd} no longer exists; the command ran in the "
                 "workspace root]")
BASH_CWD_OUTSIDE = ("[note: the command ended in {cwd}, outside the workspace; the next command "
                    "starts in the workspace root]")
BASH_STARTED = ("started {id} in the background; read its output with BashOutput(bash_id="
                "\"{id}\"), stop it with KillShell(shell_id=\"{id}\")")
BASH_TOO_MANY_JOBS = ("{maximum} background commands are running already; stop one with "
                      "KillShell first")
BASH_JOB_UNKNOWN = "no background command {id!r} (known: {ids})"
BASH_JOB_RUNNING = "[still running]"
BASH_JOB_KILLED = "[stopped by KillShell]"
BASH_JOB_DROPPED = "[... {dropped} bytes of earlier output were dropped (buffer full) ...]"
BASH_NO_NEW_OUTPUT = "(no new output)"
BASH_BAD_WAIT = "wait must be between 0 and {maximum} seconds (got {value})"
BASH_BAD_FILTER = "invalid filter {filter!r}: {reason}"
BASH_JOB_STOPPED = "stopped {id} and every process it started"
BASH_JOB_ALREADY_DONE = "{id} had already ended: {status}"

# --- arguments (tools.arguments) ---------------------------------------------------------
ARG_ALIAS = "Alias of `{name}`."
ARG_UNKNOWN = "{tool} does not take {names}; it accepts: {accepted}"
ARG_UNKNOWN_TOOL = "no tool named {tool!r}; the tools are: {tools}"
ARG_BAD_TYPE = "{name} must be of type {type} (got {got})"
ARG_BAD_ENUM = "{name} must be one of {allowed} (got {value!r})"
ARG_TWICE = "{first} and {second} name the same argument with different values"
ARG_MISSING = "{tool} needs {names}"

# --- session calls (checkpoint, log, diff, restore) ---------------------------------------
SESSION_FAILED = "{call} failed: {reason}"
PERMIT_FAILED = "the workspace cannot be changed now: {reason}"
SESSION_CHECKPOINTED = "checkpointed the workspace as {ref}"
SESSION_CHECKPOINTED_LABEL = "checkpointed the workspace as {ref} (label {label!r})"
SESSION_RESTORED = "restored the workspace to {ref}"
SESSION_RESTORED_UNDO = ("restored the workspace to {ref}; the state before was checkpointed "
                         "as {pre} (restore that ref to undo)")
SESSION_LOG_CHECKPOINT = "{seq:>4}  {time}  checkpoint ({trigger})  {ref}"
SESSION_LOG_LABEL = "  {label!r}"
SESSION_LOG_RESTORE = "{seq:>4}  {time}  restored to  {ref}"
SESSION_LOG_EMPTY = "the session has no history yet"
SESSION_LOG_STEP = "{seq:>4}  {time}  step {step} ({count} path{s}){label}"
STEP_LABEL_MAX = 200  # characters of a tool call kept as its step's label
STEPS_SHOWN = 20  # steps the changes tool lists without a step number
STEPS_NONE = "no steps recorded yet (a session without FUSE records none)"
STEP_HEAD = "step {step}{label}: {count} changed path{s}"
STEP_NOT_FOUND = "the session has no step {step} (it has {count})"
SESSION_DIFF_LIVE = "the live workspace"
SESSION_DIFF_HEAD = "{count} changed path{s} from {a} to {b}:"
SESSION_DIFF_LINE = "{status:<12} {path}"
SESSION_DIFF_NONE = "no changes from {a} to {b}"
SESSION_DIFF_MAX = 500
SESSION_DIFF_CAPPED = "[showing the first {shown} of {total} changed paths]"

# --- tool descriptions (what an MCP client shows the model) ---------------------------------
SERVER_INSTRUCTIONS = ("Tools bound to one workspace. Paths are relative to the workspace "
                       "root (absolute paths must lie inside it). Read a file before you "
                       "change it.")
DESCRIBE_READFILE = ("Read a text file: numbered lines (cat -n style) from `offset` (1-based), "
                     "at most `limit` lines (default 2000) and 100,000 bytes, long lines cut "
                     "at 2000 characters, with the offset to continue from. PNG, JPEG, GIF "
                     "and WebP images are returned as images; other binary files are not "
                     "shown. A file must be read before WriteFile or EditFile may change it.")
DESCRIBE_WRITEFILE = ("Create a file, or replace a whole file that you have read and that has "
                      "not changed since. Parent directories are created; mode, owner, "
                      "extended attributes, hard links and CRLF line breaks are kept.")
DESCRIBE_EDITFILE = ("Replace the exact text `old` by `new` in a file you have read. `old` "
                     "must occur exactly once unless `replace_all` is set. In a CRLF file, "
                     "LF line breaks in `old` and `new` stand for CRLF. Answers with a "
                     "short diff.")
DESCRIBE_GLOB = ("List files whose path matches a glob (`**` for any number of directories, "
                 "`{a,b}` alternatives) under `path`, newest first, at most 500. Files that "
                 ".gitignore/.ignore exclude are left out unless `include_ignored`.")
DESCRIBE_GREP = ("Search file contents with ripgrep under `path` (a directory or a file). "
                 "output_mode: files_with_matches (default), content (lines, with "
                 "`before`/`after`/`context` lines), or count. `glob` (e.g. `*.py`, "
                 "`!tests/**`) and `type` (e.g. `py`) filter files; `multiline` lets a "
                 "match span lines. .gitignore is honoured and binary files are skipped; "
                 "`offset` lines are skipped, then at most `head_limit` lines and 100,000 "
                 "bytes are shown.")
DESCRIBE_BASH = ("Run a bash command and return its output (stdout and stderr, 32 KiB kept: "
                 "head and tail) and exit code. The working directory persists between "
                 "calls (it starts at the workspace root). `timeout` in seconds (default "
                 "120, at most 600); every process the command started is killed when it "
                 "ends or times out. `run_in_background` starts it and answers at once "
                 "with an id for BashOutput and KillShell.")
DESCRIBE_BASH_OUTPUT = ("Read the output a background command (started by Bash with "
                        "`run_in_background`) wrote since the last read, and whether it is "
                        "still running or its exit code.")
DESCRIBE_KILL_SHELL = "Stop a background command and every process it started."
DESCRIBE_CHECKPOINT = ("Checkpoint the workspace, with an optional `label`; answers with the "
                       "new snapshot's ref.")
DESCRIBE_LOG = "Show the workspace's history of checkpoints and restores."
DESCRIBE_DIFF = ("List paths added, removed or modified between two refs (default: the last "
                 "checkpoint and the live workspace).")
DESCRIBE_CHANGES = ("List the paths each step (each WriteFile, EditFile or Bash call) added, "
                    "removed or modified; with step=N only that step's.")
REF_FORMS = ("A full ref (v1:blake3:...), a unique prefix of at least 8 hex digits, @label "
             "(the newest checkpoint with that label) or @-N (the Nth checkpoint back).")
DESCRIBE_RESTORE = "Restore the workspace to a ref (the current state is checkpointed first)."
