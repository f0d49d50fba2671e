"""Path policies (hide, protect) in the agent tools and the Bash sandbox, on a directory.

The session-level tests (spec recorded for resume, ``.rewindfs.toml``, the mount showing a
hidden file to the user) are in tests/test_path_policy_session.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from store.pathpolicy import PathPolicy, PathPolicyError, parse_policy_file
from tools import sandbox
from tools.bash import run_bash
from tools.binding import DirBinding
from tools.context import ToolContext
from tools.editfile import edit_file
from tools.glob import glob
from tools.grep import grep
from tools.readfile import read_file
from tools.writefile import write_file

HAS_BWRAP = sandbox.unavailable_reason() is None
needs_sandbox = pytest.mark.skipif(not HAS_BWRAP, reason="no bubblewrap sandbox here")
SECRET = "TOKEN=hunter2-secret"


@pytest.fixture(params=["in-sandbox", "bwrap-binds"])
def cover_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the sandbox makes the policy's covers: in the sandbox's mount namespace
    once bwrap has built it, before the command runs (where the kernel allows it), and
    bwrap's own binds (``REWINDFS_BWRAP_COVERS=1``, and wherever the first cannot be
    made)."""
    mode = str(request.param)
    if mode == "in-sandbox" and not sandbox.covers_in_sandbox():
        pytest.skip("covers cannot be made in the sandbox here")
    monkeypatch.setenv("REWINDFS_BWRAP_COVERS", "1" if mode == "bwrap-binds" else "0")
    return mode


@pytest.fixture
def ws(tmp_path: Path) -> ToolContext:
    root = tmp_path / "root"
    (root / "secrets").mkdir(parents=True)
    (root / "src").mkdir()
    (root / "vault").mkdir()
    (root / ".env").write_text(SECRET + "\n")
    (root / "src" / ".env").write_text(SECRET + "\n")
    (root / "vault" / "key.txt").write_text(SECRET + "\n")
    (root / "secrets" / "prod.txt").write_text("prod credentials\n")
    (root / "src" / "main.py").write_text("print('hello')  # TOKEN here too\n")
    (root / "link-to-env").symlink_to(".env")
    policy = PathPolicy(hide=(".env", "vault/"), protect=("secrets/**", "/README"))
    (root / "README").write_text("read me\n")
    return ToolContext(DirBinding(root, policy=policy))


def test_patterns_follow_gitignore() -> None:
    p = PathPolicy(hide=(".env", "build/"), protect=("/top.txt", "docs/**/*.md"),
                   exclude=("node_modules/", "*.pyc", "!keep.pyc"))
    assert p.hides(".env") and p.hides("a/b/.env") and p.hides(".env/inner")
    assert p.hides("build", is_dir=True) and p.hides("build/x.o")
    assert not p.hides("build")                # a file named build: dir-only pattern
    assert p.protects("top.txt") and not p.protects("sub/top.txt")
    assert p.protects("docs/a/b/c.md") and not p.protects("docs/a/b/c.txt")
    assert p.excludes("x/node_modules/pkg/index.js") and p.excludes("m/a.pyc")
    assert not p.excludes("keep.pyc")
    assert not p.hides(".") and not p.hides("")


def test_policy_file_and_bad_input() -> None:
    p = parse_policy_file(b'[policy]\nhide = [".env"]\nprotect = ["secrets/**"]\n'
                          b'exclude = ["node_modules/"]\n[other]\nx = 1\n')
    assert (p.hide, p.protect, p.exclude) == ((".env",), ("secrets/**",), ("node_modules/",))
    with pytest.raises(PathPolicyError, match="not valid TOML"):
        parse_policy_file(b"[policy\n")
    with pytest.raises(PathPolicyError, match="hide is not a list of strings"):
        parse_policy_file(b'[policy]\nhide = ".env"\n')
    with pytest.raises(PathPolicyError, match="unknown key 'hidden'"):
        PathPolicy.from_spec({"hidden": [".env"]})
    with pytest.raises(PathPolicyError, match="not a non-empty line"):
        PathPolicy(protect=("",))


