#!/usr/bin/env python3
"""No non-test Rust function over 100 lines (issue 42): a function that long has parts, and
parts with names are read, reviewed and profiled one at a time. Lists every `fn` item of the
workspace whose body spans more than MAX_LINES lines (from the line of `fn` to the line of its
closing brace), leaving out test code: files under tests/, benches/ and fuzz/, modules and items
under `#[cfg(test)]` (inline, or a `#[cfg(test)] mod name;` file) and `#[test]` functions.
Braces are matched on the source with strings, chars and comments blanked, so a `{` in a string
or a comment does not count. Exits non-zero naming each long function not on ALLOWED below.
--selftest: a planted 101-line function must be reported and a 100-line one must not."""
import os
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 100
SKIP_DIRS = {"tests", "benches", "fuzz", "target", ".git", "node_modules"}

# (path relative to the repository root, function name) -> why it may stay long. Keep it empty
# where possible: an entry is a debt with a reason, not an exemption.
ALLOWED: dict = {}


def blank(text):
    """The source with the contents of comments, strings and char literals replaced by spaces
    (newlines kept, so line numbers hold). Handles nested block comments, raw strings r#"..."#,
    byte strings, escapes, and tells a char literal from a lifetime."""
    out = list(text)
    i, n = 0, len(text)

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif c == "/" and text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif c in "rb" and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'(?:br|rb|r)(#*)"', text[i:])
            if m:
                end = text.find('"' + m.group(1), i + m.end())
                end = n if end < 0 else end + 1 + len(m.group(1))
                wipe(i + m.end(), end - 1 - len(m.group(1)))
                i = end
            elif text.startswith('b"', i) or text.startswith("b'", i):
                i += 1  # the literal itself is handled on the next turn
            else:
                i += 1
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            wipe(i + 1, j)
            i = j + 1
        elif c == "'":
            # a char literal: 'x', '\n', '\u{..}', '\''; otherwise a lifetime or label
            m = re.match(r"'(?:\\u\{[0-9a-fA-F_]+\}|\\.|[^\\'\n])'", text[i:])
            if m:
                wipe(i + 1, i + m.end() - 1)
                i += m.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def matching(code, open_at):
    """Index of the brace closing the one at open_at (len(code) if unbalanced)."""
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(code)


def item_body(code, start):
    """The span (open, close) of the braces of the item starting at start, or None when the
    item ends with `;` first (a declaration, a `mod name;`, a trait method without a body)."""
    parens = 0
    for k in range(start, len(code)):
        ch = code[k]
        if ch in "([":
            parens += 1
        elif ch in ")]":
            parens -= 1
        elif parens == 0 and ch == ";":
            return None
        elif parens == 0 and ch == "{":
            return k, matching(code, k)
    return None


TEST_ATTR = re.compile(r"#\[\s*(?:cfg\s*\(\s*(?:all\s*\(\s*)?test\b|test\s*\])")


def test_spans(code, path, skip_files):
    """Spans of code under a test attribute; `#[cfg(test)] mod name;` adds that file to skip."""
    spans = []
    for m in TEST_ATTR.finditer(code):
        # the item the attribute belongs to: past any further attributes
        k = m.end()
        while True:
            close = code.find("]", k)
            nxt = re.match(r"\s*#\[", code[close + 1 :]) if close >= 0 else None
            if not nxt:
                k = close + 1
                break
            k = close + 1 + nxt.end()
        decl = re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", code[k:])
        if decl:
            here = path.parent if path.stem in ("mod", "lib", "main") else path.parent / path.stem
            skip_files.add(here / (decl.group(1) + ".rs"))
            skip_files.add(here / decl.group(1) / "mod.rs")
            continue
        body = item_body(code, k)
        if body:
            spans.append(body)
    return spans


FN = re.compile(r"\bfn\s+(r#)?([A-Za-z_]\w*)")


def long_functions(path, skip_files, limit=MAX_LINES):
    """(name, first line, line count) of each non-test function in path over limit lines."""
    code = blank(path.read_text(encoding="utf-8"))
    tests = test_spans(code, path, skip_files)
    found = []
    for m in FN.finditer(code):
        if any(a <= m.start() <= b for a, b in tests):
            continue
        body = item_body(code, m.end())
        if not body:
            continue
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, body[1]) + 1
        if last - first + 1 > limit:
            found.append((m.group(2), first, last - first + 1))
    return found


def rust_files(root):
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(names):
            if f.endswith(".rs"):
                yield pathlib.Path(dirpath) / f


def scan(root):
    # test-module files are named by their parent module, which os.walk visits first in the
    # same directory only for mod.rs/lib.rs; collect them all before judging any file
    skip_files, results = set(), []
    for path in rust_files(root):
        results.append((path, long_functions(path, skip_files)))
    return [
        (path.relative_to(root).as_posix(), name, line, count)
        for path, found in results
        if path not in skip_files
        for name, line, count in found
    ]


def report(root, allowed, out=print):
    """Print each long function; the number not allowed. An allowlist entry that names no
    long function any more is pointed out (remove it), without failing: it was split."""
    bad, seen = 0, set()
    for rel, name, line, count in scan(root):
        if (rel, name) in allowed:
            seen.add((rel, name))
            out(f"allowed: {rel}:{line} fn {name}: {count} lines ({allowed[(rel, name)]})")
        else:
            out(f"{rel}:{line} fn {name}: {count} lines (over {MAX_LINES}; split it into named parts)")
            bad += 1
    for rel, name in sorted(set(allowed) - seen):
        out(f"note: allowlist entry {rel} fn {name} names no function over {MAX_LINES} lines; remove it")
    return bad


def planted(name, lines):
    """A function of exactly `lines` lines whose body holds braces in strings and comments."""
    body = ['    let s = "}}}"; // }'] + ["    let _ = '{'; /* { */"] * (lines - 3)
    return "\n".join([f"pub fn {name}() {{"] + body + ["}"]) + "\n"


def selftest():
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "crate" / "src"
        src.mkdir(parents=True)
        (src / "lib.rs").write_text(
            "#[cfg(test)]\nmod tests;\n"
            + planted("too_long", MAX_LINES + 1)
            + planted("just_fits", MAX_LINES)
            + "#[cfg(test)]\nmod inline {\n"
            + planted("test_helper", MAX_LINES + 5)
            + "}\n"
        )
        (src / "tests.rs").write_text(planted("in_test_file", MAX_LINES + 5))
        names = [name for _, name, _, _ in scan(pathlib.Path(tmp))]
        if names != ["too_long"]:
            print(f"selftest failed: expected only too_long reported, got {names}")
            return False
        if report(pathlib.Path(tmp), {}, out=lambda _: None) != 1:
            print("selftest failed: a planted long function did not fail the check")
            return False
    print("selftest: a planted 101-line function is reported, a 100-line one is not")
    return True


def main():
    if "--selftest" in sys.argv[1:] and not selftest():
        return 1
    bad = report(ROOT, ALLOWED)
    if bad:
        return 1
    print(f"no function over {MAX_LINES} lines outside the allowlist ({len(ALLOWED)} entries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
