"""The chart's tensor-parallel options: one pod whose worker spawns its ranks (``tensorParallel.size``
with as many GPUs), or a LeaderWorkerSet group of ``size`` one-GPU pods (a worker and followers)
that the autoscaler scales as a unit. Pod templates are checked against the Kubernetes schema."""

from __future__ import annotations

import pytest

from .support import _k8s_subschema, helm

BASE = {"kafka": {"bootstrapServers": "kafka:9092"}}


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_default_has_no_tensor_parallel_setting(render):
    r = render(BASE)
    assert "QWORKER_TENSOR_PARALLEL_SIZE" not in r.config and "LeaderWorkerSet" not in r.kinds()
    # helper-125: a collective timeout the worker would refuse, unused without tensor parallelism
    r = render({**BASE, "tensorParallel": {"size": 1, "leaderWorkerSet": {"collectiveTimeoutSeconds": 172800}}})
    assert "QWORKER_TP_TIMEOUT_S" not in r.config


def test_one_pod_spawns_its_ranks(render):
    r = render({**BASE, "gpu": {"enabled": True, "count": 2}, "tensorParallel": {"size": 2}})
    assert r.config["QWORKER_TENSOR_PARALLEL_SIZE"] == "2"
    assert r.container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "LeaderWorkerSet" not in r.kinds()


def test_leader_worker_set_is_one_unit_of_ranks(render):
    r = render({**BASE, "gpu": {"enabled": True, "count": 1}, "tensorParallel": {"size": 4, "leaderWorkerSet": {"enabled": True}}})
    assert "Deployment" not in r.kinds()
    lws = r.one("LeaderWorkerSet")
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 4 and t["restartPolicy"] == "RecreateGroupOnPodRestart"
    pod_schema = _k8s_subschema("podtemplatespec-v1")
    for tmpl in (t["leaderTemplate"], t["workerTemplate"]):
        pod_schema.validate(tmpl)
    (leader,) = t["leaderTemplate"]["spec"]["containers"]
    (follower,) = t["workerTemplate"]["spec"]["containers"]
    assert _env(leader)["QWORKER_TP_EXTERNAL_FOLLOWERS"] == "1" and _env(leader)["MASTER_PORT"] == "29500"
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in leader["ports"]
    assert "livenessProbe" in leader and "args" not in follower and "livenessProbe" not in follower
    assert follower["command"][-2:] == ["-m", "qworker.model.parallel.follower"]
    assert _env(follower)["OMP_NUM_THREADS"]["resourceFieldRef"]["containerName"] == "follower"
    assert r.config["QWORKER_TENSOR_PARALLEL_SIZE"] == "4"
    target = r.one("ScaledObject")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("LeaderWorkerSet", lws["metadata"]["name"])
    assert "LeaderWorkerSet group of 4 pods" in r.notes


@pytest.mark.parametrize("values,needle", [
    ({"gpu": {"enabled": True, "count": 1}, "tensorParallel": {"size": 2}}, "gpu.count to at least 2"),
    ({"tensorParallel": {"size": 1, "leaderWorkerSet": {"enabled": True}}}, "tensorParallel.size >= 2"),
    ({"gpu": {"enabled": True, "count": 2}, "tensorParallel": {"size": 2, "leaderWorkerSet": {"enabled": True}}}, "gpu.count to 1"),
    # helper-124: the rendezvous on the probe server's port (it binds first); a timeout the worker refuses
    ({"gpu": {"enabled": True, "count": 1}, "tensorParallel": {"size": 2, "leaderWorkerSet": {"enabled": True, "port": 8080}}},
     "must differ from worker.httpPort"),
    ({"tensorParallel": {"size": 2, "leaderWorkerSet": {"collectiveTimeoutSeconds": 172800}}}, "collectiveTimeoutSeconds"),
])
def test_bad_tensor_parallel_values(render, values, needle):
    with pytest.raises(helm.HelmError) as info:
        render({**BASE, **values})
    assert needle in str(info.value)
