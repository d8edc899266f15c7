#!/usr/bin/env python3
"""The workers' forward passes under a load, per node, for the scenarios' breakdowns.

    worker_steps.py snapshot NAME=METRICS_URL ... > before.json
    ... load ...
    worker_steps.py snapshot NAME=METRICS_URL ... > after.json
    worker_steps.py diff before.json after.json TOKENS   # JSON: per node, what the load cost

Per node (a connector-worker's /metrics): forward passes run (steps run ahead included), engine
steps answered (some carry no rows: connector work only), seconds the executor spent on them (a step run ahead counts with the step that used it), tokens run through
the model, rows run ahead (used, discarded, skipped) and the executor's mean idle gap between a
pass and the next one continuing its requests. Why: on one machine P/D and a colocated node
share the cores; throughput then depends on how many passes each output token needs and how
long each takes, which this shows side by side (docs/benchmarks.md).
"""
import json
import sys
import urllib.request

SERIES = {
    "passes": "pdmesh_worker_forward_passes_total",
    "steps": "pdmesh_worker_execute_seconds_count",
    "execute_s": "pdmesh_worker_execute_seconds_sum",
    "tokens": "pdmesh_worker_tokens_computed_total",
    "ahead_used": 'pdmesh_worker_speculative_rows_total{outcome="used"}',
    "ahead_discarded": 'pdmesh_worker_speculative_rows_total{outcome="discarded"}',
    "ahead_skipped": 'pdmesh_worker_speculative_rows_total{outcome="skipped"}',
    "gap_s": "pdmesh_worker_step_gap_seconds_sum",
    "gaps": "pdmesh_worker_step_gap_seconds_count",
}


def scrape(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = value
    out = {}
    for key, series in SERIES.items():
        try:
            out[key] = float(values.get(series, 0))
        except ValueError:
            out[key] = 0.0
    return out


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "snapshot":
        nodes = dict(a.split("=", 1) for a in sys.argv[2:])
        json.dump({name: scrape(url) for name, url in nodes.items()}, sys.stdout)
    elif len(sys.argv) == 5 and sys.argv[1] == "diff":
        before, after = (json.load(open(p)) for p in sys.argv[2:4])
        tokens = max(int(sys.argv[4]), 1)
        out = {"tokens": tokens, "nodes": {}}
        for name, a in after.items():
            b = before.get(name, {})
            d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in SERIES}
            if d["passes"] <= 0:
                continue
            out["nodes"][name] = d
        json.dump(out, sys.stdout)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
