#!/usr/bin/env python3
"""Parse the Kubernetes manifests and check what a cluster would reject first.

Every object needs apiVersion, kind and metadata.name; Deployments and StatefulSets need a
selector that matches their pod template's labels; every Service selects the labels of some
workload's pods, and every container port a Service targets by name exists. Liveness probes
must use `/live`: `/health` is readiness, and probing it for liveness restarts a healthy
service whenever a peer behind it is slow to come up (docs/DECISIONS.md D36). Every pdmesh
container must read the mesh secret from the Secret `pdmesh-mesh-secret`, not optionally: P and
D authenticate with it, and the services of a node on tcp transport seal their internal links
with it and refuse to start without it (D45); the router reads it too, so no pod is left out.
Run by
scripts/test.sh; skips (exit 0, with the reason) when PyYAML is not installed.
"""
import glob
import sys

try:
    import yaml
except ImportError:
    print("check-k8s: PyYAML not installed, skipping the manifest check")
    sys.exit(0)

errors = []
objects = []
for path in sorted(glob.glob("deploy/k8s/*.yaml")):
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc:
                continue
            name = (doc.get("metadata") or {}).get("name")
            if not (doc.get("apiVersion") and doc.get("kind") and name):
                errors.append(f"{path}: object without apiVersion/kind/metadata.name: {list(doc)}")
                continue
            objects.append((path, doc))

pod_labels = []  # (workload, labels, container port names)
for path, doc in objects:
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        spec = doc.get("spec") or {}
        template = spec.get("template") or {}
        labels = (template.get("metadata") or {}).get("labels") or {}
        selector = (spec.get("selector") or {}).get("matchLabels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            errors.append(f"{path}: {doc['kind']} {doc['metadata']['name']}: selector {selector} does not match template labels {labels}")
        ports = {p.get("name") for c in (template.get("spec") or {}).get("containers", []) for p in c.get("ports", []) or []}
        pod_labels.append((doc["metadata"]["name"], labels, ports))
        for c in (template.get("spec") or {}).get("containers", []):
            live = ((c.get("livenessProbe") or {}).get("httpGet") or {}).get("path")
            if live is not None and live != "/live":
                errors.append(f"{path}: {doc['metadata']['name']}: livenessProbe probes {live}, not /live")
            if c.get("name") == "pdmesh":
                refs = [(e.get("secretRef") or {}) for e in c.get("envFrom") or []]
                if not any(r.get("name") == "pdmesh-mesh-secret" and not r.get("optional") for r in refs):
                    errors.append(f"{path}: {doc['metadata']['name']}: container pdmesh does not read the Secret pdmesh-mesh-secret")

for path, doc in objects:
    if doc["kind"] != "Service":
        continue
    sel = (doc.get("spec") or {}).get("selector") or {}
    matches = [w for w in pod_labels if all(w[1].get(k) == v for k, v in sel.items())]
    if sel and not matches:
        errors.append(f"{path}: Service {doc['metadata']['name']} selects {sel}, which no workload's pods carry")
    for p in (doc.get("spec") or {}).get("ports", []) or []:
        target = p.get("targetPort")
        if isinstance(target, str) and matches and not any(target in w[2] for w in matches):
            errors.append(f"{path}: Service {doc['metadata']['name']} targets port {target!r}, not declared by its pods")

for e in errors:
    print("check-k8s:", e)
print(f"check-k8s: {len(objects)} objects, {len(errors)} problems")
sys.exit(1 if errors else 0)