def test_hidden_is_absent_for_the_file_tools(ws: ToolContext) -> None:
    for path in (".env", "src/.env", "vault/key.txt", "vault", "link-to-env",
                 "src/../.env", str(Path(ws.root.path) / ".env")):
        r = read_file(ws, path)
        assert not r.ok and "no such file or directory" in r.text, (path, r.text)
        assert SECRET not in r.text
    assert read_file(ws, "src/main.py").ok
    found = glob(ws, "**/*")
    assert found.data["paths"], found.text
    assert not [p for p in found.data["paths"] if ".env" in p or p.startswith("vault")]
    assert "src/main.py" in found.data["paths"]
    r = glob(ws, "*", path="vault")
    assert not r.ok and "no such file" in r.text
    g = grep(ws, "TOKEN", output_mode="content")
    assert "src/main.py" in g.text and SECRET not in g.text, g.text
    assert not grep(ws, "TOKEN", path=".env").ok
    # Writing a hidden path is refused the same way: the agent cannot plant or probe one.
    w = write_file(ws, "vault/new.txt", "x")
    assert not w.ok and "no such file" in w.text
    assert not (Path(ws.root.path) / "vault" / "new.txt").exists()


def test_protected_refuses_tool_changes(ws: ToolContext) -> None:
    root = Path(ws.root.path)
    assert read_file(ws, "secrets/prod.txt").ok      # readable
    for path in ("secrets/prod.txt", "secrets/new.txt", "secrets/deep/new.txt", "README"):
        r = write_file(ws, path, "overwritten\n")
        assert not r.ok and r.data["kind"] == "protected", (path, r.text)
        assert "EACCES" in r.text and "protected" in r.text
    e = edit_file(ws, "secrets/prod.txt", "prod", "test")
    assert not e.ok and e.data["kind"] == "protected"
    assert (root / "secrets" / "prod.txt").read_text() == "prod credentials\n"
    assert not (root / "secrets" / "new.txt").exists()
    assert not (root / "secrets" / "deep").exists()
    assert (root / "README").read_text() == "read me\n"
    # Elsewhere the tools write as usual.
    assert write_file(ws, "src/new.py", "x = 1\n").ok


@needs_sandbox
def test_hidden_and_protected_inside_bash(ws: ToolContext, cover_mode: str) -> None:
    root = Path(ws.root.path)
    r = run_bash(ws, "cat .env; echo rc=$?; cat src/.env; echo rc=$?; cat vault/key.txt; "
                     "echo rc=$?; cat link-to-env; echo rc=$?; grep -r hunter2 . ; "
                     "echo grep=$?; cat src/main.py")
    assert SECRET not in r.text and "hunter2" not in r.text, r.text
    assert r.text.count("rc=1") == 4, r.text
    assert "print('hello')" in r.text
    w = run_bash(ws, "echo x > secrets/prod.txt; echo a=$?; echo x > secrets/new.txt; "
                     "echo b=$?; rm -f secrets/prod.txt; echo c=$?; echo x >> README; "
                     "echo d=$?; echo ok > src/out.txt; echo e=$?")
    for k in "abcd":
        assert f"{k}=0" not in w.text, w.text
    assert "e=0" in w.text and "Read-only file system" in w.text
    assert (root / "secrets" / "prod.txt").read_text() == "prod credentials\n"
    assert (root / "README").read_text() == "read me\n"
    assert (root / "src" / "out.txt").read_text() == "ok\n"
    # The user still has every file; nothing of the masks is left behind.
    assert (root / ".env").read_text() == SECRET + "\n"
    assert sorted(os.listdir(root / "vault")) == ["key.txt"]


