"""The README's "Deploy on Kubernetes" walkthrough, followed literally.

Its shell blocks are read in order, as a user would paste them: variables are set, namespaces,
Secrets and claims are created, files are copied onto claims, and each ``helm install`` of this
chart is rendered with the exact ``-f`` files and ``--set`` values it names. At every command the
namespace it uses must exist already; every value a step sets must be a key of the chart
(values.schema.json); and what a rendered step uses must exist by then: the Secrets and their
keys, the claim and the model folder on it, the CRDs of its custom resources. The served model
name must be the one the README's own example lines ask for, the pod must have a CPU limit
(its thread count), and the topic step must say its replication factor."""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from .support import CHART_DIR, REPO, deep_merge, load_example, validate_object

README = (REPO / "README.md").read_text()
SECTION = README.split("## Deploy on Kubernetes", 1)[1].split("\n## ", 1)[0]
SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
BUILTIN_GROUPS = {"", "apps", "autoscaling", "policy", "batch", "rbac.authorization.k8s.io", "networking.k8s.io"}
# CRD groups, and the words that install them: a helm install of this chart, or a prerequisite
CRD_PROVIDERS = {"keda.sh": re.compile(r"^helm install \S+ kedacore/keda\b"), "monitoring.coreos.com": None}


@dataclass
class Command:
    step: str
    argv: list[str]
    heredoc: str = ""


def commands(section: str) -> list[Command]:
    """Every command of the section's shell blocks, in order: continuation lines joined, comments
    dropped, a here-document attached to the command that reads it."""
    out: list[Command] = []
    step = "intro"
    lines = section.splitlines()
    i = 0
    while i < len(lines):
        heading = re.match(r"^### (.+)", lines[i])
        if heading:
            step = heading.group(1)
        if re.match(r"^```(bash|sh)\s*$", lines[i]):
            i += 1
            while not lines[i].startswith("```"):
                line = lines[i]
                while line.endswith("\\"):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                heredoc = ""
                m = re.search(r"<<-?'?(\w+)'?", line)
                if m:
                    body = []
                    i += 1
                    while lines[i].strip() != m.group(1):
                        body.append(lines[i])
                        i += 1
                    heredoc, line = "\n".join(body), line[: m.start()]
                argv = shlex.split(line, comments=True)
                if argv:
                    out.append(Command(step, argv, heredoc))
                i += 1
        i += 1
    return out


def prerequisites(section: str) -> str:
    return section.split("You need:", 1)[1].split("\n\n", 1)[0]


def option(argv: list[str], *names: str) -> list[str]:
    """The values of every ``--name value`` / ``--name=value`` / ``-n value`` in argv."""
    found = []
    for k, a in enumerate(argv):
        for n in names:
            if a == n and k + 1 < len(argv):
                found.append(argv[k + 1])
            elif a.startswith(n + "=") and n.startswith("--"):
                found.append(a.split("=", 1)[1])
    return found


def set_value(tree: dict[str, Any], dotted: str, raw: str) -> None:
    """``--set a.b=raw`` as helm reads it: numbers and booleans typed, the rest strings."""
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    if re.fullmatch(r"-?[0-9]+", raw):
        node[parts[-1]] = int(raw)
    elif raw in ("true", "false"):
        node[parts[-1]] = raw == "true"
    elif raw == "null":
        node[parts[-1]] = None
    else:
        node[parts[-1]] = raw


