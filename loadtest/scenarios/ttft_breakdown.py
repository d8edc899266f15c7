#!/usr/bin/env python3
"""Where a request's time to first token goes, from the spans the mesh exports (docs/TRACING.md).

Reads the span list of `pdmesh-otlp-sink` (`GET /api/spans`, JSON) and prints, per request
phase, the median and p90 over the requests it finds, in milliseconds since the router (P/D) or
the frontend (colocated) received the request. Used by loadtest/scenarios/ttft-breakdown.sh.

    ttft_breakdown.py SPANS.json [CLIENT_TTFT_P50_MS_PD CLIENT_TTFT_P50_MS_COLOCATED]
"""
import json
import statistics
import sys
from collections import defaultdict

spans = json.load(open(sys.argv[1]))
if isinstance(spans, dict):
    spans = spans.get("spans", [])
by_trace = defaultdict(list)
for s in spans:
    by_trace[s["trace_id"]].append(s)


def node(s):
    return s.get("resource", {}).get("pdmesh.node", "")


def find(tr, name, nd=None):
    return [s for s in tr if s["name"] == name and (nd is None or node(s) == nd)]


def event(ss, name):
    ts = [e.get("time_unix_nano", 0) for s in ss for e in s.get("events", []) if e["name"] == name]
    ts = [t for t in ts if t]
    return min(ts) if ts else None


MS = 1e6


def phases(pts, t0):
    """Each phase's length (ms) from the end of the one before it; a missing point is None and
    the next phase counts from the last point that was there."""
    row, last = {}, t0
    for k, t in pts.items():
        if t is None:
            row[k] = None
            continue
        row[k] = (t - last) / MS
        last = t
    return row


def p_points(pleg, p_eng, p_wp, p_hold, hold_label):
    """P's leg, from the router sending it to its answer back at the router."""
    return {
        "router: request in → P leg sent": pleg[0]["start_unix_nano"],
        "P: HTTP, frontend, dp-lb → engine-core": p_eng[0]["start_unix_nano"],
        "P: queued → prefill forward starts": min(s["start_unix_nano"] for s in p_wp),
        "P: prefill forward": max(s["end_unix_nano"] for s in p_wp),
        "P: forward done → hold registered": p_hold[0]["start_unix_nano"] if p_hold else None,
        hold_label: p_eng[0]["end_unix_nano"],
        "P: answer → router (dp-lb, frontend, HTTP)": pleg[0]["end_unix_nano"],
    }


