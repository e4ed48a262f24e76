"""Recipe: start a GPU Dask cluster on Kubernetes from Python, then train on it with dask-ddp.

Needs ``pip install dask-kubernetes`` where this runs, kubectl access to a
cluster, and the dask-kubernetes operator installed there::

    python docker/kubernetes/kubecluster.py --image registry.example.com/dask-ddp:gpu --workers 2

``KubeCluster(resources=...)`` would put the GPU limit on the scheduler too, so
the recipe builds the spec with ``make_cluster_spec`` and then gives the
workers, and only the workers, one GPU and a memory-backed ``/dev/shm``, and
every pod the Pod Security "restricted" settings and a
memory limit: the same cluster as ``daskcluster-gpu.yaml``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from dask.distributed import Client

import dask_ddp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as example  # noqa: E402  (docker/kubernetes/train.py; dask-ddp ships it to the workers by value)

WORKER_ENV = [
    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    {"name": "NCCL_DEBUG", "value": "WARN"},
]  # no *_SOCKET_IFNAME: dask-ddp sets them to the interface of each worker's address
UID = 10001  # the images' `ddp` user: USER 10001:10001 in docker/Dockerfile
# Pod Security "restricted", as in the manifests (README.md).
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
SCHEDULER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
# /dev/shm is memory-backed and counts against the worker's memory limit.
WORKER_RESOURCES = {"requests": {"cpu": "4", "memory": "16Gi"},
                    "limits": {"nvidia.com/gpu": "1", "memory": "32Gi"}}  # the GPU a string, as the CRD types it


def gpu_cluster_spec(name: str, image: str, n_workers: int, shm_size: str = "8Gi") -> dict:
    """A ``DaskCluster`` resource with one GPU per worker pod and none on the scheduler."""
    from dask_kubernetes.operator import make_cluster_spec

    address = f"tcp://{name}-scheduler.$(POD_NAMESPACE).svc.cluster.local:8786"
    spec = make_cluster_spec(name=name, image=image, n_workers=n_workers,
                             worker_command=["dask", "cuda", "worker", address])
    _drop_nulls(spec)  # the API server prunes them too; this keeps the printed spec honest
    # make_cluster_spec runs `dask-scheduler`, a script distributed no longer installs.
    for container in spec["spec"]["scheduler"]["spec"]["containers"]:
        container["args"] = ["dask", "scheduler"]
        container["resources"] = copy.deepcopy(SCHEDULER_RESOURCES)
    pod = spec["spec"]["worker"]["spec"]
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    # Memory-backed: NCCL's shared-memory transport and DataLoader workers need more than 64 MiB.
    pod["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}]
    for container in pod["containers"]:
        container["resources"] = copy.deepcopy(WORKER_RESOURCES)
        container["env"] = [dict(item) for item in WORKER_ENV]
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for role in ("scheduler", "worker"):
        _restrict(spec["spec"][role]["spec"])
    return spec


def _restrict(pod: dict) -> None:
    """Pod Security "restricted" settings, and no service account token: no pod here calls the Kubernetes API."""
    pod["automountServiceAccountToken"] = False
    pod["securityContext"] = copy.deepcopy(POD_SECURITY)
    for container in pod["containers"]:
        container["securityContext"] = copy.deepcopy(CONTAINER_SECURITY)


def _drop_nulls(node):
    if isinstance(node, dict):
        for key in [k for k, v in node.items() if v is None]:
            del node[key]
        for value in node.values():
            _drop_nulls(value)
    elif isinstance(node, list):
        for value in node:
            _drop_nulls(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="dask-ddp-gpu")
    parser.add_argument("--namespace", default=None, help="default: the current kubectl namespace")
    parser.add_argument("--image", required=True, help="the image built from docker/Dockerfile, pushed")
    parser.add_argument("--workers", type=int, default=2, help="worker pods = DDP ranks (one GPU each)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for the workers")
    args = parser.parse_args(argv)

    from dask_kubernetes.operator import KubeCluster

    spec = gpu_cluster_spec(args.name, args.image, args.workers)
    with KubeCluster(custom_cluster_spec=spec, namespace=args.namespace) as cluster, Client(cluster) as client:
        client.wait_for_workers(args.workers, timeout=args.timeout)
        job = dask_ddp.dispatch.run(client, example.train, args.epochs)
        print("final loss per rank:", job.result())
        print(job.metrics.tail())


if __name__ == "__main__":
    main()
