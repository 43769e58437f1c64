"""The import-layer contract of the megacp package, read from the source (AST, nothing imported).

Layers, top first; a module may import its own package, and packages of its own layer or of
layers below it, never above (README, "Architecture"). A layer is a package of ``megacp`` or a
sub-package or module inside one (a module belongs to the longest name below that holds it):

    megacp, generate, train  the package root (public re-exports), the entry points
    serve, launch            (``python -m megacp.generate`` / ``train`` / ``serve``) and what they
                             need of their launcher
    families                 the model-family seam: what a model is, how it loads, trains and saves
    integrations             the transformers attention interface, memory features, CPTrainer
    checkpoint               formats, conversion, loading weights into a built model
    models                   the model, its config and parameter schema
    layers                   CP attention modules, CPSettings, the step kinds, swap_attention
    attention                the ring floor: KV blocks and ring checks, ring prefill, decode,
                             the training ring, strategy
    attention.kernels        the kernel floor: one block of attention (partial attention and its
                             backward, the fused kernels, varlen runs, tiles, merges, plans)
    kv_cache                 the CP-sharded KV cache
    placement                which CP rank holds which token, layouts, tiles, training batches
    parallel                 process mesh, groups, the CP ring
    config, version,         megacp's validated config sections; its version; the table of
    attention.kernels.registry  attention backends (data only: the config takes its choices from it)

Every import counts, also one inside a function (it is a dependency all the same). There must be
no import cycle between modules, and none between packages of one layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT

PACKAGE = ROOT / "megacp"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("megacp", "generate", "train", "serve", "launch"),
    ("families",),
    ("integrations",),
    ("checkpoint",),
    ("models",),
    ("layers",),
    ("attention",),
    ("attention.kernels",),
    ("kv_cache",),
    ("placement",),
    ("parallel",),
    ("config", "version", "attention.kernels.registry"),
)
RANK = {name: depth for depth, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """megacp modules that module ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import megacp.x.y` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _component(module: str) -> str:
    """The layer name of ``module``: the longest name of :data:`RANK` that holds it, else its package."""
    parts = module.split(".")[1:]
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in RANK:
            return ".".join(parts[:end])
    return parts[0] if parts else "megacp"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_package_has_a_layer() -> None:
    unplaced = sorted({_component(m) for m in _modules()} - set(RANK))
    assert not unplaced, f"place {unplaced} in LAYERS here and in README's Architecture paragraph"


def test_no_import_cycle_between_modules() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_no_import_cycle_between_packages() -> None:
    packages: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        packages.setdefault(_component(module), set()).update(
            _component(t) for t in targets if _component(t) != _component(module))
    cycle = _cycle(packages)
    assert cycle is None, " -> ".join(cycle or [])


def test_layers_only_import_downward() -> None:
    upward = [
        f"{module} imports {target}"
        for module, targets in sorted(_graph().items())
        for target in sorted(targets)
        if _component(target) in RANK and _component(module) in RANK
        and RANK[_component(target)] < RANK[_component(module)]
    ]
    assert not upward, "; ".join(upward)


def test_the_contract_sees_real_imports() -> None:
    """The parser finds the imports the layers are built from (a guard against a vacuous pass)."""
    graph = _graph()
    assert "megacp.placement" in graph["megacp.kv_cache"]
    assert "megacp.placement.tiles" in graph["megacp.placement.plan"]
    assert "megacp.attention.kernels.merge_kernel" in graph["megacp.attention.kernels.merge"]  # `from megacp.attention.kernels import merge_kernel`
    assert "megacp.config" in graph["megacp.parallel.state"]
    assert "megacp.attention.kernels.registry" in graph["megacp.config"]  # the backend choices
    assert [_component(m) for m in ("megacp.attention.pass_kv", "megacp.attention.kernels.partial",
                                    "megacp.attention.kernels.registry", "megacp")] == \
        ["attention", "attention.kernels", "attention.kernels.registry", "megacp"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_package_imports_no_entry_point_outside_it() -> None:
    """``tools/``, ``scripts/`` and ``tests/`` sit above every layer: the package never imports them."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{name} imports {r}" for r in roots if r.split(".")[0] in ("tools", "scripts", "tests")]
    assert not found, "; ".join(found)


def _sys_path_edits(source: str) -> list[int]:
    """Lines of ``source`` that change ``sys.path`` (a call on it, an assignment to it, or ``site.addsitedir``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value if node.func.attr != "addsitedir" else node.func
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if isinstance(target, ast.Attribute) and target.attr in ("path", "addsitedir") and isinstance(target.value, ast.Name) \
                and target.value.id in ("sys", "site"):
            lines.append(node.lineno)
    return lines


def test_no_sys_path_edits() -> None:
    """Code imports installed or on-path packages; nothing edits ``sys.path`` (package, tools, scripts, tests)."""
    found = [f"{path.relative_to(ROOT)}:{line}" for folder in ("megacp", "tools", "scripts", "tests")
             for path in sorted((ROOT / folder).rglob("*.py")) for line in _sys_path_edits(path.read_text(encoding="utf-8"))]
    assert not found, "sys.path edited at " + ", ".join(found)
    assert _sys_path_edits("import sys\nsys.path.insert(0, 'x')\n") == [2]
    assert _sys_path_edits("import sys\nsys.path = ['x']\n") == [2]
    assert _sys_path_edits("import sys\nsys.path += ['x']\n") == [2]
