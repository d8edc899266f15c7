#!/usr/bin/env python3
"""Every workspace crate is on the maps: docs/ARCHITECTURE.md's code map names its package and
path, README's layout names its directory. Fails, naming what is missing, when a crate is added
without them. --selftest: a crate missing from either map must be reported."""
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def members():
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--no-deps", "--format-version", "1"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout
    )
    out = []
    for p in meta["packages"]:
        path = pathlib.Path(p["manifest_path"]).parent.relative_to(ROOT).as_posix()
        out.append((p["name"], path))
    return sorted(out)


def missing(crates, architecture, readme):
    problems = []
    rows = [l for l in architecture.splitlines() if l.startswith("| `")]
    layout = readme.split("## Layout", 1)[-1].split("```")[1] if "## Layout" in readme else ""
    for name, path in crates:
        if not any(re.match(rf"\| `{re.escape(name)}` \| {re.escape(path)} \|", r) for r in rows):
            problems.append(f"docs/ARCHITECTURE.md's code map has no row for {name} ({path})")
        top, _, leaf = path.rpartition("/")
        # shared/x and services/x are named under their folder's line; loadtest has its own
        if not re.search(rf"(^|[\s,(]){re.escape(leaf)}([\s,(/]|$)", layout):
            problems.append(f"README's layout does not name {path}")
    return problems


def main():
    architecture = (ROOT / "docs/ARCHITECTURE.md").read_text()
    readme = (ROOT / "README.md").read_text()
    crates = members()
    if "--selftest" in sys.argv:
        fake = crates + [("pdmesh-new-crate", "shared/new-crate")]
        found = missing(fake, architecture, readme)
        assert any("pdmesh-new-crate" in p for p in found), found
        assert any("shared/new-crate" in p and "README" in p for p in found), found
    problems = missing(crates, architecture, readme)
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print(f"code map: {len(crates)} crates, all on docs/ARCHITECTURE.md's map and README's layout")


main()
