"""Leader election on a coordination.k8s.io Lease, so two replicas never act at once.

The holder renews the Lease every `renew` seconds; a standby takes it over once it has
not been renewed for `duration` seconds. Updates carry the Lease's resourceVersion, so
two candidates cannot both win the same round. A holder renews from the Lease its last
update returned: one request per round (it reads again only after a conflict).

A holder steps down as soon as it sees another holder, and when it has not renewed for
`deadline` seconds (the API server unreachable: shorter than `duration`, so it has
stopped before a standby can take over); it leads again once it renews. `run` goes
round that for the life of the process: a replica that loses the Lease becomes a
standby again, caches and all. Only the Lease's own requests are sent while not
leading (`kube.request(..., standby=True)`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from posttrain.controller import kube

log = logging.getLogger("posttrain.leader")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _time(dt: datetime.datetime) -> str:
    return dt.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


class LeaseElector:
    def __init__(
        self,
        namespace: str,
        name: str,
        identity: str,
        duration: int = 15,
        renew: float = 3,
        deadline: float = 10,
    ):
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration, self.renew, self.deadline = duration, renew, deadline
        self.collection = kube.COLLECTIONS["Lease"].format(namespace=namespace)
        self.path = f"{self.collection}/{name}"
        self.lease: dict[str, Any] | None = None  # as the last read or update returned it

    def _spec(self, transitions: int, acquire_time: str) -> dict[str, Any]:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.duration,
            "acquireTime": acquire_time,
            "renewTime": _time(_now()),
            "leaseTransitions": transitions,
        }

    def _read(self) -> dict[str, Any] | None:
        """The Lease, {} when there is none."""
        try:
            return kube.request("GET", self.path, standby=True)
        except ApiException as e:
            return {} if e.status == 404 else None

    def try_acquire(self) -> bool | None:
        """One round: True when this replica holds the Lease afterwards, False when
        another does, None when the API server could not be reached."""
        try:
            return self._round()
        except urllib3.exceptions.HTTPError:
            return None

    def _round(self, again: bool = True) -> bool | None:
        lease = self.lease or self._read()
        if lease is None:
            return None
        if not lease:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(0, _time(_now())),
            }
            try:
                self.lease = kube.request("POST", self.collection, body, standby=True)
                return True
            except ApiException:
                return False
        spec = lease.get("spec") or {}
        mine = spec.get("holderIdentity") == self.identity
        renewed = _parse(spec.get("renewTime") or spec.get("acquireTime"))
        expired = renewed is None or (_now() - renewed).total_seconds() > (
            spec.get("leaseDurationSeconds") or self.duration
        )
        if not (mine or expired or not spec.get("holderIdentity")):
            self.lease = None
            return False
        transitions = (spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        acquired = spec.get("acquireTime") if mine else _time(_now())
        update = {**lease, "spec": self._spec(transitions, acquired or _time(_now()))}
        try:
            self.lease = kube.request("PUT", self.path, update, standby=True)
        except ApiException as e:
            self.lease = None
            if e.status == 409 and mine and again:
                return self._round(again=False)  # renewed an old copy: read, try once more
            return False if e.status == 409 else None
        if not mine:
            log.info("acquired lease %s/%s as %s", self.namespace, self.name, self.identity)
        return True

    def wait_until_leader(self, stop: threading.Event, on_round: Callable[[], None]) -> bool:
        while not stop.is_set():
            on_round()
            if self.try_acquire():
                return True
            stop.wait(self.renew)
        return False

    def hold(self, stop: threading.Event, on_round: Callable[[], None]) -> bool:
        """Renew until stopped (False) or no longer the holder (True): another replica
        holds the Lease, or no renewal went through for `deadline` seconds."""
        renewed = time.monotonic()
        while not stop.wait(self.renew):
            on_round()
            held = self.try_acquire()
            if held:
                renewed = time.monotonic()
            elif held is False:
                log.error("lost lease %s/%s to another replica", self.namespace, self.name)
                return True
            elif time.monotonic() - renewed > self.deadline:
                log.error(
                    "lease %s/%s not renewed for %.0fs: stepping down",
                    self.namespace,
                    self.name,
                    time.monotonic() - renewed,
                )
                self.lease = None
                return True
        return False

    def run(
        self,
        stop: threading.Event,
        lead: Callable[[], None],
        follow: Callable[[], None],
        on_round: Callable[[], None],
    ) -> None:
        """Until stopped: wait for the Lease, lead() once held, follow() once no
        longer held or stopped (called on this thread, at once), and wait again."""
        while self.wait_until_leader(stop, on_round):
            lead()
            self.hold(stop, on_round)
            follow()

    def release(self) -> None:
        """Give the Lease up on a clean shutdown so a standby takes over at once."""
        try:
            lease = self._read()
            spec = (lease or {}).get("spec") or {}
            if spec.get("holderIdentity") == self.identity:
                spec = {**spec, "holderIdentity": None, "renewTime": None}
                kube.request("PUT", self.path, {**lease, "spec": spec}, standby=True)
        except (ApiException, urllib3.exceptions.HTTPError):
            pass
