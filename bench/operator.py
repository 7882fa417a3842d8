"""Operator throughput on the local control plane.

Creates N PostTrainJobs at once and measures, from a watch on JobSets, the time until all
N JobSets exist and each job's create-to-JobSet latency. The baseline, measured in the
same run against the same API server, is creating N JobSets directly from the client:
the ratio shows what the operator adds on top of the API server's own cost.

    python bench/operator.py --jobs 500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from invalid_jobs import valid_job  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402

from posttrain.api.validate import validate  # noqa: E402
from posttrain.render import render  # noqa: E402
from tests import cluster as local  # noqa: E402

GROUP, VERSION = "posttrain.dev", "v1alpha1"


def watch_jobsets(
    plane, namespace: str, expected: int, seen: dict[str, float], done: threading.Event
):
    from kubernetes import client, watch

    api = client.CustomObjectsApi(plane.api_client)
    w = watch.Watch()
    for event in w.stream(
        api.list_namespaced_custom_object,
        "jobset.x-k8s.io",
        "v1alpha2",
        namespace,
        "jobsets",
        timeout_seconds=1800,
    ):
        if event["type"] == "ADDED":
            seen.setdefault(event["object"]["metadata"]["name"], time.monotonic())
            if len(seen) >= expected:
                break
    w.stop()
    done.set()


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def create_all(
    plane, namespace: str, objects: list[tuple[str, dict]], workers: int = 16
) -> dict[str, float]:
    from kubernetes import client

    api = client.CustomObjectsApi(plane.api_client)
    created: dict[str, float] = {}

    def create(item: tuple[str, dict]) -> None:
        (group, version, plural), body = item[1]
        created[body["metadata"]["name"]] = time.monotonic()
        api.create_namespaced_custom_object(group, version, namespace, plural, body)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(create, objects))
    return created


def run(plane, jobs: int, operator_mode: bool, workdir: Path) -> dict[str, float]:
    namespace = plane.create_namespace("bench-op" if operator_mode else "bench-base")
    op = None
    if operator_mode:
        op = OperatorProcess(
            plane.kubeconfig, workdir, namespace, "-n", namespace, identity="bench"
        ).start()
    items = []
    for i in range(jobs):
        doc = valid_job(f"job-{i:04d}")
        doc["metadata"]["namespace"] = namespace
        if operator_mode:
            items.append((doc["metadata"]["name"], ((GROUP, VERSION, "posttrainjobs"), doc)))
        else:
            job, _ = validate(doc)
            jobset = render(job)[-1]
            items.append(
                (jobset["metadata"]["name"], (("jobset.x-k8s.io", "v1alpha2", "jobsets"), jobset))
            )
    seen: dict[str, float] = {}
    done = threading.Event()
    watcher = threading.Thread(
        target=watch_jobsets, args=(plane, namespace, jobs, seen, done), daemon=True
    )
    watcher.start()
    time.sleep(1)
    start = time.monotonic()
    created = create_all(plane, namespace, items)
    done.wait(1800)
    total = max(seen.values()) - start
    latencies = [seen[name] - created[name] for name in created if name in seen]
    rss_mb = None
    if op is not None:
        status = Path(f"/proc/{op.proc.pid}/status").read_text()
        rss_mb = (
            int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1])
            / 1024
        )
        op.stop()
    plane.delete_namespace(namespace)
    return {
        "total_s": total,
        "p50_s": statistics.median(latencies),
        "p99_s": percentile(latencies, 99),
        "count": len(seen),
        "rss_mb": rss_mb,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    args = parser.parse_args()
    plane = local.start(full=False)
    workdir = Path("/tmp/posttrain-bench")
    workdir.mkdir(exist_ok=True)
    try:
        base = run(plane, args.jobs, operator_mode=False, workdir=workdir)
        op = run(plane, args.jobs, operator_mode=True, workdir=workdir)
    finally:
        local.stop(plane)
    print(f"jobs: {args.jobs}")
    print(
        f"baseline (client creates JobSets directly): all in {base['total_s']:.1f}s, "
        f"p50 {base['p50_s'] * 1000:.0f} ms, p99 {base['p99_s'] * 1000:.0f} ms"
    )
    print(
        f"operator (PostTrainJob -> JobSet):        all in {op['total_s']:.1f}s, "
        f"p50 {op['p50_s'] * 1000:.0f} ms, p99 {op['p99_s'] * 1000:.0f} ms, "
        f"{op['count']} JobSets, operator peak RSS {op['rss_mb']:.0f} MiB"
    )
    print(
        f"ratio operator/baseline: time-to-all {op['total_s'] / base['total_s']:.2f}x, "
        f"p50 {op['p50_s'] / base['p50_s']:.2f}x, p99 {op['p99_s'] / base['p99_s']:.2f}x"
    )
    return 0 if op["count"] == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
