"""What a process freed goes back to the system on ``trim`` (``trace_plugin.freed_memory``).

The probe runs in a fresh process: glibc's thresholds are per process and move as it frees.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

PROBE = """
import json, sys, torch
from trace_plugin import freed_memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
big = torch.ones(8 << 20, dtype=torch.uint8)
del big  # freeing a mapped 8 MB block raises glibc's own threshold: 4 MB blocks go to the heap
before = rss()
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(100)]  # 400 MB in 4 MB tensors
held = rss()
pinned = blocks[::10]  # every tenth kept: the heap cannot shrink past them on its own
del blocks
freed = rss()
freed_memory.trim()
print(json.dumps({"held": held - before, "freed": freed - before, "trimmed": rss() - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_trim_returns_freed_tensors_the_heap_kept():
    """360 MB of freed 4 MB tensors between ones still held stay resident (the heap keeps
    them for reuse) until ``trim``, which leaves the 40 MB still held."""
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    rss = json.loads(out.stdout)
    assert rss["held"] > 350
    assert rss["freed"] > 300
    assert rss["trimmed"] < 80
