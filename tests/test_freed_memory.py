"""Freed tensors go back to the system once a model is loaded (``trace_plugin.freed_memory``).

Each case runs in a fresh process: glibc's threshold is per process and moves as it frees.
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
if sys.argv[1] == "mapped":
    assert freed_memory.map_large_blocks()
big = torch.ones(8 << 20, dtype=torch.uint8)
del big  # freeing a mapped 8 MB block raises glibc's own threshold
before = rss()
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(100)]  # 400 MB in 4 MB tensors
held = rss()
pinned = blocks[::10]  # every tenth kept: the heap cannot shrink past them
del blocks
print(json.dumps({"held": held - before, "after_free": rss() - before}))
"""


def probe(mode: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_tensors_of_a_megabyte_or_more_leave_the_process():
    """Without the setting, 360 MB of freed 4 MB tensors stay resident between the ones
    still held (the heap keeps them for reuse); with it, each was its own mapping and is
    gone when freed."""
    kept, mapped = probe("default"), probe("mapped")
    assert kept["held"] > 350 and mapped["held"] > 350  # both did allocate them
    assert kept["after_free"] > 300
    assert mapped["after_free"] < 80  # the 40 MB still held


def test_load_model_maps_large_blocks_and_trim_is_safe_anywhere():
    from trace_plugin import freed_memory

    freed_memory.trim()  # nothing to return is no error
    assert freed_memory.map_large_blocks() is freed_memory.map_large_blocks()  # once per process
