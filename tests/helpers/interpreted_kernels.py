"""Kernel modules for the Triton tests, interpreted where there is no GPU.

Without CUDA the tests run Triton kernels under TRITON_INTERPRET=1 (conftest sets it
before triton is imported). A kernel module imported while it was unset holds compiled
kernels that cannot run on the CPU: ``kernel_modules`` then reloads the modules it is
given, in that order (dependencies first: a module that imports a jit function from
another must come after it), so that their kernels are interpreted. With CUDA it only
imports them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch


def kernel_modules(*names: str) -> list[ModuleType]:
    """pagoda.kernels.<name> for each name, reloaded for the interpreter if needed."""
    modules = [importlib.import_module(f"pagoda.kernels.{name}") for name in names]
    if torch.cuda.is_available() or not any(map(_has_compiled_kernels, modules)):
        return modules
    return [importlib.reload(module) for module in modules]


def _has_compiled_kernels(module: ModuleType) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return any(
        isinstance(value, JITFunction) and not isinstance(value, InterpretedFunction)
        for value in vars(module).values()
    )
