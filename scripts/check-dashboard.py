#!/usr/bin/env python3
"""Check the Grafana dashboard and its provisioning against the code (docs/DECISIONS.md D48).

A dashboard is code that no compiler reads: a renamed metric leaves a panel empty without any
error. So this check reads the metric definitions out of the Rust sources (the first argument
of every `counter`/`counter_vec`/`float_counter_vec`/`gauge`/`gauge_vec`/`histogram`/
`histogram_vec` call in services/ and shared/, a string literal or a `const NAME: &str` naming
one; unit-test modules excluded), with their type and labels, and fails when:

- a PromQL expression of a panel or a template variable names a series the code does not
  define (`_bucket`/`_sum`/`_count` are accepted on histograms only, and a histogram's bare
  name is refused: Prometheus has no such series) or that docs/METRICS.md does not list;
- a label matcher or `by (...)` names a label neither the metric nor the scrape config
  (deploy/prometheus.yml target labels, `job`, `instance`; `le` on buckets) gives it;
- `rate`/`irate`/`increase` is taken of a gauge, or `histogram_quantile` aggregates without `le`;
- an expression uses a `$variable` the dashboard does not define, or a panel's title or
  description names a `pdmesh_*` metric the code does not define;
- two panels share an id, or a panel (other than a row) has no datasource, or its datasource
  is neither `${DS_PROMETHEUS}` nor the provisioned datasource's uid;
- a provisioning file points to a path that docker-compose.yml does not mount from an
  existing folder, the datasource URL names no compose service, a Prometheus target host is no
  compose service, or scripts/compose-test.sh starts a compose profile (it cannot pull images);
- a metric defined in the code is missing from docs/METRICS.md.

The only series allowed that the code does not define is Prometheus' own `up` (one per
scrape target; how a dashboard sees a target down). Python 3 standard library only; run by
scripts/test.sh. `--selftest` also feeds it known-bad expressions and fails unless each is
refused.
"""
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/dashboards/pdmesh.json"
DS_PROVISIONING = ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml"
DASH_PROVISIONING = ROOT / "deploy/grafana/provisioning/dashboards/pdmesh.yml"
COMPOSE = ROOT / "deploy/docker-compose.yml"
PROMETHEUS = ROOT / "deploy/prometheus.yml"
COMPOSE_TEST = ROOT / "scripts/compose-test.sh"
METRICS_DOC = ROOT / "docs/METRICS.md"

PROMETHEUS_BUILTIN = {"up": ("gauge", set())}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
GRAFANA_BUILTIN_VARS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s",
                        "__range_ms", "__name", "__org", "__user", "__dashboard", "__from", "__to"}
# PromQL words that are not series: aggregations, set and grouping operators, modifiers.
KEYWORDS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
            "bottomk", "topk", "quantile", "limitk", "limit_ratio", "by", "without", "on",
            "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
            "atan2", "inf", "nan"}
RATE_FUNCS = {"rate", "irate", "increase"}


# ------------------------------------------------------------------ the code's metrics
CTOR = re.compile(
    r"\b(counter|counter_vec|float_counter_vec|gauge|gauge_vec|histogram|histogram_vec)\(\s*"
    r'(?:"(pdmesh_[a-z0-9_]+)"|([A-Z][A-Z0-9_]*))\s*,\s*"(?:[^"\\]|\\.)*"\s*(?:,\s*&\[([^\]]*)\])?',
    re.S)
