"""Layers import downward only: the kernels and launchers, and the rules below them, never reach up
into the ops, the autograd layer or anything above (no import cycle through them)."""

from __future__ import annotations

import ast
from pathlib import Path

import dsnorm

PACKAGE = Path(dsnorm.__file__).parent

# Each module's layer may import only from the layers listed for it (dsnorm.* modules; anything
# outside dsnorm is free). Imports inside functions count too: a lazy import is still a dependency.
BASE = {"dsnorm.ref", "dsnorm.forking", "dsnorm.dispatch", "dsnorm.rows"}
SPEC = BASE | {"dsnorm.spec"}
# dsnorm.cpu's modules, each with the package's modules it may import (downward only; alloc is
# self-contained, and the package itself imports none of them).
CPU_BELOW = {
    "dsnorm.cpu": set(),
    "dsnorm.cpu.alloc": set(),
    "dsnorm.cpu.runtime": set(),
    "dsnorm.cpu.intrinsics": set(),
    "dsnorm.cpu.cascade": {"dsnorm.cpu.intrinsics"},
    "dsnorm.cpu.stages": {"dsnorm.cpu.intrinsics"},
}
CPU_BELOW["dsnorm.cpu.kernels"] = {"dsnorm.cpu.runtime", "dsnorm.cpu.intrinsics", "dsnorm.cpu.cascade",
                                   "dsnorm.cpu.stages"}
CPU_BELOW["dsnorm.cpu.fusion_kernels"] = CPU_BELOW["dsnorm.cpu.kernels"] | {"dsnorm.cpu.kernels"}
CPU_BELOW["dsnorm.cpu.launch"] = CPU_BELOW["dsnorm.cpu.fusion_kernels"] | {"dsnorm.cpu.fusion_kernels",
                                                                             "dsnorm.cpu.alloc"}
CPU_BELOW["dsnorm.cpu.lane"] = CPU_BELOW["dsnorm.cpu.launch"] | {"dsnorm.cpu.launch"}
KERNELS = SPEC | set(CPU_BELOW) | {"dsnorm.triton", "dsnorm.triton.kernels", "dsnorm.triton.launch",
                                   "dsnorm.triton.fusions"}
ALLOWED = {
    "dsnorm.ref": set(),
    "dsnorm.forking": set(),
    "dsnorm.dispatch": set(),
    "dsnorm.rows": set(),
    "dsnorm.spec": BASE,
    **{name: (set() if name in ("dsnorm.cpu", "dsnorm.cpu.alloc") else SPEC | {"dsnorm.cpu"}) | below
       for name, below in CPU_BELOW.items()},
    "dsnorm.triton.kernels": KERNELS,
    "dsnorm.triton.launch": KERNELS,
    "dsnorm.triton.fusions": KERNELS,
    "dsnorm.ops": KERNELS | {"dsnorm.ops"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dsnorm_imports(path: Path) -> set:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "dsnorm"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dsnorm":
            # ``from dsnorm import ops`` names a module; ``from dsnorm.spec import Form`` a name in one.
            names = {f"{node.module}.{a.name}" for a in node.names}
            found |= {n for n in names if n in ALLOWED or (PACKAGE.parent / (n.replace(".", "/") + ".py")).exists()}
            found |= {node.module} if node.module != "dsnorm" else set()
    return found


def test_lower_layers_import_nothing_above_them():
    checked = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name not in ALLOWED:
            continue
        checked.add(name)
        upward = {m for m in _dsnorm_imports(path) if m not in ALLOWED[name] | {name}}
        assert not upward, f"{name} imports {sorted(upward)} from a layer above it"
    assert checked == set(ALLOWED), sorted(set(ALLOWED) - checked)


# The bench (a tool on top of the library, free to import any of it) is layered the same way inside:
# each of its modules may import only the bench modules listed for it (and dsnorm.integrations.vllm_bench,
# the registry's peer module, only the two below it). The package's __init__ imports none of them.
_CASES, _MACHINE, _VERIFY = "dsnorm.bench.cases", "dsnorm.bench.machine", "dsnorm.bench.verify"
_PROVIDERS, _REGISTRY, _TIMING = "dsnorm.bench.providers", "dsnorm.bench.registry", "dsnorm.bench.timing"
_HARNESS, _REPORT, _PLOT = "dsnorm.bench.harness", "dsnorm.bench.report", "dsnorm.bench.plot"
_VLLM_PEERS = "dsnorm.integrations.vllm_bench"
BENCH_ALLOWED = {
    "dsnorm.bench": set(),
    _CASES: set(),
    _MACHINE: set(),
    _VERIFY: {_CASES},
    _PROVIDERS: {_CASES},
    _VLLM_PEERS: {_CASES, _PROVIDERS},
    _REGISTRY: {_PROVIDERS, _VLLM_PEERS},
    _TIMING: {_PROVIDERS},
    _HARNESS: {_CASES, _MACHINE, _VERIFY, _PROVIDERS, _REGISTRY, _TIMING},
    _REPORT: {_PROVIDERS, _REGISTRY, _TIMING},
    _PLOT: {_REGISTRY, _REPORT},
    "dsnorm.bench.cli": {_CASES, _HARNESS, _PLOT, _PROVIDERS, _REGISTRY, _REPORT},
}


def test_bench_modules_import_only_downward():
    bench_modules = {_module_name(p) for p in (PACKAGE / "bench").rglob("*.py")}
    assert bench_modules <= set(BENCH_ALLOWED), sorted(bench_modules - set(BENCH_ALLOWED))  # every module placed
    for name in BENCH_ALLOWED:
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        imported = {m for m in _dsnorm_imports(path) if m in BENCH_ALLOWED} - {name}
        assert imported <= BENCH_ALLOWED[name], f"{name} imports {sorted(imported - BENCH_ALLOWED[name])}"
    # The allowed imports themselves form no cycle: modules fall away layer by layer.
    left = dict(BENCH_ALLOWED)
    while left:
        lowest = {name for name, deps in left.items() if not deps & set(left)}
        assert lowest, f"an import cycle among {sorted(left)}"
        left = {name: deps for name, deps in left.items() if name not in lowest}
