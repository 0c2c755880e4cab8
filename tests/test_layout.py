"""The package boundary (issue 10, item 6): an engine needs kvwire, not the daemon package."""

from __future__ import annotations

import ast
import subprocess
import sys

from harness.daemon import ROOT


def loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                         cwd=str(ROOT), capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_engine_client_and_model_runner_load_no_daemon_module():
    mods = loaded_after("import engine_client, engine_client.client, engine_client.sync_client, model_runner.scheduler")
    assert not {m for m in mods if m == "kvservice" or m.startswith("kvservice.")}


def test_the_shared_package_loads_neither_torch_nor_the_daemon():
    mods = loaded_after("import kvwire.v1.kvcache_pb2, kvwire.v1.admin_pb2_grpc, kvwire.ids, kvwire.peer_socket")
    assert "torch" not in mods
    assert not {m for m in mods if m == "kvservice" or m.startswith("kvservice.")}


PACKAGES = ("kvservice", "engine_client", "model_runner", "kvwire", "harness")


def module_imports() -> dict[str, set[str]]:
    """Each of our modules -> our modules it imports when it loads (imports inside functions and under
    TYPE_CHECKING do not run at load time, so they cannot close a circle)."""
    paths = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: set[str] = set()

        def visit(nodes: list[ast.stmt]) -> None:
            for node in nodes:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    continue
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    visit(node.orelse)
                    continue
                if isinstance(node, ast.Import):
                    edges.update(a.name for a in node.names if a.name in paths)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                        base = ".".join(up + ([base] if base else []))
                    for a in node.names:
                        edges.add(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base)
                visit([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])

        visit(ast.parse(path.read_text()).body)
        graph[mod] = {e for e in edges if e in paths and e != mod}
    return graph


def test_no_import_circles():
    """Issue 10: the import circles (cache <-> tiers, servicer <-> server) are gone and stay gone."""
    graph = module_imports()
    assert len(graph) > 50  # the walk found the tree
    circles, done = [], set()

    def walk(mod: str, stack: list[str]) -> None:
        if mod in stack:
            circles.append(stack[stack.index(mod):] + [mod])
            return
        if mod in done:
            return
        for dep in sorted(graph[mod]):
            walk(dep, stack + [mod])
        done.add(mod)

    for mod in sorted(graph):
        walk(mod, [])
    assert not circles, circles
