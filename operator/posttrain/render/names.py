"""Names of the objects a PostTrainJob makes, and the length limits they must keep.

JobSet names its pods' hostnames `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>`, and a
hostname is a DNS label of at most 63 characters; the longest one decides how long a
job's name may be.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.api.spec import PostTrainJobSpec
from posttrain.catalog import Placement

DNS_LABEL_MAX = 63
JAX_COORDINATOR_PORT = 8476


class NameTooLong(ValueError):
    pass


@dataclass(frozen=True)
class ReplicatedJobShape:
    name: str
    replicas: int  # Jobs
    pods: int  # pods per Job (parallelism = completions)


def config_map_name(job_name: str) -> str:
    return f"{job_name}-config"


def jobset_name(job_name: str) -> str:
    return job_name


def replicated_jobs(spec: PostTrainJobSpec, placement: Placement) -> list[ReplicatedJobShape]:
    """The replicated jobs of the JobSet for this spec, in order."""
    res = spec.resources
    if placement.is_tpu and res.pathways.enabled:
        return [
            ReplicatedJobShape("pathways-head", 1, 1),
            ReplicatedJobShape("worker", res.slices, placement.hosts),
        ]
    if placement.is_tpu:
        return [ReplicatedJobShape("slice", res.slices, placement.hosts)]
    return [ReplicatedJobShape("node", 1, res.nodes)]


def pod_hostname(jobset: str, rjob: str, job_index: int, pod_index: int) -> str:
    return f"{jobset}-{rjob}-{job_index}-{pod_index}"


def check_name_lengths(job_name: str, spec: PostTrainJobSpec, placement: Placement) -> None:
    """Raise NameTooLong when a derived hostname would exceed the DNS label limit."""
    longest = max(
        (
            pod_hostname(jobset_name(job_name), r.name, r.replicas - 1, r.pods - 1)
            for r in replicated_jobs(spec, placement)
        ),
        key=len,
    )
    if len(longest) > DNS_LABEL_MAX:
        allowed = DNS_LABEL_MAX - (len(longest) - len(job_name))
        raise NameTooLong(
            f"{job_name!r} is {len(job_name)} characters; this job's longest pod hostname "
            f"would be {longest!r} ({len(longest)} characters), over the {DNS_LABEL_MAX}-"
            f"character DNS label limit: use a name of at most {allowed} characters"
        )


def coordinator_address(job_name: str, spec: PostTrainJobSpec, placement: Placement) -> str:
    """host:port of JAX process 0: the first pod of the first replicated job."""
    first = replicated_jobs(spec, placement)[0]
    js = jobset_name(job_name)
    return f"{pod_hostname(js, first.name, 0, 0)}.{js}:{JAX_COORDINATOR_PORT}"
