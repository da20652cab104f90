"""edgeq.bench.measure reads process memory through psutil where psutil has the field: the numbers must be the kernel's
own, exactly. A stopped child process holds still while both are read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgeq.bench import measure

# anonymous heap, a shared anonymous mapping (RssShmem) and a private file mapping (RssFile), all touched
CHILD = """
import mmap, sys, time
heap = bytearray(24 << 20)
for i in range(0, len(heap), 4096):
    heap[i] = 1
shared = mmap.mmap(-1, 8 << 20)
shared[:] = b"x" * len(shared)
with open(sys.argv[1], "rb") as f:
    view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
total = sum(view[i] for i in range(0, len(view), 4096))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def stopped_child(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(4 << 20))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(data)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)
        yield proc.pid, str(data)
    finally:
        proc.kill()
        proc.wait()


def _status_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            fields[key] = int(rest.split()[0]) * 1024
    return fields


def _smaps_by_start(pid: int) -> dict[int, tuple[int, int]]:
    """{start address: (Rss, Anonymous)} parsed from /proc/<pid>/smaps."""
    out, start = {}, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(None, 1)[0]
        if not head.endswith(":"):
            start = int(head.split("-")[0], 16)
            out[start] = [0, 0]
        elif head in ("Rss:", "Anonymous:"):
            out[start][head == "Anonymous:"] = int(line.split()[1]) * 1024
    return {k: tuple(v) for k, v in out.items()}


def test_status_equals_the_kernels_status_file(stopped_child):
    pid, _ = stopped_child
    s, k = measure.status(pid), _status_kb(pid)
    assert (s.rss, s.anon, s.file, s.shmem, s.hwm, s.size) == (
        k["VmRSS"], k["RssAnon"], k["RssFile"], k["RssShmem"], k["VmHWM"], k["VmSize"])
    assert s.anon >= 24 << 20 and s.shmem >= 8 << 20 and s.file > 0


def test_mappings_equal_the_kernels_smaps(stopped_child):
    pid, data = stopped_child
    maps = measure.mappings(pid)
    assert {m.start: (m.rss, m.anonymous) for m in maps} == _smaps_by_start(pid)
    mine = [m for m in maps if m.path == data]
    assert len(mine) == 1 and mine[0].size == 4 << 20 and mine[0].rss == 4 << 20 and mine[0].anonymous == 0


def test_own_status_adds_up():
    s = measure.status()
    assert s.rss == s.anon + s.file + s.shmem and s.hwm >= s.rss > 0
