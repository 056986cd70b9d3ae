"""Imports flow one way (docs/architecture.md's floors), module by module: storage imports nothing
of ours; the engine reaches storage only through the ExpertSource module (and the named
errors every floor shares); the daemon imports the engine and storage; ctl's client path
imports the protocol module and nothing else of ours, while its offline commands (run,
convert, doctor, demo-model) run the engine and storage in-process, lazily; the gateway
is a client like colictl (the protocol and ctl's client)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {"storage": set(), "engine": {"storage"}, "daemon": {"engine", "storage"}, "ctl": {"daemon"},
           "gateway": {"daemon", "ctl"}}
# the modules of another package each package may import ("*": any)
MODULES = {
    "engine": {"storage": {"storage.experts", "storage.errors"}},
    "daemon": {"engine": {"*"}, "storage": {"*"}},
    "ctl": {"daemon": {"daemon.protocol"}},
    "gateway": {"daemon": {"daemon.protocol"}, "ctl": {"ctl.client"}},  # a client, like colictl: never the engine
}
# ctl's offline commands run the engine in-process (and read the daemon's configuration)
OFFLINE = {"ctl/offline.py": {"engine": {"*"}, "storage": {"*"},
                              "daemon": {"daemon.protocol", "daemon.config", "daemon.kept", "daemon.planner"}},
           "ctl/planning.py": {"engine": {"*"}, "storage": {"*"},
                               "daemon": {"daemon.config", "daemon.kept", "daemon.planner"}},
           "ctl/doctor.py": {"engine": {"*"}, "storage": {"*"},
                             "daemon": {"daemon.protocol", "daemon.config", "daemon.kept"}}}


def our_imports(path: Path, package: str) -> set[str]:
    """The modules of our other packages that `path` imports, as "package.module" (a
    package imported whole, `from ..daemon import protocol`, names its modules)."""
    depth = len(path.relative_to(ROOT).parts) - 1  # engine/x.py: 1, engine/models/x.py: 2
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if 0 < node.level <= depth:
                continue  # within the same top package
            if node.level == depth + 1:
                module = node.module or ""
            elif node.module and node.module.startswith("colibri."):
                module = node.module.removeprefix("colibri.")
            else:
                continue
            if "." in module:
                found.add(".".join(module.split(".")[:2]))
            else:  # `from ..daemon import protocol`: the names are modules
                found |= {f"{module}.{a.name}" if module else a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("colibri."):
                    found.add(".".join(a.name.split(".")[1:3]))
    return {m for m in found if m.split(".")[0] not in (package, "__version__")}  # the root holds only __version__


def allowed(module: str, rules: dict) -> bool:
    mods = rules.get(module.split(".")[0], set())
    return "*" in mods or module in mods


def test_client_commands_stay_light():
    import subprocess
    import sys

    code = ("import sys; import colibri.ctl.main, colibri.ctl.client; "
            "heavy = {'numpy', 'numba', 'colibri.engine', 'colibri.storage.cache'} & set(sys.modules); "
            "assert not heavy, heavy")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_imports_flow_one_way():
    bad = []
    for package in ALLOWED:
        for f in sorted((ROOT / package).rglob("*.py")):
            rel = str(f.relative_to(ROOT))
            rules = OFFLINE.get(rel, MODULES.get(package, {}))
            extra = sorted(m for m in our_imports(f, package) if not allowed(m, rules))
            if extra:
                bad.append(f"{rel} imports {extra}")
    assert not bad, bad


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The rule bites: an engine module reaching into the cache, or colictl's client into
    the daemon's server, is reported (the check reads `from` imports of every spelling)."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "ctl").mkdir()
    engine = tmp_path / "engine" / "x.py"
    engine.write_text("from ..storage.cache import ExpertCache\nfrom ..storage import experts\n")
    ctl = tmp_path / "ctl" / "x.py"
    ctl.write_text("def f():\n    from colibri.daemon import server, protocol\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert our_imports(engine, "engine") == {"storage.cache", "storage.experts"}
        assert not allowed("storage.cache", MODULES["engine"]) and allowed("storage.experts", MODULES["engine"])
        assert [m for m in our_imports(ctl, "ctl") if not allowed(m, MODULES["ctl"])] == ["daemon.server"]
    finally:
        ROOT = root


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
