"""Leader election on a coordination.k8s.io Lease, so two replicas never act at once.

The holder renews the Lease every `renew` seconds; a standby takes it over once it has
not been renewed for `duration` seconds. Updates carry the Lease's resourceVersion, so
two candidates cannot both win the same round.

While the API server is unreachable the holder keeps acting (nobody else can take the
Lease through a server that is down); it steps down as soon as it sees another holder.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("posttrain.leader")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class LeaseElector:
    def __init__(
        self, namespace: str, name: str, identity: str, duration: int = 15, renew: float = 3
    ):
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration, self.renew = duration, renew
        self.api = client.CoordinationV1Api()

    def _spec(self, transitions: int, acquire_time: datetime.datetime) -> client.V1LeaseSpec:
        return client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=self.duration,
            acquire_time=acquire_time,
            renew_time=_now(),
            lease_transitions=transitions,
        )

    def try_acquire(self) -> bool | None:
        """One round: True when this replica holds the Lease afterwards, False when
        another does, None when the API server could not be reached."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status != 404:
                return None
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(0, _now()),
            )
            try:
                self.api.create_namespaced_lease(self.namespace, body)
                return True
            except ApiException:
                return False
        except urllib3.exceptions.HTTPError:
            return None
        spec = lease.spec
        mine = spec.holder_identity == self.identity
        renewed = spec.renew_time or spec.acquire_time
        expired = renewed is None or (_now() - renewed).total_seconds() > (
            spec.lease_duration_seconds or self.duration
        )
        if not (mine or expired or not spec.holder_identity):
            return False
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        lease.spec = self._spec(transitions, spec.acquire_time if mine else _now())
        try:
            self.api.replace_namespaced_lease(self.name, self.namespace, lease)
            if not mine:
                log.info("acquired lease %s/%s as %s", self.namespace, self.name, self.identity)
            return True
        except ApiException:
            return False  # someone else updated it first
        except urllib3.exceptions.HTTPError:
            return None

    def wait_until_leader(self, stop: threading.Event, on_round: Callable[[], None]) -> bool:
        while not stop.is_set():
            on_round()
            if self.try_acquire():
                return True
            stop.wait(self.renew)
        return False

    def hold(
        self, stop: threading.Event, lost: Callable[[], None], on_round: Callable[[], None]
    ) -> None:
        """Renew until stopped; call lost() once another replica holds the Lease."""
        while not stop.wait(self.renew):
            on_round()
            if self.try_acquire() is False:
                log.error("lost lease %s/%s to another replica", self.namespace, self.name)
                lost()
                return

    def release(self) -> None:
        """Give the Lease up on a clean shutdown so a standby takes over at once."""
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                lease.spec.renew_time = None
                self.api.replace_namespaced_lease(self.name, self.namespace, lease)
        except (ApiException, urllib3.exceptions.HTTPError):
            pass
