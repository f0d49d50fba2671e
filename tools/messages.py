"""Every text the agent tools show a model, in one place.

These texts are part of the tools' interface: models read them and tests pin them (golden
tests in tests/test_tools_messages.py). Change one only on purpose, together with its test.
Templates use ``str.format`` fields; the field names are the contract of each template.
"""

from __future__ import annotations

# --- caps and defaults (CONTRACT 5) -------------------------------------------------------
READ_DEFAULT_LIMIT = 2000          # lines
READ_LINE_CHARS = 2000             # characters kept of one line
GLOB_MAX_RESULTS = 500             # paths
GREP_HEAD_LIMIT = 200              # output lines (entries in files/count modes)
GREP_LINE_CHARS = 64 * 1024        # characters kept of one matched or context line
GREP_TIMEOUT_S = 30.0              # seconds
BASH_DEFAULT_TIMEOUT_S = 120       # seconds
BASH_MAX_TIMEOUT_S = 600           # seconds
BASH_OUTPUT_CAP = 32 * 1024        # bytes of combined stdout+stderr shown (head + tail)
EDIT_DIFF_MAX_LINES = 60           # lines of the diff shown after an edit

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
PATH_CHANGED = "{path}: changed while being opened; try again"
PATH_OS_ERROR = "{path}: {reason}"

# --- ReadFile -----------------------------------------------------------------------------
READ_LINE_CUT = " [... line cut at {chars} characters]"
READ_MORE = "[lines {first}-{last} of {total}; continue with offset={next}]"
READ_EMPTY = "{path}: empty file"
READ_PAST_END = "{path}: offset {offset} is past the end of the file ({total} lines)"
READ_BINARY = "{path}: binary file ({size} bytes); not shown"
READ_BAD_ARGS = "offset must be >= 1 and limit >= 1 (got offset={offset}, limit={limit})"

# --- WriteFile / EditFile freshness -------------------------------------------------------
STALE_NOT_READ = "{path}: exists but has not been read; read it with ReadFile before changing it"
STALE_CHANGED = ("{path}: changed since it was last read; read it again with ReadFile "
                 "before changing it")
STALE_CREATED = ("{path}: was created by someone else meanwhile; read it with ReadFile "
                 "before changing it")
WRITE_CREATED = "created {path} ({lines} lines, {size} bytes)"
WRITE_UPDATED = "wrote {path} ({lines} lines, {size} bytes)"

# --- EditFile -----------------------------------------------------------------------------
EDIT_SAME = "old and new are identical; nothing to change"
EDIT_EMPTY_OLD = "old must not be empty; use WriteFile to create or replace a whole file"
EDIT_NOT_TEXT = "{path}: not UTF-8 text; cannot edit it"
EDIT_NO_MATCH = "{path}: old text not found. Closest lines:\n{closest}"
EDIT_NO_MATCH_NONE = "{path}: old text not found, and no line resembles its first line"
EDIT_CLOSEST_LINE = "{number:>6}\t{text}"
EDIT_MULTIPLE = ("{path}: old text occurs {count} times (lines {lines}); include more "
                 "context to make it unique, or set replace_all")
EDIT_DONE = "edited {path}: {count} replacement{s}"
EDIT_DIFF_CUT = "[... diff cut: {omitted} more lines]"

# --- Glob ---------------------------------------------------------------------------------
GLOB_NONE = "no files match {pattern!r} under {path}"
GLOB_CAPPED = "[showing the newest {shown} of {total} matches; narrow the pattern or path]"
GLOB_BAD_PATTERN = "invalid glob pattern {pattern!r}: {reason}"

# --- Grep ---------------------------------------------------------------------------------
GREP_NONE = "no matches for {pattern!r} under {path}"
GREP_CAPPED = ("[showing {shown} of {total} {unit}; narrow the search or raise head_limit]")
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
BASH_OMITTED = "\n[... {omitted} bytes of output omitted ...]\n"
BASH_NO_OUTPUT = "(no output)"
BASH_UNCONFINED = ("[note: ran unconfined (no sandbox available here): the command could "
                   "read and write outside the workspace]")
BASH_NO_SANDBOX = ("refused: no sandbox can be built here ({reason}); the operator may run "
                   "`rewindfs mcp` with --unsafe-no-sandbox to allow unconfined commands")
BASH_BAD_TIMEOUT = "timeout must be between 1 and {maximum} seconds (got {value})"
BASH_EMPTY = "command must not be empty"
BASH_START_FAILED = "could not start the command: {reason}"

# --- session calls (checkpoint, log, diff, restore) ---------------------------------------
SESSION_FAILED = "{call} failed: {reason}"
PERMIT_FAILED = "the workspace cannot be changed now: {reason}"
SESSION_CHECKPOINTED = "checkpointed the workspace as {ref}"
SESSION_LABEL_NOT_KEPT = ("[note: the session keeps no labels; refer to this checkpoint by "
                          "its ref]")
SESSION_RESTORED = "restored the workspace to {ref}"
SESSION_RESTORED_UNDO = ("restored the workspace to {ref}; the state before was checkpointed "
                         "as {pre} (restore that ref to undo)")
SESSION_LOG_CHECKPOINT = "{seq:>4}  {time}  checkpoint ({trigger})  {ref}"
SESSION_LOG_RESTORE = "{seq:>4}  {time}  restored to  {ref}"
SESSION_LOG_EMPTY = "the session has no history yet"
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
                     "at most `limit` lines (default 2000), long lines cut at 2000 characters. "
                     "A file must be read before WriteFile or EditFile may change it.")
DESCRIBE_WRITEFILE = ("Create a file, or replace a whole file that you have read and that has "
                      "not changed since. Parent directories are created; the mode is kept.")
DESCRIBE_EDITFILE = ("Replace the exact text `old` by `new` in a file you have read. `old` "
                     "must occur exactly once unless `replace_all` is set. Answers with a "
                     "short diff.")
DESCRIBE_GLOB = ("List files whose path matches a glob (`**` for any number of directories, "
                 "`{a,b}` alternatives) under `path`, newest first, at most 500.")
DESCRIBE_GREP = ("Search file contents for a regular expression under `path` (a directory "
                 "or a file). output_mode: files_with_matches (default), content (lines, "
                 "with `before`/`after`/`context` lines), or count. `glob` filters files "
                 "(e.g. `*.py`, `!tests/**`). .gitignore is honoured; at most `head_limit` "
                 "lines are shown.")
DESCRIBE_BASH = ("Run a bash command in the workspace root and return its output (stdout and "
                 "stderr, 32 KiB kept: head and tail) and exit code. `timeout` in seconds "
                 "(default 120, at most 600); every process the command started is killed "
                 "when it ends or times out.")
DESCRIBE_CHECKPOINT = "Checkpoint the workspace; answers with the new snapshot's ref."
DESCRIBE_LOG = "Show the workspace's history of checkpoints and restores."
DESCRIBE_DIFF = ("List paths added, removed or modified between two refs (default: the last "
                 "checkpoint and the live workspace).")
DESCRIBE_RESTORE = "Restore the workspace to a ref (the current state is checkpointed first)."
