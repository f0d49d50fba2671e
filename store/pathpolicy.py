"""Path policies of a session: ``hide``, ``protect`` and ``exclude`` (CONTRACT amendment
"0, 3.1 policies").

Each policy is a list of patterns in gitignore syntax (git's ``gitignore(5)``, matched by
``pathspec``'s ``GitIgnoreSpec``): a pattern without a slash matches a name at any depth,
a trailing slash matches directories only, ``**`` spans directories, ``!`` re-includes.
A path matches when it or one of its ancestors does, so a matching directory covers its
whole subtree.

- ``hide``: invisible to the agent's tools and inside the Bash sandbox; still in the tree.
- ``protect``: the agent's tools and sandboxed commands cannot change it.
- ``exclude``: derived data kept in the session's upper and never frozen into a Ref.

A policy comes from the session spec (``--hide``/``--protect``/``--exclude``) and from a
``.rewindfs.toml`` at the seed's root (read with ``tomllib``)::

    [policy]
    hide = [".env"]
    protect = ["secrets/**"]
    exclude = ["node_modules/"]

Paths given to the matchers are workspace-relative, ``/``-separated, without a leading
slash (``"."`` or ``""`` is the root, which never matches).
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pathspec

KINDS = ("hide", "protect", "exclude")
POLICY_FILE = ".rewindfs.toml"
MAX_PATTERNS = 10_000


class PathPolicyError(ValueError):
    """A policy cannot be used: ``source`` names where it came from (an option, a file),
    ``reason`` says what is wrong (not a list of strings, a bad pattern, bad TOML)."""

    exit_code = 10            # a configuration error, like the session layer's

    def __init__(self, source: str, reason: str) -> None:
        self.source = source
        self.reason = reason
        super().__init__(f"path policy from {source}: {reason}")


def _combined(spec: pathspec.PathSpec) -> re.Pattern[str] | None:
    """One regular expression equal to ``spec`` when every pattern includes (no ``!``), so
    that a path is matched in one search instead of one per pattern (``match_file``'s
    cost, paid per entry in every Bash call's walk); None when that does not hold."""
    parts = []
    for p in spec.patterns:
        rx = getattr(p, "regex", None)
        if p.include is None:
            continue                          # a comment or blank line
        if p.include is not True or not isinstance(rx, re.Pattern):
            return None
        parts.append("(?:" + rx.pattern.replace("(?P<ps_d>", "(?:") + ")")
    try:
        return re.compile("|".join(parts)) if parts else None
    except re.error:
        return None


def _compile(kind: str, patterns: tuple[str, ...], source: str) -> pathspec.PathSpec | None:
    if not patterns:
        return None
    for p in patterns:
        if not isinstance(p, str) or not p.strip() or "\0" in p or "\n" in p:
            raise PathPolicyError(source, f"{kind} pattern {p!r} is not a non-empty line")
    try:
        return pathspec.GitIgnoreSpec.from_lines(patterns)
    except Exception as e:  # pathspec raises its own errors for malformed patterns
        raise PathPolicyError(source, f"{kind} pattern: {e}") from None


@dataclass(frozen=True)
class PathPolicy:
    """The three pattern lists, validated and compiled. Raises PathPolicyError."""

    hide: tuple[str, ...] = ()
    protect: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    source: str = field(default="the session spec", compare=False)
    _specs: dict[str, pathspec.PathSpec | None] = field(default_factory=dict, init=False,
                                                        repr=False, compare=False)
    _fast: dict[str, re.Pattern[str] | None] = field(default_factory=dict, init=False,
                                                     repr=False, compare=False)

    def __post_init__(self) -> None:
        for kind in KINDS:
            pats = tuple(getattr(self, kind))
            if len(pats) > MAX_PATTERNS:
                raise PathPolicyError(self.source, f"more than {MAX_PATTERNS} {kind} patterns")
            object.__setattr__(self, kind, pats)
            spec = self._specs[kind] = _compile(kind, pats, self.source)
            self._fast[kind] = _combined(spec) if spec is not None else None

    @property
    def empty(self) -> bool:
        return not (self.hide or self.protect or self.exclude)

    def _match(self, kind: str, rel: str, is_dir: bool) -> bool:
        spec = self._specs[kind]
        if spec is None or rel in ("", "."):
            return False
        path = rel + "/" if is_dir else rel
        fast = self._fast[kind]
        if fast is not None:
            return fast.match(path) is not None
        return bool(spec.match_file(path))

    def matcher(self, kind: str) -> Callable[[str], bool] | None:
        """A fast test for one kind (hide, protect, exclude) taking the path with a trailing
        slash for a directory (``"a/b/"``), or None when the kind has no patterns. For
        walks that test every entry of a tree."""
        spec = self._specs[kind]
        if spec is None:
            return None
        fast = self._fast[kind]
        if fast is not None:
            m = fast.match
            return lambda path: m(path) is not None
        return lambda path: bool(spec.match_file(path))

    def hides(self, rel: str, is_dir: bool = False) -> bool:
        """True when workspace path ``rel`` (a directory when ``is_dir``) is hidden."""
        return self._match("hide", rel, is_dir)

    def protects(self, rel: str, is_dir: bool = False) -> bool:
        """True when workspace path ``rel`` may not be changed by the agent."""
        return self._match("protect", rel, is_dir)

    def excludes(self, rel: str, is_dir: bool = False) -> bool:
        """True when workspace path ``rel`` is derived data kept out of every Ref."""
        return self._match("exclude", rel, is_dir)

    def to_spec(self) -> dict[str, list[str]]:
        """The JSON shape recorded in the session spec: only the non-empty lists."""
        return {k: list(getattr(self, k)) for k in KINDS if getattr(self, k)}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None, source: str = "the session spec"
                  ) -> PathPolicy:
        """The policy a spec's ``paths`` mapping (or a TOML ``[policy]`` table) describes.
        Unknown keys and values that are not lists of strings raise PathPolicyError."""
        if not spec:
            return cls(source=source)
        if not isinstance(spec, Mapping):
            raise PathPolicyError(source, "not a table of hide/protect/exclude lists")
        unknown = sorted(set(spec) - set(KINDS))
        if unknown:
            raise PathPolicyError(source, f"unknown key {unknown[0]!r} (known: "
                                          f"{', '.join(KINDS)})")
        lists: dict[str, tuple[str, ...]] = {}
        for kind in KINDS:
            value = spec.get(kind, [])
            if isinstance(value, str) or not isinstance(value, list | tuple) or \
                    not all(isinstance(v, str) for v in value):
                raise PathPolicyError(source, f"{kind} is not a list of strings")
            lists[kind] = tuple(value)
        return cls(lists["hide"], lists["protect"], lists["exclude"], source=source)

    def merged(self, other: PathPolicy) -> PathPolicy:
        """Both policies' patterns, ``self``'s first, duplicates dropped."""
        def union(a: Iterable[str], b: Iterable[str]) -> tuple[str, ...]:
            return tuple(dict.fromkeys([*a, *b]))
        return PathPolicy(union(self.hide, other.hide), union(self.protect, other.protect),
                          union(self.exclude, other.exclude), source=self.source)