pd_rows, d63_rows, local_rows, colo_rows = [], [], [], []
for tr in by_trace.values():
    root = find(tr, "router.request")
    if root:
        r = root[0]
        t0 = r["start_unix_nano"]
        pleg, dleg = find(tr, "router.prefill"), find(tr, "router.decode")
        p_eng, d_eng = find(tr, "engine.request", "p"), find(tr, "engine.request", "d")
        # D's first step computes the last prompt token; the worker calls it a prefill or, when
        # only that token is left, a decode: the earliest of either is D's first step.
        p_wp = find(tr, "worker.prefill", "p")
        d_steps = find(tr, "worker.prefill", "d") + find(tr, "worker.decode", "d")
        d_wp = [min(d_steps, key=lambda s: s["start_unix_nano"])] if d_steps else []
        p_hold = find(tr, "kv.hold", "p")
        d_read = find(tr, "kv.read", "d")
        d_fe = find(tr, "frontend.generate", "d")
        first = event(d_fe, "first token")
        # D63: the client's first token is P's, sent by the router once D has answered.
        from_p = event(root, "first token from the prefill node")
        if from_p and pleg and dleg and p_eng and d_eng and p_wp:
            # D65: P's answer leaves before its hold registers (the next step's metadata).
            hold_first = p_hold and p_hold[0]["start_unix_nano"] < p_eng[0]["end_unix_nano"]
            pts = p_points(pleg, p_eng, p_wp, p_hold if hold_first else [], "P: (hold registered →) answer released")
            if dleg[0]["start_unix_nano"] < pleg[0]["end_unix_nano"]:
                # D66: D's leg left with P's and was parked on D; only the params' hand-over
                # stands between P's answer and the client's first token.
                pts["router: P answered → params handed to D, P's token sent"] = from_p
            else:
                pts["router: P answered → D leg sent"] = dleg[0]["start_unix_nano"]
                pts["D: HTTP, frontend, dp-lb → engine-core"] = d_eng[0]["start_unix_nano"]
                pts["D: admitted → its answer's headers at the router"] = event(dleg, "decode answered")
                pts["router: D answered → P's token sent (first token)"] = from_p
            row = phases(pts, t0)
            row["= router in → first token (P's, D63)"] = (from_p - t0) / MS
            d63_rows.append(row)
            continue
        relayed = event(root, "first token relayed")
        if not pleg and dleg and d_eng and d_wp and first:
            # D69: prefilled on D, P not asked; the router relays D's stream.
            pts = {
                "router: request in → D leg sent": dleg[0]["start_unix_nano"],
                "D: HTTP, frontend, dp-lb → engine-core": d_eng[0]["start_unix_nano"],
                "D: queued → prefill forward starts": min(s["start_unix_nano"] for s in d_wp),
                "D: prefill forward": min(s["end_unix_nano"] for s in d_wp),
                "D: token → frontend's first token": first,
                "router: D's first token → relayed to the client": relayed,
            }
            row = phases(pts, t0)
            row["= router in → first token relayed"] = ((relayed or first) - t0) / MS
            local_rows.append(row)
            continue
        if not (pleg and dleg and p_eng and d_eng and p_wp and d_wp and d_read and first):
            continue
        pts = p_points(pleg, p_eng, p_wp, p_hold, "P: hold registered → answer released")
        pts.update({
            "router: P answered → D leg sent": dleg[0]["start_unix_nano"],
            "D: HTTP, frontend, dp-lb → engine-core": d_eng[0]["start_unix_nano"],
            "D: admission → read starts": d_read[0]["start_unix_nano"],
            "D: handshake, lease, read": d_read[0]["end_unix_nano"],
            "D: read done → first step's forward starts": min(s["start_unix_nano"] for s in d_wp),
            "D: first step's forward (last prompt token)": min(s["end_unix_nano"] for s in d_wp),
            "D: token → frontend's first token": first,
        })
        row = phases(pts, t0)
        row["= router in → D's frontend first token"] = (first - t0) / MS
        pd_rows.append(row)
        continue
    fe = find(tr, "frontend.request", "colocated")
    if fe:
        t0 = fe[0]["start_unix_nano"]
        eng, wp = find(tr, "engine.request", "colocated"), find(tr, "worker.prefill", "colocated")
        first = event(find(tr, "frontend.generate", "colocated"), "first token")
        if not (eng and wp and first):
            continue
        pts = {
            "frontend, dp-lb → engine-core": eng[0]["start_unix_nano"],
            "queued → prefill forward starts": min(s["start_unix_nano"] for s in wp),
            "prefill forward": max(s["end_unix_nano"] for s in wp),
            "token → frontend's first token": first,
        }
        row = phases(pts, t0)
        row["= frontend in → first token"] = (first - t0) / MS
        colo_rows.append(row)


def table(title, rows, client):
    if not rows:
        print(f"{title}: no complete traces")
        return
    print(f"\n{title} ({len(rows)} requests; ms, median / p90)\n")
    print("| phase | p50 | p90 |")
    print("|---|---|---|")
    for k in rows[0]:
        xs = sorted(r[k] for r in rows if r.get(k) is not None)
        if not xs:
            continue
        p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
        print(f"| {k} | {statistics.median(xs):.2f} | {p90:.2f} |")
    if client is not None:
        print(f"| client TTFT p50 (pdmesh-load) | {client:.2f} | |")


args = [float(a) for a in sys.argv[2:4]] + [None, None]
table("P/D (router → P → D)", pd_rows, args[0])
table("P/D, P's token streamed at once (D63)", d63_rows, args[0])
table("P/D, prefilled on D (D69)", local_rows, args[0])
table("colocated", colo_rows, args[1])
