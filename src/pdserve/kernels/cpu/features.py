"""What this CPU multiplies fast: whether it has bfloat16 instructions
(and its flags, which kernels/cpu/matmul.py reads for AVX2).

`dtype: auto` runs a quantized GGUF in bfloat16 only where the CPU has
them (AVX512-BF16 or AMX-BF16): there oneDNN's bfloat16 matmuls run about
twice as fast as float32's, and elsewhere bfloat16 is emulated and slower
than float32. Read once per process (flags do not change under it)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")     # /proc/cpuinfo's names, best first


@dataclass(frozen=True)
class Bfloat16Support:
    """Whether bfloat16 is this CPU's fast dtype, and the evidence for it."""
    fast: bool
    why: str           # e.g. "this CPU has avx512_bf16", said in the load's log line


def bfloat16_from_flags(flags: set[str], capability: str) -> Bfloat16Support:
    """The decision from /proc/cpuinfo's flags and torch's CPU capability
    (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2, AVX512, ...):
    the flag says the instructions exist, the capability that torch's
    kernels were built to use an AVX512 or AMX path."""
    have = [f for f in BF16_FLAGS if f in flags]
    if not have:
        return Bfloat16Support(False, "this CPU has no bfloat16 instructions "
                                      f"({' or '.join(BF16_FLAGS)})")
    if not capability.startswith(("AVX512", "AMX")):
        return Bfloat16Support(False, f"this CPU has {have[0]}, but torch's CPU kernels "
                                      f"run its {capability} path")
    return Bfloat16Support(True, f"this CPU has {have[0]}")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags (empty where there is none, as on macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


@functools.lru_cache(maxsize=1)
def cpu_bfloat16() -> Bfloat16Support:
    """This machine's answer (no /proc/cpuinfo, as on macOS: not fast)."""
    import torch

    return bfloat16_from_flags(cpu_flags(), torch.backends.cpu.get_cpu_capability())
