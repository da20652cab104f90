"""Process memory, read from the kernel: what this process holds, split by kind, and what of a mapping is resident.

Linux only (``/proc`` and ``mincore(2)``); every reader raises :class:`EdgeqError` elsewhere rather than guessing.
No torch import here: the bench parent uses it too. The kernel's files are read through psutil where psutil reports
the field (``memory_info``: statm; ``memory_maps``: smaps); by hand only for the two fields it lacks (see
:func:`status`).

Kinds of resident memory (``/proc/self/status``, kB there, bytes here)::

    VmRSS = RssAnon + RssFile + RssShmem

- ``RssAnon``: private anonymous pages (heap, tensors, the KV cache, copy-on-write copies of mapped pages);
- ``RssFile``: file-backed pages mapped into this process (shared libraries, the mapped checkpoint);
- ``RssShmem``: shared memory and tmpfs files (a checkpoint on /dev/shm or a tmpfs /tmp lands here, not in RssFile).

``VmHWM`` is the peak of VmRSS; writing ``5`` to ``/proc/self/clear_refs`` resets it (Linux >= 4.0), so a peak can be
taken over one phase (:func:`reset_peak`). ``ru_maxrss`` (getrusage, wait4) is the whole-life peak and cannot be reset.

Residency (:func:`resident_bytes`): ``mincore(2)`` fills one byte per page of a mapped range whose bit 0 says "in
RAM". For anonymous memory that means touched (an allocated but never written page is not resident). For a file
mapping it means "in the page cache", whether or not this process has faulted the page in -- for files the caller owns
or may write (Linux >= 5.0 reports, for other files, only pages this process has mapped). The per-mapping ``Rss`` of
``/proc/self/smaps`` is the other view: pages of that mapping in this process's page tables.
Worked example: an 8 MiB file just written, fsynced and dropped from the cache (``posix_fadvise(DONTNEED)``), then
mapped: mincore says 0 bytes; read one byte in each of its first 256 pages (with ``MADV_RANDOM``, no read-ahead):
mincore says 1 MiB (256 * 4096), smaps Rss about 1 MiB (plus fault-around of already-cached neighbours).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
from dataclasses import dataclass
from pathlib import Path

import psutil

from edgeq.errors import EdgeqError

PAGE = mmap.PAGESIZE
# psutil reports neither: its memory_info().shared is RssFile + RssShmem together, and it has no peak RSS (getrusage's
# ru_maxrss is a peak too, but the whole life's: it cannot be reset per phase like VmHWM).
_STATUS_ONLY = ("RssShmem", "VmHWM")


@dataclass(frozen=True)
class ProcMemory:
    """One reading of /proc/<pid>/status, in bytes."""

    rss: int
    anon: int
    file: int
    shmem: int
    hwm: int  # peak VmRSS since start or the last reset_peak()
    size: int  # virtual size (allocated address space, not memory)


def _kb_fields(text: str, names) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * 1024  # the kernel writes kB
    return out


def status(pid: int | str = "self") -> ProcMemory:
    """VmRSS, RssAnon, RssFile, RssShmem, VmHWM and VmSize of a process.

    psutil's ``memory_info()`` reads /proc/<pid>/statm, whose resident and shared pages are the kernel counters that
    /proc/<pid>/status prints: ``rss`` = VmRSS (anon + file + shmem pages), ``shared`` = RssFile + RssShmem,
    ``vms`` = VmSize; so RssAnon = rss - shared, the same number. RssShmem and VmHWM come from status (psutil has
    neither), and RssFile = shared - RssShmem keeps ``rss == anon + file + shmem`` exact, as in the kernel's files.
    """
    try:  # statm first: VmHWM read after it is >= the rss read before it, as when both came from status
        mem = psutil.Process(os.getpid() if pid == "self" else int(pid)).memory_info()
        text = Path(f"/proc/{pid}/status").read_text()
    except (OSError, psutil.Error) as e:
        raise EdgeqError(f"/proc/{pid}: unreadable ({e}); edgeq measures memory on Linux only") from e
    f = _kb_fields(text, _STATUS_ONLY)
    missing = [k for k in _STATUS_ONLY if k not in f]
    if missing:
        raise EdgeqError(f"/proc/{pid}/status: no {', '.join(missing)} (Linux >= 4.5 reports them)")
    shmem = f["RssShmem"]
    return ProcMemory(rss=mem.rss, anon=mem.rss - mem.shared, file=mem.shared - shmem, shmem=shmem, hwm=f["VmHWM"],
                      size=mem.vms)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False when the kernel refuses (then VmHWM is the whole-life peak)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def maxrss_self() -> int:
    """Whole-life peak RSS of this process (getrusage), bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class Mapping:
    """One VMA of /proc/self/smaps: address range, path, and its resident pages."""

    start: int
    end: int
    perms: str
    path: str
    rss: int  # pages of this mapping in this process's page tables
    anonymous: int  # of which anonymous (copy-on-write copies of a private file mapping)

    @property
    def size(self) -> int:
        return self.end - self.start


