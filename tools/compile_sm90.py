"""Compile Triton kernels for Hopper (sm_90) on a machine without a GPU.

    python tools/compile_sm90.py            # every kernel case in CASES (tools/sm90_cases/)
    python tools/compile_sm90.py moe        # the cases of one group
    python tools/compile_sm90.py --loops pdl   # and each kernel's loops in SASS
    python tools/compile_sm90.py --sass DIR pdl   # and each case's SASS into DIR
    python tools/compile_sm90.py defaults   # the decode kernels the engine runs by default

The Triton interpreter (what the CPU tests run) executes a kernel's Python, so it
cannot see what the GPU compiler rejects (an op a layout cannot lower, shared memory
or registers over the limit, a constexpr used as a runtime value). This tool binds
each case's arguments (CPU tensors stand in for device pointers: only dtype and
alignment matter), builds the kernel with Triton's own compiler for
GPUTarget("cuda", 90, 32) through ptxas (shipped with Triton) and prints its
registers, spills and shared memory. A compile error is raised, and the run exits 1.
With --sass DIR it writes each case's whole SASS to DIR/<group>.<case>.sass: run it
before and after a change that should not alter the compiled code (a kernel split into
helpers, say) and diff the two folders.
With --loops it also disassembles the cubin (cuobjdump -sass) and prints each loop
(a backward branch) with its instruction count and commonest opcodes: for a kernel
bound by instruction issue, the count of its main loop is a first measure of a change.
It says nothing about speed or results. The local Triton may be newer than the GPU
machine's: a kernel that compiles here is likely, not certain, to compile there, and
its pipelining (buffers, copy waits) and counts can differ: for those, run this tool
under the GPU's Triton (pip install triton==3.6.0 into a scratch venv with torch).

The cases (tools/sm90_cases/, by kernel family) take their tiles and launch options from
the kernel families' configs for Hopper (`for_capability(HOPPER)`), as the engine's
wrappers pass them on an H100 or H200, with programmatic dependent launch on (USE_PDL).
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from sm90_cases import CASES  # noqa: E402  (tools/sm90_cases/, beside this file)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_for_sm90(kernel, *args, **kwargs):
    """Compiles kernel (a triton.jit function) for TARGET with these launch arguments
    (as in kernel[grid](*args, **kwargs)); returns the compiled kernel."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def _cuobjdump(compiled, flag: str) -> str:
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resource_usage(compiled) -> str:
    """cuobjdump's resource line of the cubin (registers, stack, local memory)."""
    out = _cuobjdump(compiled, "-res-usage")
    lines = [ln.strip() for ln in out.splitlines() if "REG:" in ln]
    return lines[0] if lines else out.strip()[-200:]


_SASS_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
_COPY_WAIT = re.compile(r"\bDEPBAR\.LE SB0, (0x[0-9a-f]+)")


def sass_loops(sass: str) -> list[tuple[int, int, collections.Counter, list[int]]]:
    """(start address, instruction count, opcode counts, copy waits) of each loop in the
    SASS text (cuobjdump -sass): the instructions from a backward branch's target to the
    branch itself. Copy waits: each DEPBAR.LE SB0, N in the loop, N the cp.async groups
    left in flight (a loop that waits with 0 at its top has no copy in flight during its
    math: Triton's pipelining did not overlap the loads)."""
    instructions = [
        (int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, sass.splitlines()) if m
    ]
    index = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        target = _BRANCH_TARGET.search(text)
        start = index.get(int(target.group(1), 16)) if target else None
        if start is None or instructions[start][0] >= address:
            continue
        body = instructions[start : i + 1]
        opcodes = collections.Counter(
            re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body
        )
        waits = [int(m.group(1), 16) for _, t in body for m in [_COPY_WAIT.search(t)] if m]
        loops.append((instructions[start][0], len(body), opcodes, waits))
    return loops


def preloaded_loads(ptx: str) -> str:
    """How many global loads the PTX issues before its griddepcontrol.wait (a kernel
    that preloads its weights must have some); RuntimeError if none."""
    head = ptx[: ptx.index("griddepcontrol.wait")]
    loads = len(re.findall(r"\bld\.global", head))
    if loads == 0:
        raise RuntimeError("a preloading kernel with no global load before its wait")
    return f"{loads} global loads before griddepcontrol.wait"


def bulk_prefetches(ptx: str, name: str) -> str:
    """How many L2 bulk prefetches the PTX issues (pagoda.kernels.launch.l2_prefetch): none for a
    case named with prefetch off (`=False` / `=0`), some otherwise; RuntimeError if not."""
    count = ptx.count("cp.async.bulk.prefetch.L2.global")
    off = re.search(r"prefetch\w*=(False|0)\b", name) is not None
    if (count == 0) != off:
        raise RuntimeError(
            f"{count} bulk prefetches in a case with the prefetch {'off' if off else 'on'}"
        )
    return f"{count} L2 bulk prefetches"


def check_pdl_order(ptx: str) -> None:
    """The kernel waits on its predecessor (griddepcontrol.wait), then releases its
    dependents (griddepcontrol.launch_dependents), pagoda.kernels.launch.pdl's order."""
    if "griddepcontrol.wait" not in ptx or "griddepcontrol.launch_dependents" not in ptx:
        raise RuntimeError("USE_PDL but no griddepcontrol.wait / launch_dependents in the PTX")
    if ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait"):
        raise RuntimeError("griddepcontrol order: the release comes before the wait")


def report(name: str, compiled) -> str:
    meta = compiled.metadata
    return (
        f"{name}: {resource_usage(compiled)}; {meta.shared} B shared (dynamic), "
        f"{meta.num_warps} warps"
    )


def write_sass(directory: str, case: str, sass: str) -> None:
    """A case's SASS (cuobjdump -sass) as directory/<case>.sass, the case name with
    anything but letters, digits, '.', '_', '=' and '-' replaced by '_'."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, re.sub(r"[^\w.=-]", "_", case) + ".sass"), "w") as f:
        f.write(sass)


def main(argv: list[str]) -> int:
    loops = "--loops" in argv
    sass_dir = None
    if "--sass" in argv:
        at = argv.index("--sass")
        if at + 1 >= len(argv):
            raise SystemExit("--sass needs a folder")
        sass_dir = argv[at + 1]
        argv = argv[:at] + argv[at + 2 :]
    names = [a for a in argv if a != "--loops"] or list(CASES)
    failed = 0
    for module in names:
        for name, kernel, args, kwargs in CASES[module]():
            try:
                compiled = compile_for_sm90(kernel, *args, **kwargs)
                ptx = compiled.asm["ptx"]
                if kwargs.get("USE_PDL"):
                    check_pdl_order(ptx)
                print(report(f"{module}.{name}", compiled))
                # Disassembled once for both --sass and --loops.
                sass = _cuobjdump(compiled, "-sass") if loops or sass_dir else ""
                if sass_dir:
                    write_sass(sass_dir, f"{module}.{name}", sass)
                if "preload" in name:
                    print(f"  {preloaded_loads(ptx)}")
                if "prefetch" in name:
                    print(f"  {bulk_prefetches(ptx, name)}")
                for start, count, opcodes, waits in sass_loops(sass) if loops else ():
                    top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(8))
                    print(f"  loop at {start:#x}: {count} instructions ({top})")
                    if waits:
                        print(f"    cp.async waits (groups left in flight): {waits}")
            except Exception as exc:  # report every case, then fail
                failed += 1
                print(f"{module}.{name}: FAILED {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