def schema_paths_missing(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys of ``values`` the chart does not have (values.schema.json; free-form maps allowed)."""
    missing = []
    props = schema.get("properties")
    for k, v in values.items():
        path = f"{prefix}{k}"
        if props is not None and k in props:
            if isinstance(v, dict):
                missing += schema_paths_missing(v, props[k], path + ".")
        elif props is not None and schema.get("additionalProperties") is False:
            missing.append(path)
    return missing


def quantity(q: Any) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


@dataclass
class Cluster:
    """What the walkthrough has made so far."""

    variables: dict[str, str] = field(default_factory=dict)
    namespaces: set[str] = field(default_factory=lambda: {"default", "kube-system"})
    secrets: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    claims: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # -> folders copied onto it
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    crd_groups: set[str] = field(default_factory=set)
    installs: list[tuple[str, Any, str, list[str]]] = field(default_factory=list)


def expand(arg: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), arg)


def namespace_of(argv: list[str]) -> str | None:
    ns = option(argv, "-n", "--namespace")
    return ns[0] if ns else None


def follow(render, section: str = SECTION) -> Cluster:
    """Run the walkthrough against a model of the cluster; assert as it goes."""
    c = Cluster()
    prereq = prerequisites(section)
    if "Prometheus Operator" in prereq and "ServiceMonitor" in prereq:
        c.crd_groups.add("monitoring.coreos.com")
    for cmd in commands(section):
        argv = [expand(a, c.variables) for a in cmd.argv]
        where = f"{cmd.step}: {' '.join(cmd.argv)[:120]}"
        while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
            name, value = argv.pop(0).split("=", 1)
            if not argv:  # a shell variable for the commands that follow
                c.variables[name] = value
        if not argv:
            continue
        ns = namespace_of(argv)
        creates_ns = argv[0] == "helm" and "--create-namespace" in argv
        if argv[:3] == ["kubectl", "create", "namespace"] or argv[:3] == ["kubectl", "create", "ns"]:
            c.namespaces.add(argv[3])
            continue
        if ns is not None:
            assert ns in c.namespaces or creates_ns, f"namespace {ns!r} used before it is created ({where})"
            c.namespaces.add(ns)
        if argv[0] == "kubectl":
            rest = [a for k, a in enumerate(argv[1:], 1) if a not in ("-n", "--namespace") and argv[k - 1] not in ("-n", "--namespace")]
            if rest[:3] == ["create", "secret", "generic"]:
                keys = {v.split("=", 1)[0] for v in option(argv, "--from-literal", "--from-file")}
                c.secrets[(ns or "default", rest[3])] = keys
            elif rest[:2] == ["create", "secret"] and rest[2] == "tls":
                c.secrets[(ns or "default", rest[3])] = {"tls.crt", "tls.key"}
            elif rest[:1] == ["apply"] and cmd.heredoc:
                for doc in yaml.safe_load_all(cmd.heredoc):
                    if doc and doc["kind"] == "PersistentVolumeClaim":
                        c.claims[(ns or "default", doc["metadata"]["name"])] = set()
                    elif doc and doc["kind"] == "Pod":
                        for vol in doc["spec"].get("volumes", []):
                            claim = vol.get("persistentVolumeClaim", {}).get("claimName")
                            assert claim is None or (ns or "default", claim) in c.claims, f"claim {claim!r} used before it exists ({where})"
                        c.pods[(ns or "default", doc["metadata"]["name"])] = doc
            elif rest[:1] == ["cp"]:
                pod, dest = rest[2].split(":", 1)
                spec = c.pods[(ns or "default", pod)]["spec"]
                (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if dest.startswith(m["mountPath"].rstrip("/") + "/")]
                (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
                rel = posixpath.relpath(dest, mount["mountPath"])
                c.claims[(ns or "default", vol["persistentVolumeClaim"]["claimName"])].add(rel)
        if argv[0] == "helm" and argv[1:2] == ["install"]:
            release, chart = argv[2], argv[3]
            for group, pattern in CRD_PROVIDERS.items():
                if pattern is not None and pattern.match(" ".join(argv)):
                    c.crd_groups.add(group)
            if chart != "helm/qworker":
                continue
            files = option(argv, "-f", "--values")
            sets = option(argv, "--set")
            values: dict[str, Any] = {}
            for f in files:
                assert f.startswith("helm/qworker/examples/"), f
                from_file = load_example(f.rsplit("/", 1)[1])
                assert not schema_paths_missing(from_file, SCHEMA), f"{f} sets keys the chart lacks: {schema_paths_missing(from_file, SCHEMA)}"
                values = deep_merge(values, from_file)
            overrides: dict[str, Any] = {}
            for s in sets:
                key, raw = s.split("=", 1)
                assert "$" not in raw, f"--set {s}: variable not set by an earlier step ({where})"
                set_value(overrides, key, raw)
            assert not schema_paths_missing(overrides, SCHEMA), f"--set of keys the chart lacks: {schema_paths_missing(overrides, SCHEMA)}"
            values = deep_merge(values, overrides)
            rendered = render(values, name=release, namespace=ns or "default")
            check_install(c, rendered, ns or "default", where)
            c.installs.append((release, rendered, ns or "default", files))
    return c


def check_install(c: Cluster, r, ns: str, where: str) -> None:
    for obj in r.objects:
        validate_object(obj)
        group = obj["apiVersion"].rsplit("/", 1)[0] if "/" in obj["apiVersion"] else ""
        if group not in BUILTIN_GROUPS:
            assert group in c.crd_groups, f"{obj['kind']} needs the {group} CRDs, which no earlier step or prerequisite installs ({where})"
    made = {o["metadata"]["name"]: set(o.get("data", {})) | set(o.get("stringData", {})) for o in r.of_kind("Secret")}

    def secret(name: str, key: str | None) -> None:
        keys = made.get(name, c.secrets.get((ns, name)))
        assert keys is not None, f"Secret {name!r} is used but neither the chart nor an earlier step creates it in {ns!r} ({where})"
        assert key is None or key in keys, f"Secret {name!r} has no key {key!r} (keys {sorted(keys)}) ({where})"

    pod = r.pod
    for ctr in pod["containers"]:
        for e in ctr.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                secret(ref["name"], ref["key"])
        for src in ctr.get("envFrom", []):
            if "secretRef" in src:
                secret(src["secretRef"]["name"], None)
    mounts = {m["name"]: m for m in r.container.get("volumeMounts", [])}
    for vol in pod.get("volumes", []):
        if "secret" in vol:
            for item in vol["secret"].get("items", []) or [None]:
                secret(vol["secret"]["secretName"], item and item["key"])
        if "projected" in vol:
            for src in vol["projected"]["sources"]:
                if "secret" in src:
                    for item in src["secret"].get("items", []) or [None]:
                        secret(src["secret"]["name"], item and item["key"])
    for ta in r.of_kind("TriggerAuthentication"):
        for ref in ta["spec"].get("secretTargetRef", []):
            secret(ref["name"], ref["key"])

    env = r.env()
    model = env["QWORKER_MODEL"]
    claimed = [v for v in pod.get("volumes", []) if "persistentVolumeClaim" in v]
    for vol in claimed:
        claim = vol["persistentVolumeClaim"]["claimName"]
        assert (ns, claim) in c.claims, f"claim {claim!r} is mounted but no earlier step creates it in {ns!r} ({where})"
        mount = mounts[vol["name"]]["mountPath"]
        if model.startswith(mount.rstrip("/") + "/"):
            rel = posixpath.relpath(model, mount)
            assert rel in c.claims[(ns, claim)], f"QWORKER_MODEL={model} but the claim {claim!r} only got {sorted(c.claims[(ns, claim)])} ({where})"

    served = env.get("QWORKER_MODEL_NAME") or posixpath.basename(model.rstrip("/"))
    asked = set(re.findall(r'"model": "([^"]+)"', README.split("### OpenAI batch files", 1)[1].split("\n### ", 1)[0]))
    assert asked, "the README's OpenAI batch example lines name a model"
    assert asked <= {served, posixpath.basename(model.rstrip("/"))}, f"served as {served!r}, the README's lines ask for {sorted(asked)}: wrong_model ({where})"

    res = r.container["resources"]
    assert "cpu" in res.get("limits", {}), f"no CPU limit: the worker's threads would follow the node's cores ({where})"
    assert quantity(res["limits"]["cpu"]) >= quantity(res.get("requests", {}).get("cpu", 0)), f"CPU limit below the request ({where})"


def test_the_walkthrough_has_its_steps() -> None:
    steps = {cmd.step for cmd in commands(SECTION)}
    assert {"intro", "2. Create the topics, with their final partition count", "4. Install the chart"} <= steps
    assert any(cmd.argv[:2] == ["helm", "install"] and "helm/qworker" in cmd.argv for cmd in commands(SECTION))


def test_the_walkthrough_runs_in_order(render) -> None:
    c = follow(render)
    assert c.installs, "the walkthrough installs the chart"
    assert ("inference", "qworker-models") in c.claims


def test_topic_creation_says_its_replication_factor() -> None:
    creates = [cmd for cmd in commands(SECTION) if "topics" in cmd.argv and "create" in cmd.argv]
    assert creates
    for cmd in creates:
        assert option(cmd.argv, "--replication"), f"`{' '.join(cmd.argv)}` leaves the replication factor unsaid"


def test_the_cpu_example_serves_the_readmes_model_name(render) -> None:
    r = render(load_example("values-cpu.yaml"))
    asked = set(re.findall(r'"model": "([^"]+)"', README))
    assert r.config.get("QWORKER_MODEL_NAME") in asked


@pytest.mark.parametrize("broken, fixed, says", [
    ("kubectl create namespace inference\n", "", "used before it is created"),
    ("kubectl -n inference create secret generic kafka-cluster-ca", "true", "Secret 'kafka-cluster-ca'"),
    ("  --set model.path=/models/$MODEL \\\n", "", "QWORKER_MODEL=/models/llama"),
    ("metadata: {name: qworker-models}", "metadata: {name: models}", "claim 'qworker-models'"),
    ("Prometheus Operator", "monitoring stack", "monitoring.coreos.com CRDs"),
])
def test_the_checker_catches_a_broken_walkthrough(render, broken: str, fixed: str, says: str) -> None:
    """Each defect the walkthrough had, put back, is caught."""
    section = SECTION.replace(broken, fixed)
    assert section != SECTION
    with pytest.raises(AssertionError, match=re.escape(says)):
        follow(render, section)


def test_chart_defaults_limit_cpu_and_name_the_served_model(render) -> None:
    r = render({})
    res = r.container["resources"]
    assert quantity(res["limits"]["cpu"]) >= quantity(res["requests"]["cpu"]) >= 1  # threads follow the limit
    assert "QWORKER_MODEL_NAME" not in r.config  # the worker serves the folder's name
    named = render({"model": {"name": "smollm2-135m"}})
    assert named.config["QWORKER_MODEL_NAME"] == "smollm2-135m"
    assert named.config["QWORKER_MODEL"] == "/models/smollm2-135m"


@pytest.mark.parametrize("given, env", [("0.90", "0.90"), (0.9, "0.9"), (1.0, "1.0"), (1, "1.0"), ("4GiB", "4GiB"), ("1073741824", "1073741824"), ("", None)])
def test_kv_cache_memory_reaches_the_worker_as_it_reads_it(render, given, env) -> None:
    from qworker.config import WorkerSettings

    cfg = render({"worker": {"kvCacheMemory": given}}).config
    assert cfg.get("QWORKER_KV_CACHE_MEMORY") == env
    if env is not None:
        WorkerSettings.from_env({"QWORKER_KV_CACHE_MEMORY": env})  # accepted by the worker, not just by the chart
