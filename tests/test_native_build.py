"""``arbor.kernels.native``: the C kernels' build settings are checked, and a kernel built for an
AVX2-only target reports its AVX-512 paths unavailable (so callers take the PyTorch path)."""

import shutil

import pytest

from arbor.kernels import cpu_attention, cpu_moe
from arbor.kernels import native

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@pytest.mark.parametrize("var, value", [("ARBOR_CPU_KERNELS", "off"), ("ARBOR_CPU_ARCH", "x86 64;rm")])
def test_bad_settings_are_refused_naming_the_variable(monkeypatch, var, value):
    monkeypatch.setenv("ARBOR_CPU_KERNELS", "1")             # the suite may run with the kernels off
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        native.build(cpu_moe.SOURCE, cpu_moe.FLAGS)


def test_kernels_off_builds_nothing(monkeypatch):
    monkeypatch.setenv("ARBOR_CPU_KERNELS", "0")
    assert native.build(cpu_moe.SOURCE, cpu_moe.FLAGS) is None


@needs_cc
def test_an_arch_the_compiler_refuses_is_an_error_not_a_silent_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("ARBOR_CPU_KERNELS", "1")
    monkeypatch.setenv("ARBOR_CACHE", str(tmp_path))
    monkeypatch.setenv("ARBOR_CPU_ARCH", "no-such-cpu")
    with pytest.raises(ValueError, match="ARBOR_CPU_ARCH='no-such-cpu'"):
        native.build(cpu_moe.SOURCE, cpu_moe.FLAGS)


@needs_cc
def test_an_avx2_build_has_no_avx512_kernels(monkeypatch, tmp_path):
    monkeypatch.setenv("ARBOR_CPU_KERNELS", "1")
    monkeypatch.setenv("ARBOR_CACHE", str(tmp_path))
    monkeypatch.setenv("ARBOR_CPU_ARCH", "x86-64-v3")
    moe = native.build(cpu_moe.SOURCE, cpu_moe.FLAGS)
    prefill = native.build(cpu_attention.PREFILL_SOURCE, cpu_attention.FLAGS)
    assert moe is not None and prefill is not None
    assert moe.moe_experts_bf16_available() == 0 and prefill.paged_prefill_available() == 0
    assert len(list(tmp_path.glob("*.so"))) == 2          # built for this target, beside no native build
