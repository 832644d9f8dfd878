"""Narrow bytes-in/bytes-out storage for the prefix cache.

Keys are ``/``-separated paths of safe segments (``[A-Za-z0-9_-][A-Za-z0-9._-]*``);
a *prefix* is ``""`` or a key followed by ``/``. Names starting with ``.`` are
reserved for in-flight temp files, so they never appear in listings.

Contract (checked by tests/unit/test_blob_store.py against every store):

* ``put`` replaces the whole object atomically: readers see the old bytes or
  the new bytes, never a mix. ``durable=False`` may skip fsync (index
  markers: losing one only costs a cache miss).
* ``get`` returns the whole object as a read-only view that keeps the bytes it was read with,
  even if the key is replaced or deleted meanwhile (objects are never changed in place, so a
  directory store can map the file instead of copying it).
* ``get``/``get_head``/``stat`` return ``None`` for a missing key.
* ``list`` returns sorted immediate child names (objects and sub-prefixes);
  a sub-prefix disappears once its last object is deleted.
* ``scan`` returns every object below a prefix with size and mtime.
* Missing keys are not errors; real I/O failures raise ``OSError``.
"""

from __future__ import annotations

import builtins
import contextlib
import mmap
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from shared.prefix_cache.residency import resident_bytes

_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
_PUT_RETRIES = 3
# File systems on which a mapped file keeps its pages until unmapped, even once replaced or
# unlinked. On a network file system another host's delete can take a page away, and reading
# that page through a mapping is SIGBUS, not an OSError: there `get` reads instead.
MAPPABLE_FILE_SYSTEMS = frozenset(
    {"btrfs", "ext2", "ext3", "ext4", "f2fs", "overlay", "tmpfs", "xfs", "zfs"}
)
_OCTAL = re.compile(r"\\([0-7]{3})")  # /proc/self/mounts writes a space in a path as \040


@dataclass(frozen=True, slots=True)
class BlobStat:
    size_bytes: int
    mtime_s: float


@dataclass(frozen=True, slots=True)
class BlobEntry:
    key: str
    size_bytes: int
    mtime_s: float


class BlobStore(Protocol):
    def put(self, key: str, data: bytes, *, durable: bool = True) -> None: ...

    def get(self, key: str) -> memoryview | None: ...

    def get_head(self, key: str, n_bytes: int) -> bytes | None:
        """First ``n_bytes`` bytes (fewer if the object is shorter)."""
        ...

    def stat(self, key: str) -> BlobStat | None: ...

    def resident_bytes(self, key: str) -> int | None:
        """Bytes of the object a read would find in memory, not on a disk (None: unknown)."""
        ...

    def touch(self, key: str, mtime_s: float) -> bool:
        """Set the modification time; False if the key is missing."""
        ...

    def delete(self, key: str) -> bool:
        """Remove the object; False if it was already missing."""
        ...

    def list(self, prefix: str) -> builtins.list[str]: ...

    def scan(self, prefix: str) -> builtins.list[BlobEntry]: ...


def split_key(key: str) -> builtins.list[str]:
    parts = key.split("/")
    if not all(_SEGMENT.fullmatch(p) for p in parts):
        raise ValueError(f"invalid blob key {key!r}")
    return parts


def split_prefix(prefix: str) -> builtins.list[str]:
    if prefix == "":
        return []
    if not prefix.endswith("/"):
        raise ValueError(f"prefix must be empty or end with '/': {prefix!r}")
    return split_key(prefix[:-1])


