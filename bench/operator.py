"""The operator's cost on the local control plane, as ratios from one run.

All on one API server (etcd + kube-apiserver, no controllers: nothing else writes):

(a) burst: N JobSets created directly by a client (the baseline), N PostTrainJobs with no
    operator running (what the jobs' own creates cost, which the operator part includes),
    then N PostTrainJobs at once with the operator running: the time until every JobSet
    exists and until every job is fully reconciled (all its objects made, status
    written), each over the baseline's time; the API server's CPU seconds per job over
    its CPU per direct JobSet create, in all and less the jobs' own creates; the
    operator's CPU seconds.
(b) steady: with --present jobs in place, new jobs at --rate per second; p50/p99 of each
    job's create -> JobSet latency.
(c) idle: with those jobs in place and nothing changing, requests per second the API
    server serves (its apiserver_request_total, less this script's own reads).
(d) the operator's peak RSS (VmHWM) after all of it.
(e) a standby replica taking over from a killed leader with all those jobs present (its
    watches already warm: it is started and has seen every job before the kill).

    python bench/operator.py --jobs 500 --present 1000 --rate 5
    python bench/operator.py --takeover-only --present 1000

With --write-costs instead: the API server's CPU for each kind of write a job costs
(N JobSet creates, PostTrainJob creates, the operator's first status patches, Events),
without the operator.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import urllib3

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from invalid_jobs import valid_job  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402

from posttrain.checks import validate  # noqa: E402
from posttrain.render import render  # noqa: E402
from tests import cluster as local  # noqa: E402

JOBS = ("posttrain.dev", "v1alpha1", "posttrainjobs")
JOBSETS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM")).split()[1]) / 1024


def apiserver_requests(plane) -> Counter:
    """Requests the API server has served (all clients), by verb and resource, from its
    apiserver_request_total."""
    response = plane.api_client.call_api("GET", plane.api_client.configuration.host + "/metrics")
    response.read()
    counts: Counter = Counter()
    for line in response.data.decode().splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            counts[f"{labels.get('verb')} {labels.get('resource')}"] += float(
                line.rsplit(" ", 1)[1]
            )
    return counts


class Seen:
    """The first time each object of a kind in a namespace satisfies `ready`, from a watch."""

    def __init__(self, plane, kind: tuple[str, str, str], namespace: str, ready: Callable):
        self.times: dict[str, float] = {}
        self.changed = threading.Condition()
        self._stop = False
        args = (plane, kind, namespace, ready)
        threading.Thread(target=self._watch, args=args, daemon=True).start()
        time.sleep(0.5)

    def _watch(self, plane, kind, namespace, ready) -> None:
        from kubernetes import client, watch

        api = client.CustomObjectsApi(plane.api_client)
        while not self._stop:
            w = watch.Watch()
            try:
                for event in w.stream(
                    api.list_namespaced_custom_object,
                    *kind[:2],
                    namespace,
                    kind[2],
                    timeout_seconds=1800,
                ):
                    obj = event["object"]
                    name = obj["metadata"]["name"]
                    if event["type"] != "DELETED" and name not in self.times and ready(obj):
                        with self.changed:
                            self.times[name] = time.monotonic()
                            self.changed.notify_all()
                    if self._stop:
                        break
            except client.exceptions.ApiException as e:  # a fresh plane: 429 while the
                if e.status != 429:  # kind's storage initializes
                    raise
                time.sleep(1)
            except urllib3.exceptions.HTTPError:  # the stream was cut: the namespace or
                time.sleep(0.5)  # the plane is going away (stopped), or watch again

    def wait(self, names: list[str], timeout: float = 900) -> float:
        """The monotonic time the last of `names` was seen."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not all(n in self.times for n in names):
                if not self.changed.wait(max(0.0, deadline - time.monotonic())):
                    missing = [n for n in names if n not in self.times]
                    raise TimeoutError(
                        f"{len(missing)} of {len(names)} not seen, e.g. {missing[:3]}"
                    )
        return max(self.times[n] for n in names)

    def stop(self) -> None:
        self._stop = True


