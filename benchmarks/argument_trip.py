"""Follow one argument through the code, as a reader following it would: the files it enters, in the order written.

    python3 benchmarks/argument_trip.py src/flowfleet/commands/sample.py:run_generate:args
    python3 benchmarks/argument_trip.py src/flowfleet/commands/sample.py:run_generate:args --rev 4259c88

From the entry function, every call that is handed the argument (or a name taken from it: `x = args.out`, `args.n`)
and whose callee the source names (a function of the package, a class, `self.`/`cls.` methods, `module.function`) is
entered, its receiving parameters become the argument, and so on, depth first, each function walked once. Calls the
source cannot name (a method of an object of unknown type, a library) are where the trail is lost.

A room is one source file. A stay is a visit to a room: the trip enters a new stay whenever a call takes it into a
file other than the one it last entered. A file's floor is one above the highest floor among the package files it
imports (floor 1 imports none; files that import each other share a floor), so a stay on a higher floor than the
stay before it climbs back up against the import order. Printed: every stay, then rooms (distinct files), climbs
back up, and returns (stays in a room the trip had already left).

Static, from the AST (nothing is run). Written by hand because the call-graph libraries draw every call of a
program, not the trail of one argument. --rev reads the files of a git revision instead of the working tree.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "flowfleet"


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)  # "f", "Cls.m"
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # bound name -> (module, attribute)

    @property
    def is_package(self) -> bool:
        return self.path.endswith("__init__.py")


class Source:
    """The package's files at the working tree or at a git revision, parsed, with their imports and definitions."""

    def __init__(self, src: str, rev: str | None):
        self.modules: dict[str, Module] = {}
        for path, text in self._files(src, rev):
            rel = Path(path).relative_to(src).with_suffix("")
            parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            name = ".".join(parts)
            self.modules[name] = self._read(name, path, text)
        self.floors = self._floors()

    @staticmethod
    def _files(src: str, rev: str | None):
        if rev is None:
            for path in sorted(Path(src, PACKAGE).rglob("*.py")):
                yield str(path), path.read_text()
            return
        listing = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", rev, f"{src}/{PACKAGE}"], capture_output=True, text=True, check=True
        )
        for path in listing.stdout.split():
            if path.endswith(".py"):
                yield path, subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True).stdout

    @staticmethod
    def _read(name: str, path: str, text: str) -> Module:
        mod = Module(name, path, ast.parse(text))
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in mod.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                mod.classes[node.name] = node
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        mod.functions[f"{node.name}.{item.name}"] = item
        for node in ast.walk(mod.tree):  # imports at any depth (a command imports its stage inside the function)
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    mod.imports[alias.asname or alias.name] = (base, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    mod.imports[bound] = (alias.name if alias.asname else bound, None)
        return mod

    def module_of(self, module: str, attr: str | None) -> str | None:
        """`from module import attr` or `import module`: the package module it names, when it names one."""
        if attr is not None:
            return f"{module}.{attr}" if f"{module}.{attr}" in self.modules else None
        return module if module in self.modules else None

    def _floors(self) -> dict[str, int]:
        edges: dict[str, set[str]] = {}
        for name, mod in self.modules.items():
            targets = set()
            for module, attr in mod.imports.values():
                found = self.definition(module, attr) if attr else None
                target = found[0] if found else (self.module_of(module, attr) or self.module_of(module, None))
                if target is not None and target != name:
                    targets.add(target)
            edges[name] = targets
        # strongly connected components (Tarjan), then the longest path down the condensed graph
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        component: dict[str, int] = {}
        members: dict[int, list[str]] = {}
        counter = [0]

        def connect(v: str) -> None:
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            for w in edges[v]:
                if w not in index:
                    connect(w)
                    low[v] = min(low[v], low[w])
                elif w in stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                found = len(members)
                members[found] = []
                while True:
                    w = stack.pop()
                    component[w] = found
                    members[found].append(w)
                    if w == v:
                        break

        for v in edges:
            if v not in index:
                connect(v)
        floor: dict[int, int] = {}

        def floor_of(c: int) -> int:
            if c not in floor:
                below = {component[w] for v in members[c] for w in edges[v]} - {c}
                floor[c] = 1 + max((floor_of(b) for b in below), default=0)
            return floor[c]

        return {v: floor_of(c) for v, c in component.items()}

    def definition(self, module: str, name: str | None, seen: frozenset = frozenset()) -> tuple[str, str] | None:
        """Where `name` of `module` is defined: (module, "f" or "Cls"), through a package's re-exports."""
        mod = self.modules.get(module)
        if mod is None or name is None or (module, name) in seen:
            return None
        if name in mod.functions or name in mod.classes:
            return module, name
        if name in mod.imports:
            source, attr = mod.imports[name]
            return self.definition(source, attr, seen | {(module, name)})
        return None

    def returned_class(self, module: str, qualname: str) -> tuple[str, str] | None:
        """The package class a function returns, as its annotation names it (a class's __init__: the class)."""
        if qualname.endswith(".__init__"):
            return module, qualname.rpartition(".")[0]
        returns = self.modules[module].functions[qualname].returns
        name = returns.value if isinstance(returns, ast.Constant) else getattr(returns, "id", None)
        found = self.definition(module, name) if isinstance(name, str) else None
        return found if found and found[1] in self.modules[found[0]].classes else None

    def method(self, module: str, cls: str, name: str) -> tuple[str, str] | None:
        """Cls.name, looked up through the base classes the package defines."""
        mod = self.modules[module]
        if f"{cls}.{name}" in mod.functions:
            return module, f"{cls}.{name}"
        for base in mod.classes[cls].bases:
            found = self.definition(module, base.id) if isinstance(base, ast.Name) else None
            if found and found[1] in self.modules[found[0]].classes:
                hit = self.method(found[0], found[1], name)
                if hit:
                    return hit
        return None


def mentions(node: ast.AST, names: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def carries(node: ast.AST, names: set[str]) -> bool:
    """Whether an expression is the argument in another form (`args.out`, `out or default`, `xs[0]`), not a new
    value a call made from it (`RunRoot(out)`: the call is followed; what it returns is not the argument)."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, (ast.Call, ast.Lambda)):
        return False
    return any(carries(child, names) for child in ast.iter_child_nodes(node))


@dataclass
class Stay:
    module: str
    floor: int
    entered_by: str
    as_names: list[str]


class Walk:
    def __init__(self, source: Source):
        self.source = source
        self.passed: set[tuple[str, str]] = set()
        self.stays: list[Stay] = []
        self.lost: list[str] = []

    def callee(self, module: str, qualname: str, func: ast.expr) -> tuple[str, str] | None:
        """The function a call names, as far as the source names it; a class gives its __init__."""
        cls = qualname.split(".")[0] if "." in qualname else None
        found = None
        if isinstance(func, ast.Name):
            found = self.source.definition(module, func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            owner = func.value.id
            if owner in ("self", "cls") and cls is not None:
                return self.source.method(module, cls, func.attr)
            mod = self.source.modules[module]
            if owner in mod.imports:
                target = self.source.module_of(*mod.imports[owner])
                if target is not None:
                    found = self.source.definition(target, func.attr)
                else:
                    holder = self.source.definition(module, owner)
                    if holder and holder[1] in self.source.modules[holder[0]].classes:
                        return self.source.method(holder[0], holder[1], func.attr)
            elif owner in mod.classes:
                return self.source.method(module, owner, func.attr)
        if found and found[1] in self.source.modules[found[0]].classes:
            return self.source.method(found[0], found[1], "__init__")
        return found

    def enter(self, module: str, qualname: str, names: set[str], by: str) -> None:
        if not self.stays or self.stays[-1].module != module:
            self.stays.append(Stay(module, self.source.floors[module], by, sorted(names)))
        if (module, qualname) in self.passed:
            return
        self.passed.add((module, qualname))
        node = self.source.modules[module].functions[qualname]
        tracked = set(names)
        events: list[ast.AST] = [
            n for n in ast.walk(node) if isinstance(n, (ast.Call, ast.Assign, ast.AnnAssign, ast.NamedExpr))
        ]
        # a raise ends the trail: the exception and its message are built to be read by a person, not passed on
        raised = {id(c) for r in ast.walk(node) if isinstance(r, ast.Raise) and r.exc for c in ast.walk(r.exc)}
        events = [n for n in events if id(n) not in raised]
        events.sort(key=lambda n: (n.lineno, n.col_offset))
        types: dict[str, tuple[str, str]] = {}  # name -> the package class of the object it holds
        done: set[int] = set()
        for event in events:
            if isinstance(event, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                value = event.value
                if value is None:
                    continue
                targets = event.targets if isinstance(event, ast.Assign) else [event.target]
                bound = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                if isinstance(value, ast.Call):
                    done.add(id(value))
                    entered = self.call(module, qualname, value, tracked, types)
                    if entered is not None:  # the argument was put down in what the call returns
                        tracked |= bound
                        held = self.source.returned_class(*entered)
                        types.update({name: held for name in bound if held is not None})
                elif carries(value, tracked):
                    tracked |= bound
                continue
            if id(event) not in done:
                self.call(module, qualname, event, tracked, types)

    def call(
        self, module: str, qualname: str, call: ast.Call, tracked: set[str], types: dict[str, tuple[str, str]]
    ) -> tuple[str, str] | None:
        """Enter the callee when the call hands it the argument (or is a method of an object that holds it):
        -> the callee entered, or None."""
        func = call.func
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        as_self = owner is not None and owner in tracked and owner not in ("self", "cls")
        if not as_self and not any(mentions(a, tracked) for a in [*call.args, *(k.value for k in call.keywords)]):
            return None
        if owner is not None and owner in types:
            target = self.source.method(*types[owner], func.attr)  # type: ignore[union-attr]
        else:
            target = self.callee(module, qualname, func)
        if target is None:
            self.lost.append(f"{ast.unparse(func)} ({self.source.modules[module].path}:{call.lineno})")
            return None
        node = self.source.modules[target[0]].functions[target[1]]
        params = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
        if params and params[0] in ("self", "cls") and "." in target[1]:
            params = params[1:]
        receiving: set[str] = {"self"} if as_self and owner in types else set()
        for i, arg in enumerate(call.args):
            if mentions(arg, tracked):
                if isinstance(arg, ast.Starred) or i >= len(params):
                    receiving |= {node.args.vararg.arg} if node.args.vararg else set()
                else:
                    receiving.add(params[i])
        names = {a.arg for a in node.args.kwonlyargs} | set(params)
        for keyword in call.keywords:
            if mentions(keyword.value, tracked):
                if keyword.arg in names:
                    receiving.add(keyword.arg)
                elif node.args.kwarg:
                    receiving.add(node.args.kwarg.arg)
        if not receiving:
            return None
        self.enter(target[0], target[1], receiving, target[1])
        return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("start", help="FILE:FUNCTION:PARAM, e.g. src/flowfleet/commands/sample.py:run_generate:args")
    parser.add_argument("--src", default="src", help="the folder that holds the package")
    parser.add_argument("--rev", help="a git revision to read instead of the working tree")
    a = parser.parse_args()
    path, function, param = a.start.split(":")
    source = Source(a.src, a.rev)
    module = next(m.name for m in source.modules.values() if Path(m.path) == Path(path))
    walk = Walk(source)
    walk.enter(module, function, {param}, function)
    seen: set[str] = set()
    climbs = returns = 0
    for i, stay in enumerate(walk.stays, 1):
        step = ""
        if i > 1:
            change = stay.floor - walk.stays[i - 2].floor
            climbs += change > 0
            step = f"UP {change}" if change > 0 else (f"down {-change}" if change < 0 else "same floor")
        again = stay.module in seen
        returns += again
        seen.add(stay.module)
        where = source.modules[stay.module].path
        print(
            f"{i:3d}. floor {stay.floor:2d}  {where:48s} {step:11s} {'again' if again else '     '}  "
            f"in by {stay.entered_by} as {', '.join(stay.as_names)}"
        )
    print(f"\n{len(walk.stays)} stays; {len(seen)} rooms; {climbs} climbs back up; {returns} returns to a room left")
    if walk.lost:
        print(f"trail lost at {len(walk.lost)} calls the source cannot name, e.g. {'; '.join(walk.lost[:5])}")


if __name__ == "__main__":
    main()
