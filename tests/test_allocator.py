"""The tuned allocator keeps freed memory for reuse (arbor.kernels.allocator); each case runs in a fresh
process, since glibc's settings are per process. The blocks come from libc's malloc itself, so no
other allocation lands above them at the heap's top (glibc's default trimming then always applies:
with tensors it depends on what else the process allocated)."""

import os
import platform
import subprocess
import sys

import pytest

STEPS = """
import ctypes, resource
from arbor.kernels.allocator import tune_allocator
took = tune_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def step():                     # COUNT blocks of SIZE live at once (written), then freed
    blocks = [libc.malloc(SIZE) for _ in range(COUNT)]
    for b in blocks:
        ctypes.memset(b, 1, SIZE)
    for b in blocks:
        libc.free(b)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def blocks(size: int, count: int) -> str:
    return STEPS.replace("SIZE", str(size)).replace("COUNT", str(count))


def run(code: str, mode: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "ARBOR_MALLOC": mode}
    return subprocess.run([sys.executable, *(["-c", code] if code else args)], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_tuned_allocator_reuses_freed_blocks_where_glibc_faults_them_in_again():
    tuned, system = (run(blocks(8 << 20, 12), mode).stdout.split() for mode in ("tuned", "system"))
    assert tuned[0] == "True" and system[0] == "False"
    # glibc's thresholds adapt to at most 32 MiB (mmap) and 64 MiB (trim): the 96 MiB freed each step
    # go back to the kernel and are faulted in again (24,576 pages a step)
    assert int(system[1]) > 10 * 20000
    assert int(tuned[1]) < 1000


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_tuned_allocator_reuses_blocks_above_glibcs_largest_mmap_threshold():
    """2 blocks of 64 MiB (an MoE layer's expert gradients are 128 MiB at 32 experts of 1024 × 1024):
    above 32 MiB M_MMAP_THRESHOLD cannot keep them off mmap; M_MMAP_MAX = 0 does."""
    tuned = run(blocks(64 << 20, 2), "tuned").stdout.split()
    assert tuned[0] == "True" and int(tuned[1]) < 1000              # mapped each step: 10 × 32,768 faults


def test_a_bad_arbor_malloc_value_is_refused_naming_the_choices():
    out = run("", "fast", "-m", "arbor", "generate", "no-such-model", "hi")
    assert out.returncode == 2
    assert "ARBOR_MALLOC='fast'" in out.stderr and "tuned" in out.stderr and "system" in out.stderr


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_lean_allocator_returns_every_freed_block_at_once():
    """ARBOR_MALLOC=lean: each 8 MiB block is its own mapping, unmapped when freed (resident memory is
    the live blocks only), so every step faults its 96 MiB in again, as glibc's defaults do here."""
    lean = run(blocks(8 << 20, 12), "lean").stdout.split()
    assert lean[0] == "True" and int(lean[1]) > 10 * 20000
