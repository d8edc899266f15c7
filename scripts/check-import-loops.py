#!/usr/bin/env python3
"""No import loop of more than two modules inside any service crate (issue 42): within each
crate under services/, the modules (one per file) and the `crate::`/`super::` paths their code
names (comments and test modules left out) form a graph whose strongly connected components
must hold at most two modules. A loop of two (a module and its helper calling back) is allowed;
a longer one means nobody can tell which module is below which. Fails naming the loop.
--selftest: a planted three-module loop must be reported."""
import os
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LOOP = 2


def modules(src):
    files = {}
    for dirpath, _, names in os.walk(src):
        for f in names:
            if f.endswith(".rs"):
                path = os.path.join(dirpath, f)
                parts = os.path.relpath(path, src)[:-3].split("/")
                if parts[-1] in ("mod", "lib", "main"):
                    parts = parts[:-1]
                files["::".join(parts)] = path
    return files


def code_of(path):
    text = open(path, encoding="utf-8").read()
    text = re.split(r"#\[cfg\(test\)\]\s*\n\s*(?:pub(?:\(crate\))? )?mod tests", text)[0]
    return re.sub(r"//[^\n]*", "", text)


def references(text, me, names):
    out = set()
    for m in re.finditer(r"crate::((?:[a-z_0-9]+::)*[a-z_0-9]+)", text):
        path = m.group(1).split("::")
        for k in range(len(path), 0, -1):
            if "::".join(path[:k]) in names:
                out.add("::".join(path[:k]))
                break
    for m in re.finditer(r"((?:super::)+)((?:[a-z_0-9]+::)*[a-z_0-9]*)", text):
        up = m.group(1).count("super::")
        base = me.split("::") if me else []
        base = base[: max(len(base) - up, 0)]
        path = base + [p for p in m.group(2).split("::") if p]
        for k in range(len(path), 0, -1):
            if "::".join(path[:k]) in names:
                out.add("::".join(path[:k]))
                break
    # the crate root and a module's own children are not imports
    return {x for x in out if x and x != me and not x.startswith(me + "::")} if me else set()


def loops(src):
    files = modules(src)
    names = set(files)
    graph = {m: references(code_of(p), m, names) for m, p in files.items()}
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > MAX_LOOP:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def check(crates):
    problems = []
    for crate in crates:
        for component in loops(crate / "src"):
            problems.append(f"{crate.relative_to(ROOT) if crate.is_relative_to(ROOT) else crate}: "
                            f"an import loop of {len(component)} modules: {', '.join(component)}")
    return problems


def main():
    if "--selftest" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            src = pathlib.Path(tmp) / "demo" / "src"
            src.mkdir(parents=True)
            (src / "lib.rs").write_text("mod a;\nmod b;\nmod c;\n")
            (src / "a.rs").write_text("use crate::b::X;\n")
            (src / "b.rs").write_text("use crate::c::Y;\n// crate::a in a comment is no import\n")
            (src / "c.rs").write_text("fn f() { super::a::g() }\n")
            found = check([src.parent])
            assert found and "a, b, c" in found[0], found
            (src / "c.rs").write_text("fn f() {}\n#[cfg(test)]\nmod tests { use crate::a::g; }\n")
            assert check([src.parent]) == [], "a test module's imports are not the crate's"
    crates = sorted(p.parent for p in (ROOT / "services").glob("*/Cargo.toml"))
    problems = check(crates)
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print(f"import loops: none over {MAX_LOOP} modules in {len(crates)} service crates")


main()
