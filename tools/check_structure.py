"""The house rules on the package's structure, checked on its source (nothing is imported).

Run from anywhere: ``python tools/check_structure.py [ROOT]`` (ROOT: the repository, by
default the one holding this file). It prints every violation and exits 1 if there is one;
``make test`` runs it through ``tests/test_structure.py``. The rules:

* **no import cycle** between the modules of ``pallas_flash``. An edge is any import
  statement (inside functions too) and any ``importlib.import_module("pallas_flash...")``
  of a string literal; an ``import_module`` of a computed name is itself a violation, since
  no check can see where it leads;
* **no private name** (``_x``) of one module imported by another, or read as ``module._x``;
* **layers**: every module has a place in the tables below, and imports only what its
  place allows (``docs/architecture.md``, "Modules and what they may import"). A backend
  imports only the contract, the core and its own modules; an entry point imports no
  backend; only the tutorial and ``__main__`` import the tutorial;
* **no lab code**: the package imports neither ``benchmarks`` nor ``models``;
* **the wheel ships only pallas_flash**: pyproject's setuptools rules find no other package.
"""

from __future__ import annotations

import ast
import fnmatch
import sys
import tomllib
from pathlib import Path

PACKAGE = "pallas_flash"
# Names below are relative to the package ("dispatch" is pallas_flash.dispatch).
#: Pure math and data shared by every layer: they import only each other.
CORE = frozenset({"bias", "compat", "fp8_format", "logits", "masking", "padding", "segments"})
#: What the backends need from the package: it imports only the core.
CONTRACT = "contract"
#: The backends, each a module or a package with its submodules: they import the contract,
#: the core and themselves.
BACKENDS = frozenset({"mosaic", "triton", "xla"})
#: The call layer, which drives the backends, and what each of its modules may import
#: besides the core and the contract ("backends": any backend module).
CALL_LAYER = {
    "arguments": frozenset(),
    "autodiff": frozenset({"call", "dispatch", "sharding"}),
    # The canonical call: the argument checks, and the dispatcher's array checks.
    "call": frozenset({"arguments", "dispatch", "flex"}),
    "dispatch": frozenset({"backends"}),
    # User score and mask functions, block masks and their dense XLA evaluation.
    "flex": frozenset({"arguments"}),
    # The planner: the path and the forward's kernels of a canonical call.
    "plan": frozenset({"call", "dispatch", "flex", "tuning"}),
    "reference": frozenset(),
    "sharding": frozenset(),
    # It builds each backend's candidate configs, whose types live in the backends.
    "tuning": frozenset({"autodiff", "dispatch", "backends"}),
}
#: The public surface ("" is the package's __init__): any module of the package but a
#: backend, which they reach through the dispatcher.
ENTRY_POINTS = frozenset({"", "__main__", "api", "decode", "fp8", "nn", "paged", "ring"})
#: The tutorial, a subpackage on top of the package (the papers' loops, the command line):
#: it may import any module but a backend, and only it and ``__main__`` import it.
TUTORIAL = "tutorial"
#: The adapters to other model libraries: like the tutorial, a subpackage on top that no
#: other module imports and that reaches the kernels through the public entry points. It
#: may import its libraries' modules by computed name (a table of library classes): no
#: module of this package can hide behind those, since the adapters import no backend.
INTEGRATIONS = "integrations"
#: Top-level directories of the repository that the package must not import.
LAB = frozenset({"benchmarks", "models"})
#: The setuptools ``find`` include patterns that select the package alone.
WHEEL_PATTERNS = frozenset({PACKAGE, f"{PACKAGE}*", f"{PACKAGE}.*"})