def create(plane, namespace: str, kind: tuple[str, str, str], bodies: list[dict]) -> dict:
    """Create bodies with 16 client threads; the monotonic time each create was sent."""
    from kubernetes import client

    api = client.CustomObjectsApi(plane.api_client)
    sent: dict[str, float] = {}

    def one(body: dict) -> None:
        sent[body["metadata"]["name"]] = time.monotonic()
        api.create_namespaced_custom_object(*kind[:2], namespace, kind[2], body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, bodies))
    return sent


def jobs(prefix: str, n: int, namespace: str) -> list[dict]:
    docs = [valid_job(f"{prefix}-{i:04d}") for i in range(n)]
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
    return docs


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def reconciled(job: dict) -> bool:
    return bool((job.get("status") or {}).get("jobSetName"))


def run(plane, n: int, present: int, rate: float, steady: int, idle_s: float) -> dict:
    apiserver = local.control_plane._pid("kube-apiserver")
    out: dict = {"load_before": os.getloadavg()}

    # (a) baseline: the same JobSets, created directly.
    base_ns = plane.create_namespace("bench-base")
    jobsets = []
    for doc in jobs("job", n, base_ns):
        parsed, _ = validate(doc)
        jobsets.append(render(parsed)[-1])
    seen = Seen(plane, JOBSETS, base_ns, lambda _: True)
    cpu0, start = cpu_seconds(apiserver), time.monotonic()
    create(plane, base_ns, JOBSETS, jobsets)
    out["base_s"] = seen.wait([j["metadata"]["name"] for j in jobsets]) - start
    out["base_cpu"] = cpu_seconds(apiserver) - cpu0
    seen.stop()

    # (a) the jobs alone: the same PostTrainJobs, no operator (nothing reconciles them).
    alone_ns = plane.create_namespace("bench-jobs")
    seen = Seen(plane, JOBS, alone_ns, lambda _: True)
    cpu0, start = cpu_seconds(apiserver), time.monotonic()
    alone = jobs("job", n, alone_ns)
    create(plane, alone_ns, JOBS, alone)
    out["jobs_s"] = seen.wait([d["metadata"]["name"] for d in alone]) - start
    out["jobs_cpu"] = cpu_seconds(apiserver) - cpu0
    seen.stop()
    plane.delete_namespace(alone_ns)

    # (a) the operator, N jobs at once.
    ns = plane.create_namespace("bench-op")
    op = OperatorProcess(plane.kubeconfig, Path("/tmp"), ns, "-n", ns, identity="bench").start()
    try:
        js_seen = Seen(plane, JOBSETS, ns, lambda _: True)
        job_seen = Seen(plane, JOBS, ns, reconciled)
        burst = jobs("job", n, ns)
        names = [d["metadata"]["name"] for d in burst]
        cpu0, op_cpu0, start = cpu_seconds(apiserver), cpu_seconds(op.proc.pid), time.monotonic()
        sent = create(plane, ns, JOBS, burst)
        out["op_jobsets_s"] = js_seen.wait(names) - start
        out["op_reconciled_s"] = job_seen.wait(names) - start
        out["op_api_cpu"] = cpu_seconds(apiserver) - cpu0
        out["op_cpu"] = cpu_seconds(op.proc.pid) - op_cpu0
        latencies = [js_seen.times[k] - sent[k] for k in names]
        out["burst_p50"], out["burst_p99"] = statistics.median(latencies), percentile(latencies, 99)

        # Up to `present` jobs in place (not measured).
        if present > n:
            rest = jobs("more", present - n, ns)
            create(plane, ns, JOBS, rest)
            job_seen.wait([d["metadata"]["name"] for d in rest])

        # (c) idle.
        time.sleep(10)
        req0, op_cpu0, api_cpu0 = (
            apiserver_requests(plane),
            cpu_seconds(op.proc.pid),
            cpu_seconds(apiserver),
        )
        time.sleep(idle_s)
        requests = apiserver_requests(plane)
        requests.subtract(req0)
        requests["GET "] -= 1  # this script's first read of /metrics
        out["idle_rps"] = sum(requests.values()) / idle_s
        out["idle_top"] = ", ".join(
            f"{k} {v / idle_s:.2f}/s" for k, v in requests.most_common(5) if v > 0
        )
        out["idle_op_cpu"] = cpu_seconds(op.proc.pid) - op_cpu0
        out["idle_api_cpu"] = cpu_seconds(apiserver) - api_cpu0

        # (b) steady arrivals.
        arrivals = jobs("steady", steady, ns)
        sent = {}
        from kubernetes import client

        api = client.CustomObjectsApi(plane.api_client)
        t0 = time.monotonic()
        for i, doc in enumerate(arrivals):
            time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            sent[doc["metadata"]["name"]] = time.monotonic()
            api.create_namespaced_custom_object(*JOBS[:2], ns, JOBS[2], doc)
        js_seen.wait(list(sent))
        job_seen.wait(list(sent))
        latencies = [js_seen.times[k] - sent[k] for k in sent]
        out["steady_p50"], out["steady_p99"] = (
            statistics.median(latencies),
            percentile(latencies, 99),
        )
        out["steady_max"] = max(latencies)
        out["jobs_present"] = len(job_seen.times)
        out["rss_mib"] = peak_rss_mib(op.proc.pid)
        out["op_cpu_total"] = cpu_seconds(op.proc.pid)

        # (e) a standby takes over.
        out.update(takeover(plane, op, ns, len(job_seen.times)))
        js_seen.stop()
        job_seen.stop()
    finally:
        op.stop()
        plane.delete_namespace(ns)
        plane.delete_namespace(base_ns)
    out["load_after"] = os.getloadavg()
    return out


