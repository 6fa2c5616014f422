"""The services' malloc settings (specdec/malloc_tuning.py): once serving, a large block comes
from the heap and is reused when freed, not mapped afresh (and faulted in page by page) each step.
Checked on glibc's own counters in a fresh interpreter, so this process keeps its settings."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

LIBC, LIBC_VERSION = platform.libc_ver()
pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and LIBC == "glibc"
         and tuple(map(int, LIBC_VERSION.split(".")[:2])) >= (2, 33)),
    reason="glibc's mallopt, and its mallinfo2 (glibc >= 2.33) to check it")

# Allocates a 64 MB buffer (the size of a wave's hidden-state rows at C = 64) and prints how many
# MB of mmapped blocks that added (glibc's mallinfo2, glibc >= 2.33; its fields are size_t).
PROBE = """
import ctypes, sys
from specdec.malloc_tuning import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
lines = []
if sys.argv[1] == "tuned":
    assert keep_freed_memory(type("Log", (), {"info": lambda self, *a, **k: lines.append(a)})())
before = libc.mallinfo2().hblkhd
block = bytearray(64 << 20)
print((libc.mallinfo2().hblkhd - before) >> 20, lines)
"""


def _mapped_mb(mode: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True).stdout
    mb, lines = out.split(" ", 1)
    return int(mb), lines


def test_once_tuned_a_large_block_comes_from_the_heap():
    mb, _ = _mapped_mb("default")
    assert mb >= 64   # glibc's default: a fresh mapping for the buffer
    mb, lines = _mapped_mb("tuned")
    assert mb == 0 and "keeps large freed blocks" in lines


def test_the_step_messages_benchmark_reports_every_hop_both_ways():
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_step_messages.py"
    out = subprocess.run([sys.executable, str(script), "--batch", "2", "--repeats", "2"], check=True,
                         capture_output=True, text=True).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 10 and rows[-1][1] == "**all**"
    assert all(float(r[2].strip("*")) > 0 and float(r[3].strip(" |*")) > 0 for r in rows)