def mappings(pid: int | str = "self") -> list[Mapping]:
    """Every VMA with its Rss and Anonymous: /proc/<pid>/smaps, read by psutil (``memory_maps(grouped=False)``;
    an anonymous mapping's path is ``[anon]`` there)."""
    try:
        maps = psutil.Process(os.getpid() if pid == "self" else int(pid)).memory_maps(grouped=False)
    except (OSError, psutil.Error) as e:
        raise EdgeqError(f"/proc/{pid}/smaps: unreadable ({e}); edgeq measures memory on Linux only") from e
    out = []
    for m in maps:
        start, end = (int(a, 16) for a in m.addr.split("-"))
        out.append(Mapping(start, end, m.perms, m.path, m.rss, m.anonymous))
    return out


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
        lib.mincore.restype = ctypes.c_int
        _libc = lib
    return _libc.mincore


def resident_bytes(address: int, length: int) -> int:
    """Bytes of ``[address, address + length)`` whose pages are in RAM, by mincore(2); page granularity, clipped to
    the range (a partly covered page counts only its covered bytes). The range must be mapped (else EdgeqError)."""
    if length <= 0:
        return 0
    first = address - address % PAGE
    end = address + length
    pages = (end - first + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _mincore()(ctypes.c_void_p(first), ctypes.c_size_t(pages * PAGE), vec) != 0:
        err = ctypes.get_errno()
        raise EdgeqError(f"mincore({address:#x}, {length}): {os.strerror(err)}; the range is not (all) mapped")
    raw = bytes(vec)
    total = sum(b & 1 for b in raw) * PAGE if pages < 64 else _count_fast(raw)
    if raw[0] & 1:
        total -= address - first  # the part of the first page before the range
    last_end = first + pages * PAGE
    if raw[-1] & 1:
        total -= last_end - end
    return total


def _count_fast(raw: bytes) -> int:
    # bit 0 is the only defined bit; masking keeps this correct if the kernel ever sets others.
    return raw.translate(_ODD).count(1) * PAGE


_ODD = bytes(b & 1 for b in range(256))


@dataclass(frozen=True)
class FileResidency:
    """Mapped files under one root: their mapped size, what mincore finds in RAM, and what this process has paged in."""

    files: tuple[str, ...]
    mapped_bytes: int  # address space of the mappings (allocated is not resident)
    resident_bytes: int  # mincore: in RAM (page cache or private copies)
    rss_bytes: int  # smaps Rss: in this process's page tables
    anonymous_bytes: int  # smaps Anonymous: private copies of mapped pages (writes to a MAP_PRIVATE view)
    pmd_mapped_bytes: int = 0  # smaps FilePmdMapped: of rss_bytes, mapped with 2 MiB entries (huge pages)


def pmd_mapped(pid: int | str = "self") -> dict[int, int]:
    """{VMA start address: FilePmdMapped bytes} from /proc/<pid>/smaps (psutil does not report this field): how much of
    each file mapping the kernel maps with one 2 MiB page-table entry per 512 pages. {} where smaps is unreadable."""
    try:
        return parse_pmd_mapped(Path(f"/proc/{pid}/smaps").read_text())
    except OSError:
        return {}


def parse_pmd_mapped(text: str) -> dict[int, int]:
    """The smaps parsing of :func:`pmd_mapped`: a VMA's header line starts with ``start-end``, its fields follow."""
    out, start = {}, None
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            start = int(head.split("-")[0], 16)
        elif head == "FilePmdMapped:" and start is not None:
            out[start] = int(rest.split()[0]) * 1024
    return out


def mapped_residency(root: str | Path, maps: list[Mapping] | None = None) -> FileResidency:
    """Residency of every mapping of a file at or under ``root`` (a checkpoint directory or one file)."""
    root_s = os.path.realpath(root)
    prefix = root_s.rstrip("/") + "/"
    files, mapped, resident, rss, anon, pmd = set(), 0, 0, 0, 0, 0
    huge = pmd_mapped() if maps is None else {}
    for m in maps if maps is not None else mappings():
        path = m.path.removesuffix(" (deleted)")
        if path == root_s or path.startswith(prefix):
            files.add(path)
            mapped += m.size
            resident += resident_bytes(m.start, m.size)
            rss += m.rss
            anon += m.anonymous
            pmd += huge.get(m.start, 0)
    return FileResidency(tuple(sorted(files)), mapped, resident, rss, anon, pmd)


def file_cached_bytes(path: str | Path) -> int:
    """Bytes of a file now in the page cache (maps it read-only for a moment; reads no data)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:  # writable view: ctypes needs one for the address; nothing is written
        return resident_bytes(address_of(m), size)


def address_of(m: mmap.mmap) -> int:
    """Start address of an mmap object. The buffer export is released at once, so the mmap can still be closed."""
    probe = ctypes.c_char.from_buffer(m)
    address = ctypes.addressof(probe)
    del probe
    return address


def tensor_resident(t) -> tuple[int, int]:
    """(allocated bytes, resident bytes) of a CPU tensor's storage (allocated is not resident)."""
    storage = t.untyped_storage()
    n = storage.nbytes()
    return n, resident_bytes(storage.data_ptr(), n) if n else 0
