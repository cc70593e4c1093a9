"""The import graph of dhelix/, megatron_patches/, planner/, profiler/ and scripts/ keeps its
declared layer order (profile -> plan -> run). Pure Python over the source's AST: every
`import` and `from ... import` in a module, at module level or inside a function, is an
arrow from that module to the project module it names. An arrow may go down the layers or
stay inside one; it fails the test when it runs back up, when it joins the two sides of the
profile | plan layer (the profiler and the planner share only what sits below both), and
when it closes a circle other than the kernel registration's. A module no layer names
fails too, so a new module must be placed. The failure message lists the offending imports
(file:line).

Violations that cannot be moved yet are listed in KNOWN_UPWARD / KNOWN_CIRCLES, each with
its reason. The lists only shrink: a listed violation that no longer exists fails the test
until it is removed from the list."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dhelix", "megatron_patches", "planner", "profiler", "scripts")


@dataclass(frozen=True)
class Layer:
    """One layer of the import order: `sides` are groups of module names or package
    prefixes; modules of one side may not import modules of another side of the layer."""

    name: str
    sides: tuple[tuple[str, ...], ...]


# Lowest first. A module belongs to the layer of the longest entry that names it or one of
# its packages; the top-level packages' __init__ modules import nothing and sit at the
# bottom (matched exactly, so they catch no unplaced module).
LAYERS = (
    Layer("foundations: file formats, arguments, operator DAGs, topology, fingerprints, the "
          "emulated cluster, devices, a rank's one-line error, the profile and plan file "
          "formats (what the planner, the profiler and the argument checks share); nothing "
          "of the engine", ((
              "dhelix.file_formats", "dhelix.dag", "dhelix.topology", "dhelix.run_fingerprint",
              "dhelix.argument_error", "dhelix.dhelix_arguments", "dhelix.presets",
              "dhelix.folding", "dhelix.rank_errors",
              "dhelix.divergence", "dhelix.cluster", "dhelix.devices", "dhelix.options",
              "dhelix.c10d_ops", "dhelix.arriving", "dhelix.waiter_thread", "dhelix.gloo_device",
              "profiler.profile_file", "profiler.fingerprint", "planner.plan"),)),
    Layer("engine: megatron-core adapters and shims, process groups, checkpoints, data", ((
        "megatron_patches", "dhelix.parallel", "dhelix.harness", "dhelix.stall",
        "dhelix.checkpoint_integrity", "dhelix.memtrace",
        "dhelix.parity", "dhelix.megatron_lm_checks"),)),
    Layer("execution: operator programs, schedules as data and their executor, lanes, the "
          "strand and streamed executors, the timeline (nothing of planning or profiling)", ((
              "dhelix.ops", "dhelix.schedules", "dhelix.runtime.lanes",
              "dhelix.runtime.strand_executor", "dhelix.runtime.streamed_executor",
              "dhelix.runtime.timeline",
              "dhelix.runtime.layer_runner", "dhelix.runtime.forward_step_capture",
              "dhelix.runtime.operator_passes", "dhelix.runtime.intra_batch_passes",
              "dhelix.gpu_emulation"),)),
    Layer("profile | plan", (("profiler",), ("planner",))),
    Layer("run: the DHelix schedules built from a plan", ((
        "dhelix.runtime",),)),
    Layer("entry points: the Megatron-LM plugin's hooks and its step harness, CLIs, benchmarks, "
          "scripts", ((
        "megatron_patches.training_hooks", "megatron_patches.step_harness",
        "megatron_patches.parsed_arguments", "dhelix.ops.cli", "profiler.cli", "dhelix.megatron_lm",
        "dhelix.cli", "dhelix.launch",
        "dhelix.env_report", "dhelix.__main__", "dhelix.bench", "scripts"),)),
)

# The one intended circle: kernels register themselves in the registry, which imports them.
INTENDED_CIRCLES = {frozenset({"dhelix.ops.kernels", "dhelix.ops.moe_kernels",
                               "dhelix.ops.registry"})}

# (importer, imported): why it is not moved yet. Only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
KNOWN_CIRCLES: dict[frozenset, str] = {}


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imports(modules: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """(importer, imported project module) -> ["file:line", ...] for every import statement."""
    arrows: dict[tuple[str, str], list[str]] = {}

    def owner(name: str) -> str | None:  # the project module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for module, path in modules.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + [base]).strip(".")
                # `from package import submodule` depends on the submodule
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            else:
                continue
            for name in names:
                target = owner(name)
                if target and target != module:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    arrows.setdefault((module, target), []).append(where)
    return arrows


def placement(module: str) -> tuple[int, int] | None:
    """(layer index, side index) of a module, or None when no layer names it."""
    if module in PACKAGES:
        return (0, 0)
    best = None
    for i, layer in enumerate(LAYERS):
        for j, side in enumerate(layer.sides):
            for entry in side:
                if module == entry or module.startswith(entry + "."):
                    if best is None or len(entry) > best[0]:
                        best = (len(entry), i, j)
    return None if best is None else best[1:]


def upward_arrows(arrows) -> dict[tuple[str, str], list[str]]:
    bad = {}
    for (a, b), where in arrows.items():
        (la, sa), (lb, sb) = placement(a), placement(b)
        if lb > la or (lb == la and sb != sa):
            bad[(a, b)] = where
    return bad


def circles(arrows) -> set[frozenset]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {}
    for a, b in arrows:
        graph.setdefault(a, []).append(b)
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(pairs, arrows) -> str:
    return "\n".join(f"  {a} -> {b}: {', '.join(arrows[(a, b)])}" for a, b in sorted(pairs))


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in module_files() if placement(m) is None)
    assert not unplaced, f"give these modules a layer in LAYERS ({__file__}): {unplaced}"


def test_no_import_runs_back_up_the_layers():
    arrows = imports(module_files())
    upward = upward_arrows(arrows)
    new = set(upward) - set(KNOWN_UPWARD)
    assert not new, ("imports that run up the layers or join the profiler and the planner "
                     "(move the code down, or import the other way):\n"
                     + _describe(new, arrows))
    gone = set(KNOWN_UPWARD) - set(upward)
    assert not gone, f"no longer imported: remove from KNOWN_UPWARD: {sorted(gone)}"


def test_no_circles_but_the_kernel_registration():
    arrows = imports(module_files())
    found = circles(arrows)
    new = found - INTENDED_CIRCLES - set(KNOWN_CIRCLES)
    assert not new, "import circles:\n" + "\n".join(
        _describe({(a, b) for (a, b) in arrows if a in c and b in c}, arrows) for c in new)
    gone = set(KNOWN_CIRCLES) - found
    assert not gone, f"no longer a circle: remove from KNOWN_CIRCLES: {sorted(map(sorted, gone))}"
    assert INTENDED_CIRCLES <= found, "the kernel registration circle is gone: update the test"


def test_the_check_finds_what_it_is_for(tmp_path, monkeypatch):
    """Negative control: an upward import, a profiler -> planner import and a new circle in
    a throw-away tree are all reported."""
    for name, text in {
        "dhelix/__init__.py": "",
        "dhelix/dag.py": "from dhelix.runtime import setup\n",        # foundations -> run
        "dhelix/runtime/__init__.py": "",
        "dhelix/runtime/setup.py": "import dhelix.dag\n",               # closes a circle
        "profiler/__init__.py": "",
        "profiler/heatmap.py": "from planner.costs import oef\n",       # across the sides
        "planner/__init__.py": "",
        "planner/costs.py": "def oef(): pass\n",
        "megatron_patches/__init__.py": "",
        "scripts/__init__.py": "",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    arrows = imports(module_files())
    assert set(upward_arrows(arrows)) == {("dhelix.dag", "dhelix.runtime.setup"),
                                          ("profiler.heatmap", "planner.costs")}
    assert arrows[("dhelix.dag", "dhelix.runtime.setup")] == ["dhelix/dag.py:1"]
    assert circles(arrows) == {frozenset({"dhelix.dag", "dhelix.runtime.setup"})}