@needs_sandbox
def test_paths_matching_at_call_start(ws: ToolContext, cover_mode: str) -> None:
    """A hidden or protected path that appears after one call (made by the user, or by
    that call's command) is covered in the next."""
    root = Path(ws.root.path)
    first = run_bash(ws, "mkdir -p src/made && echo " + SECRET + " > src/made/.env; "
                         "cat src/made/.env")
    assert SECRET in first.text, first.text     # not covered while the call that made it runs
    (root / "src" / "late").mkdir()
    (root / "src" / "late" / ".env").write_text(SECRET)
    (root / "secrets" / "late.txt").write_text("late\n")
    r = run_bash(ws, "cat src/late/.env; echo a=$?; cat src/made/.env; echo b=$?; "
                     "echo x > secrets/late.txt; echo c=$?; cat secrets/late.txt")
    assert SECRET not in r.text and "late" in r.text, r.text
    for k in "abc":
        assert f"{k}=0" not in r.text, r.text
    assert (root / "secrets" / "late.txt").read_text() == "late\n"


# Inside the sandbox: umount2, a read-write remount and a move of a cover, by system call.
_UNMOUNT_BY_SYSCALL = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for name, call in (("umount2", lambda p: libc.umount2(p, 2)),
                   ("remount", lambda p: libc.mount(None, p, None, 0x20 | 0x1000, None)),
                   ("open_tree", lambda p: libc.syscall(428, -100, p, 1, 0, 0))):
    for path in sys.argv[1:]:
        rc = call(path.encode())
        print(name, path, rc, os.strerror(ctypes.get_errno()) if rc < 0 else "done")
