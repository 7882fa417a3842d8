"""A standby replica against a real kube-apiserver: it watches but writes nothing, takes
over from its warm caches, and stops acting as soon as it loses the Lease.

The test holds the operator's Lease itself (as another replica would, renewing it), so
the operator under test stays a standby for as long as the test wants. Writes are
counted on the API server (its apiserver_request_total): on this tier's plane nothing
but the test and the operator writes the kinds counted.
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from collections import Counter

import pytest
from invalid_jobs import valid_job
from kubernetes.client.exceptions import ApiException
from operator_process import OperatorProcess

from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.integration
GROUP, VERSION, PLURAL = "posttrain.dev", "v1alpha1", "posttrainjobs"
LEASE = ("coordination.k8s.io", "v1", "leases")
LEASE_NAME = "posttrain-operator"
WRITES = {"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"}
# Every kind the operator writes but its Lease.
OPERATOR_KINDS = {
    "posttrainjobs",
    "jobsets",
    "serviceaccounts",
    "roles",
    "rolebindings",
    "configmaps",
    "events",
    "workloads",
}


def writes(apiserver: Cluster) -> Counter:
    """Write requests the API server has served, by verb and resource, for the kinds the
    operator writes (its Lease aside)."""
    client = apiserver.api_client
    response = client.call_api("GET", client.configuration.host + "/metrics")
    response.read()
    counts: Counter = Counter()
    for line in response.data.decode().splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            if labels.get("verb") in WRITES and labels.get("resource") in OPERATOR_KINDS:
                key = f"{labels['verb']} {labels['resource']}/{labels.get('subresource', '')}"
                counts[key] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def since(before: Counter, after: Counter) -> dict[str, int]:
    return {k: v - before[k] for k, v in after.items() if v != before[k]}


class OtherHolder:
    """Holds the operator's Lease as another replica would: renews it every second."""

    def __init__(self, apiserver: Cluster, namespace: str):
        self.custom, self.namespace = apiserver.custom, namespace
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _spec(self) -> dict:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"holderIdentity": "elsewhere", "leaseDurationSeconds": 15, "renewTime": now}

    def take(self) -> None:
        """Take the Lease (from whoever holds it) and keep renewing it."""
        wait_for(self._take, timeout=10, interval=0.2, what="the Lease taken")
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()

    def _take(self) -> bool:
        try:
            lease = self.custom.get_namespaced_custom_object(
                *LEASE[:2], self.namespace, LEASE[2], LEASE_NAME
            )
        except ApiException as e:
            if e.status != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": LEASE_NAME, "namespace": self.namespace},
                "spec": self._spec(),
            }
            self.custom.create_namespaced_custom_object(*LEASE[:2], self.namespace, LEASE[2], body)
            return True
        lease["spec"] = {**lease["spec"], **self._spec()}
        # With the resourceVersion read: a renewal in between makes this a 409, tried again.
        self.custom.replace_namespaced_custom_object(
            *LEASE[:2], self.namespace, LEASE[2], LEASE_NAME, lease
        )
        return True

    def _renew(self) -> None:
        while not self._stop.wait(1.0):
            patch = {"spec": self._spec()}
            self.custom.patch_namespaced_custom_object(
                *LEASE[:2], self.namespace, LEASE[2], LEASE_NAME, patch
            )

    def release(self) -> None:
        """Stop renewing and give the Lease up, as a replica shutting down does."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        patch = {"spec": {"holderIdentity": None, "renewTime": None}}
        self.custom.patch_namespaced_custom_object(
            *LEASE[:2], self.namespace, LEASE[2], LEASE_NAME, patch
        )


def create_job(apiserver: Cluster, namespace: str, name: str) -> dict:
    return apiserver.custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, valid_job(name)
    )


def get_job(apiserver: Cluster, namespace: str, name: str) -> dict:
    return apiserver.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def jobset_names(apiserver: Cluster, namespace: str) -> list[str]:
    items = apiserver.custom.list_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets"
    )["items"]
    return sorted(j["metadata"]["name"] for j in items)


def reconciled(apiserver: Cluster, namespace: str, names: list[str]) -> bool:
    return all(
        (get_job(apiserver, namespace, n).get("status") or {}).get("jobSetName") == n for n in names
    )


def seen_jobs(op: OperatorProcess) -> float:
    """How many jobs the operator's watches have brought it (its posttrain_jobs)."""
    _, text = op.get("/metrics")
    return sum(
        float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("posttrain_jobs{")
    )


def test_standby_writes_nothing_then_acts_from_its_caches(
    apiserver: Cluster, namespace: str, tmp_path
):
    other = OtherHolder(apiserver, namespace)
    other.take()
    op = OperatorProcess(
        apiserver.kubeconfig, tmp_path, namespace, "-n", namespace, identity="standby"
    ).start(wait_leader=False)
    try:
        # A standby: its watches bring it every job, and it writes nothing at all.
        before = writes(apiserver)
        names = [f"warm-{i}" for i in range(3)]
        created = {
            n: create_job(apiserver, namespace, n)["metadata"]["resourceVersion"] for n in names
        }
        wait_for(
            lambda: seen_jobs(op) == 3,
            timeout=30,
            what="the standby saw the jobs",
            describe=op.logs,
        )
        time.sleep(6)  # two of its Lease rounds
        assert op.metric("posttrain_leader") == 0.0
        assert since(before, writes(apiserver)) == {"POST posttrainjobs/": 3}
        assert jobset_names(apiserver, namespace) == []
        for n in names:  # no status, no kopf annotation, no finalizer: untouched
            assert get_job(apiserver, namespace, n)["metadata"]["resourceVersion"] == created[n]

        # The Lease is free: the standby leads and reconciles every job it has seen.
        other.release()
        released = time.monotonic()
        wait_for(lambda: reconciled(apiserver, namespace, names), timeout=30, describe=op.logs)
        took = time.monotonic() - released
        assert jobset_names(apiserver, namespace) == names
        assert op.metric("posttrain_leader") == 1.0
        time.sleep(2)  # its Events for them are posted

        # Another replica takes the Lease: the operator stops acting within a Lease round
        # and stays up as a standby, writing nothing.
        other.take()
        taken = time.monotonic()
        wait_for(lambda: op.metric("posttrain_leader") == 0.0, timeout=10, interval=0.1)
        stepped_down = time.monotonic() - taken
        before = writes(apiserver)
        late = create_job(apiserver, namespace, "late")["metadata"]["resourceVersion"]
        wait_for(lambda: seen_jobs(op) == 4, timeout=30, what="the standby saw the job")
        time.sleep(4)
        assert since(before, writes(apiserver)) == {"POST posttrainjobs/": 1}
        assert get_job(apiserver, namespace, "late")["metadata"]["resourceVersion"] == late
        assert op.proc.poll() is None

        # And leads again from the same caches once the Lease is free.
        other.release()
        wait_for(lambda: reconciled(apiserver, namespace, ["late"]), timeout=30, describe=op.logs)
        assert jobset_names(apiserver, namespace) == sorted([*names, "late"])
        assert stepped_down < 4.5, f"stepped down {stepped_down:.1f}s after losing the Lease"
        print(f"took over in {took:.1f}s, stepped down in {stepped_down:.1f}s")
    finally:
        other._stop.set()
        op.stop()
