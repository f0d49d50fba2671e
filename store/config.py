"""The store config file: one line switches a store directory from embedded to shared.

A store directory (``--store DIR``) normally holds everything: packs, index, caches. When
it holds ``store.json``, it is instead this host's *local part* of a shared store::

    {"blobs": "s3://BUCKET/PREFIX", "s3_endpoint": "http://127.0.0.1:8333" | null,
     "catalog": "postgresql://...", "cache": "/abs/cache/dir", "cache_bytes": 10737418240}

and ``Store(DIR)`` opens the packs on S3 (``store/s3.py``) through the local range cache
(``store/blobcache.py``) and the metadata in the shared catalog (``store/pgcatalog.py``).
DIR keeps what belongs to this host only: the files and dirs caches (``index.sqlite``),
the lock files, and everything the session layer derives from the store directory (the
session state base ``DIR/sessions`` with uppers and session records, the paths hidden
from Bash, the persistence-overlap checks), so every such rule holds for DIR unchanged.

Rules: a remote blob store needs a catalog shared by its hosts, and a shared catalog needs
a remote blob store (each host's local directory would otherwise hold packs the others
cannot read); either alone is ``StoreConfigError``. The file is written once by
``configure`` (mode 0600, atomically) and a later ``configure`` with other values is
refused, so a directory never silently changes store. Credentials are never in it: S3 keys
come from the standard AWS environment and files, a PostgreSQL password from libpq's
``PGPASSWORD``, ``~/.pgpass`` or ``PGPASSFILE``; ``configure`` refuses (exit 2) a catalog
URL with a password (``user:PASSWORD@`` or ``password=``) and an S3 endpoint with one.

Environment (read by the CLI, rewindfs/cli.py): ``REWINDFS_STORE`` (a directory or an
``s3://`` URL), ``REWINDFS_S3_ENDPOINT``, ``REWINDFS_CATALOG``, ``REWINDFS_LOCAL``,
``REWINDFS_CACHE_BYTES``, ``REWINDFS_HOST_ID``, and the S3 client's bounds
``REWINDFS_S3_ATTEMPTS``, ``REWINDFS_S3_CONNECT_TIMEOUT``, ``REWINDFS_S3_READ_TIMEOUT``,
``REWINDFS_S3_HOLD_OFF`` (store/s3.py, read here). Default local directory of a URL store:
``$XDG_STATE_HOME/rewindfs`` (``~/.local/state/rewindfs``); default cache
``$XDG_CACHE_HOME/rewindfs`` (``~/.cache/rewindfs``), 10 GiB.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from .errors import StoreError, has_secret, redact

CONFIG_FILE = "store.json"
DEFAULT_CACHE_BYTES = 10 << 30


class StoreConfigError(StoreError):
    """A store configuration is refused (see store/config.py for the rules)."""

    exit_code = 2


@dataclass(frozen=True)
class SharedConfig:
    """What ``store.json`` says (see the module docstring)."""

    blobs: str
    catalog: str
    s3_endpoint: str | None = None
    cache: str | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES

    def check(self) -> SharedConfig:
        """This configuration with its ``blobs`` canonical (``canonical_blobs``); raises
        StoreConfigError if it breaks the rules."""
        if not self.blobs:
            raise StoreConfigError("a shared catalog needs a remote blob store "
                                   "(--store s3://BUCKET/PREFIX)")
        if not self.catalog:
            raise StoreConfigError(f"the remote store {self.blobs} needs a catalog shared by "
                                   "its hosts (--catalog postgresql://...)")
        try:
            blobs = canonical_blobs(self.blobs)
        except ValueError as e:
            raise StoreConfigError(f"--store: {e}") from None
        if not self.catalog.startswith(("postgresql://", "postgres://")):
            # A libpq keyword/value string may hold a password: never echoed.
            raise StoreConfigError(f"--catalog must be a postgresql:// URL, not "
                                   f"{redact(self.catalog.split('://')[0])!r}")
        if self.cache_bytes <= 0:
            raise StoreConfigError("the cache size must be positive")
        return self if blobs == self.blobs else replace(self, blobs=blobs)


def canonical_blobs(url: str) -> str:
    """The one spelling of the S3 store ``url`` names: ``s3://BUCKET/PREFIX`` without
    slashes at the prefix's ends (``s3://b/p/`` and ``s3://b//p`` are ``s3://b/p``), or
    ``s3://BUCKET``. Raises ValueError for a URL that is not one (``parse_s3_url``)."""
    from .s3 import parse_s3_url

    bucket, prefix = parse_s3_url(url)
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def is_store_dir(root: str) -> bool:
    """True if ``root`` holds a store: an embedded one (its index) or this host's local
    directory of a shared one (its ``store.json``)."""
    return os.path.exists(os.path.join(root, "index.sqlite")) or os.path.exists(
        os.path.join(root, CONFIG_FILE))


