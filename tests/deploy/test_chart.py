"""The Helm chart, rendered by Helm's own engine for many value sets; every
object is validated, and the properties the deployment relies on are checked
on each rendering (not only on the defaults)."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from .support import (
    CHART_DIR,
    NAMESPACE,
    deep_merge,
    helm,
    load_example,
    validate_object,
)

SASL_INLINE = {"kafka": {"sasl": {"enabled": True, "username": "svc-qworker", "password": "s3cret"}}}
SASL_EXISTING = {"kafka": {"sasl": {"enabled": True, "mechanism": "SCRAM-SHA-256",
                                    "existingSecret": "kafka-creds"}}}
MTLS_EXISTING = {"kafka": {"tls": {"enabled": True, "existingSecret": "kafka-ca", "clientAuth": True}}}
TLS_INLINE = {"kafka": {"tls": {"enabled": True, "ca": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"}}}

VALID_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu": {"gpu": {"enabled": True}},
    "gpu-two-per-pod": {"gpu": {"enabled": True, "count": 2, "runtimeClassName": "nvidia"},
                        "resources": {"requests": {"nvidia.com/gpu": 1}}},
    "keda-off-hpa-cpu": {"autoscaling": {"keda": {"enabled": False}}},
    "keda-off-hpa-pods-metric": {"autoscaling": {"keda": {"enabled": False}, "hpa": {"metric": "pods"}}},
    "sasl-inline": SASL_INLINE,
    "sasl-existing-secret-mtls": deep_merge(SASL_EXISTING, MTLS_EXISTING),
    "tls-inline-ca": TLS_INLINE,
    "sasl-tls-keda-off": deep_merge(deep_merge(SASL_INLINE, TLS_INLINE),
                                    {"autoscaling": {"keda": {"enabled": False}}}),
    "pdb-off": {"podDisruptionBudget": {"enabled": False}},
    "pdb-min-available": {"podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "50%"}},
    "autoscaling-off": {"autoscaling": {"enabled": False}, "replicaCount": 3},
    "scale-to-zero": {"autoscaling": {"minReplicas": 0, "maxReplicas": 12},
                      "kafka": {"jobsPartitions": 12}},
    "observability": {"otel": {"enabled": True, "endpoint": "http://otel:4318",
                               "resourceAttributes": {"deployment.environment": "prod"}},
                      "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                      "model": {"name": "smollm2"}},
    "hard-anti-affinity-no-spread": {"podAntiAffinity": "hard", "topologySpread": {"enabled": False},
                                     "nodeSelector": {"pool": "cpu"},
                                     "tolerations": [{"key": "dedicated", "operator": "Equal",
                                                      "value": "ml", "effect": "NoSchedule"}]},
    "baked-model-no-volume": {"model": {"path": "/opt/qworker/model", "existingClaim": ""}},
    "model-on-nfs": {"model": {"path": "/models/m", "volume": {"nfs": {"server": "nas", "path": "/llm",
                                                                       "readOnly": True}}}},
    "service-account-external": {"serviceAccount": {"create": False, "name": "ml-workers"}},
    "extras": {"worker": {"extraArgs": ["--log-level", "debug"],
                          "extraEnv": [{"name": "QWORKER_EXTRA", "value": "1"}],
                          "kvCacheMemory": "2GiB", "dtype": "float32"},
               "image": {"digest": "sha256:" + "a" * 64},
               "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
               "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
               "imagePullSecrets": [{"name": "regcred"}], "priorityClassName": "inference"},
    "long-drain": {"worker": {"drainTimeoutSeconds": 600}},
    "lora-claim": {"lora": {"enabled": True, "existingClaim": "qworker-adapters", "maxLoras": 2, "maxCpuLoras": 8,
                            "modules": {"sql-lora": "/adapters/sql", "chat/v2": "/adapters/teams/chat-v2"}}},
    "lora-in-model-volume": {"lora": {"enabled": True, "mountPath": "/models/adapters", "modules": {"a": "/models/adapters/a"}}},
    "lora-on-nfs-none-yet": {"lora": {"enabled": True, "volume": {"nfs": {"server": "nas", "path": "/adapters", "readOnly": True}}}},
    "example-gpu": load_example("values-gpu.yaml"),
    "example-cpu": load_example("values-cpu.yaml"),
}


# --------------------------------------------------------------------------
# Properties every rendering must have.
# --------------------------------------------------------------------------
def check_invariants(r, merged: dict[str, Any]) -> None:
    objects = r.objects
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert len(names) == len(objects), "two objects share a kind and name"
    for o in objects:
        assert o["metadata"].get("namespace") == NAMESPACE, o["kind"]
        assert o["metadata"]["labels"]["app.kubernetes.io/instance"] == "qw"

    dep = r.deployment
    pod = r.pod
    c = r.container
    cfg = r.config
    env = r.env()
    selector = dep["spec"]["selector"]["matchLabels"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()

    # The worker's configuration reaches the container.
    for key in ["QWORKER_MODEL", "QWORKER_BOOTSTRAP_SERVERS", "QWORKER_GROUP_ID", "QWORKER_JOBS_TOPIC",
                "QWORKER_TOKENS_TOPIC", "QWORKER_COMPLETIONS_TOPIC", "QWORKER_DLQ_TOPIC",
                "QWORKER_CANCEL_TOPIC", "QWORKER_MAX_WAITING_JOBS", "QWORKER_MAX_NUM_SEQS",
                "QWORKER_DEVICE", "QWORKER_DTYPE", "QWORKER_HTTP_PORT", "QWORKER_DRAIN_TIMEOUT_S",
                "QWORKER_KAFKA_SECURITY_PROTOCOL", "QWORKER_ENABLE_IDEMPOTENCE"]:
        assert key in env, key
    assert all(isinstance(v, str) for v in cfg.values()), "ConfigMap data must be strings"
    assert cfg["QWORKER_BOOTSTRAP_SERVERS"] == merged["kafka"]["bootstrapServers"]
    assert cfg["QWORKER_DEVICE"] == ("cuda" if merged["gpu"]["enabled"] else "cpu")
    assert {"configMapRef": {"name": r.config_map["metadata"]["name"]}} in c["envFrom"]

    # Signals: the grace period outlasts the drain and the broker steps after it (20 s) and the
    # trace flush (5 s).
    drain = int(cfg["QWORKER_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= drain + 25

    # Rollouts never drop capacity.
    strategy = dep["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0
    assert strategy["rollingUpdate"]["maxSurge"] not in (0, "0%")

    # Probes: a long startup budget for model load, then liveness/readiness.
    port = int(cfg["QWORKER_HTTP_PORT"])
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in c["ports"]
    for probe, path in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")]:
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/startupz", "port": "http"}  # passes once the model is loaded
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    liveness = c["livenessProbe"]
    assert budget >= 300 and budget > liveness["periodSeconds"] * liveness["failureThreshold"]

    # Volumes: /dev/shm in memory, every mount backed by a volume, the model
    # path inside the model mount when there is one.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert all(m["name"] in volumes for m in c["volumeMounts"])
    if "model" in volumes:
        (model_mount,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
        assert model_mount.get("readOnly") is True
        assert (cfg["QWORKER_MODEL"] + "/").startswith(model_mount["mountPath"].rstrip("/") + "/")

    # Non-root, no privilege escalation.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False

    # Every Secret reference resolves: to a rendered Secret holding the key,
    # or to a Secret the values say the user provides.
    rendered_secrets = {s["metadata"]["name"]: s.get("data", {}) for s in r.of_kind("Secret")}
    external = {merged["kafka"]["sasl"].get("existingSecret"), merged["kafka"]["tls"].get("existingSecret")}
    refs = [(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
    refs += [(v["secret"]["secretName"], item["key"]) for v in pod["volumes"] if "secret" in v
             for item in v["secret"].get("items", [])]
    for ta in r.of_kind("TriggerAuthentication"):
        refs += [(ref["name"], ref["key"]) for ref in ta["spec"]["secretTargetRef"]]
    for name, key in refs:
        assert (name in rendered_secrets and key in rendered_secrets[name]) or name in external, (name, key)

    # Kafka security is consistent between worker, mounts and scaler.
    sasl, tls = merged["kafka"]["sasl"]["enabled"], merged["kafka"]["tls"]["enabled"]
    expected_protocol = {(True, True): "SASL_SSL", (True, False): "SASL_PLAINTEXT",
                         (False, True): "SSL", (False, False): "PLAINTEXT"}[(sasl, tls)]
    assert cfg["QWORKER_KAFKA_SECURITY_PROTOCOL"] == expected_protocol
    assert ("QWORKER_KAFKA_SASL_PASSWORD" in env) == sasl
    if tls:
        tls_mount = next(m for m in c["volumeMounts"] if m["name"] == "kafka-tls")
        assert cfg["QWORKER_KAFKA_SSL_CAFILE"].startswith(tls_mount["mountPath"] + "/")

    # Service account.
    if merged["serviceAccount"]["create"]:
        assert r.one("ServiceAccount")["metadata"]["name"] == pod["serviceAccountName"]
    else:
        assert "ServiceAccount" not in r.kinds()

    # Autoscaling: one autoscaler at most, aimed at this Deployment, capped
    # by the jobs topic's partitions, scaling down slowly.
    partitions = merged["kafka"]["jobsPartitions"]
    scalers = r.of_kind("ScaledObject") + r.of_kind("HorizontalPodAutoscaler")
    auto = merged["autoscaling"]
    if not auto["enabled"]:
        assert not scalers
        assert 0 <= dep["spec"]["replicas"] <= partitions
    else:
        assert len(scalers) == 1
        assert "replicas" not in dep["spec"], "the autoscaler owns .spec.replicas"
        (scaler,) = scalers
        assert scaler["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                    "name": dep["metadata"]["name"]}
        if scaler["kind"] == "ScaledObject":
            check_scaled_object(r, scaler, merged)
        else:
            spec = scaler["spec"]
            assert 1 <= spec["minReplicas"] <= spec["maxReplicas"] <= partitions
            assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
            assert "TriggerAuthentication" not in r.kinds()

    # Service, PDB and ServiceMonitor all select the worker pods.
    svc = r.one("Service")
    assert svc["spec"]["selector"] == selector
    assert any(p["targetPort"] == "http" for p in svc["spec"]["ports"])
    pdbs = r.of_kind("PodDisruptionBudget")
    assert len(pdbs) == (1 if merged["podDisruptionBudget"]["enabled"] else 0)
    for pdb in pdbs:
        assert pdb["spec"]["selector"]["matchLabels"] == selector
    for sm in r.of_kind("ServiceMonitor"):
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        port_names = {p["name"] for p in svc["spec"]["ports"]}
        assert all(ep["port"] in port_names and ep["path"] == "/metrics" for ep in sm["spec"]["endpoints"])

    assert "qworker topics create" in r.notes and f"--partitions {partitions}" in r.notes
    check_lora(r, merged)


def check_lora(r, merged: dict[str, Any]) -> None:
    """LoRA: the modules reach the worker as a file in a mounted ConfigMap folder (a subPath
    mount would never see an update), every adapter inside the root, the worker's own parser
    reads what the chart wrote, and the settings the worker gets pass its validation."""
    from qworker.config import WorkerSettings
    from qworker.lora_modules import parse_modules

    lora, cfg, pod, c = merged["lora"], r.config, r.pod, r.container
    lora_maps = [o for o in r.of_kind("ConfigMap") if o["metadata"]["name"].endswith("-lora")]
    if not lora["enabled"]:
        assert not lora_maps and not any(k.startswith("QWORKER_LORA") or "LORAS" in k for k in cfg)
        return
    (cm,) = lora_maps
    modules = parse_modules(cm["data"]["modules.json"])
    assert modules == (lora["modules"] or {})
    root = cfg["QWORKER_LORA_ROOT"]
    assert root == lora["mountPath"] and all(p.startswith(root.rstrip("/") + "/") for p in modules.values())
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "lora-modules"]
    assert "subPath" not in mount and mount.get("readOnly") is True
    assert volumes["lora-modules"]["configMap"]["name"] == cm["metadata"]["name"]
    assert cfg["QWORKER_LORA_MODULES"] == mount["mountPath"] + "/modules.json"
    if lora["existingClaim"] or lora["volume"]:
        (adapters,) = [m for m in c["volumeMounts"] if m["name"] == "lora-adapters"]
        assert adapters["mountPath"] == root and adapters.get("readOnly") is True
    assert int(cfg["QWORKER_MAX_LORAS"]) == lora["maxLoras"]
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "modules.json")
        with open(path, "w") as f:
            f.write(cm["data"]["modules.json"])
        env = {k: v for k, v in cfg.items() if k.startswith("QWORKER_") and ("LORA" in k)}
        env.update(QWORKER_LORA_MODULES=path, QWORKER_LORA_ROOT=d)
        s = WorkerSettings.from_env(env)
        assert s.lora_enabled and s.engine_config()["max_loras"] == lora["maxLoras"]


def test_lora_modules_change_without_a_rollout(render):
    """Adding an adapter changes only the -lora ConfigMap: the pod template (and its config
    checksum) stays the same, so running pods pick it up through the mount."""
    one = {"lora": {"enabled": True, "existingClaim": "adapters", "modules": {"a": "/adapters/a"}}}
    two = {"lora": {"enabled": True, "existingClaim": "adapters", "modules": {"a": "/adapters/a", "b": "/adapters/b"}}}
    r1, r2 = render(one), render(two)
    assert r1.deployment["spec"]["template"] == r2.deployment["spec"]["template"]
    maps = [[o["data"] for o in r.of_kind("ConfigMap") if o["metadata"]["name"].endswith("-lora")] for r in (r1, r2)]
    assert maps[0] != maps[1]


def check_scaled_object(r, so: dict[str, Any], merged: dict[str, Any]) -> None:
    spec = so["spec"]
    cfg = r.config
    auto, keda = merged["autoscaling"], merged["autoscaling"]["keda"]
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] <= merged["kafka"]["jobsPartitions"]
    (trigger,) = spec["triggers"]
    md = trigger["metadata"]
    assert trigger["type"] == "kafka"
    # The scaler watches the very group and topic the worker consumes.
    assert md["bootstrapServers"] == cfg["QWORKER_BOOTSTRAP_SERVERS"]
    assert md["consumerGroup"] == cfg["QWORKER_GROUP_ID"]
    assert md["topic"] == cfg["QWORKER_JOBS_TOPIC"]
    capacity = int(cfg["QWORKER_MAX_NUM_SEQS"]) + int(cfg["QWORKER_MAX_WAITING_JOBS"])
    assert int(md["lagThreshold"]) == (keda.get("lagThreshold") or capacity)
    assert int(md["activationLagThreshold"]) == keda["activationLagThreshold"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert behavior == auto["behavior"]
    if keda["fallback"]["enabled"]:
        assert 1 <= spec["fallback"]["replicas"] <= spec["maxReplicaCount"]
    sasl, tls = merged["kafka"]["sasl"]["enabled"], merged["kafka"]["tls"]["enabled"]
    if sasl or tls:
        ta = r.one("TriggerAuthentication")
        assert trigger["authenticationRef"]["name"] == ta["metadata"]["name"]
        params = {ref["parameter"] for ref in ta["spec"]["secretTargetRef"]}
        assert ({"username", "password"} <= params) == sasl
        assert ("ca" in params) == tls
    else:
        assert "authenticationRef" not in trigger
        assert "TriggerAuthentication" not in r.kinds()
    mech = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256", "SCRAM-SHA-512": "scram_sha512"}
    assert md.get("sasl") == (mech[cfg["QWORKER_KAFKA_SASL_MECHANISM"]] if sasl else None)
    assert md.get("tls") == ("enable" if tls else None)


@pytest.fixture(scope="module")
def rendered_cases(chart, render):
    return {name: (render(values), chart.merge_values(values)) for name, values in VALID_CASES.items()}


@pytest.mark.parametrize("case", sorted(VALID_CASES))
def test_renders_valid_objects(rendered_cases, case):
    r, merged = rendered_cases[case]
    assert {"Deployment", "ConfigMap", "Service"} <= r.kinds()
    for obj in r.objects:
        try:
            validate_object(obj)
        except Exception as exc:  # report which object failed and where
            path = ".".join(str(p) for p in getattr(exc, "path", []))
            pytest.fail(f"{case}: {obj['kind']}/{obj['metadata']['name']} invalid at {path}: "
                        f"{getattr(exc, 'message', exc)}")
    check_invariants(r, merged)


def test_validator_catches_mistakes(render):
    """The validation above is not vacuous: typos and wrong types fail."""
    r = render({})
    dep = r.deployment
    bad = {**dep, "spec": {**dep["spec"], "replica": 2}}
    with pytest.raises(Exception):
        validate_object(bad)
    so = r.one("ScaledObject")
    trig = so["spec"]["triggers"][0]
    bad_so = {**so, "spec": {**so["spec"], "triggers": [{**trig, "metadata": {**trig["metadata"], "lagThreshold": 5}}]}}
    with pytest.raises(Exception):
        validate_object(bad_so)
    adv = so["spec"]["advanced"]
    bad_behavior = {**so, "spec": {**so["spec"], "advanced": {**adv, "horizontalPodAutoscalerConfig": {
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": "long"}}}}}}
    with pytest.raises(Exception):
        validate_object(bad_behavior)


# --------------------------------------------------------------------------
# Specific value combinations.
# --------------------------------------------------------------------------
def test_default_is_a_cpu_pool_scaled_by_keda(rendered_cases):
    r, _ = rendered_cases["default"]
    assert r.container["image"].endswith(":0.1.0-cpu")
    assert not any("nvidia.com/gpu" in str(k) for k in r.container["resources"].get("limits", {}))
    assert r.config["QWORKER_DTYPE"] == "float32"
    assert {"ScaledObject", "PodDisruptionBudget", "ServiceAccount"} <= r.kinds()
    assert not {"HorizontalPodAutoscaler", "Secret", "TriggerAuthentication", "ServiceMonitor"} & r.kinds()
    assert r.config["OTEL_SDK_DISABLED"] == "true"


def test_threads_follow_the_cpu_limit(rendered_cases):
    """OpenMP/torch threads come from the container's own CPU limit, not the node's core count."""
    for name in ("default", "gpu"):
        r, _ = rendered_cases[name]
        env = {e["name"]: e for e in r.container["env"]}
        ref = env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
        assert ref["resource"] == "limits.cpu" and ref["containerName"] == r.container["name"]


def test_gpu_requests_the_device(rendered_cases):
    r, _ = rendered_cases["gpu"]
    assert r.container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert r.container["image"].endswith(":0.1.0-cuda")
    assert r.config["QWORKER_DEVICE"] == "cuda"
    assert r.config["QWORKER_DTYPE"] == "bfloat16"
    r2, _ = rendered_cases["gpu-two-per-pod"]
    res = r2.container["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 2 and res["requests"]["nvidia.com/gpu"] == 2
    assert r2.pod["runtimeClassName"] == "nvidia"


def test_keda_off_uses_a_plain_hpa(rendered_cases):
    r, merged = rendered_cases["keda-off-hpa-cpu"]
    assert "ScaledObject" not in r.kinds()
    hpa = r.one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert hpa["spec"]["behavior"] == merged["autoscaling"]["behavior"]
    r2, _ = rendered_cases["keda-off-hpa-pods-metric"]
    (metric,) = r2.one("HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "qworker_num_requests_waiting"


def test_sasl_credentials_come_from_a_secret(rendered_cases):
    r, _ = rendered_cases["sasl-inline"]
    secret = r.one("Secret")
    assert base64.b64decode(secret["data"]["password"]).decode() == "s3cret"
    assert "s3cret" not in str(r.deployment) + str(r.config) + str(r.one("ScaledObject"))
    env = {e["name"]: e for e in r.container["env"]}
    assert env["QWORKER_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    assert r.config["QWORKER_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert r.one("ScaledObject")["spec"]["triggers"][0]["metadata"]["sasl"] == "scram_sha512"
    # A config or secret change rolls the pods.
    base, _ = rendered_cases["default"]
    ann = lambda x: x.deployment["spec"]["template"]["metadata"]["annotations"]  # noqa: E731
    assert ann(r)["checksum/secret"] != ann(base)["checksum/secret"]
    assert ann(r)["checksum/config"] != ann(base)["checksum/config"]


def test_existing_secrets_are_referenced_not_created(rendered_cases):
    r, _ = rendered_cases["sasl-existing-secret-mtls"]
    assert "Secret" not in r.kinds()
    ta = r.one("TriggerAuthentication")
    by_param = {ref["parameter"]: ref["name"] for ref in ta["spec"]["secretTargetRef"]}
    assert by_param == {"username": "kafka-creds", "password": "kafka-creds",
                        "ca": "kafka-ca", "cert": "kafka-ca", "key": "kafka-ca"}
    assert r.config["QWORKER_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert r.config["QWORKER_KAFKA_SSL_KEYFILE"] == "/etc/qworker/kafka-tls/tls.key"


def test_pdb_off(rendered_cases):
    r, _ = rendered_cases["pdb-off"]
    assert "PodDisruptionBudget" not in r.kinds()
    r2, _ = rendered_cases["pdb-min-available"]
    spec = r2.one("PodDisruptionBudget")["spec"]
    assert spec["minAvailable"] == "50%" and "maxUnavailable" not in spec


def test_lag_threshold_is_sized_to_pod_capacity(render):
    def threshold(values):
        return render(values).one("ScaledObject")["spec"]["triggers"][0]["metadata"]["lagThreshold"]

    assert threshold({"worker": {"maxNumSeqs": 8, "maxWaitingJobs": 4}}) == "12"
    assert threshold({"worker": {"maxNumSeqs": 64, "maxWaitingJobs": 1}}) == "65"
    assert threshold({"autoscaling": {"keda": {"lagThreshold": 20}}}) == "20"


def test_grace_period_follows_the_drain(render):
    assert render({"worker": {"drainTimeoutSeconds": 200}}).pod["terminationGracePeriodSeconds"] == 230
    r = render({"worker": {"drainTimeoutSeconds": 200}, "terminationGracePeriodSeconds": 225})
    assert r.pod["terminationGracePeriodSeconds"] == 225


def test_scale_to_zero_only_with_keda(rendered_cases):
    r, _ = rendered_cases["scale-to-zero"]
    so = r.one("ScaledObject")["spec"]
    assert so["minReplicaCount"] == 0 and so["fallback"]["replicas"] == 1


def test_examples_are_distinct_pools(rendered_cases):
    gpu, _ = rendered_cases["example-gpu"]
    cpu, _ = rendered_cases["example-cpu"]
    assert gpu.container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t.get("key") == "nvidia.com/gpu" for t in gpu.pod["tolerations"])
    assert "ScaledObject" in gpu.kinds() and "ServiceMonitor" in gpu.kinds()
    assert "HorizontalPodAutoscaler" in cpu.kinds()
    assert "model" not in {v["name"] for v in cpu.pod["volumes"]}


def test_helm_lint_is_clean():
    report = helm.lint(str(CHART_DIR), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report.get("errors"), report


# --------------------------------------------------------------------------
# Bad values fail at install/template time, naming the offending key.
# --------------------------------------------------------------------------
INVALID_CASES = [
    ("negative-replicas", {"replicaCount": -1}, "replicaCount"),
    ("negative-replicas-no-autoscaling", {"replicaCount": -2, "autoscaling": {"enabled": False}}, "replicaCount"),
    ("missing-bootstrap-empty", {"kafka": {"bootstrapServers": ""}}, "bootstrapServers"),
    ("missing-bootstrap-null", {"kafka": {"bootstrapServers": None}}, "bootstrapServers"),
    ("bootstrap-without-port", {"kafka": {"bootstrapServers": "kafka"}}, "bootstrapServers"),
    ("max-above-partitions", {"kafka": {"jobsPartitions": 8}, "autoscaling": {"maxReplicas": 9}}, "jobsPartitions"),
    ("max-above-partitions-hpa", {"kafka": {"jobsPartitions": 2},
                                  "autoscaling": {"maxReplicas": 3, "keda": {"enabled": False}}}, "jobsPartitions"),
    ("replicas-above-partitions", {"kafka": {"jobsPartitions": 2}, "replicaCount": 3,
                                   "autoscaling": {"enabled": False}}, "jobsPartitions"),
    ("zero-partitions", {"kafka": {"jobsPartitions": 0}}, "jobsPartitions"),
    ("min-above-max", {"autoscaling": {"minReplicas": 5, "maxReplicas": 4}}, "minReplicas"),
    ("negative-min", {"autoscaling": {"minReplicas": -1}}, "minReplicas"),
    ("hpa-scale-to-zero", {"autoscaling": {"minReplicas": 0, "keda": {"enabled": False}}}, "minReplicas"),
    ("hpa-cpu-without-request", {"autoscaling": {"keda": {"enabled": False}},
                                 "resources": {"requests": {"cpu": None}}}, "requests.cpu"),
    ("grace-not-above-drain", {"terminationGracePeriodSeconds": 120}, "terminationGracePeriodSeconds"),
    # helper-72: drain + 1 rendered, but the broker steps (20 s) and the trace flush (5 s) follow the drain
    ("grace-without-the-broker-steps", {"terminationGracePeriodSeconds": 144}, "+ 25"),
    ("grace-below-long-drain", {"worker": {"drainTimeoutSeconds": 600},
                                "terminationGracePeriodSeconds": 300}, "drainTimeoutSeconds"),
    ("sasl-without-credentials", {"kafka": {"sasl": {"enabled": True}}}, "kafka.sasl"),
    ("sasl-bad-mechanism", {"kafka": {"sasl": {"enabled": True, "mechanism": "GSSAPI",
                                               "existingSecret": "x"}}}, "mechanism"),
    ("tls-without-ca", {"kafka": {"tls": {"enabled": True}}}, "kafka.tls"),
    ("mtls-without-cert", {"kafka": {"tls": {"enabled": True, "ca": "PEM", "clientAuth": True}}}, "kafka.tls.cert"),
    ("bad-topic-name", {"kafka": {"topics": {"jobs": "my jobs"}}}, "jobs"),
    ("max-surge-zero", {"rollingUpdate": {"maxSurge": 0}}, "maxSurge"),
    ("pdb-blocks-drains", {"podDisruptionBudget": {"maxUnavailable": 0}}, "maxUnavailable"),
    ("model-path-relative", {"model": {"path": "models/x"}}, "path"),
    ("model-outside-mount", {"model": {"path": "/data/model", "mountPath": "/models"}}, "model.path"),
    ("gpu-count-zero", {"gpu": {"enabled": True, "count": 0}}, "count"),
    ("fallback-above-max", {"autoscaling": {"maxReplicas": 2, "keda": {"fallback": {"replicas": 3}}}}, "fallback"),
    ("negative-lag-threshold", {"autoscaling": {"keda": {"lagThreshold": -1}}}, "lagThreshold"),
    ("short-startup-budget", {"probes": {"startup": {"failureThreshold": 2}}}, "startup"),
    ("unknown-key-typo", {"kafka": {"bootstrapServer": "kafka:9092"}}, "bootstrapServer"),
    ("wrong-type", {"autoscaling": {"maxReplicas": "many"}}, "maxReplicas"),
    # helper-52: values the schema let through that rendered a wrong image, an invalid object, or a
    # PDB that blocks every drain or that the API server refuses
    ("image-tag-as-number", {"image": {"tag": 20240101}}, "/image/tag"),
    ("extra-env-value-as-number", {"worker": {"extraEnv": [{"name": "A", "value": 5}]}}, "/worker/extraEnv/0/value"),
    ("pod-label-as-boolean", {"podLabels": {"a": True}}, "/podLabels/a"),
    ("common-label-as-number", {"commonLabels": {"tier": 1}}, "/commonLabels/tier"),
    ("pod-annotation-as-number", {"podAnnotations": {"a": 1}}, "/podAnnotations/a"),
    ("pdb-zero-written-00", {"podDisruptionBudget": {"maxUnavailable": "00%"}}, "maxUnavailable"),
    ("pdb-negative", {"podDisruptionBudget": {"maxUnavailable": -1}}, "maxUnavailable"),
    ("pdb-not-a-count", {"podDisruptionBudget": {"maxUnavailable": "abc"}}, "maxUnavailable"),
    ("pdb-min-all", {"podDisruptionBudget": {"maxUnavailable": None, "minAvailable": "100%"}}, "minAvailable"),
    ("otel-attribute-name-with-comma", {"otel": {"resourceAttributes": {"a,b": "c"}}}, "a,b"),
    ("kv-cache-bytes-as-number", {"worker": {"kvCacheMemory": 4294967296}}, "kvCacheMemory"),
    ("kv-cache-zero", {"worker": {"kvCacheMemory": "0"}}, "kvCacheMemory"),
    ("kv-cache-fraction-above-one", {"worker": {"kvCacheMemory": "1.5"}}, "kvCacheMemory"),
    ("kv-cache-no-unit-fraction-as-number", {"worker": {"kvCacheMemory": 0}}, "kvCacheMemory"),
    ("lora-adapter-outside-root", {"lora": {"enabled": True, "modules": {"a": "/models/a"}}}, "lora.modules.a"),
    ("lora-adapter-relative", {"lora": {"enabled": True, "modules": {"a": "adapters/a"}}}, "modules"),
    ("lora-bad-name", {"lora": {"enabled": True, "modules": {"bad name": "/adapters/a"}}}, "bad name"),
    ("lora-cpu-below-slots", {"lora": {"enabled": True, "maxLoras": 4, "maxCpuLoras": 2}}, "lora.maxCpuLoras"),
    ("lora-same-mount-as-model", {"lora": {"enabled": True, "mountPath": "/models", "existingClaim": "a"}}, "lora.mountPath"),
    # helper-124: values that rendered, then stopped the worker or its engine at start
    ("no-waiting-jobs", {"worker": {"maxWaitingJobs": 0}}, "maxWaitingJobs"),
    ("lora-with-tensor-parallel", {"lora": {"enabled": True, "modules": {"a": "/adapters/a"}}, "tensorParallel": {"size": 2},
                                   "gpu": {"enabled": True, "count": 2}}, "tensorParallel.size > 1"),
]


@pytest.mark.parametrize("values,needle", [c[1:] for c in INVALID_CASES], ids=[c[0] for c in INVALID_CASES])
def test_bad_values_fail_with_a_clear_message(render, values, needle):
    with pytest.raises(helm.HelmError) as info:
        render(values)
    assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize(("value", "fraction"), [(1.0, 1.0), (1, 1.0), (0.9, 0.9), ("0.90", 0.9), (0.25, 0.25), (1e-05, 1e-05), (2.5e-7, 2.5e-7)])
def test_a_kv_cache_fraction_reaches_the_worker_as_a_fraction(render, value, fraction):
    """helper-52: 1.0 as a YAML number rendered "1", which the worker reads as one byte and refuses;
    helper-53: 1e-05 rendered in e-notation, which the worker refuses too."""
    from qworker.config import parse_kv_memory

    got = parse_kv_memory(render({"worker": {"kvCacheMemory": value}}).config["QWORKER_KV_CACHE_MEMORY"])
    assert isinstance(got, float) and got == pytest.approx(fraction)


def test_otel_resource_attribute_values_are_escaped(render, monkeypatch):
    """helper-52: a "," or "=" in a value started another attribute; the SDK must read back each
    value whole (it percent-decodes them)."""
    from opentelemetry.sdk.resources import Resource

    attrs = {"team": "a,b=c", "cost.center": 42, "note": "x y+z $(HOME) 100%"}
    env = render({"otel": {"enabled": True, "resourceAttributes": attrs}, "model": {"name": "m=1,2"}}).env()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", env["OTEL_RESOURCE_ATTRIBUTES"])
    read = Resource.create().attributes
    assert {k: read[k] for k in attrs} == {k: str(v) for k, v in attrs.items()}
    assert read["gen_ai.request.model"] == "m=1,2" and read["k8s.pod.name"] == "$(POD_NAME)"