def check(root: Path) -> list[str]:
    """Every violation of the rules (the module docstring) in the repository at ``root``."""
    modules = _modules(root / PACKAGE)
    edges: dict[str, set[str]] = {name: set() for name in modules}
    violations: list[str] = []
    for name, path in sorted(modules.items()):
        _read(name, path, modules, edges[name], violations)
    violations += _cycles(edges)
    violations += _layers(modules, edges)
    violations += _wheel(root)
    return violations


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name -> source file of every module of the package (a package by its
    ``__init__.py``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _read(name: str, path: Path, modules: dict[str, Path], edges: set[str],
          violations: list[str]) -> None:
    """Adds module ``name``'s imports of the package to ``edges``, and its private-name,
    lab and unseeable imports to ``violations``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    aliases: dict[str, str] = {}  # local name -> the package module it is bound to

    def target(dotted: str) -> str | None:
        """The module of the package that an import of ``dotted`` loads (its longest
        prefix that is one), or None for a module outside the package."""
        while dotted:
            if dotted in modules:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    def imports(dotted: str, line: int) -> str | None:
        if dotted.split(".")[0] in LAB:
            violations.append(f"{name} imports {dotted} (line {line}): the package "
                              "imports no lab code (benchmarks/, models/)")
        found = target(dotted)
        if found is not None and found != name:
            edges.add(found)
        return found

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = imports(alias.name, node.lineno)
                if found is not None and alias.asname:
                    aliases[alias.asname] = found
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(name, is_package, node)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                found = imports(full, node.lineno)
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                if found is not None and found != name and _private(alias.name):
                    violations.append(f"{name} imports the private name {source}."
                                      f"{alias.name} (line {node.lineno})")
        elif isinstance(node, ast.Call) and _is_import_module(node):
            argument = node.args[0] if node.args else next(
                (k.value for k in node.keywords if k.arg == "name"), None)
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                imports(argument.value, node.lineno)
            elif not name.startswith(f"{PACKAGE}.{INTEGRATIONS}."):
                violations.append(f"{name} imports a computed module name (line "
                                  f"{node.lineno}): use a plain import, which the checks "
                                  "can follow")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and aliases.get(node.value.id, name) != name and _private(node.attr)):
            violations.append(f"{name} reads the private name {aliases[node.value.id]}."
                              f"{node.attr} (line {node.lineno})")


def _absolute(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in module ``name`` imports from."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _private(attribute: str) -> bool:
    return attribute.startswith("_") and not attribute.startswith("__")


def _is_import_module(node: ast.Call) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    func = node.func
    if isinstance(func, ast.Attribute):
        return (func.attr == "import_module" and isinstance(func.value, ast.Name)
                and func.value.id == "importlib")
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    """One violation per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[str] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append("import cycle among " + ", ".join(sorted(component)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _place(module: str) -> tuple[str, str] | None:
    """``(layer, key)`` of a module: ``("core" | "contract" | "backend" | "call" |
    "entry" | "tutorial", its name relative to the package, a backend's or the tutorial's
    by its top name)``, or None for a module the tables do not place."""
    relative = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    top = relative.split(".")[0]
    if top in BACKENDS:
        return "backend", top
    if top == TUTORIAL:
        return "tutorial", top
    if top == INTEGRATIONS:
        return "integrations", top
    for layer, names in (("core", CORE), ("contract", {CONTRACT}), ("call", CALL_LAYER),
                         ("entry", ENTRY_POINTS)):
        if relative in names:
            return layer, relative
    return None


def _allowed(importer: tuple[str, str], imported: tuple[str, str]) -> tuple[bool, str]:
    """Whether a module placed at ``importer`` may import one placed at ``imported``, and
    the rule that says so."""
    layer, key = importer
    to_layer, to_key = imported
    if to_layer == "integrations" and layer != "integrations":
        return False, "no module of the package imports the integrations"
    if layer == "integrations":
        return to_layer not in ("backend", "tutorial"), (
            "the integrations import no backend and no tutorial (they call the entry points)")
    if to_layer == "tutorial" and layer != "tutorial":
        return key == "__main__", "only the tutorial and __main__ import the tutorial"
    if layer == "core":
        return to_layer == "core", "the core imports only the core"
    if layer == "contract":
        return to_layer == "core", "the contract imports only the core"
    if layer == "backend":
        return (to_layer in ("core", "contract") or to_key == key,
                "a backend imports only the contract, the core and itself")
    if layer == "entry":
        return to_layer != "backend", "an entry point imports no backend (it asks dispatch)"
    if layer == "tutorial":
        return to_layer != "backend", "the tutorial imports no backend (it asks dispatch)"
    may = CALL_LAYER[key]
    return (to_layer in ("core", "contract") or to_key in may
            or (to_layer == "backend" and "backends" in may),
            f"{key} imports only the core, the contract and {sorted(may) or 'nothing else'}")


def _layers(modules: dict[str, Path], edges: dict[str, set[str]]) -> list[str]:
    """Modules the tables do not place, and imports their places forbid."""
    found = []
    for module in sorted(modules):
        importer = _place(module)
        if importer is None:
            found.append(f"{module} has no place in the layers: add it to "
                         "tools/check_structure.py and docs/architecture.md")
            continue
        for imported in sorted(edges[module]):
            to = _place(imported)
            if to is None:
                continue
            allowed, rule = _allowed(importer, to)
            if not allowed:
                found.append(f"{module} -> {imported}: {rule}")
    return found


def _wheel(root: Path) -> list[str]:
    """What pyproject's setuptools rules would ship besides the package."""
    pyproject = root / "pyproject.toml"
    setuptools = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {})
    found = [f"pyproject.toml: [tool.setuptools] {key} ships files beside {PACKAGE}"
             for key in ("py-modules", "data-files") if key in setuptools]
    packages = setuptools.get("packages")
    if isinstance(packages, list):
        found += [f"pyproject.toml: packages lists {name}, which is not {PACKAGE}"
                  for name in packages if name.split(".")[0] != PACKAGE]
        return found
    find = packages.get("find") if isinstance(packages, dict) else None
    if not isinstance(find, dict) or not find.get("include"):
        found.append("pyproject.toml: no [tool.setuptools.packages.find] include rule, so "
                     "setuptools' discovery decides what the wheel ships")
        return found
    if find.get("where", ["."]) != ["."]:
        found.append(f"pyproject.toml: packages.find where = {find['where']}, not ['.']")
    for pattern in find["include"]:
        if pattern not in WHEEL_PATTERNS:
            found.append(f"pyproject.toml: packages.find includes {pattern!r}; only "
                         f"{sorted(WHEEL_PATTERNS)} select {PACKAGE} alone")
            continue
        found += [f"pyproject.toml: packages.find include {pattern!r} also ships {d.name}/"
                  for d in sorted(root.iterdir())
                  # setuptools finds only directories named as Python packages are
                  # (not pallas_flash.egg-info)
                  if d.is_dir() and d.name.isidentifier() and d.name != PACKAGE
                  and fnmatch.fnmatchcase(d.name, pattern)]
    return found


def main(argv: list[str]) -> int:
    """Prints the violations in the repository ``argv[1]`` (default: this file's);
    returns the exit status."""
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    violations = check(root)
    for violation in violations:
        print(violation)
    print(f"structure: {len(violations)} violation(s)" if violations else
          "structure: every rule holds")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