def metric_sum(proc: OperatorProcess, name: str) -> float:
    """The sum of every series of metric `name` on an operator's /metrics."""
    _, text = proc.get("/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def takeover(plane, op: OperatorProcess, ns: str, jobs_present: int) -> dict:
    """(e) A standby starts, its watches fill its indexes (every job seen, posttrain_jobs),
    then the leader is killed (SIGKILL): the time from the kill until the standby leads
    and until it has reconciled every job (its reconcile count), the list requests the
    API server served meanwhile, and the standby's peak RSS."""
    out: dict = {}
    standby = OperatorProcess(
        plane.kubeconfig, Path("/tmp"), ns, "-n", ns, identity="standby"
    ).start(wait_leader=False)
    try:
        start = time.monotonic()
        while metric_sum(standby, "posttrain_jobs") < jobs_present:
            if time.monotonic() - start > 600:
                raise TimeoutError("the standby did not see every job")
            time.sleep(0.5)
        out["standby_warm_s"] = time.monotonic() - start
        out["standby_rss_before_mib"] = peak_rss_mib(standby.proc.pid)
        time.sleep(3)
        requests0 = apiserver_requests(plane)
        op.kill()
        killed = time.monotonic()
        out["takeover_leader_s"] = None
        while (standby.metric("posttrain_reconciles_total", 'handler="status"') or 0) < (
            jobs_present
        ):
            if out["takeover_leader_s"] is None and standby.metric("posttrain_leader") == 1.0:
                out["takeover_leader_s"] = time.monotonic() - killed
            if time.monotonic() - killed > 300:
                break
            time.sleep(0.2)
        out["takeover_s"] = time.monotonic() - killed
        requests = apiserver_requests(plane)
        requests.subtract(requests0)
        out["takeover_lists"] = sum(v for k, v in requests.items() if k.startswith("LIST "))
        out["standby_rss_mib"] = peak_rss_mib(standby.proc.pid)
    finally:
        standby.stop()
    return out


def write_costs(plane, n: int) -> list[str]:
    """The API server's CPU per write, n of each kind, 16 client threads."""
    import datetime

    from kubernetes import client

    from posttrain.api.spec import Phase
    from posttrain.controller.phase import Observation, observation_patch

    apiserver = local.control_plane._pid("kube-apiserver")
    ns = plane.create_namespace("bench-writes")
    docs = jobs("job", n, ns)
    jobsets = [render(validate(d)[0])[-1] for d in docs]
    custom, core = client.CustomObjectsApi(plane.api_client), client.CoreV1Api(plane.api_client)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    waiting = Observation(Phase.pending, "WaitingForPods", "waiting for pods to start")
    status = observation_patch(waiting, docs[0]["spec"], {}, now, 1) | {"jobSetName": "x"}

    def each(fn: Callable) -> Callable:
        return lambda: list(ThreadPoolExecutor(16).map(fn, docs))

    def patch(doc: dict) -> None:
        name = doc["metadata"]["name"]
        custom.patch_namespaced_custom_object_status(
            *JOBS[:2], ns, JOBS[2], name, {"status": status}
        )

    def event(doc: dict) -> None:
        name = doc["metadata"]["name"]
        ref = {"apiVersion": "/".join(JOBS[:2]), "kind": "PostTrainJob", "name": name}
        body = {
            "metadata": {"generateName": f"{name}."},
            "involvedObject": {**ref, "namespace": ns},
            "reason": "Pending",
            "message": "waiting for pods to start",
            "type": "Normal",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        core.create_namespaced_event(ns, body)

    kinds = [
        ("JobSet create", lambda: create(plane, ns, JOBSETS, jobsets)),
        ("PostTrainJob create", lambda: create(plane, ns, JOBS, docs)),
        ("the operator's first status patch", each(patch)),
        ("Event create", each(event)),
    ]
    lines = [f"API server CPU per write, {n} of each (load {os.getloadavg()[0]:.2f}):"]
    try:
        for what, run_them in kinds:
            cpu0 = cpu_seconds(apiserver)
            run_them()
            lines.append(f"    {what}: {(cpu_seconds(apiserver) - cpu0) / n * 1000:.1f} ms")
    finally:
        plane.delete_namespace(ns)
    return lines


def report(r: dict, n: int, present: int, rate: float) -> list[str]:
    load = lambda t: "/".join(f"{x:.2f}" for x in t)  # noqa: E731
    per_base, per_job = r["base_cpu"] / n, r["op_api_cpu"] / n
    per_own = (r["op_api_cpu"] - r["jobs_cpu"]) / n
    return [
        f"machine: {os.cpu_count()} cores, load average (1/5/15 min) {load(r['load_before'])} "
        f"before, {load(r['load_after'])} after",
        f"(a) burst of {n}: baseline (client creates the JobSets) {r['base_s']:.1f}s, "
        f"API server CPU {r['base_cpu']:.1f}s ({per_base * 1000:.1f} ms per JobSet)",
        f"    the PostTrainJobs alone (no operator): {r['jobs_s']:.1f}s "
        f"({r['jobs_s'] / r['base_s']:.2f}x), API server CPU {r['jobs_cpu']:.1f}s "
        f"({r['jobs_cpu'] / n * 1000:.1f} ms per job, {r['jobs_cpu'] / r['base_cpu']:.2f}x "
        "a JobSet create)",
        f"    operator: all JobSets in {r['op_jobsets_s']:.1f}s "
        f"({r['op_jobsets_s'] / r['base_s']:.2f}x, target <= 2x), all reconciled in "
        f"{r['op_reconciled_s']:.1f}s ({r['op_reconciled_s'] / r['base_s']:.2f}x, target <= 3x); "
        f"create->JobSet p50 {r['burst_p50']:.1f}s p99 {r['burst_p99']:.1f}s",
        f"    API server CPU {r['op_api_cpu']:.1f}s ({per_job * 1000:.1f} ms per job, "
        f"{per_job / per_base:.2f}x a JobSet create, target <= 2x; less the job's own "
        f"create {per_own * 1000:.1f} ms, {per_own / per_base:.2f}x); "
        f"operator CPU {r['op_cpu']:.1f}s",
        f"(b) steady {rate:g} jobs/s with {present} present: create->JobSet "
        f"p50 {r['steady_p50']:.2f}s p99 {r['steady_p99']:.2f}s max {r['steady_max']:.2f}s "
        f"(target p99 <= 2s)",
        f"(c) idle with {present} jobs: {r['idle_rps']:.2f} requests/s to the API server "
        f"(target < 1); operator CPU {r['idle_op_cpu']:.2f}s, API server CPU "
        f"{r['idle_api_cpu']:.2f}s over the window",
        f"    by verb and resource: {r['idle_top']}",
        f"(d) operator peak RSS {r['rss_mib']:.0f} MiB with {r['jobs_present']} jobs "
        f"(target <= 150 MiB); operator CPU in all {r['op_cpu_total']:.1f}s",
        *takeover_report(r),
    ]


def takeover_report(r: dict) -> list[str]:
    leader = r["takeover_leader_s"]
    return [
        f"(e) standby takeover after SIGKILL of the leader, {r['jobs_present']} jobs: the "
        f"standby saw every job {r['standby_warm_s']:.1f}s after it started (peak RSS then "
        f"{r['standby_rss_before_mib']:.0f} MiB); it leads "
        f"{'-' if leader is None else f'{leader:.1f}'}s after the kill (the Lease lasts 15s) "
        f"and has reconciled every job {r['takeover_s']:.1f}s after it (target <= 30s); "
        f"{r['takeover_lists']:.0f} list requests meanwhile; its peak RSS "
        f"{r['standby_rss_mib']:.0f} MiB",
    ]


def run_takeover(plane, present: int) -> dict:
    """Only (e): `present` jobs reconciled by a leader, then the takeover."""
    out: dict = {"load_before": os.getloadavg()}
    ns = plane.create_namespace("bench-op")
    op = OperatorProcess(plane.kubeconfig, Path("/tmp"), ns, "-n", ns, identity="bench").start()
    try:
        job_seen = Seen(plane, JOBS, ns, reconciled)
        docs = jobs("job", present, ns)
        create(plane, ns, JOBS, docs)
        job_seen.wait([d["metadata"]["name"] for d in docs])
        out["jobs_present"] = len(job_seen.times)
        out.update(takeover(plane, op, ns, out["jobs_present"]))
        job_seen.stop()
    finally:
        op.stop()
        plane.delete_namespace(ns)
    out["load_after"] = os.getloadavg()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500, help="the burst (a)")
    parser.add_argument("--present", type=int, default=1000, help="jobs in place for (b)-(d)")
    parser.add_argument("--rate", type=float, default=5.0, help="arrivals per second (b)")
    parser.add_argument("--steady", type=int, default=100, help="jobs arriving in (b)")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds measured in (c)")
    parser.add_argument(
        "--takeover-only", action="store_true", help="only (e), with --present jobs"
    )
    parser.add_argument("--write-costs", action="store_true", help="only each write's CPU")
    args = parser.parse_args()
    plane = local.start(full=False)
    if args.write_costs:
        try:
            print("\n".join(write_costs(plane, args.jobs)))
        finally:
            local.stop(plane)
        return 0
    try:
        if args.takeover_only:
            r = run_takeover(plane, args.present)
        else:
            r = run(plane, args.jobs, args.present, args.rate, args.steady, args.idle)
    finally:
        local.stop(plane)
    if args.takeover_only:
        load = "/".join(f"{x:.2f}" for x in r["load_before"])
        after = "/".join(f"{x:.2f}" for x in r["load_after"])
        print(f"machine: {os.cpu_count()} cores, load average {load} before, {after} after")
        print("\n".join(takeover_report(r)))
        return 0 if r["takeover_s"] <= 300 else 1
    print("\n".join(report(r, args.jobs, args.present, args.rate)))
    return 0 if r["jobs_present"] >= max(args.present, args.jobs) + args.steady else 1


if __name__ == "__main__":
    sys.exit(main())
