"""Helpers for the deployment checks: render the Helm chart with Helm's own
template engine and validate what comes out.

* Rendering uses ``helm-python-sdk`` (``helm_python``), a ctypes binding to
  Helm v4's Go library: the same engine as ``helm template``, including
  ``values.schema.json`` validation and ``fail``. No cluster, no binary.
* Built-in kinds are validated with ``kubernetes-validate`` against the
  Kubernetes OpenAPI schemas in strict mode (unknown fields are errors), for
  the Kubernetes version the Helm SDK reports in ``.Capabilities``.
* KEDA's ScaledObject/TriggerAuthentication and the Prometheus Operator's
  ServiceMonitor are CRDs, absent from those schemas. We check their
  structure with the small JSON schemas below, written from the CRD field
  lists (a subset: the fields this chart may emit, nothing else allowed),
  and validate the HPA ``behavior`` KEDA embeds against the real
  autoscaling/v2 schema.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a test dependency")
kv = pytest.importorskip("kubernetes_validate")
import jsonschema  # noqa: E402  (a kubernetes-validate dependency)
from kubernetes_validate import utils as kv_utils  # noqa: E402
from referencing import Registry, Resource  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "qworker"
EXAMPLES = CHART_DIR / "examples"
RELEASE = "qw"
NAMESPACE = "inference"

# --------------------------------------------------------------------------
# CRD structure schemas (KEDA v2 and Prometheus Operator v1).
# --------------------------------------------------------------------------
_DNS1123 = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": _DNS1123},
        "namespace": {"type": "string", "pattern": _DNS1123},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
    "additionalProperties": False,
}
_INT_STRING = {"type": "string", "pattern": r"^[0-9]+$"}


def _crd(api_version: str, kind: str, spec: dict) -> dict:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


KAFKA_TRIGGER_METADATA = {
    "type": "object",
    "required": ["bootstrapServers", "consumerGroup", "topic", "lagThreshold"],
    # KEDA's CRD types trigger metadata as map[string]string: a YAML number
    # or boolean here is rejected by the API server.
    "additionalProperties": {"type": "string"},
    "properties": {
        "bootstrapServers": {"type": "string", "pattern": r"^[^,\s]+:[0-9]+(,[^,\s]+:[0-9]+)*$"},
        "consumerGroup": {"type": "string", "minLength": 1},
        "topic": {"type": "string", "minLength": 1},
        "lagThreshold": {"type": "string", "pattern": r"^[1-9][0-9]*$"},
        "activationLagThreshold": _INT_STRING,
        "offsetResetPolicy": {"enum": ["earliest", "latest"]},
        "allowIdleConsumers": {"enum": ["true", "false"]},
        "sasl": {"enum": ["plaintext", "scram_sha256", "scram_sha512", "gssapi", "oauthbearer"]},
        "tls": {"enum": ["enable", "disable"]},
    },
}

SCALED_OBJECT = _crd(
    "keda.sh/v1alpha1",
    "ScaledObject",
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "additionalProperties": False,
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": {"type": "string", "minLength": 1},
                    "envSourceContainerName": {"type": "string"},
                },
            },
            "pollingInterval": {"type": "integer", "minimum": 1},
            "initialCooldownPeriod": {"type": "integer", "minimum": 0},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "idleReplicaCount": {"type": "integer", "minimum": 0},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "fallback": {
                "type": "object",
                "required": ["failureThreshold", "replicas"],
                "additionalProperties": False,
                "properties": {
                    "failureThreshold": {"type": "integer", "minimum": 1},
                    "replicas": {"type": "integer", "minimum": 0},
                    "behavior": {"enum": ["static", "currentReplicas", "currentReplicasIfHigher",
                                          "currentReplicasIfLower"]},
                },
            },
            "advanced": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                    },
                    "scalingModifiers": {"type": "object"},
                },
            },
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "additionalProperties": False,
                    "properties": {
                        "type": {"const": "kafka"},
                        "name": {"type": "string"},
                        "metadata": KAFKA_TRIGGER_METADATA,
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": {
                            "type": "object",
                            "required": ["name"],
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                            },
                        },
                    },
                },
            },
        },
    },
)

TRIGGER_AUTHENTICATION = _crd(
    "keda.sh/v1alpha1",
    "TriggerAuthentication",
    {
        "type": "object",
        "required": ["secretTargetRef"],
        "additionalProperties": False,
        "properties": {
            "secretTargetRef": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["parameter", "name", "key"],
                    "additionalProperties": False,
                    "properties": {
                        # The Kafka scaler's authentication parameters.
                        "parameter": {"enum": ["sasl", "username", "password", "tls", "ca", "cert",
                                               "key", "keyPassword"]},
                        "name": {"type": "string", "pattern": _DNS1123},
                        "key": {"type": "string", "minLength": 1},
                    },
                },
            }
        },
    },
)

_DURATION = {"type": "string", "pattern": r"^(0|([0-9]+(\.[0-9]+)?(ms|s|m|h|d|w|y))+)$"}
SERVICE_MONITOR = _crd(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "additionalProperties": False,
        "properties": {
            "selector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"matchLabels": _STRING_MAP, "matchExpressions": {"type": "array"}},
            },
            "namespaceSelector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"any": {"type": "boolean"},
                               "matchNames": {"type": "array", "items": {"type": "string"}}},
            },
            "jobLabel": {"type": "string"},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string", "minLength": 1},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"},
                    },
                },
            },
        },
    },
)

CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): TRIGGER_AUTHENTICATION,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
}


# --------------------------------------------------------------------------
# Rendering and validation helpers.
# --------------------------------------------------------------------------
@functools.cache
def kube_versions() -> tuple[str, ...]:
    """Validate against the oldest Kubernetes the chart claims (Chart.yaml
    kubeVersion) and the newest schema set kubernetes-validate ships."""
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    m = re.search(r">=\s*v?([0-9]+\.[0-9]+)", meta["kubeVersion"])
    assert m, "Chart.yaml kubeVersion must state a minimum"
    return (f"{m.group(1)}.0", kv_utils.latest_version())


def _k8s_subschema(name: str) -> jsonschema.protocols.Validator:
    version = kube_versions()[-1]
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    schema = kv_utils.schema_contents(f"{schema_dir}/{name}.json", version)
    defs = kv_utils.schema_contents(f"{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


class Rendered:
    """One rendering of the chart: parsed objects plus NOTES.txt."""

    def __init__(self, manifests: dict[str, str], values: dict[str, Any]):
        self.values = values
        self.manifests = manifests
        self.notes = ""
        self.objects: list[dict[str, Any]] = []
        for path, text in sorted(manifests.items()):
            if path.endswith("NOTES.txt"):
                self.notes = text
                continue
            for doc in yaml.safe_load_all(text):
                if doc:
                    self.objects.append(doc)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects}

    @property
    def deployment(self) -> dict[str, Any]:
        return self.one("Deployment")

    @property
    def pod(self) -> dict[str, Any]:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def container(self) -> dict[str, Any]:
        (c,) = [c for c in self.pod["containers"] if c["name"] == "worker"]
        return c

    @property
    def config_map(self) -> dict[str, Any]:
        """The worker's settings ConfigMap (the LoRA modules one, ``<release>-lora``, is apart)."""
        (cm,) = [o for o in self.of_kind("ConfigMap") if not o["metadata"]["name"].endswith("-lora")]
        return cm

    @property
    def config(self) -> dict[str, str]:
        return self.config_map["data"]

    def env(self) -> dict[str, Any]:
        """Container env: ConfigMap entries, then explicit env (which wins)."""
        merged: dict[str, Any] = dict(self.config)
        for item in self.container.get("env", []):
            merged[item["name"]] = item.get("value", item.get("valueFrom"))
        return merged


def validate_object(obj: dict[str, Any]) -> str:
    """Validate one rendered object; return what it was checked against."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_SCHEMAS:
        jsonschema.validate(obj, CRD_SCHEMAS[key])
        if key[1] == "ScaledObject":
            behavior = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
            if behavior is not None:
                _behavior_validator().validate(behavior)
        return "crd-structure"
    return ",".join(kv.validate(obj, v, strict=True) for v in kube_versions())


_BEHAVIOR: list[Any] = []


def _behavior_validator():
    if not _BEHAVIOR:
        _BEHAVIOR.append(_k8s_subschema("horizontalpodautoscalerbehavior-autoscaling-v2"))
    return _BEHAVIOR[0]


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out

