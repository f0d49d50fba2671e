"""The host id (store/hostid.py): configured or derived from machine id and boot id."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.config import HOST_FILE, StoreConfigError, bind_host
from store.hostid import check_host_id, host_id


def test_host_id_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWINDFS_HOST_ID", "build-7.eu")
    assert host_id() == "build-7.eu"
    monkeypatch.setenv("REWINDFS_HOST_ID", "bad:id")
    with pytest.raises(ValueError):
        host_id()


def test_derived_host_id_is_stable_and_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REWINDFS_HOST_ID", raising=False)
    a = host_id()
    assert a == host_id() and check_host_id(a) == a
    assert ":" not in a and len(a.rsplit("-", 1)[1]) == 12


@pytest.mark.parametrize("bad", ["", "a:b", "x" * 65, "a b", "ü"])
def test_invalid_host_ids(bad: str) -> None:
    with pytest.raises(ValueError):
        check_host_id(bad)


def test_an_empty_host_id_file_is_refused_in_one_line(tmp_path: Path) -> None:
    """A local directory's host id file left empty is a typed refusal naming the file (it
    recursed until RecursionError: the link that publishes the id found the file there)."""
    (tmp_path / HOST_FILE).write_text("\n")
    with pytest.raises(StoreConfigError, match="host id file of this directory is empty"):
        bind_host(str(tmp_path), "hostA")
