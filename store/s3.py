"""The S3 blob backend: packs and history objects as objects under ``s3://BUCKET/PREFIX/``.

Client: boto3 (botocore). Chosen over obstore because it is the reference S3 client, kept
by the service's own vendor, with the retry behaviour we need built in and configurable
(botocore's ``standard`` retry mode: exponential backoff with jitter on throttling, 5xx,
connection errors and timeouts, a bounded number of attempts), managed multipart uploads
(s3transfer: parts uploaded and retried one by one, the upload aborted on failure) and the
standard credential chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_PROFILE``,
``~/.aws/credentials`` and ``~/.aws/config``); obstore is younger and its Python surface
narrower. Credentials are never passed through this module nor logged: botocore finds them.

The BlobBackend contract (store/backend.py) on S3:

- ``put``: a small object is written with ``If-None-Match: *``, so of two writers of one key
  exactly one succeeds; the other reads the stored bytes back and either returns (same
  bytes) or raises ``BlobConflictError``. A blob of ``MULTIPART_THRESHOLD`` bytes or more
  (a big pack, whose key is its own digest, so any stored copy holds the same bytes) is
  checked with HEAD and then uploaded in ``PART_SIZE`` parts. An upload that fails leaves no
  object (S3 makes an object visible only when its upload completes), so a half-uploaded
  pack is never visible, let alone indexed.
- ``sync``: a no-op; S3 acknowledges a put only once it is durable.
- An upload killed part-way (the process or the server) leaves an unfinished multipart
  upload whose parts stay stored; GC aborts those older than its grace period
  (``abort_stale_uploads``).
- ``delete`` of a missing key raises ``BlobNotFoundError`` (S3 itself would not say).
- Every other failure (server gone after the retries, access denied, ...) is
  ``BackendError`` naming the operation, key and the S3 error code, never the credentials.
- Held-off reads: once a read (``get``, ``get_range``) of a key has timed out (every
  attempt: the server accepts connections and never answers, or never accepts them),
  further reads of that key fail at once with ``BackendError`` for ``hold_off_s``
  seconds, without a request; the first read after that asks the server again, and a
  read of the key that succeeds meanwhile (one begun earlier) ends the hold-off. A read
  through a mount so fails after one request's bounds, not one per retry of the kernel
  (it retries a failed read-ahead as a plain read). The state is this object's, in
  memory: another process asks the server itself.

Keys are those of the protocol, stored as ``PREFIX/key``.
"""

from __future__ import annotations

import builtins
import io
import threading
import time
from typing import Any

from .backend import check_key
from .errors import BackendError, BlobConflictError, BlobNotFoundError, redact

DEFAULT_ATTEMPTS = 3
DEFAULT_CONNECT_TIMEOUT = 3.0
DEFAULT_READ_TIMEOUT = 10.0
DEFAULT_HOLD_OFF = 30.0
TIMEOUT_ENV = {"max_attempts": "REWINDFS_S3_ATTEMPTS",
               "connect_timeout": "REWINDFS_S3_CONNECT_TIMEOUT",
               "read_timeout": "REWINDFS_S3_READ_TIMEOUT",
               "hold_off_s": "REWINDFS_S3_HOLD_OFF"}
MULTIPART_THRESHOLD = 16 << 20
PART_SIZE = 8 << 20
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (bucket, prefix without slashes at either end). Raises
    ValueError for anything else."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}")
    prefix = prefix.strip("/")
    if prefix:
        check_key(prefix)
    return bucket, prefix


def timeouts() -> dict[str, Any]:
    """``S3Backend``'s ``max_attempts``, ``connect_timeout``, ``read_timeout`` and
    ``hold_off_s`` as the environment sets them (``TIMEOUT_ENV``: attempts a whole number from 1, seconds above
    0), each unset one left out. Raises ValueError naming a variable with another value."""
    import math
    import os

    out: dict[str, Any] = {}
    for name, var in TIMEOUT_ENV.items():
        text = os.environ.get(var)
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        whole = name != "max_attempts" or value.is_integer()
        if not (value > 0 and math.isfinite(value) and whole):
            raise ValueError(f"{var}={text!r}: not " + (
                "a whole number from 1" if name == "max_attempts" else "seconds above 0"))
        out[name] = int(value) if name == "max_attempts" else value
    return out