def default_local_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "rewindfs")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "rewindfs")


def read(root: str) -> SharedConfig | None:
    """The shared configuration of store directory ``root``, or None for an embedded store.
    Raises StoreConfigError for a file that is not a valid configuration."""
    path = os.path.join(root, CONFIG_FILE)
    try:
        with open(path, "rb") as f:
            raw: Any = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StoreConfigError(f"{path}: not a store configuration ({e})") from None
    try:
        cfg = SharedConfig(blobs=str(raw.get("blobs") or ""), catalog=str(raw.get("catalog") or ""),
                           s3_endpoint=raw.get("s3_endpoint") or None,
                           cache=raw.get("cache") or None,
                           cache_bytes=int(raw.get("cache_bytes") or DEFAULT_CACHE_BYTES))
    except (AttributeError, TypeError, ValueError) as e:
        raise StoreConfigError(f"{path}: not a store configuration ({e})") from None
    return cfg.check()


def refuse_secrets(cfg: SharedConfig) -> None:
    """Raise StoreConfigError (exit 2, the secret masked) if the catalog URL or the S3
    endpoint of ``cfg`` holds a password: ``store.json`` never holds one, and a command
    line is visible to every user of the host."""
    if has_secret(cfg.catalog):
        raise StoreConfigError(
            f"--catalog {redact(cfg.catalog)}: a password is never written to store.json; "
            "leave it out of the URL and give it through PGPASSWORD, ~/.pgpass or PGPASSFILE")
    if cfg.s3_endpoint and has_secret(cfg.s3_endpoint):
        raise StoreConfigError(
            f"--s3-endpoint {redact(cfg.s3_endpoint)}: credentials are never written to "
            "store.json; leave them out of the URL and give them through AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials")


