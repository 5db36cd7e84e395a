"""deploy/kubernetes: the manifests are valid Kubernetes objects (kubernetes-validate's
bundled schemas, offline), and they agree with resilient and with each other: the agents'
command line parses, the etcd endpoints are the StatefulSet's members, the grace period
covers launch.preemption_grace, /dev/shm is memory, the secret comes from a Secret.

Not run here: a cluster (none on this machine). deploy/slurm runs for real in
tests/integration/test_deploy_slurm.py.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess

import pytest
import yaml

from launchutil import REPO

K8S = REPO / "deploy" / "kubernetes"
SCHEMA_VERSION = "1.29.0"  # the oldest Kubernetes the manifests aim at


def docs(name: str) -> dict[str, dict]:
    return {d["kind"] + "/" + d["metadata"]["name"]: d for d in yaml.safe_load_all((K8S / name).read_text()) if d}


def all_docs() -> list[dict]:
    return [d for f in sorted(K8S.glob("*.yaml")) for d in docs(f.name).values()]


def test_manifests_pass_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (a test extra)")
    found = all_docs()
    assert {d["kind"] for d in found} >= {"StatefulSet", "Job", "Service", "ClusterRole"}
    for d in found:
        kv.validate(d, SCHEMA_VERSION, strict=True)
    # The validator rejects what is wrong (strict: unknown fields too), so a pass means something.
    job = copy.deepcopy(docs("training.yaml")["Job/resilient-trainer"])
    job["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kv.ValidationError):
        kv.validate(job, SCHEMA_VERSION, strict=True)


def _agent(job: dict) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def test_training_job_agrees_with_resilient_and_etcd():
    from resilient.launch_args import parse_args

    etcd = docs("etcd.yaml")["StatefulSet/resilient-etcd"]
    job = docs("training.yaml")["Job/resilient-trainer"]
    pod, agent = job["spec"]["template"]["spec"], _agent(job)
    args = parse_args(agent["args"] + ["--node-id", "node-a", "--domain", "zone-a"])  # as the script appends them

    members = [f"{etcd['metadata']['name']}-{i}.{etcd['spec']['serviceName']}:2379" for i in range(etcd["spec"]["replicas"])]
    assert etcd["spec"]["replicas"] == 3 and args.rdzv_endpoint.split(",") == members
    cluster = next(a for a in _agent(etcd)["args"] if a.startswith("--initial-cluster="))
    assert len(cluster.split(",")) == 3

    grace = float(next(o.split("=", 1)[1] for o in args.overrides if o.startswith("launch.preemption_grace=")))
    assert pod["terminationGracePeriodSeconds"] >= grace + 5  # the agent leaves after its workers' grace

    shm = next(m for m in agent["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]

    env = {e["name"]: e for e in agent["env"]}
    assert env["RESILIENT_JOB_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "resilient-job"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == int(args.nnodes.split(":")[1])
    assert pod["subdomain"] == docs("training.yaml")["Service/resilient-trainer"]["metadata"]["name"]

    script = agent["command"][agent["command"].index("-c") + 1]
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", "-c", script], check=True)
    zone_lookup = re.search(r"<<'PY'\n(.*?)\nPY\n", script, re.S).group(1)
    compile(zone_lookup, "zone lookup", "exec")


def test_sbatch_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPO / "deploy" / "slurm" / "resilient.sbatch")], check=True)
