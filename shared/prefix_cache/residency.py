"""How much of a file the page cache holds, and how fast a directory reads what it does not.

A restore from the page cache costs a memory copy; the same restore from a slow disk can cost
more than prefilling its tokens again (worker/restore_cost.py decides). `mincore` answers the
first without reading a byte, so asking changes nothing: a probe read would itself start the
disk reading. `uncached_read_rate` measures the second on a file of its own, written and
dropped from the page cache first.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

PROBE_BYTES = 4 * 2**20  # long enough that a disk's seek is a small part of the read
# The probe stops reading after this long: on a slow disk it would otherwise hold the disk for
# seconds while the first jobs' restores wait behind it (seen at 1 MB/s).
PROBE_S = 0.25
PIECE = 256 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(path: Path) -> int | None:
    """Bytes of the file at `path` the page cache holds now; None when that cannot be known
    (no file, or a system without mincore)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            return None
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                return None
            resident = sum(1 for page in vector if page & 1)
        finally:
            _libc.munmap(address, size)
        return min(size, resident * mmap.PAGESIZE)
    finally:
        os.close(fd)


def uncached_read_rate(directory: Path, n_bytes: int = PROBE_BYTES) -> float | None:
    """Bytes per second reading a file of `directory` that the page cache does not hold: a
    file of our own is written, synced, dropped from the page cache and read back, for at most
    `PROBE_S`. None when the directory cannot be written or the cache not dropped (then
    nothing is known)."""
    path = directory / f".read-probe-{uuid.uuid4().hex}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        log.warning("cannot measure how fast %s reads: %s", directory, exc)
        return None
    try:
        os.write(fd, os.urandom(n_bytes))
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if (resident_bytes(path) or 0) > n_bytes // 2:
            return None  # the page cache kept it (some file systems ignore the advice)
        started = time.perf_counter()
        read = 0
        while (chunk := os.pread(fd, PIECE, read)) and time.perf_counter() - started < PROBE_S:
            read += len(chunk)
        return (read + len(chunk)) / max(time.perf_counter() - started, 1e-9)
    except OSError as exc:
        log.warning("cannot measure how fast %s reads: %s", directory, exc)
        return None
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