def configure(root: str, cfg: SharedConfig) -> SharedConfig:
    """Make ``root`` the local directory of the shared store ``cfg`` (writing ``store.json``
    if absent; the cache directory defaults to ``default_cache_dir()``). Returns the stored
    configuration. Raises StoreConfigError if ``cfg`` breaks the rules, holds a password
    (``refuse_secrets``), if ``root`` already belongs to another store, or if ``root`` is
    an embedded store holding packs."""
    cfg = cfg.check()
    refuse_secrets(cfg)
    if cfg.cache is None:
        cfg = SharedConfig(cfg.blobs, cfg.catalog, cfg.s3_endpoint, default_cache_dir(),
                           cfg.cache_bytes)
    root = os.path.abspath(root)
    have = read(root)
    if have is not None:
        differ = _differences(have, cfg)
        if differ:
            raise StoreConfigError(
                f"{root} is the local directory of another shared store: "
                f"{'; '.join(differ)}; use another --local directory for this store, or "
                f"the options of the store it holds ({_options(have)})")
        return have
    if os.path.isdir(os.path.join(root, "backend", "packs")):
        raise StoreConfigError(f"{root} is an embedded store; use another --local directory")
    os.makedirs(root, mode=0o700, exist_ok=True)
    path = os.path.join(root, CONFIG_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(asdict(cfg), sort_keys=True, indent=1).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return cfg


HOST_FILE = "host_id"
"""The file of a shared store's local directory recording the host id given with it."""


def bind_host(root: str, given: str | None) -> str | None:
    """The host id of the local directory ``root`` of a shared store: the one it records
    (``HOST_FILE``), written by the first command that gave one (``given``: ``--host-id``
    or ``$REWINDFS_HOST_ID``; None when neither). Raises StoreConfigError (exit 2) naming
    both if ``given`` is another: the directory holds that host's session records and
    state, which another host id would take over as its own. A host id derived from the
    machine and boot (no id given, store/hostid.py) is never recorded, since it changes at
    each reboot of the same host; a command giving none runs as the recorded one."""
    path = os.path.join(root, HOST_FILE)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            have: str | None = f.read().strip()
    except FileNotFoundError:
        have = None
    except OSError as e:
        raise StoreConfigError(f"{path}: cannot read the host id of this directory ({e})"
                               ) from None
    if have == "":  # never written so (a link publishes it whole): damaged
        raise StoreConfigError(f"{path}: the host id file of this directory is empty; "
                               f"remove it and give --host-id again")
    if have:
        from .hostid import check_host_id

        try:
            check_host_id(have)
        except ValueError as e:
            raise StoreConfigError(f"{path}: {e}") from None
        if given is not None and given != have:
            raise StoreConfigError(
                f"{root} is the local directory of host {have} ({path}), not {given} "
                f"(--host-id or REWINDFS_HOST_ID); give each host id its own --local "
                f"directory, or --host-id {have} for this one")
        return have
    if given is None:
        return None
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{given}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # the first writer wins; a racing one reads it and compares
    except FileExistsError:
        os.unlink(tmp)
        return bind_host(root, given)
    os.unlink(tmp)
    return given


_FIELDS = (("blobs", "S3 bucket/prefix", "--store"), ("catalog", "catalog", "--catalog"),
           ("s3_endpoint", "S3 endpoint", "--s3-endpoint"))
"""The fields of ``store.json`` naming the store: (attribute, what it is, its option)."""


def _differences(have: SharedConfig, want: SharedConfig) -> list[str]:
    """Each field of ``_FIELDS`` where ``want`` names another store than ``have``, as
    "its WHAT is OLD (store.json), not NEW (given)", secrets masked."""
    out = []
    for attr, what, _ in _FIELDS:
        old, new = getattr(have, attr), getattr(want, attr)
        if old != new:
            out.append(f"its {what} is {_shown(old)} (store.json), not {_shown(new)} (given)")
    return out


def _options(cfg: SharedConfig) -> str:
    """The command-line options naming the store ``cfg``, secrets masked."""
    return " ".join(f"{opt} {redact(getattr(cfg, attr))}" for attr, _, opt in _FIELDS
                    if getattr(cfg, attr))


def _shown(value: str | None) -> str:
    return "none" if not value else redact(value)


def open_parts(root: str, cfg: SharedConfig) -> tuple[Any, Any]:
    """The (backend, catalog) of shared store ``cfg`` for local directory ``root``: S3
    through the range cache, and the PostgreSQL catalog. Nothing asks the S3 server here:
    the first request that needs it raises BackendError if it cannot be reached (so a
    command that needs only the catalog and the cache works while it is down), except
    that a catalog of an earlier version recording no store is checked for a few of its
    packs in this one once (``pgcatalog.bind_store``). Raises CatalogError if the catalog
    cannot be reached, StoreConfigError if it indexes another store or ``cfg`` breaks the
    rules (``SharedConfig.check``: the store is compared in its canonical spelling)."""
    from .blobcache import CachedBackend
    from .pgcatalog import PostgresCatalog

    cfg = cfg.check()
    s3 = _s3(cfg)
    cache_dir = os.path.join(cfg.cache or default_cache_dir(), _cache_name(cfg.blobs))
    catalog = PostgresCatalog(cfg.catalog, store=cfg.blobs, holds=s3.exists)
    return CachedBackend(s3, cache_dir, cfg.cache_bytes), catalog


def probe(cfg: SharedConfig) -> None:
    """Raise BackendError unless the bucket of ``cfg`` answers with this environment's
    credentials, CatalogError unless its catalog does, StoreConfigError if that catalog
    indexes another store (``pgcatalog.bind_store``; nothing is created): what a first
    ``configure`` of a directory checks, so that a failed first open leaves no
    ``store.json`` binding the directory to a store it never opened. ``cfg`` is checked
    first (``SharedConfig.check``), so the catalog compares the store's canonical spelling
    (``canonical_blobs``: ``s3://b/p/`` is ``s3://b/p``)."""
    from .pgcatalog import probe as probe_catalog

    cfg = cfg.check()
    s3 = _s3(cfg)
    s3.check()
    probe_catalog(cfg.catalog, store=cfg.blobs, holds=s3.exists)


def _s3(cfg: SharedConfig) -> Any:
    """The S3 backend of ``cfg``, with the environment's attempts and timeouts (store/s3.py);
    StoreConfigError for a bad one."""
    from .s3 import S3Backend, parse_s3_url, timeouts

    bucket, prefix = parse_s3_url(cfg.blobs)
    try:
        bounds = timeouts()
    except ValueError as e:
        raise StoreConfigError(str(e)) from None
    return S3Backend(bucket, prefix, endpoint_url=cfg.s3_endpoint, **bounds)


def _cache_name(blobs: str) -> str:
    # One cache directory per store URL, so two stores never share cached ranges.
    import blake3

    return blake3.blake3(blobs.encode()).hexdigest()[:16]
