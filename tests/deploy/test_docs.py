"""The README's "Deploy on Kubernetes" section stays in step with the chart and the Dockerfile it
describes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
_README = (REPO / "README.md").read_text()
DOC = "## Deploy on Kubernetes" + _README.split("## Deploy on Kubernetes", 1)[1].split("\n## ", 1)[0]
VALUES = yaml.safe_load((REPO / "helm" / "qworker" / "values.yaml").read_text())


def test_walks_through_every_step():
    assert DOC.startswith("## Deploy on Kubernetes")
    for needle in ["docker build -t", "--build-arg VARIANT=cuda", "--build-arg MODEL_SOURCE=baked",
                   "qworker topics create --partitions", "kafka.jobsPartitions", "helm install qworker helm/qworker",
                   "kubectl -n inference get hpa", "get scaledobject", "checked by CI elsewhere"]:
        assert needle in DOC, needle


def test_value_keys_in_the_doc_exist():
    keys = set(re.findall(r"`((?:kafka|model|gpu|worker|autoscaling|probes|podDisruptionBudget|serviceMonitor"
                          r"|otel|image)\.[A-Za-z.]+)`", DOC))
    assert len(keys) > 10
    for key in keys:
        node = VALUES
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key} is not a chart value"
            node = node[part]


def test_referenced_files_exist():
    for path in set(re.findall(r"(helm/qworker/examples/[\w.-]+\.yaml)", DOC)):
        assert (REPO / path).is_file(), path
