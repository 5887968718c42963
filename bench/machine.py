"""The processor a benchmark ran on, in one line: its model name and the ISA flags that decide
the half-precision kernels (``amx_bf16``: Intel's AMX tiles; ``avx512_bf16``: AVX-512 BF16
instructions; ``avx512_fp16``: AVX-512 FP16), as Linux's ``/proc/cpuinfo`` lists them."""

from __future__ import annotations

import os
import platform

FLAGS = ("amx_bf16", "avx512_bf16", "avx512_fp16")


def processor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``"AMD EPYC, 2 cores: avx512_bf16; no amx_bf16, avx512_fp16"`` (where ``cpuinfo``
    cannot be read: the platform's own name for the processor)."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines()
                      if line.startswith("flags")), []))
    has = [f for f in FLAGS if f in flags]
    lacks = [f for f in FLAGS if f not in flags]
    return (f"{name}, {os.cpu_count()} cores: {', '.join(has) or 'none of ' + '/'.join(FLAGS)}"
            + (f"; no {', '.join(lacks)}" if has and lacks else ""))


if __name__ == "__main__":
    print(processor())
