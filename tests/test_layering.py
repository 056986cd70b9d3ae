"""Imports flow one way (DESIGN.md): storage imports nothing of ours, engine only storage,
daemon engine and storage, ctl only daemon.protocol (offline commands aside)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {"storage": set(), "engine": {"storage"}, "daemon": {"engine", "storage"}, "ctl": {"daemon"}}
# ctl's offline commands (run, convert, doctor, demo-model) run the engine in-process, lazily
OFFLINE = {"ctl/offline.py": {"engine", "storage"}, "ctl/doctor.py": {"engine", "storage"}}


def our_imports(path: Path, package: str) -> set[str]:
    depth = len(path.relative_to(ROOT).parts) - 1  # engine/x.py: 1, engine/models/x.py: 2
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if 0 < node.level <= depth:
                continue  # within the same top package
            if node.level == depth + 1:
                found.add((node.module or "").split(".")[0] or "colibri")
            elif node.module and node.module.startswith("colibri."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("colibri."):
                    found.add(a.name.split(".")[1])
    return found - {package, "colibri"}  # the root package holds only __version__


def test_client_commands_stay_light():
    import subprocess
    import sys

    code = ("import sys; import colibri.ctl.main, colibri.ctl.client; "
            "heavy = {'numpy', 'numba', 'colibri.engine', 'colibri.storage.cache'} & set(sys.modules); "
            "assert not heavy, heavy")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_imports_flow_one_way():
    bad = []
    for package, allowed in ALLOWED.items():
        for f in sorted((ROOT / package).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            extra = our_imports(f, package) - allowed - OFFLINE.get(rel, set())
            if extra:
                bad.append(f"{rel} imports {sorted(extra)}")
    assert not bad, bad


def test_no_module_imports_back_a_module_that_imports_it():
    """Within a package, imports (at the top or inside functions) form no cycle: e.g. the
    daemon's command line imports the server, never the other way round."""
    graph = {}
    for package in ALLOWED:
        for f in sorted((ROOT / package).rglob("*.py")):
            mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            deps = set()
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                    deps.add(".".join(f.relative_to(ROOT).parts[:-1] + (node.module.split(".")[0],)))
            graph[mod] = deps - {mod}

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, (*seen, d))) for d in graph.get(a, ()))

    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert not cycles, cycles
