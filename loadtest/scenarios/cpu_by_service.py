#!/usr/bin/env python3
"""CPU time of a mesh's processes, per service, for the scenarios' breakdowns.

    cpu_by_service.py snapshot TOPOLOGY_PATH > before.json
    ... load ...
    cpu_by_service.py snapshot TOPOLOGY_PATH > after.json
    cpu_by_service.py diff before.json after.json TOKENS   # JSON: CPU ms per service and per token

A mesh's children are `pdmesh <service> --topology PATH --node NAME --rank R` (`pdmesh up`), so
a process belongs to the mesh whose topology path its command line names; the supervisor and
the router are counted too. CPU time is user + system time from /proc (clock ticks), summed per
"node/service". Why: on one machine P/D and the colocated node share the cores, and the
throughput they reach is the cores' time spent per output token, which this splits by process.
Minor page faults are counted beside it: a cache first touched while serving shows up there.
"""
import json
import os
import sys

TICK = os.sysconf("SC_CLK_TCK")


def snapshot(topology):
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if topology not in argv or not argv[0].endswith("pdmesh"):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # fields[11], [12]: utime, stime (the 14th and 15th fields of stat); fields[7]: minflt
        ticks = int(fields[11]) + int(fields[12])
        faults = int(fields[7])
        service = argv[1] if len(argv) > 1 else "?"
        node = argv[argv.index("--node") + 1] if "--node" in argv else ("" if service == "up" else "-")
        rank = argv[argv.index("--rank") + 1] if "--rank" in argv else ""
        key = "/".join(p for p in (node, service + (f"[{rank}]" if rank not in ("", "0") else "")) if p)
        had = out.get(key, [0, 0])
        out[key] = [had[0] + ticks, had[1] + faults]
    return out


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "snapshot":
        json.dump(snapshot(sys.argv[2]), sys.stdout)
        return
    if len(sys.argv) == 5 and sys.argv[1] == "diff":
        before, after = (json.load(open(p)) for p in sys.argv[2:4])
        tokens = max(int(sys.argv[4]), 1)
        zero = [0, 0]
        ms = {k: 1000.0 * (after[k][0] - before.get(k, zero)[0]) / TICK for k in after}
        faults = {k: after[k][1] - before.get(k, zero)[1] for k in after}
        json.dump(
            {
                "cpu_ms": {k: round(v, 1) for k, v in sorted(ms.items())},
                "cpu_ms_total": round(sum(ms.values()), 1),
                "cpu_ms_per_token": round(sum(ms.values()) / tokens, 3),
                "minor_faults": dict(sorted(faults.items())),
                "tokens": tokens,
            },
            sys.stdout,
        )
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main()