def parse_policy_file(data: bytes, source: str = POLICY_FILE) -> PathPolicy:
    """The ``[policy]`` table of a ``.rewindfs.toml`` (other tables are left to others).
    Raises PathPolicyError for bad TOML or a bad table."""
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise PathPolicyError(source, f"not valid TOML: {e}") from None
    return PathPolicy.from_spec(doc.get("policy"), source)


MAX_POLICY_FILE_BYTES = 1 << 20


def seed_policy(store: Any, seed: str | None) -> PathPolicy:
    """The policy of the ``.rewindfs.toml`` at the root of ``seed`` (a directory, or a Ref
    of ``store``); an empty policy when there is no seed or no such regular file. Raises
    PathPolicyError for a bad file (or one over MAX_POLICY_FILE_BYTES)."""
    if not seed:
        return PathPolicy()
    if os.path.isdir(seed):
        path = os.path.join(seed, POLICY_FILE)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, OSError):
            return PathPolicy()
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return PathPolicy()
            data = f.read(MAX_POLICY_FILE_BYTES + 1)
        source = path
    else:
        from store.browse import resolve
        from store.errors import SnapshotNotFoundError
        from store.tree import Kind

        try:
            entry = resolve(store, seed, POLICY_FILE)
        except SnapshotNotFoundError:
            return PathPolicy()
        if entry is None or entry.kind is not Kind.FILE:
            return PathPolicy()
        if entry.size > MAX_POLICY_FILE_BYTES:
            data = b"x" * (MAX_POLICY_FILE_BYTES + 1)
        else:
            from store.browse import cat

            data = b"".join(cat(store, seed, POLICY_FILE))
        source = f"{POLICY_FILE} in {seed}"
    if len(data) > MAX_POLICY_FILE_BYTES:
        raise PathPolicyError(source, f"larger than {MAX_POLICY_FILE_BYTES} bytes")
    found = parse_policy_file(data, source)
    if found.empty:
        return found
    # The file that set the policy is itself kept from the agent's changes.
    return found.merged(PathPolicy(protect=(f"/{POLICY_FILE}",)))
