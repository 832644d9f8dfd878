"""One contract suite, run against every BlobStore implementation."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from shared.prefix_cache.blobs import (
    MAPPABLE_FILE_SYSTEMS,
    BlobStore,
    DirectoryBlobStore,
    MemoryBlobStore,
    file_system,
)


@pytest.fixture(params=["directory-mapped", "directory-read", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "memory":
        return MemoryBlobStore()
    return DirectoryBlobStore(tmp_path / "store", map_reads=request.param == "directory-mapped")


def test_put_get_roundtrip_and_overwrite(store: BlobStore) -> None:
    store.put("a/b/c", b"one")
    assert store.get("a/b/c") == b"one"
    store.put("a/b/c", b"two!")
    assert store.get("a/b/c") == b"two!"
    store.put("a/empty", b"", durable=False)
    assert store.get("a/empty") == b""


def test_get_is_a_read_only_view_that_outlives_replace_and_delete(store: BlobStore) -> None:
    store.put("a/k", b"first")
    view = store.get("a/k")
    assert view is not None and view.readonly
    with pytest.raises(TypeError):
        view[0] = 0
    store.put("a/k", b"second, longer")
    assert store.get("a/k") == b"second, longer"
    store.delete("a/k")
    assert view == b"first"


def test_missing_keys_are_none_not_errors(store: BlobStore) -> None:
    assert store.get("x/y") is None
    assert store.get_head("x/y", 4) is None
    assert store.stat("x/y") is None
    assert store.touch("x/y", 1.0) is False
    assert store.delete("x/y") is False
    assert store.list("x/") == []
    assert store.scan("x/") == []


def test_get_head(store: BlobStore) -> None:
    store.put("k", b"0123456789")
    assert store.get_head("k", 4) == b"0123"
    assert store.get_head("k", 100) == b"0123456789"


def test_stat_and_touch(store: BlobStore) -> None:
    store.put("d/k", b"12345")
    stat = store.stat("d/k")
    assert stat is not None and stat.size_bytes == 5
    assert store.touch("d/k", 1_000_000.5) is True
    stat = store.stat("d/k")
    assert stat is not None and stat.mtime_s == pytest.approx(1_000_000.5)


def test_delete(store: BlobStore) -> None:
    store.put("d/k", b"x")
    assert store.delete("d/k") is True
    assert store.get("d/k") is None
    assert store.delete("d/k") is False


def test_list_immediate_children_sorted(store: BlobStore) -> None:
    for key in ("r/b", "r/a", "r/sub/x", "r/sub/deeper/y", "other/z"):
        store.put(key, b".")
    assert store.list("r/") == ["a", "b", "sub"]
    assert store.list("r/sub/") == ["deeper", "x"]
    assert store.list("") == ["other", "r"]


def test_empty_prefixes_vanish_after_last_delete(store: BlobStore) -> None:
    store.put("r/sub/deeper/y", b".")
    store.put("r/keep", b".")
    store.delete("r/sub/deeper/y")
    assert store.list("r/") == ["keep"]
    store.put("r/sub/deeper/y", b"again")  # recreating a pruned prefix works
    assert store.get("r/sub/deeper/y") == b"again"


def test_scan_is_recursive_with_sizes(store: BlobStore) -> None:
    store.put("s/a", b"1")
    store.put("s/d/b", b"22")
    store.put("t/c", b"333")
    found = {(e.key, e.size_bytes) for e in store.scan("s/")}
    assert found == {("s/a", 1), ("s/d/b", 2)}
    assert len(store.scan("")) == 3


@pytest.mark.parametrize("key", ["", "/a", "a/", "a//b", "../a", "a/../b", ".hidden", "a b"])
def test_invalid_keys_rejected(store: BlobStore, key: str) -> None:
    with pytest.raises(ValueError):
        store.put(key, b"x")
    with pytest.raises(ValueError):
        store.get(key)


def test_invalid_prefix_rejected(store: BlobStore) -> None:
    with pytest.raises(ValueError):
        store.list("no-trailing-slash")


def test_key_cannot_be_both_object_and_prefix(store: BlobStore) -> None:
    store.put("a/b", b"x")
    with pytest.raises(OSError):
        store.put("a/b/c", b"y")
    store.put("p/q/r", b"x")
    with pytest.raises(OSError):
        store.put("p/q", b"y")


# ---- DirectoryBlobStore specifics -------------------------------------------------


def test_directory_store_leaves_no_temp_files(tmp_path: Path) -> None:
    store = DirectoryBlobStore(tmp_path)
    store.put("a/b", b"x" * 1000)
    store.put("a/b", b"y")
    assert sorted(os.listdir(tmp_path / "a")) == ["b"]


def test_directory_store_hides_temp_files_from_listings(tmp_path: Path) -> None:
    store = DirectoryBlobStore(tmp_path)
    store.put("a/b", b"x")
    (tmp_path / "a" / ".b.deadbeef.tmp").write_bytes(b"partial")
    assert store.list("a/") == ["b"]
    assert [e.key for e in store.scan("")] == ["a/b"]


def test_directory_store_write_failure_cleans_temp(tmp_path: Path) -> None:
    store = DirectoryBlobStore(tmp_path)
    store.put("a/b/c", b"x")
    with pytest.raises(OSError):
        store.put("a/b", b"dir in the way")
    assert sorted(os.listdir(tmp_path / "a")) == ["b"]


def test_directory_store_shares_state_between_instances(tmp_path: Path) -> None:
    DirectoryBlobStore(tmp_path).put("k/v", b"shared")
    assert DirectoryBlobStore(tmp_path).get("k/v") == b"shared"


MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw,nosuid 0 0
server:/export /srv/cache nfs4 rw,relatime 0 0
tmpfs /srv/cache/local tmpfs rw 0 0
/dev/vdb /srv/my\\040cache xfs rw 0 0
server:/other /srv/my\\040cache fuse.sshfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/var/lib/granary", "ext4"),
        ("/srv/cache", "nfs4"),
        ("/srv/cache/kv/blobs", "nfs4"),
        ("/srv/cache/local/kv", "tmpfs"),
        ("/srv/cache-other", "ext4"),  # a longer name is not below the mount point
        ("/srv/my cache/kv", "fuse.sshfs"),  # escaped space; the later mount is on top
    ],
)
def test_file_system_of_a_path(path: str, kind: str) -> None:
    assert file_system(Path(path), MOUNTS) == kind


def test_directory_store_maps_files_on_a_local_file_system(tmp_path: Path) -> None:
    DirectoryBlobStore(tmp_path).put("k", b"same")
    local = file_system(tmp_path, Path("/proc/self/mounts").read_text()) in MAPPABLE_FILE_SYSTEMS
    for map_reads, mapped in ((None, local), (True, True), (False, False)):
        view = DirectoryBlobStore(tmp_path, map_reads=map_reads).get("k")
        assert view == b"same" and isinstance(view.obj, mmap.mmap) == mapped