class S3Backend:
    """Blobs in ``bucket`` under ``prefix`` on an S3-compatible server (see module docstring).

    ``endpoint_url`` is for servers other than AWS (SeaweedFS, MinIO: path-style addressing
    is used then); ``max_attempts`` bounds botocore's attempts at one request (the first
    and its retries); ``connect_timeout``/``read_timeout`` are seconds, each attempt's time
    to connect and its longest silence while reading. A server that accepts connections
    and never answers so fails one request after about ``max_attempts * read_timeout``
    seconds plus botocore's backoff between attempts (random, at most 1, 2, 4, ... s);
    ``hold_off_s`` is how long reads of a key whose read timed out fail without a request
    (module docstring). ``timeouts()`` gives the defaults from the environment.
    Thread-safe (one botocore client, which is).
    """

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, max_attempts: int = DEFAULT_ATTEMPTS,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 read_timeout: float = DEFAULT_READ_TIMEOUT,
                 hold_off_s: float = DEFAULT_HOLD_OFF) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.bounds = (f"{max_attempts} attempts, each {connect_timeout:g} s to connect and "
                       f"{read_timeout:g} s of silence while reading")
        cfg = Config(retries={"mode": "standard", "total_max_attempts": max_attempts},
                     connect_timeout=connect_timeout, read_timeout=read_timeout,
                     max_pool_connections=32,
                     s3={"addressing_style": "path" if endpoint_url else "auto"})
        session = boto3.session.Session()
        self._client: Any = session.client("s3", endpoint_url=endpoint_url,
                                           region_name=region or session.region_name
                                           or "us-east-1", config=cfg)
        self._transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD,
                                        multipart_chunksize=PART_SIZE, max_concurrency=4,
                                        use_threads=True)
        self._lock = threading.Lock()
        self.hold_off_s = hold_off_s
        # key -> (time.monotonic() its read timed out, that failure's text)
        self._timed_out: dict[str, tuple[float, str]] = {}

    def __repr__(self) -> str:
        return f"S3Backend(s3://{self.bucket}/{self.prefix}, endpoint={redact(str(self.endpoint_url))})"

    def _k(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}{key}"

    def _fail(self, op: str, key: str, e: Exception) -> BackendError:
        code = _code(e)
        where = self._where(key)
        # No answer at all (timeouts, refused connections): say what was waited for.
        waited = "" if code else (f" (gave up after {self.bounds}; to change: "
                                  f"{', '.join(TIMEOUT_ENV.values())})")
        return BackendError(f"cannot {op} {where}: {code or type(e).__name__}: "
                            f"{redact(_message(e))}{waited}")

    def _check_held_off(self, key: str) -> None:
        """Raise BackendError, without a request, if a read of ``key`` timed out less than
        ``hold_off_s`` seconds ago."""
        if not self._timed_out:
            return
        with self._lock:
            got = self._timed_out.get(key)
        if got is None:
            return
        ago = time.monotonic() - got[0]
        if ago >= self.hold_off_s:
            return
        raise BackendError(f"cannot get {self._where(key)}: not asked again for "
                           f"{self.hold_off_s - ago:.1f} s (REWINDFS_S3_HOLD_OFF), its read "
                           f"{ago:.1f} s ago timed out: {got[1]}")

    def _read_failed(self, key: str, e: Exception, err: BackendError) -> BackendError:
        """``err`` (the failure of a read of ``key``), remembered for the hold-off if the
        read timed out."""
        from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

        if isinstance(e, (ReadTimeoutError, ConnectTimeoutError)):
            now = time.monotonic()
            with self._lock:
                for k in [k for k, (t, _) in self._timed_out.items()
                          if now - t >= self.hold_off_s]:
                    del self._timed_out[k]
                self._timed_out[key] = (now, str(err).removeprefix(
                    f"cannot get {self._where(key)}: "))
        return err

    def _read_ok(self, key: str) -> None:
        if self._timed_out:
            with self._lock:
                self._timed_out.pop(key, None)

    # -- protocol --------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        k = self._k(key)
        data = bytes(data)
        if len(data) >= MULTIPART_THRESHOLD:
            if self.exists(key):
                self._check_same(key, data)
                return
            try:
                self._client.upload_fileobj(io.BytesIO(data), self.bucket, k,
                                            Config=self._transfer)
            except Exception as e:
                raise self._fail("put", key, e) from None
            return
        try:
            self._client.put_object(Bucket=self.bucket, Key=k, Body=data, IfNoneMatch="*")
        except Exception as e:
            if _code(e) not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise self._fail("put", key, e) from None
            self._check_same(key, data)

    def _check_same(self, key: str, data: bytes) -> None:
        if self.get(key) != data:
            raise BlobConflictError(key)

    def get(self, key: str) -> bytes:
        k = self._k(key)
        self._check_held_off(key)
        try:
            data = bytes(self._client.get_object(Bucket=self.bucket, Key=k)["Body"].read())
        except Exception as e:
            if _code(e) in _NOT_FOUND:
                raise BlobNotFoundError(key) from None
            raise self._read_failed(key, e, self._fail("get", key, e)) from None
        self._read_ok(key)
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the end of the blob), in one ranged GET."""
        k = self._k(key)
        if length <= 0:
            if not self.exists(key):
                raise BlobNotFoundError(key)
            return b""
        self._check_held_off(key)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=k,
                                           Range=f"bytes={offset}-{offset + length - 1}")
            data = bytes(resp["Body"].read())
        except Exception as e:
            code = _code(e)
            if code in _NOT_FOUND:
                raise BlobNotFoundError(key) from None
            if code == "InvalidRange":
                return b""
            raise self._read_failed(key, e, self._fail("get", key, e)) from None
        self._read_ok(key)
        return data

    def delete(self, key: str) -> None:
        k = self._k(key)
        if not self.exists(key):
            raise BlobNotFoundError(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=k)
        except Exception as e:
            raise self._fail("delete", key, e) from None

    def list(self, prefix: str = "") -> list[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: list[str] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full)
            for page in pages:
                out.extend(o["Key"][strip:] for o in page.get("Contents", ()))
        except Exception as e:
            raise self._fail("list", prefix, e) from None
        return sorted(out)

    def exists(self, key: str) -> bool:
        k = self._k(key)
        try:
            self._client.head_object(Bucket=self.bucket, Key=k)
        except Exception as e:
            if _code(e) in _NOT_FOUND:
                return False
            raise self._fail("stat", key, e) from None
        return True

    def sync(self) -> None:
        return None

    def abort_stale_uploads(self, prefix: str, older_than_s: float) -> builtins.list[str]:
        """Abort every multipart upload under ``prefix`` begun more than ``older_than_s``
        seconds ago (by the server's clock against this host's: give a bound well above
        any skew) and return the keys they were for. A killed upload leaves its parts in
        the bucket, billed and invisible, until it is aborted (ListMultipartUploads +
        AbortMultipartUpload); an upload that is under way must not be aborted, which the
        caller ensures (store/sharedgc.py: no writer is pinned while GC runs). An upload
        the server already ended meanwhile is skipped. BackendError if listing fails."""
        import datetime

        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        cutoff = datetime.datetime.now(datetime.UTC) - datetime.timedelta(
            seconds=older_than_s)
        stale: builtins.list[tuple[str, str]] = []
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=full)
            for page in pages:
                stale.extend((u["Key"], u["UploadId"]) for u in page.get("Uploads", ())
                             if u["Initiated"] < cutoff)
        except Exception as e:
            raise self._fail("list uploads of", prefix, e) from None
        out: builtins.list[str] = []
        for key, upload in stale:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                    UploadId=upload)
            except Exception as e:
                if _code(e) != "NoSuchUpload":
                    raise self._fail("abort the upload of", key[strip:], e) from None
                continue
            out.append(key[strip:])
        return out

    def check(self) -> None:
        """Raise BackendError unless the bucket is reachable with the configured credentials."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            raise self._fail("open", "", e) from None


def _code(e: Exception) -> str | None:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        code = resp.get("Error", {}).get("Code")
        if code:
            return str(code)
    return None


def _message(e: Exception) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        msg = resp.get("Error", {}).get("Message")
        if msg:
            return str(msg)
    return str(e)
