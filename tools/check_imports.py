"""The import contract of the `pagoda` package, checked by CI (`make lint`) and by
tests/test_import_contract.py.

Rules, read from the source with `ast` (nothing is imported):

1. Layers run one way. A module may import its own layer and the layers below it,
   never one above (LAYERS, top first). The feature packages that span layers put
   their torch-free planning part in the bottom layer (`*.planning`) and the rest
   in the worker layer.
2. No import cycles between modules, counting imports inside functions too: a
   function-local import that dodges a cycle is still a cycle.
3. The bottom layer (`core`, the planning parts, `config`, `sampling_params`,
   `outputs`, `structured`) imports neither torch nor triton (numpy is fine), except
   that `pagoda.config` asks torch whether CUDA is present when it resolves "auto".
4. A kernel family (`pagoda.kernels.<family>`) imports nothing of pagoda but its own
   family, `kernels.launch`, and the families KERNEL_FAMILY_DEPS names.

Usage: python tools/check_imports.py [ROOT]   (exit status 1 and one line per
violation when the contract is broken).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# Top first. A module belongs to the entry whose prefix matches it (longest prefix
# wins); `pagoda` itself (the package's __init__) is the top, and a new top-level
# module must be placed here explicitly.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("front doors", ("pagoda", "pagoda.__main__", "pagoda.entrypoints", "pagoda.bench")),
    ("engine", ("pagoda.engine", "pagoda.metrics", "pagoda.spec_decode.engine_setup")),
    ("executor", ("pagoda.executor",)),
    ("worker", ("pagoda.worker", "pagoda.spec_decode", "pagoda.kv_offload")),
    ("sample", ("pagoda.sample",)),
    ("model", ("pagoda.model",)),
    ("distributed", ("pagoda.distributed",)),
    ("attention", ("pagoda.attention",)),
    ("kernels", ("pagoda.kernels", "pagoda.progress")),
    (
        "core",
        (
            "pagoda.core",
            "pagoda.config",
            "pagoda.engine_flags",
            "pagoda.sampling_params",
            "pagoda.outputs",
            "pagoda.structured",
            "pagoda.spec_decode.planning",
            "pagoda.spec_decode.proposers.ngram",
            "pagoda.kv_offload.planning",
        ),
    ),
]
TORCH_FREE_LAYER = "core"
FORBIDDEN_IN_TORCH_FREE = ("torch", "triton")
# Modules of the torch-free layer that may import torch inside a function to probe the
# machine (never at module level).
DEVICE_PROBES = ("pagoda.config",)
# Kernel families that build on another family's device code, with the reason.
KERNEL_FAMILY_DEPS: dict[str, tuple[str, ...]] = {
    "fp8": (
        "gemv",
        "norm",
    ),  # W8A16 reuses the GEMV's tile loads; quantization fuses into the norms
    "moe": ("norm",),  # the grouped GEMMs' activation is the norm family's silu_and_mul
}
KERNEL_SHARED = "launch"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_modules(root: Path) -> dict[str, Path]:
    return {module_name(root, p): p for p in sorted((root / "pagoda").rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: dict[str, Path]):
    """(imported pagoda module or None, line, top-level package name, whether the import
    is at module level) for every import."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    seen = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            top = target.split(".")[0]
            if top == "pagoda":
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if not target or target == name:
                    continue
            else:
                target = None
            key = (target or top, node.lineno)
            if key not in seen:
                seen.add(key)
                yield target, node.lineno, top, id(node) in top_level


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            covers = module == prefix or (prefix != "pagoda" and module.startswith(prefix + "."))
            if covers and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise SystemExit(f"{module}: in no layer of tools/check_imports.py's LAYERS")
    return best


def kernel_family(module: str):
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "kernels" else None


def check_edge(src: str, dst: str) -> str | None:
    if layer_of(dst) < layer_of(src):
        return (
            f"imports {dst} ({LAYERS[layer_of(dst)][0]} layer) from the "
            f"{LAYERS[layer_of(src)][0]} layer below it"
        )
    family, target = kernel_family(src), kernel_family(dst)
    if family is not None:
        allowed = {family, KERNEL_SHARED, *KERNEL_FAMILY_DEPS.get(family, ())}
        if target not in allowed:
            return f"kernel family {family!r} imports {dst} (allowed: {', '.join(sorted(allowed))})"
    return None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def check(root: Path) -> list[str]:
    modules = collect_modules(root)
    problems, graph = [], {}
    for name, path in modules.items():
        where = path.relative_to(root)
        torch_free = LAYERS[layer_of(name)][0] == TORCH_FREE_LAYER
        for target, line, top, at_top_level in imported_modules(name, path, modules):
            if target is None:
                probe = name in DEVICE_PROBES and not at_top_level
                if torch_free and top in FORBIDDEN_IN_TORCH_FREE and not probe:
                    problems.append(f"{where}:{line}: imports {top} in the torch-free layer")
                continue
            graph.setdefault(name, set()).add(target)
            problem = check_edge(name, target)
            if problem:
                problems.append(f"{where}:{line}: {problem}")
    for cycle in find_cycles(graph):
        problems.append("import cycle: " + " <-> ".join(cycle))
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1])
    problems = check(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} import contract violation(s); see tools/check_imports.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
