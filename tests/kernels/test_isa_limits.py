"""The invariance tests (marker `invariance`: a row's bits do not depend on
what shares its round) again in a process of their own under each
instruction-set limit this CPU has, with and without PDSERVE_NO_BF16.

torch's BLAS picks its kernels by shape and by instruction set (oneDNN's
and MKL's dispatch, torch's own CPU capability), which is why pdserve's
invariant products run in its own kernels: these runs show that nothing
the invariance tests cover still leans on one of those paths. The limits
are read when a library loads, so each needs a fresh process. A level
beyond this CPU is not run (the libraries would fall back to the best
they have, a run already made)."""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pdserve.kernels.cpu.features import cpu_flags

FILES = ["test_quantized.py", "test_cpu_dense.py", "test_cpu_layer.py", "test_cpu_bf16.py",
         "test_cpu_matmul.py", "test_cpu_attention.py", "test_gguf.py", "test_isa_limits.py"]
CAPABILITY_ENV = "PDSERVE_TEST_CPU_CAPABILITY"     # what the child's torch must report


@dataclass(frozen=True)
class IsaLimit:
    name: str
    needs: tuple[str, ...]     # /proc/cpuinfo flags the level needs
    onednn: str                # ONEDNN_MAX_CPU_ISA
    mkl: str                   # MKL_ENABLE_INSTRUCTIONS
    aten: str                  # ATEN_CPU_CAPABILITY (torch's own kernels)

    def env(self) -> dict[str, str]:
        return {"ONEDNN_MAX_CPU_ISA": self.onednn, "MKL_ENABLE_INSTRUCTIONS": self.mkl,
                "ATEN_CPU_CAPABILITY": self.aten, CAPABILITY_ENV: self.aten.upper()}


LIMITS = [
    IsaLimit("avx2", ("avx2", "fma"), "AVX2", "AVX2", "avx2"),
    IsaLimit("avx512", ("avx512f", "avx512bw", "avx512vl"), "AVX512_CORE", "AVX512", "avx512"),
    IsaLimit("avx512-bf16", ("avx512_bf16",), "AVX512_CORE_BF16", "AVX512_E3", "avx512"),
    IsaLimit("amx", ("amx_bf16", "amx_tile"), "AVX512_CORE_AMX", "AVX512_E4", "avx512"),
]


def limits_here() -> list[IsaLimit]:
    """The levels this CPU has, each including the ones before it."""
    here = []
    for limit in LIMITS:
        if not set(limit.needs) <= cpu_flags():
            break
        here.append(limit)
    return here


@pytest.mark.invariance
def test_torch_runs_the_path_the_limit_asks_for():
    """In a limited run, torch reports the capability the limit set (so a
    limit that silently did nothing fails here); alone, whatever it has."""
    want = os.environ.get(CAPABILITY_ENV)
    have = torch.backends.cpu.get_cpu_capability()
    assert have == want if want else have in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX")


def runs() -> list:
    """Every level as the CPU has it; PDSERVE_NO_BF16 (which only pdserve's
    kernels read) at the lowest and the highest."""
    here = limits_here()
    ends = here[:1] + here[1:][-1:]
    return [pytest.param(limit, False, id=limit.name) for limit in here] + \
        [pytest.param(limit, True, id=f"{limit.name}-no-bf16") for limit in ends]


@pytest.mark.skipif(os.environ.get(CAPABILITY_ENV) is not None, reason="inside a limited run")
@pytest.mark.parametrize("limit,no_bf16", runs())
def test_the_invariance_tests_pass_under_an_instruction_set_limit(limit, no_bf16):
    env = {**os.environ, **limit.env()}
    env.pop("PDSERVE_NO_BF16", None)
    if no_bf16:
        env["PDSERVE_NO_BF16"] = "1"
    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "invariance",
                           "-p", "no:cacheprovider", *[str(p) for f in FILES for p in tests.rglob(f)]],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_ci_runs_at_least_two_limits_on_an_x86_cpu_with_avx_512():
    if "avx512f" in cpu_flags():
        assert len(limits_here()) >= 2
    if "avx2" in cpu_flags() and "fma" in cpu_flags():
        assert limits_here()[0].name == "avx2"
