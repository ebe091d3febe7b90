"""The package's structure: layers import one way (import-linter's contract in pyproject.toml), and no module
takes part in an import cycle, function-level and ``TYPE_CHECKING`` imports included."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")  # installed with import-linter (the test extra)

ROOT = Path(__file__).resolve().parents[1]


def cycles(graph) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as sorted lists."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return out


def test_no_module_is_in_an_import_cycle():
    graph = grimp.build_graph("tdgather", exclude_type_checking_imports=False)
    assert cycles(graph) == []


def test_the_layers_contract_holds():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "lint-imports (import-linter) is installed with the test extra"
    done = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "1 kept, 0 broken" in done.stdout