class DirectoryBlobStore:
    """Files under ``root``; safe to share between processes and NFS hosts.

    Atomicity comes from write-to-unique-temp + ``os.replace`` in the same
    directory, so no locks are needed. Empty directories are removed on
    delete; ``put`` retries if a concurrent delete removed its directory.
    ``map_reads``: whether ``get`` maps files; by default where the file system is local.
    """

    def __init__(self, root: Path | str, *, map_reads: bool | None = None) -> None:
        self.root = Path(root)
        self._map_reads = _mappable(self.root) if map_reads is None else map_reads

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*split_key(key))

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        path = self._path(key)
        for attempt in range(_PUT_RETRIES):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                _write_atomic(path, data, durable=durable)
                return
            except FileNotFoundError:
                if attempt == _PUT_RETRIES - 1:
                    raise

    def get(self, key: str) -> memoryview | None:
        try:
            with open(self._path(key), "rb") as f:
                return _mapped(f) if self._map_reads else memoryview(f.read())
        except (FileNotFoundError, NotADirectoryError):
            return None

    def get_head(self, key: str, n_bytes: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                # No read-ahead: a head is a few KB of a file of many MB, mostly not read after
                # (a lookup reads the heads of states it may pass over), and on a slow disk
                # the kernel's read-ahead would cost more than the head.
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                return f.read(n_bytes)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def stat(self, key: str) -> BlobStat | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return BlobStat(st.st_size, st.st_mtime)

    def resident_bytes(self, key: str) -> int | None:
        return resident_bytes(self._path(key))

    def touch(self, key: str, mtime_s: float) -> bool:
        try:
            os.utime(self._path(key), (mtime_s, mtime_s))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        self._remove_empty_dirs(path.parent)
        return True

    def list(self, prefix: str) -> builtins.list[str]:
        directory = self.root.joinpath(*split_prefix(prefix))
        try:
            with os.scandir(directory) as it:
                return sorted(e.name for e in it if not e.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def scan(self, prefix: str) -> builtins.list[BlobEntry]:
        out: builtins.list[BlobEntry] = []
        pending = [(self.root.joinpath(*split_prefix(prefix)), prefix)]
        while pending:
            directory, key_prefix = pending.pop()
            try:
                with os.scandir(directory) as it:
                    children = [e for e in it if not e.name.startswith(".")]
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed while we walked
            for e in children:
                key = key_prefix + e.name
                try:
                    if e.is_dir(follow_symlinks=False):
                        pending.append((Path(e.path), key + "/"))
                    elif e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        out.append(BlobEntry(key, st.st_size, st.st_mtime))
                except FileNotFoundError:
                    continue
        out.sort(key=lambda b: b.key)
        return out

    def _remove_empty_dirs(self, directory: Path) -> None:
        while directory != self.root and self.root in directory.parents:
            try:
                os.rmdir(directory)
            except OSError:
                return  # not empty (or already gone / not ours): stop climbing
            directory = directory.parent


def _mapped(f: BinaryIO) -> memoryview:
    """The file's pages in the page cache, mapped read-only: no copy and no fresh memory, which
    costs more than the copy itself on a VM (37 MB: 22 ms into a new buffer, 6 ms into an
    existing one). Populated at once rather than faulted in page by page; unmapped when the
    last view of it goes."""
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        return memoryview(b"")  # mmap refuses an empty file
    flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
    return memoryview(mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ))


def _mappable(root: Path) -> bool:
    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        return False  # not Linux: nothing known about the file system, so read
    return file_system(root, mounts) in MAPPABLE_FILE_SYSTEMS


def file_system(path: Path, mounts: str) -> str:
    """Type of the file system holding `path`, given /proc/self/mounts ("" if none matches).

    The deepest mount point above `path` wins, and the later of two on one point (it is on top).
    """
    path = path.resolve()
    found, depth = "", -1
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = Path(_OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[1]))
        if len(mount.parts) >= depth and (mount == path or mount in path.parents):
            found, depth = fields[2], len(mount.parts)
    return found


def _write_atomic(path: Path, data: bytes, *, durable: bool) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Best effort: some file systems (and all of Windows) cannot fsync a dir.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass(slots=True)
class _MemObject:
    data: bytes
    mtime_s: float


@dataclass(slots=True)
class _MemDir:
    files: dict[str, _MemObject] = field(default_factory=dict)
    dirs: dict[str, _MemDir] = field(default_factory=dict)


class MemoryBlobStore:
    """In-process store with the same contract, for tests and embedding."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._root = _MemDir()
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        *dirs, name = split_key(key)
        obj = _MemObject(bytes(data), self._clock())
        with self._lock:
            node = self._root
            for part in dirs:
                if part in node.files:
                    raise NotADirectoryError(key)
                node = node.dirs.setdefault(part, _MemDir())
            if name in node.dirs:
                raise IsADirectoryError(key)
            node.files[name] = obj

    def _find(self, key: str) -> _MemObject | None:
        *dirs, name = split_key(key)
        node = self._walk(dirs)
        return None if node is None else node.files.get(name)

    def _walk(self, parts: builtins.list[str]) -> _MemDir | None:
        node = self._root
        for part in parts:
            child = node.dirs.get(part)
            if child is None:
                return None
            node = child
        return node

    def get(self, key: str) -> memoryview | None:
        with self._lock:
            obj = self._find(key)
            return None if obj is None else memoryview(obj.data)

    def get_head(self, key: str, n_bytes: int) -> bytes | None:
        data = self.get(key)
        return None if data is None else bytes(data[:n_bytes])

    def stat(self, key: str) -> BlobStat | None:
        with self._lock:
            obj = self._find(key)
            return None if obj is None else BlobStat(len(obj.data), obj.mtime_s)

    def resident_bytes(self, key: str) -> int | None:
        stat = self.stat(key)
        return None if stat is None else stat.size_bytes

    def touch(self, key: str, mtime_s: float) -> bool:
        with self._lock:
            obj = self._find(key)
            if obj is None:
                return False
            obj.mtime_s = mtime_s
            return True

    def delete(self, key: str) -> bool:
        *dirs, name = split_key(key)
        with self._lock:
            path = [self._root]
            for part in dirs:
                child = path[-1].dirs.get(part)
                if child is None:
                    return False
                path.append(child)
            if path[-1].files.pop(name, None) is None:
                return False
            for parent, part in zip(reversed(path[:-1]), reversed(dirs), strict=True):
                child = parent.dirs[part]
                if child.files or child.dirs:
                    break
                del parent.dirs[part]
            return True

    def list(self, prefix: str) -> builtins.list[str]:
        with self._lock:
            node = self._walk(split_prefix(prefix))
            return [] if node is None else sorted([*node.files, *node.dirs])

    def scan(self, prefix: str) -> builtins.list[BlobEntry]:
        out: builtins.list[BlobEntry] = []
        with self._lock:
            start = self._walk(split_prefix(prefix))
            pending = [] if start is None else [(start, prefix)]
            while pending:
                node, key_prefix = pending.pop()
                for name, obj in node.files.items():
                    out.append(BlobEntry(key_prefix + name, len(obj.data), obj.mtime_s))
                for name, child in node.dirs.items():
                    pending.append((child, f"{key_prefix}{name}/"))
        out.sort(key=lambda b: b.key)
        return out
