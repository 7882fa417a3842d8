"""Names of the objects a PostTrainJob makes, and the length limits they must keep.

JobSet names its pods' hostnames `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>`, and a
hostname is a DNS label of at most 63 characters. The Job controller names each pod
`<hostname>-<5 random characters>`, cutting the job's name short where `<hostname>-`
would be over 58 characters; the trainer's status permission is checked against that pod
name (TRAINER_REPLICATED_JOBS), so it must keep the whole hostname. The longest hostname
decides how long a job's name may be.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.api.spec import PostTrainJobSpec
from posttrain.catalog import Placement

DNS_LABEL_MAX = 63
# names.MaxGeneratedNameLength of the API server: 63 less the 5 random characters.
GENERATED_PREFIX_MAX = 58
HOSTNAME_MAX = GENERATED_PREFIX_MAX - 1  # the pod name keeps `<hostname>-` whole
JAX_COORDINATOR_PORT = 8476
# The one ServiceAccount of every trainer pod in a namespace (see render.objects).
TRAINER_SERVICE_ACCOUNT = "posttrain-trainer"
# The replicated jobs whose pods run the trainer (and its ServiceAccount). No job name
# ends in `-<one of them>` and none ends in another's tail, so a pod name
# `<job>-<replicatedJob>-<jobIndex>-<podIndex>-<suffix>` names exactly one job.
TRAINER_REPLICATED_JOBS = ("node", "slice", "pathways-head")


class NameTooLong(ValueError):
    pass


@dataclass(frozen=True)
class ReplicatedJobShape:
    name: str
    replicas: int  # Jobs
    pods: int  # pods per Job (parallelism = completions)


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


def hostname_limit(rjob: str) -> int:
    """How long a pod hostname of this replicated job may be: a DNS label, and for the
    trainer's pods one whose whole `<hostname>-` stays in the pod's name."""
    return HOSTNAME_MAX if rjob in TRAINER_REPLICATED_JOBS else DNS_LABEL_MAX


def coordinator_label(job_name: str, first_replicated_job: str) -> str:
    """The value of JobSet's `jobset.sigs.k8s.io/coordinator` label (pod 0 of job 0)."""
    js = jobset_name(job_name)
    return f"{pod_hostname(js, first_replicated_job, 0, 0)}.{js}"


def max_name_length(first_replicated_job: str) -> int:
    """The longest job name whose coordinator label fits a label value."""
    fixed = len(coordinator_label("", first_replicated_job))
    return (DNS_LABEL_MAX - fixed) // 2


def check_name_lengths(job_name: str, spec: PostTrainJobSpec, placement: Placement) -> None:
    """Raise NameTooLong when the coordinator label (`coordinator_label`) or a derived
    hostname (`hostname_limit`) would be too long."""
    first = replicated_jobs(spec, placement)[0].name
    if len(coordinator_label(job_name, first)) > DNS_LABEL_MAX:
        allowed = max_name_length(first)
        raise NameTooLong(
            f"{job_name!r} is {len(job_name)} characters; JobSet labels every pod with its "
            f"coordinator's address `<name>-{first}-0-0.<name>`, which would be "
            f"{len(coordinator_label(job_name, first))} characters, over the "
            f"{DNS_LABEL_MAX} a label value may have: use a name of at most {allowed} "
            "characters"
        )
    rjob, longest = max(
        (
            (r.name, pod_hostname(jobset_name(job_name), r.name, r.replicas - 1, r.pods - 1))
            for r in replicated_jobs(spec, placement)
        ),
        key=lambda named: len(named[1]) - hostname_limit(named[0]),
    )
    limit = hostname_limit(rjob)
    if len(longest) > limit:
        allowed = limit - (len(longest) - len(job_name))
        why = (
            f"(its pods are named `<hostname>-<5 characters>`, and Kubernetes cuts a "
            f"generated name's prefix past {GENERATED_PREFIX_MAX} characters)"
            if limit == HOSTNAME_MAX
            else "(the DNS label limit)"
        )
        raise NameTooLong(
            f"{job_name!r} is {len(job_name)} characters; this job's longest pod hostname "
            f"would be {longest!r} ({len(longest)} characters), over {limit} {why}: use a "
            f"name of at most {allowed} characters"
        )


def coordinator_address(job_name: str, spec: PostTrainJobSpec, placement: Placement) -> str:
    """host:port of JAX process 0: the first pod of the first replicated job."""
    first = replicated_jobs(spec, placement)[0]
    js = jobset_name(job_name)
    return f"{pod_hostname(js, first.name, 0, 0)}.{js}:{JAX_COORDINATOR_PORT}"
