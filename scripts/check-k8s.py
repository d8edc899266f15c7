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

Scaled layout (D61): a router topology in a ConfigMap that names its upstreams by DNS
(`router.prefill_dns` / `decode_dns`) must name `<service>.<namespace>.svc.cluster.local:<port>`
of a headless Service (`clusterIP: None`) of that namespace, on one of its ports, whose pods are
P nodes (`kv_producer`) for prefill_dns and D nodes (`kv_consumer`) for decode_dns; some
workload must mount that ConfigMap and run `proxy --topology` on it. Every pod that runs a P/D
node with `pdmesh serve --kv-transfer-config` must advertise its own address
(VLLM_NIXL_SIDE_CHANNEL_HOST from the downward API's `status.podIP`), have an engine id unique
per pod (`metadata.name`), and bind every interface (`--host 0.0.0.0`).

`--selftest` breaks the manifests in memory in each of those ways and checks that every
breakage is reported. Run by scripts/test.sh; skips (exit 0, with the reason) when PyYAML is
not installed.
"""
import copy
import glob
import json
import re
import sys
import tomllib

try:
    import yaml
except ImportError:
    print("check-k8s: PyYAML not installed, skipping the manifest check")
    sys.exit(0)

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
DNS_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.svc\.cluster\.local\.?:(\d+)$")


def load():
    """Every manifest object, as (path, object), and the parse errors."""
    errors, objects = [], []
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
    return objects, errors


def containers(doc):
    return ((doc.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers", []) or []


def namespace(doc):
    return (doc.get("metadata") or {}).get("namespace")


def env_source(container, name, seen=()):
    """Where env var `name` of `container` comes from: the downward API field it reads
    (directly, or through `$(OTHER)`), the literal value, or None when it is not set."""
    for e in container.get("env") or []:
        if e.get("name") != name:
            continue
        field = ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if field:
            return ("field", field)
        value = str(e.get("value", ""))
        ref = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value)
        if ref and ref.group(1) not in seen:
            return env_source(container, ref.group(1), seen + (name,))
        return ("value", value)
    return None


def arg_after(args, flag):
    """The value of `flag` in a container's args (`--flag value` or `--flag=value`)."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1 :]
    return None


def pd_role(container):
    """`kv_producer` / `kv_consumer` / `kv_both` for a container running `pdmesh serve` with a
    KV transfer config, else None."""
    args = [str(a) for a in container.get("args") or []]
    if not args or args[0] != "serve":
        return None
    text = arg_after(args, "--kv-transfer-config")
    if text is None:
        return None
    try:
        return json.loads(text).get("kv_role") or "?"
    except json.JSONDecodeError:
        return "?"


def check_pd_pod(path, doc, c, errors):
    """A P/D node in a pod: its own address, a unique engine id, every interface bound."""
    name = doc["metadata"]["name"]
    args = [str(a) for a in c.get("args") or []]
    if env_source(c, "VLLM_NIXL_SIDE_CHANNEL_HOST") != ("field", "status.podIP"):
        errors.append(f"{path}: {name}: VLLM_NIXL_SIDE_CHANNEL_HOST does not come from status.podIP "
                      "(D reaches P at the address P advertises)")
    try:
        kv = json.loads(arg_after(args, "--kv-transfer-config"))
    except (TypeError, json.JSONDecodeError) as e:
        errors.append(f"{path}: {name}: --kv-transfer-config is not JSON: {e}")
        return
    ref = re.fullmatch(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(kv.get("engine_id", "")))
    if not ref or env_source(c, ref.group(1)) != ("field", "metadata.name"):
        errors.append(f"{path}: {name}: engine_id is not the pod name ($(VAR) with VAR from metadata.name): "
                      f"{kv.get('engine_id')!r}")
    if arg_after(args, "--host") != "0.0.0.0":
        errors.append(f"{path}: {name}: pdmesh serve without --host 0.0.0.0: peers in other pods cannot reach it")


def router_topologies(objects):
    """(path, ConfigMap, key, node) for each router node of a topology held in a ConfigMap."""
    for path, doc in objects:
        if doc["kind"] != "ConfigMap":
            continue
        for key, text in (doc.get("data") or {}).items():
            if not key.endswith(".toml"):
                continue
            try:
                topo = tomllib.loads(text)
            except tomllib.TOMLDecodeError:
                continue
            for node in topo.get("nodes", []):
                if node.get("role") == "router":
                    yield path, doc, key, node


def check_router(objects, pod_workloads, path, cm, key, node, errors):
    """A router topology's DNS names: headless Services of P and D pods, and a router running it."""
    where = f"{path}: ConfigMap {cm['metadata']['name']} {key}"
    router = node.get("router") or {}
    ns = namespace(cm)
    for setting, role in (("prefill_dns", "kv_producer"), ("decode_dns", "kv_consumer")):
        dns = router.get(setting)
        if dns is None:
            continue
        m = DNS_NAME.match(dns)
        if not m:
            errors.append(f"{where}: router.{setting} = {dns!r} is not <service>.<namespace>.svc.cluster.local:<port>")
            continue
        svc_name, svc_ns, port = m.group(1), m.group(3), int(m.group(5))
        if svc_ns != ns:
            errors.append(f"{where}: router.{setting} names namespace {svc_ns!r}, the objects are in {ns!r}")
        svcs = [d for _, d in objects if d["kind"] == "Service" and d["metadata"]["name"] == svc_name
                and namespace(d) == svc_ns]
        if not svcs:
            errors.append(f"{where}: router.{setting} names Service {svc_name!r} in {svc_ns!r}, which does not exist")
            continue
        spec = svcs[0].get("spec") or {}
        if spec.get("clusterIP") != "None":
            errors.append(f"{where}: Service {svc_name} is not headless (clusterIP: None): its name resolves to one "
                          "virtual IP, not to every pod")
        if not any(p.get("port") == port for p in spec.get("ports") or []):
            errors.append(f"{where}: router.{setting} uses port {port}, not a port of Service {svc_name}")
        sel = spec.get("selector") or {}
        roles = {pd_role(c) for w in pod_workloads if all(w["labels"].get(k) == v for k, v in sel.items())
                 for c in w["containers"]}
        if roles != {role}:
            errors.append(f"{where}: router.{setting}: Service {svc_name} selects pods of kv_role {sorted(map(str, roles))}, "
                          f"not only {role}")
    runs = False
    for _, d in objects:
        if d["kind"] not in WORKLOADS or namespace(d) != ns:
            continue
        spec = ((d.get("spec") or {}).get("template") or {}).get("spec") or {}
        vols = {v.get("name") for v in spec.get("volumes") or []
                if (v.get("configMap") or {}).get("name") == cm["metadata"]["name"]}
        for c in spec.get("containers") or []:
            mounts = [m.get("mountPath", "").rstrip("/") for m in c.get("volumeMounts") or [] if m.get("name") in vols]
            args = [str(a) for a in c.get("args") or []]
            topo = arg_after(args, "--topology")
            if args[:1] == ["proxy"] and topo and any(topo == f"{m}/{key}" for m in mounts):
                runs = True
    if not runs:
        errors.append(f"{where}: no workload mounts it and runs `proxy --topology <mount>/{key}`")


def check(objects):
    errors = []
    pod_workloads = []  # {name, labels, ports, containers}
    for path, doc in objects:
        if doc["kind"] in WORKLOADS:
            spec = doc.get("spec") or {}
            template = spec.get("template") or {}
            labels = (template.get("metadata") or {}).get("labels") or {}
            selector = (spec.get("selector") or {}).get("matchLabels") or {}
            name = doc["metadata"]["name"]
            if not selector or any(labels.get(k) != v for k, v in selector.items()):
                errors.append(f"{path}: {doc['kind']} {name}: selector {selector} does not match template labels {labels}")
            ports = {p.get("name") for c in containers(doc) for p in c.get("ports", []) or []}
            pod_workloads.append({"name": name, "labels": labels, "ports": ports, "containers": containers(doc)})
            for c in containers(doc):
                live = ((c.get("livenessProbe") or {}).get("httpGet") or {}).get("path")
                if live is not None and live != "/live":
                    errors.append(f"{path}: {name}: livenessProbe probes {live}, not /live")
                if c.get("name") == "pdmesh":
                    refs = [(e.get("secretRef") or {}) for e in c.get("envFrom") or []]
                    if not any(r.get("name") == "pdmesh-mesh-secret" and not r.get("optional") for r in refs):
                        errors.append(f"{path}: {name}: container pdmesh does not read the Secret pdmesh-mesh-secret")
                if pd_role(c):
                    check_pd_pod(path, doc, c, errors)

    for path, doc in objects:
        if doc["kind"] != "Service":
            continue
        sel = (doc.get("spec") or {}).get("selector") or {}
        matches = [w for w in pod_workloads if all(w["labels"].get(k) == v for k, v in sel.items())]
        if sel and not matches:
            errors.append(f"{path}: Service {doc['metadata']['name']} selects {sel}, which no workload's pods carry")
        for p in (doc.get("spec") or {}).get("ports", []) or []:
            target = p.get("targetPort")
            if isinstance(target, str) and matches and not any(target in w["ports"] for w in matches):
                errors.append(f"{path}: Service {doc['metadata']['name']} targets port {target!r}, not declared by its pods")

    for path, cm, key, node in router_topologies(objects):
        check_router(objects, pod_workloads, path, cm, key, node, errors)
    return errors


def selftest(objects):
    """Break the scaled manifest in each way the checks guard against; each must be reported."""
    def find(kind, name):
        return next(d for _, d in objects if d["kind"] == kind and d["metadata"]["name"] == name)

    def env(doc, name):
        return next(e for e in containers(doc)[0]["env"] if e["name"] == name)

    def set_router(doc, old, new):
        doc["data"]["router.toml"] = doc["data"]["router.toml"].replace(old, new)

    def set_kv(doc, old, new):
        args = containers(doc)[0]["args"]
        args[:] = [a.replace(old, new) for a in args]

    breakages = [
        ("the prefill Service has a cluster IP", lambda: find("Service", "pdmesh-prefill")["spec"].pop("clusterIP"),
         "is not headless"),
        ("decode_dns in another namespace", lambda: set_router(find("ConfigMap", "pdmesh-router"),
                                                               "pdmesh-decode.pdmesh.", "pdmesh-decode.other."),
         "names namespace 'other'"),
        ("prefill_dns names no Service", lambda: set_router(find("ConfigMap", "pdmesh-router"),
                                                            "pdmesh-prefill.", "pdmesh-p."), "does not exist"),
        ("prefill_dns on a port the Service lacks", lambda: set_router(find("ConfigMap", "pdmesh-router"),
                                                                       "local:8000\", decode", "local:9000\", decode"),
         "uses port 9000"),
        ("decode_dns names the prefill Service", lambda: set_router(find("ConfigMap", "pdmesh-router"),
                                                                    "pdmesh-decode.", "pdmesh-prefill."),
         "not only kv_consumer"),
        ("the side-channel host is fixed", lambda: env(find("Deployment", "pdmesh-prefill"),
                                                       "VLLM_NIXL_SIDE_CHANNEL_HOST").update(value="10.0.0.1"),
         "does not come from status.podIP"),
        ("POD_IP reads the host IP", lambda: env(find("Deployment", "pdmesh-decode"), "POD_IP").update(
            valueFrom={"fieldRef": {"fieldPath": "status.hostIP"}}), "does not come from status.podIP"),
        ("one engine id for every pod", lambda: set_kv(find("Deployment", "pdmesh-prefill"), "$(POD_NAME)", "prefill"),
         "engine_id is not the pod name"),
        ("P binds loopback", lambda: set_kv(find("Deployment", "pdmesh-decode"), "--host=0.0.0.0", "--host=127.0.0.1"),
         "without --host 0.0.0.0"),
        ("the router runs another file", lambda: set_kv(find("Deployment", "pdmesh-router"), "router.toml", "x.toml"),
         "runs `proxy --topology"),
        ("liveness on /health", lambda: containers(find("Deployment", "pdmesh-decode"))[0]["livenessProbe"]["httpGet"]
         .update(path="/health"), "not /live"),
    ]
    pristine = copy.deepcopy(objects)
    failed = 0
    for what, breakage, expected in breakages:
        objects[:] = copy.deepcopy(pristine)
        breakage()
        errors = check(objects)
        if not any(expected in e for e in errors):
            failed += 1
            print(f"check-k8s selftest: {what}: no error containing {expected!r}; got {errors}")
    objects[:] = pristine
    print(f"check-k8s selftest: {len(breakages) - failed} of {len(breakages)} breakages reported")
    return failed == 0


def main():
    objects, errors = load()
    errors += check(objects)
    for e in errors:
        print("check-k8s:", e)
    print(f"check-k8s: {len(objects)} objects, {len(errors)} problems")
    ok = not errors
    if "--selftest" in sys.argv[1:]:
        ok = selftest(objects) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