"""


@needs_sandbox
def test_a_command_cannot_remove_a_cover_by_system_call(tmp_path: Path, cover_mode: str
                                                         ) -> None:
    """Root inside the sandbox calling umount2, mount (a read-write remount) or open_tree
    on a cover directly fails with EPERM, and the covers stay."""
    root = tmp_path / "root"
    (root / "conf").mkdir(parents=True)
    (root / ".env").write_text(SECRET + "\n")
    (root / "conf" / "app.toml").write_text("x = 1\n")
    ws = ToolContext(DirBinding(root, policy=PathPolicy(hide=(".env",), protect=("conf/",))))
    (root / "prog.py").write_text(_UNMOUNT_BY_SYSCALL)
    b = run_bash(ws, f"python3 prog.py {root}/.env {root}/conf; cat .env; echo a=$?; "
                     "echo y > conf/app.toml; echo b=$?")
    if "python3: command not found" in b.text:
        pytest.skip("no python3 inside the sandbox")
    assert b.text.count("Operation not permitted") == 6 and "done" not in b.text, b.text
    assert SECRET not in b.text and "a=0" not in b.text and "b=0" not in b.text, b.text
    assert (root / "conf" / "app.toml").read_text() == "x = 1\n"


@pytest.mark.parametrize("patterns", [
    (".env", "build/", "/top.txt", "docs/**/*.md", "secrets/**", "*.py[co]", "a/**/b",
     "node_modules/", "# a comment", "sp\\ ace", "[!x]y.txt", "?.log"),
    ("*.txt", "!keep.txt", "dir/", "!dir/keep/"),
])
def test_walk_matcher_agrees_with_gitignore_spec(patterns: tuple[str, ...]) -> None:
    """The one-regex matcher the Bash walk uses decides every path as pathspec's
    GitIgnoreSpec does (a disagreement would leave a hidden path visible in Bash)."""
    import pathspec

    spec = pathspec.GitIgnoreSpec.from_lines(patterns)
    test = PathPolicy(hide=patterns).matcher("hide")
    assert test is not None
    paths = [".env", "a/.env", "x/.env/y", ".envx", "build", "build/", "build/x.o",
             "a/build/x", "top.txt", "x/top.txt", "docs/b.md", "docs/a/b/c.md", "docs/x.txt",
             "secrets/", "secrets/a/b", "secrets", "m.pyc", "m.pyo", "m.py", "a/b", "a/b/",
             "a/x/y/b", "node_modules/", "q/node_modules/z.js", "sp ace", "xy.txt", "zy.txt",
             "a.log", "ab.log", "keep.txt", "other.txt", "dir/", "dir/a", "dir/keep/",
             "dir/keep/f"]
    for p in paths:
        assert test(p) == bool(spec.match_file(p)), p


def test_seed_policy_from_a_directory_and_from_a_ref(tmp_path: Path) -> None:
    from store.objects import Store
    from store.pathpolicy import seed_policy
    from store.snapshot import snapshot

    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / ".rewindfs.toml").write_text('[policy]\nhide = [".env"]\n')
    store = Store(tmp_path / "store")
    ref = str(snapshot(store, seed))
    for got in (seed_policy(None, str(seed)), seed_policy(store, ref)):
        assert got.hide == (".env",)
        assert got.protects(".rewindfs.toml")       # the file that set it is protected
    (seed / ".rewindfs.toml").unlink()
    assert seed_policy(None, str(seed)).empty
    assert seed_policy(store, str(snapshot(store, seed))).empty


def _policy_ws(tmp_path: Path) -> tuple[Path, ToolContext]:
    """A root whose hidden and protected files sit below directories a command can
    rename; the patterns name the paths, not the names alone."""
    root = tmp_path / "root"
    (root / "secretsdir").mkdir(parents=True)
    (root / "conf").mkdir()
    (root / "secretsdir" / ".env").write_text(SECRET + "\n")
    (root / "conf" / "app.lock").write_text("locked\n")
    (root / "src").mkdir()
    (root / "src" / "main.py").write_text("print('hello')\n")
    policy = PathPolicy(hide=("secretsdir/.env",), protect=("conf/app.lock",))
    return root, ToolContext(DirBinding(root, policy=policy))


@needs_sandbox
def test_a_renamed_parent_keeps_hidden_and_protected_paths_covered(tmp_path: Path,
                                                                    cover_mode: str) -> None:
    """``mv secretsdir x`` in one call, ``cat x/.env`` in the next: the file is the same
    object under another name and stays hidden (and a protected one protected), for Bash
    and for the file tools."""
    root, ws = _policy_ws(tmp_path)
    r = run_bash(ws, "mv secretsdir x && mv conf c2 && echo moved")
    assert "moved" in r.text, r.text
    assert (root / "x" / ".env").read_text() == SECRET + "\n"   # the user's view
    b = run_bash(ws, "cat x/.env; echo rc=$?; grep -r hunter2 .; echo grep=$?; "
                     "echo pwned >> c2/app.lock; echo w=$?; cat src/main.py")
    assert SECRET not in b.text and "hunter2" not in b.text, b.text
    assert "rc=1" in b.text and "w=0" not in b.text, b.text
    assert "print('hello')" in b.text
    assert (root / "c2" / "app.lock").read_text() == "locked\n"
    r2 = read_file(ws, "x/.env")
    assert not r2.ok and SECRET not in r2.text
    assert "x/.env" not in glob(ws, "**/*", path=".").data.get("paths", [])
    assert SECRET not in grep(ws, "hunter2", output_mode="content").text
    w = write_file(ws, "c2/app.lock", "pwned\n")
    assert not w.ok and w.data["kind"] == "protected", w.text
    # Renaming it back changes nothing either.
    run_bash(ws, "mv x secretsdir")
    assert SECRET not in run_bash(ws, "cat secretsdir/.env").text


@needs_sandbox
def test_hard_links_to_covered_files_are_covered(tmp_path: Path, cover_mode: str) -> None:
    """A hard link to a hidden or protected file, wherever it is and whenever it was made,
    is covered like the file; inside the sandbox none can be made (EXDEV)."""
    root, ws = _policy_ws(tmp_path)
    os.link(root / "secretsdir" / ".env", root / "src" / "notes.txt")  # made before
    os.link(root / "conf" / "app.lock", root / "alias.lock")
    b = run_bash(ws, "cat src/notes.txt; echo rc=$?; echo pwned >> alias.lock; echo w=$?; "
                     "ln secretsdir/.env src/again; echo ln1=$?; ln conf/app.lock a2; "
                     "echo ln2=$?")
    assert SECRET not in b.text, b.text
    for k in ("rc", "w", "ln1", "ln2"):
        assert f"{k}=0" not in b.text, b.text
    assert not (root / "src" / "again").exists() and not (root / "a2").exists()
    assert (root / "conf" / "app.lock").read_text() == "locked\n"
    r = read_file(ws, "src/notes.txt")
    assert not r.ok and SECRET not in r.text
    assert SECRET not in grep(ws, "hunter2", output_mode="content").text
    w = write_file(ws, "alias.lock", "pwned\n")
    assert not w.ok and w.data["kind"] == "protected", w.text
    # A link made after the last scan: the tools look again before answering.
    os.link(root / "secretsdir" / ".env", root / "late.txt")
    r = read_file(ws, "late.txt")
    assert not r.ok and SECRET not in r.text, r.text
    assert "alias.lock" in glob(ws, "*", path=".").data.get("paths", [])  # seen, not hidden


@needs_sandbox
def test_a_kept_listing_is_read_again_when_its_directory_changes(tmp_path: Path) -> None:
    """The walk keeps a directory's listing between calls (once it is a second old) and
    lists it again when an entry is created, removed or renamed in it."""
    import time

    root, ws = _policy_ws(tmp_path)
    time.sleep(1.2)  # the directories' last change is then old enough for their listing
    run_bash(ws, "true")
    assert "secretsdir" in getattr(ws.root.scans, "dirs", {})   # kept
    (root / "src" / "secretsdir").mkdir()  # not a match (the pattern is anchored)
    os.rename(root / "secretsdir" / ".env", root / "secretsdir" / "was-env")
    (root / "secretsdir" / ".env").write_text("a new secret\n")
    b = run_bash(ws, "cat secretsdir/.env; echo rc=$?; cat secretsdir/was-env")
    assert "a new secret" not in b.text and "rc=1" in b.text, b.text
    assert SECRET not in b.text, b.text   # the first .env, renamed, is still itself


@needs_sandbox
def test_covers_inside_a_protected_directory(tmp_path: Path, cover_mode: str) -> None:
    """A hidden file and a hidden directory inside a protected directory stay hidden (the
    protected directory's read-only view holds their covers), a hidden directory takes no
    file, and root inside the sandbox can neither unmount a cover nor make one writable."""
    root = tmp_path / "root"
    (root / "conf" / "keys").mkdir(parents=True)
    (root / "conf" / ".env").write_text(SECRET + "\n")
    (root / "conf" / "keys" / "id").write_text(SECRET + "\n")
    (root / "conf" / "app.toml").write_text("x = 1\n")
    ws = ToolContext(DirBinding(root, policy=PathPolicy(hide=(".env", "keys/"),
                                                        protect=("conf/",))))
    b = run_bash(ws, "cat conf/.env; echo a=$?; cat conf/keys/id; echo b=$?; "
                     "grep -r hunter2 .; echo c=$?; cat conf/app.toml; "
                     "echo y > conf/app.toml; echo d=$?; touch conf/new; echo e=$?; "
                     "touch conf/keys/x; echo f=$?; umount conf/.env; echo g=$?; "
                     "umount -l conf; echo h=$?; mount -o remount,rw conf; echo i=$?; "
                     "chmod 644 conf/.env; echo j=$?; cat conf/.env; echo k=$?")
    assert SECRET not in b.text and "hunter2" not in b.text, b.text
    assert "x = 1" in b.text, b.text
    for k in "abcdefghijk":
        assert f"{k}=0" not in b.text, b.text
    assert (root / "conf" / "app.toml").read_text() == "x = 1\n"
    assert sorted(os.listdir(root / "conf")) == [".env", "app.toml", "keys"]
    assert os.listdir(root / "conf" / "keys") == ["id"]


@needs_sandbox
def test_a_cover_on_a_changed_object_runs_nothing(tmp_path: Path) -> None:
    """The covers made in the sandbox are made on the objects the scan saw: a path that is
    another object by then (here: a stale identity) fails the start, and nothing runs."""
    if not sandbox.covers_in_sandbox():
        pytest.skip("covers cannot be made in the sandbox here")
    root = tmp_path / "root"
    root.mkdir()
    (root / ".env").write_text(SECRET + "\n")
    st, top = os.lstat(root / ".env"), os.stat(root)
    empty = tmp_path / "empty"
    empty.write_text("")
    for stale in (sandbox.Cover(b".env", True, False, st.st_dev, st.st_ino + 1),
                  sandbox.Cover(b".env", True, True, st.st_dev, st.st_ino),
                  sandbox.Cover(b"../root/.env", True, False, st.st_dev, st.st_ino)):
        covers = sandbox.CoverSet((stale,), top.st_dev, top.st_ino, str(empty))
        with pytest.raises(OSError, match="path policy"):
            sandbox.start_shell(sandbox.SandboxPolicy(), str(root), str(root), [],
                                "touch ran", covers=covers)
        assert not (root / "ran").exists()
    ok = sandbox.CoverSet((sandbox.Cover(b".env", True, False, st.st_dev, st.st_ino),),
                          top.st_dev, top.st_ino, str(empty))
    import subprocess

    run = sandbox.start_shell(sandbox.SandboxPolicy(), str(root), str(root), [],
                              "cat .env; touch ran", covers=ok, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    out, _ = run.proc.communicate(timeout=60)
    run.close()
    assert SECRET.encode() not in out and (root / "ran").exists(), out


@needs_sandbox
@pytest.mark.parametrize("source", ["clone of a detached cover", "each from the empty file"])
def test_hidden_file_covers_of_either_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             source: str) -> None:
    """Hidden files are covered with clones of one detached read-only empty file where the
    kernel clones detached mounts, else each with its own clone of the empty file: both
    give every hidden file an unreadable, unwritable, empty, mode-0000 object, on many
    files at once, and a protected file beside them stays readable but not writable."""
    if not sandbox.covers_in_sandbox():
        pytest.skip("covers cannot be made in the sandbox here")
    import subprocess

    if source == "each from the empty file":
        monkeypatch.setattr(sandbox, "_CLONE_DETACHED", False)
    root = tmp_path / "root"
    root.mkdir()
    covers = []
    for i in range(20):
        (root / f"{i}.env").write_text(SECRET + "\n")
        st = os.lstat(root / f"{i}.env")
        covers.append(sandbox.Cover(f"{i}.env".encode(), True, False, st.st_dev, st.st_ino))
    (root / "deps.lock").write_text("pinned\n")
    st = os.lstat(root / "deps.lock")
    covers.append(sandbox.Cover(b"deps.lock", False, False, st.st_dev, st.st_ino))
    empty = tmp_path / "empty"
    empty.write_text("")
    empty.chmod(0)
    top = os.stat(root)
    cs = sandbox.CoverSet(tuple(covers), top.st_dev, top.st_ino, str(empty))
    script = ("for i in $(seq 0 19); do cat $i.env; echo x >> $i.env && echo wrote$i; "
              "chmod 644 $i.env && echo changed$i; "
              "stat -c '%a %s' $i.env; done; cat deps.lock; echo y >> deps.lock && echo wl")
    run = sandbox.start_shell(sandbox.SandboxPolicy(), str(root), str(root), [], script,
                              covers=cs, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = run.proc.communicate(timeout=60)
    run.close()
    text = out.decode()
    assert "hunter2" not in text and "wrote" not in text and "wl" not in text, text
    assert "changed" not in text and "Read-only file system" in text, text
    assert text.count("0 0\n") == 20 and "pinned" in text, text
    for i in range(20):
        assert (root / f"{i}.env").read_text() == SECRET + "\n"
    assert (root / "deps.lock").read_text() == "pinned\n"


@needs_sandbox
def test_the_cover_maker_is_started_again_when_it_ended(ws: ToolContext) -> None:
    """The helper that makes the covers in the sandbox is a process the server keeps; when
    it is gone (killed), the next call starts another and still covers everything."""
    if not sandbox.covers_in_sandbox():
        pytest.skip("covers cannot be made in the sandbox here")
    first = run_bash(ws, "cat .env; echo rc=$?")
    assert SECRET not in first.text and "rc=1" in first.text, first.text
    assert sandbox._maker, "no cover maker runs"
    gone = sandbox._maker[0].proc
    gone.kill()
    gone.wait()
    again = run_bash(ws, "cat .env; echo rc=$?; echo x > secrets/prod.txt; echo w=$?")
    assert SECRET not in again.text and "rc=1" in again.text, again.text
    assert "w=0" not in again.text, again.text
    assert sandbox._maker and sandbox._maker[0].proc is not gone


@needs_sandbox
def test_a_command_started_inside_a_protected_directory_stays_under_its_covers(
        tmp_path: Path, cover_mode: str) -> None:
    """A connection whose working directory is a protected directory (``cd conf`` in an
    earlier call) starts the next command there: it cannot write it, nor read a hidden file
    below it, neither through its own directory nor through that of the sandbox's first
    process (/proc/1/cwd)."""
    root = tmp_path / "root"
    (root / "conf" / "sub").mkdir(parents=True)
    (root / "conf" / "app.toml").write_text("x = 1\n")
    (root / "conf" / "sub" / ".env").write_text(SECRET + "\n")
    ws = ToolContext(DirBinding(root, policy=PathPolicy(hide=(".env",), protect=("conf/",))))
    run_bash(ws, "cd conf")
    b = run_bash(ws, "pwd; echo y > app.toml; echo a=$?; touch new; echo b=$?; "
                     "cat sub/.env; echo c=$?; cat /proc/1/cwd/sub/.env; echo d=$?; "
                     "echo y > /proc/1/cwd/app.toml; echo e=$?; "
                     "cat /proc/1/cwd/conf/sub/.env; echo f=$?; "
                     "echo y > /proc/1/cwd/conf/app.toml; echo g=$?")
    assert b.text.startswith(f"{root}/conf\n"), b.text
    assert SECRET not in b.text and "hunter2" not in b.text, b.text
    for k in "abcdefg":
        assert f"{k}=0" not in b.text or k == "e", b.text
    assert (root / "conf" / "app.toml").read_text() == "x = 1\n"
    assert sorted(os.listdir(root / "conf")) == ["app.toml", "sub"]


@needs_sandbox
def test_a_scan_of_an_unchanged_tree_still_covers_what_appears_later(tmp_path: Path,
                                                                     cover_mode: str) -> None:
    """Once directories are settled (kept between scans, with what the scan did in them), a
    new hidden file in one of them, a hard link to a hidden file made in another, and a
    protected file's directory renamed are covered in the next call as in the first."""
    import time

    root = tmp_path / "root"
    for d in ("a", "b", "c/locks"):
        (root / d).mkdir(parents=True)
    (root / "a" / ".env").write_text(SECRET + "\n")
    (root / "c" / "locks" / "deps.lock").write_text("pinned\n")
    ws = ToolContext(DirBinding(root, policy=PathPolicy(hide=(".env",), protect=("*.lock",))))
    time.sleep(1.2)                        # every directory is settled: kept by the scans
    for _ in range(2):
        b = run_bash(ws, "cat a/.env; echo a=$?; echo x > c/locks/deps.lock; echo b=$?")
        assert SECRET not in b.text and "a=0" not in b.text and "b=0" not in b.text, b.text
    (root / "b" / ".env").write_text(SECRET + "\n")
    os.link(root / "a" / ".env", root / "b" / "alias")
    os.rename(root / "c" / "locks", root / "c" / "moved")
    b = run_bash(ws, "cat b/.env; echo a=$?; cat b/alias; echo b=$?; cat a/.env; echo c=$?; "
                     "echo x > c/moved/deps.lock; echo d=$?")
    assert SECRET not in b.text and "hunter2" not in b.text, b.text
    for k in "abcd":
        assert f"{k}=0" not in b.text, b.text
    assert (root / "c" / "moved" / "deps.lock").read_text() == "pinned\n"