CONST = re.compile(r'\bconst\s+([A-Z][A-Z0-9_]*)\s*:\s*&str\s*=\s*"(pdmesh_[a-z0-9_]+)"')
TEST_MODULE = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+\w+\s*\{")


def code_metrics():
    """{name: (type, labels, file)} for every metric the services and shared crates define."""
    out = {}
    for top in ("services", "shared"):
        for path in sorted((ROOT / top).rglob("*.rs")):
            rel = path.relative_to(ROOT)
            if "tests" in rel.parts or path.name == "tests.rs" or "target" in rel.parts:
                continue
            text = path.read_text(encoding="utf-8")
            cut = TEST_MODULE.search(text)
            if cut:
                text = text[:cut.start()]
            consts = dict(CONST.findall(text))
            for m in CTOR.finditer(text):
                kind, literal, ident, labels = m.groups()
                name = literal or consts.get(ident or "")
                if not name:
                    continue
                typ = "histogram" if kind.startswith("histogram") else \
                      "gauge" if kind.startswith("gauge") else "counter"
                out[name] = (typ, set(re.findall(r'"([a-z_]+)"', labels or "")), str(rel))
    return out


def documented(code):
    """Metric names docs/METRICS.md lists, `a_x` / `_y` shorthands expanded against the code."""
    names = set()
    for line in METRICS_DOC.read_text(encoding="utf-8").splitlines():
        ticks = re.findall(r"`([A-Za-z0-9_:]+)`", line)
        full = [t for t in ticks if re.fullmatch(r"[a-z][a-z0-9_]*", t)]
        names.update(full)
        for short in (t for t in ticks if t.startswith("_")):
            for base in full:
                for i, c in enumerate(base):
                    if c == "_" and base[:i] + short in code:
                        names.add(base[:i] + short)
    return names


# ------------------------------------------------------------------ PromQL scanning
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def strip_vars(expr):
    """Grafana variables -> placeholder literals; returns (expr, variable names used)."""
    used = re.findall(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", expr)
    names = {a or b for a, b in used}
    return re.sub(r"\$\{\w+(?::\w+)?\}|\$\w+", "VAR", expr), names


def scan(expr):
    """Yield (metric, matcher labels, enclosing function) for every series selector, and the
    label lists of every `by`/`without`/`on`/`ignoring` clause as ("#by", labels, None)."""
    i, n = 0, len(expr)
    stack = []          # function names (or "" for plain parentheses) of the open parentheses
    pending = None      # an identifier that may open a call or take a matcher block
    while i < n:
        c = expr[i]
        if c in "\"'`":
            j = i + 1
            while j < n and expr[j] != c:
                j += 2 if expr[j] == "\\" else 1
            i = j + 1
            continue
        if c == "[":
            i = expr.index("]", i) + 1
            continue
        if c == "{":
            j = expr.index("}", i)
            labels = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", expr[i + 1:j])
            metric = pending if pending and pending not in KEYWORDS else None
            yield (metric, set(labels), stack[-1] if stack else None) if metric else ("{}", set(labels), None)
            pending = None
            i = j + 1
            continue
        m = IDENT.match(expr, i)
        if m and not (i > 0 and (expr[i - 1].isdigit() or expr[i - 1] == ".")):
            word = m.group(0)
            i = m.end()
            if pending and pending not in KEYWORDS:
                yield (pending, set(), stack[-1] if stack else None)
            pending = word
            if word in ("by", "without", "on", "ignoring", "group_left", "group_right"):
                k = i
                while k < n and expr[k].isspace():
                    k += 1
                if k < n and expr[k] == "(":
                    j = expr.index(")", k)
                    yield ("#by", set(IDENT.findall(expr[k + 1:j])), None)
                    i = j + 1
                pending = None
            continue
        if c == "(":
            stack.append(pending if pending and pending not in KEYWORDS or pending in ("count", "quantile") else "")
            pending = None
        elif c == ")":
            if pending and pending not in KEYWORDS:
                yield (pending, set(), stack[-1] if stack else None)
            pending = None
            if stack:
                stack.pop()
        elif not c.isspace():
            if pending and pending not in KEYWORDS:
                yield (pending, set(), stack[-1] if stack else None)
            pending = None
        i += 1
    if pending and pending not in KEYWORDS:
        yield (pending, set(), stack[-1] if stack else None)


def check_expr(expr, where, ctx):
    """Problems of one PromQL expression (a list of strings)."""
    problems = []
    expr, used_vars = strip_vars(expr)
    for v in sorted(used_vars - ctx["vars"] - GRAFANA_BUILTIN_VARS):
        problems.append(f"{where}: uses ${v}, which the dashboard does not define")
    for fn in ("label_values", "query_result", "metrics", "label_names"):
        expr = re.sub(rf"\b{fn}\(", "(", expr)
    # label_values(selector, label): the trailing label is not a series
    expr = re.sub(r",\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", ")", expr)
    series_labels = set()
    by_lists = []
    unknown = False
    for metric, labels, func in scan(expr):
        if metric == "#by":
            by_lists.append(labels)
            continue
        if metric == "{}":
            problems.append(f"{where}: a matcher block with no metric name")
            continue
        if metric == "VAR" or re.fullmatch(r"\d+[smhdwy]?", metric):
            continue
        known = ctx["code"].get(metric) or PROMETHEUS_BUILTIN.get(metric)
        base, suffix = metric, ""
        if not known:
            for s in HISTOGRAM_SUFFIXES:
                if metric.endswith(s) and metric[:-len(s)] in ctx["code"]:
                    base, suffix = metric[:-len(s)], s
                    known = ctx["code"][base]
        if not known:
            problems.append(f"{where}: {metric} is not a metric the code defines")
            unknown = True
            continue
        typ, own_labels = known[0], set(known[1])
        if suffix and typ != "histogram":
            problems.append(f"{where}: {metric}: {base} is a {typ}, it has no {suffix} series")
            continue
        if typ == "histogram" and not suffix:
            problems.append(f"{where}: {metric} is a histogram: use {metric}_bucket/_sum/_count")
            continue
        if base not in ctx["docs"] and base not in PROMETHEUS_BUILTIN:
            problems.append(f"{where}: {base} is not listed in docs/METRICS.md")
        allowed = own_labels | ctx["scrape_labels"] | ({"le"} if suffix == "_bucket" else set())
        for lab in sorted(labels - allowed):
            problems.append(f"{where}: {metric} has no label {lab!r} (it has {sorted(allowed)})")
        if func in RATE_FUNCS and typ == "gauge":
            problems.append(f"{where}: {func}() of the gauge {metric}")
        series_labels |= allowed
    for labels in by_lists if not unknown else []:
        for lab in sorted(labels - series_labels):
            problems.append(f"{where}: groups by {lab!r}, which none of its series carries")
    if "histogram_quantile" in expr and by_lists and not any("le" in b for b in by_lists):
        problems.append(f"{where}: histogram_quantile over an aggregation without `le`")
    return problems


# ------------------------------------------------------------------ files
def compose_services():
    """{service name: [volume lines]} of deploy/docker-compose.yml (top-level `services:`)."""
    services, current, in_services, in_volumes = {}, None, False, False
    for line in COMPOSE.read_text(encoding="utf-8").splitlines():
        if re.match(r"^\S", line):
            in_services = line.startswith("services:")
            current = None
            continue
        if not in_services:
            continue
        m = re.match(r"^  ([A-Za-z0-9_.-]+):\s*$", line)
        if m:
            current, in_volumes = m.group(1), False
            services[current] = []
            continue
        if current is None:
            continue
        m = re.match(r"^    (\w[\w-]*):", line)
        if m:
            in_volumes = m.group(1) == "volumes"
            continue
        m = re.match(r"^      - (.+)$", line)
        if m and in_volumes:
            services[current].append(m.group(1).strip().strip("\"'"))
    return services


def yaml_values(path, key):
    """Every scalar value of `key:` in a simple YAML file (no anchors or flow maps)."""
    return [v.strip().strip("\"'") for v in re.findall(rf"^\s*-?\s*{key}:\s*(\S.*?)\s*$",
                                                         path.read_text(encoding="utf-8"), re.M)]


def host_path(container_path, service, services):
    """The file or folder on this machine a path inside `service`'s container comes from."""
    best = None
    for vol in services.get(service, []):
        parts = vol.split(":")
        if len(parts) < 2 or not parts[0].startswith((".", "/")):
            continue
        src, dst = parts[0], parts[1].rstrip("/")
        if container_path == dst or container_path.startswith(dst + "/"):
            if best is None or len(dst) > len(best[1]):
                best = (src, dst)
    if best is None:
        return None
    return (COMPOSE.parent / best[0]).resolve() / container_path[len(best[1]):].lstrip("/")


def check_files(ctx):
    problems = []
    services = compose_services()
    for f in (DS_PROVISIONING, DASH_PROVISIONING):
        if not f.is_file():
            problems.append(f"{f.relative_to(ROOT)} is missing")
    if problems:
        return problems
    if "grafana" not in services:
        return ["deploy/docker-compose.yml has no grafana service"]
    if "prometheus" not in services:
        problems.append("deploy/docker-compose.yml has no prometheus service")
    # the provisioning folder and the dashboards folder reach the container
    prov = host_path("/etc/grafana/provisioning", "grafana", services)
    if prov is None or not prov.is_dir():
        problems.append(f"grafana: /etc/grafana/provisioning is not mounted from an existing folder ({prov})")
    for path in yaml_values(DASH_PROVISIONING, "path"):
        src = host_path(path, "grafana", services)
        where = DASH_PROVISIONING.relative_to(ROOT)
        if src is None or not src.exists():
            problems.append(f"{where}: path {path} is not mounted from an existing path ({src})")
        elif src.resolve() not in (DASHBOARD.parent.resolve(), DASHBOARD.resolve()):
            problems.append(f"{where}: path {path} is {src}, not {DASHBOARD.parent}")
    for url in yaml_values(DS_PROVISIONING, "url"):
        host = re.sub(r"^\w+://", "", url).split("/")[0].split(":")[0]
        if host not in services:
            problems.append(f"{DS_PROVISIONING.relative_to(ROOT)}: url {url}: {host} is no compose service")
    for target in re.findall(r"targets:\s*\[([^\]]*)\]", PROMETHEUS.read_text(encoding="utf-8")):
        for t in target.split(","):
            host = t.strip().strip("\"'").split(":")[0]
            if host and host not in services:
                problems.append(f"deploy/prometheus.yml: target {t.strip()}: {host} is no compose service")
    if re.search(r"--profile|COMPOSE_PROFILES=\S", COMPOSE_TEST.read_text(encoding="utf-8")):
        problems.append("scripts/compose-test.sh starts a compose profile (its images cannot be pulled there)")
    return problems


def scrape_labels():
    """Labels Prometheus adds to every series of deploy/prometheus.yml's targets."""
    labels = {"job", "instance"}
    text = PROMETHEUS.read_text(encoding="utf-8")
    for block in re.findall(r"labels:\s*\{([^}]*)\}", text):
        labels.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*:", block))
    labels.update(re.findall(r"target_label:\s*([A-Za-z_][A-Za-z0-9_]*)", text))
    return labels


def all_panels(panels):
    for p in panels:
        yield p
        yield from all_panels(p.get("panels") or [])


def check_dashboard(dash, ctx):
    problems = []
    ids = {}
    for p in all_panels(dash.get("panels") or []):
        title = p.get("title", "?")
        pid = p.get("id")
        if pid is None:
            problems.append(f"panel {title!r} has no id")
        elif pid in ids:
            problems.append(f"panel id {pid} used by {ids[pid]!r} and {title!r}")
        else:
            ids[pid] = title
        if p.get("type") == "row":
            continue
        ds = p.get("datasource") or {}
        if not ds or not all(t.get("datasource") or ds for t in p.get("targets") or []):
            problems.append(f"panel {title!r} has no datasource")
        for d in [ds] + [t.get("datasource") or {} for t in p.get("targets") or []]:
            uid = d.get("uid") if isinstance(d, dict) else d
            if uid and uid not in ctx["ds_uids"]:
                problems.append(f"panel {title!r}: datasource uid {uid!r} is neither ${{DS_PROMETHEUS}} nor provisioned")
        for word in re.findall(r"\bpdmesh_[a-z0-9_]+", f"{title} {p.get('description', '')}"):
            base = re.sub(r"_(bucket|sum|count)$", "", word) if word not in ctx["code"] else word
            if base not in ctx["code"]:
                problems.append(f"panel {title!r}: its title or description names {word}, which the code does not define")
        targets = p.get("targets") or []
        if not targets:
            problems.append(f"panel {title!r} has no query")
        for t in targets:
            expr = t.get("expr")
            if not expr:
                problems.append(f"panel {title!r} target {t.get('refId')} has no expr")
                continue
            problems += check_expr(expr, f"panel {title!r} [{t.get('refId')}]", ctx)
    for v in (dash.get("templating") or {}).get("list", []):
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if q:
            problems += check_expr(q, f"variable ${v.get('name')}", ctx)
    return problems


def context():
    code = code_metrics()
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v.get("name") for v in (dash.get("templating") or {}).get("list", [])}
    uids = set(yaml_values(DS_PROVISIONING, "uid")) if DS_PROVISIONING.is_file() else set()
    if "DS_PROMETHEUS" in variables:
        uids |= {"${DS_PROMETHEUS}", "$DS_PROMETHEUS"}
    return dash, {"code": code, "docs": documented(code), "vars": variables,
                  "scrape_labels": scrape_labels(), "ds_uids": uids}


SELFTEST_BAD = [
    'rate(pdmesh_frontend_http_request_total[5m])',                 # misspelt (no `s`)
    'rate(pdmesh_engine_requests_waiting[5m])',                      # rate of a gauge
    'pdmesh_frontend_time_to_first_token_seconds',                   # bare histogram name
    'rate(pdmesh_frontend_prompt_tokens_total_bucket[5m])',          # _bucket of a counter
    'sum by (kind) (pdmesh_frontend_requests_in_flight)',            # label it does not carry
    'pdmesh_frontend_request_errors_total{reason="x"}',              # matcher on a missing label
    'histogram_quantile(0.9, sum by (node) (rate(pdmesh_worker_kv_transfer_seconds_bucket[5m])))',
    'rate(pdmesh_frontend_http_requests_total{node=~"$nodes"}[5m])',  # undefined variable
]


def main():
    dash, ctx = context()
    problems = check_dashboard(dash, ctx) + check_files(ctx)
    undocumented = sorted(set(ctx["code"]) - ctx["docs"])
    for name in undocumented:
        problems.append(f"{name} (defined in {ctx['code'][name][2]}) is not listed in docs/METRICS.md")
    if "--selftest" in sys.argv:
        for bad in SELFTEST_BAD:
            if not check_expr(bad, "selftest", ctx):
                problems.append(f"selftest: the bad expression {bad!r} was not refused")
    panels = [p for p in all_panels(dash.get("panels") or []) if p.get("type") != "row"]
    used = set()
    for p in panels:
        for t in p.get("targets") or []:
            e, _ = strip_vars(t.get("expr") or "")
            used.update(re.sub(r"_(bucket|sum|count)$", "", m) if m not in ctx["code"] else m
                        for m, _, _ in scan(e) if m.startswith("pdmesh_"))
    for e in problems:
        print("check-dashboard:", e)
    print(f"check-dashboard: {len(panels)} panels, {len(used)} pdmesh metrics used, "
          f"{len(ctx['code'])} metrics in the code, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
