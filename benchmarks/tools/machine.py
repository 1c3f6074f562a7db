"""What machine a benchmark ran on: CPU model and the flags that decide which kernels run (printed with every
figure, since machines here differ: one has AVX-512 with bf16 and AMX, another had neither)."""

from __future__ import annotations

from pathlib import Path

import torch

FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpuinfo() -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> str:
    flags = set(_cpuinfo().get("flags", "").split())
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in FLAGS)


def machine_line() -> str:
    """One line: model name, flags, torch's threads and its CPU capability."""
    return (f"{_cpuinfo().get('model name', 'unknown CPU')}; {cpu_flags()}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, kernels {torch.backends.cpu.get_cpu_capability()}")
