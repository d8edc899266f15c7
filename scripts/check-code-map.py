#!/usr/bin/env python3
"""The maps are drawn from the code. docs/ARCHITECTURE.md's code map has a row for every
workspace crate (package and path) whose "used by" column is exactly the workspace crates that
depend on it (normal and build dependencies, from `cargo metadata`); README's layout names
every crate's directory; and no service depends on another service (services/pdmesh, the binary
that links them all, excepted). Fails, naming each difference.

--write: rewrite the "used by" column from `cargo metadata` (then review the diff).
--selftest: a crate missing from either map, a wrong "used by" cell and a service depending on
another service must each be reported."""
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The binary links every service: the one crate under services/ allowed to depend on others.
BINARY = "pdmesh"


def metadata():
    return json.loads(
        subprocess.run(
            ["cargo", "metadata", "--no-deps", "--format-version", "1"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout
    )


def workspace(meta):
    """[(name, path, [workspace deps])] with normal/build dependencies only (dev-dependencies
    are tests' business, not the architecture's)."""
    ids = set(meta["workspace_members"])
    by_id = {p["id"]: p for p in meta["packages"] if p["id"] in ids}
    names = {p["name"] for p in by_id.values()}
    out = []
    for p in by_id.values():
        path = pathlib.Path(p["manifest_path"]).parent.relative_to(ROOT).as_posix()
        deps = sorted({d["name"] for d in p["dependencies"] if d["name"] in names and d.get("kind") in (None, "build")})
        out.append((p["name"], path, deps))
    return sorted(out)


def short(name):
    return name.removeprefix("pdmesh-") if name != "pdmesh" else "pdmesh"


def used_by(crates):
    users = {name: [] for name, _, _ in crates}
    for name, _, deps in crates:
        for d in deps:
            users[d].append(short(name))
    return {k: ", ".join(sorted(v)) if v else "—" for k, v in users.items()}


ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<path>[^ |]+) \| (?P<owns>.*) \| (?P<used>[^|]*) \|$")


def missing(crates, architecture, readme):
    problems = []
    rows = {m["name"]: m for m in map(ROW.match, architecture.splitlines()) if m}
    layout = readme.split("## Layout", 1)[-1].split("```")[1] if "## Layout" in readme else ""
    expected = used_by(crates)
    for name, path, _ in crates:
        row = rows.get(name)
        if row is None or row["path"] != path:
            problems.append(f"docs/ARCHITECTURE.md's code map has no row for {name} ({path})")
        elif row["used"].strip() != expected[name]:
            problems.append(
                f"docs/ARCHITECTURE.md: {name} is used by `{expected[name]}` (cargo metadata), "
                f"the map says `{row['used'].strip()}` (scripts/check-code-map.py --write)"
            )
        top, _, leaf = path.rpartition("/")
        # shared/x and services/x are named under their folder's line; loadtest has its own
        if not re.search(rf"(^|[\s,(]){re.escape(leaf)}([\s,(/]|$)", layout):
            problems.append(f"README's layout does not name {path}")
    return problems


def service_edges(crates):
    """Service → service dependencies (the binary excepted)."""
    services = {name for name, path, _ in crates if path.startswith("services/") and name != BINARY}
    return [
        f"service {a} depends on service {b}"
        for a, _, deps in crates
        if a in services
        for b in deps
        if b in services
    ]


def write(crates, architecture):
    expected = used_by(crates)

    def fix(line):
        m = ROW.match(line)
        if not m or m["name"] not in expected:
            return line
        return f"| `{m['name']}` | {m['path']} | {m['owns']} | {expected[m['name']]} |"

    return "\n".join(fix(l) for l in architecture.splitlines()) + "\n"


def selftest(crates, architecture, readme):
    fake = crates + [("pdmesh-new-crate", "shared/new-crate", [])]
    found = missing(fake, architecture, readme)
    assert any("no row for pdmesh-new-crate" in p for p in found), found
    assert any("shared/new-crate" in p and "README" in p for p in found), found
    # a new edge the map does not show
    name, path, deps = crates[0]
    other = next(n for n, _, _ in crates if n != name and n not in deps)
    edged = [(n, p, sorted(d + [name]) if n == other else d) for n, p, d in crates]
    assert any(f"{name} is used by" in p for p in missing(edged, architecture, readme)), "a wrong used-by cell"
    svc = [(n, p) for n, p, _ in crates if p.startswith("services/") and n != BINARY]
    (a, _), (b, _) = svc[0], svc[1]
    looped = [(n, p, d + [b] if n == a else d) for n, p, d in crates]
    assert service_edges(looped) == [f"service {a} depends on service {b}"], service_edges(looped)


def main():
    arch_path = ROOT / "docs/ARCHITECTURE.md"
    architecture = arch_path.read_text()
    readme = (ROOT / "README.md").read_text()
    crates = workspace(metadata())
    if "--write" in sys.argv:
        arch_path.write_text(write(crates, architecture))
        return
    if "--selftest" in sys.argv:
        selftest(crates, architecture, readme)
    problems = missing(crates, architecture, readme) + service_edges(crates)
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print(
        f"code map: {len(crates)} crates, each on docs/ARCHITECTURE.md's map with its users as cargo metadata "
        "has them, and on README's layout; no service depends on another"
    )


main()
