"""Whether torch.compile can build a graph here, asked before anything is traced.

On a CPU, inductor writes C++ and builds it with its configured C++ compiler (CXX, else g++), but only after
Dynamo has traced the model and inductor has lowered it: on a machine without one, `--compile` cost each rank
10 to 20 s of a core on 2 cores before the build failed and the step ran eager anyway. Inductor's own search
(`<compiler> --version`, cached for the process) answers in milliseconds. On CUDA the kernels are Triton's,
whose compiler is not asked here: a failure there is still found by compiling.
"""

from __future__ import annotations

import torch


def missing(device: torch.device | str) -> Exception | None:
    """What inductor raises for want of a C++ compiler for a graph on `device`; None where it has one (or the
    device is not a CPU)."""
    if torch.device(device).type != "cpu":
        return None
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler, or an OSError of a CXX that is not a program
        return e
    return None
