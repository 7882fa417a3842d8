"""Render the JobSet that runs a PostTrainJob.

Modes (chosen from spec.resources):
- TPU: replicated job `slice` (one Job per slice, one pod = one JAX process per host),
  exclusive placement per node pool, MEGASCALE_* env when there are several slices.
- TPU with Pathways: `pathways-head` (resource manager and proxy as native sidecars, the
  trainer as a single JAX client) and `worker` (pathways-worker on every TPU host); see
  `posttrain.render.pathways`. TPU pods get what GKE runs them with: `posttrain.render.tpu`.
- GPU and CPU: replicated job `node`, one pod per node.

Restarts: the trainer exits with USER_ERROR_EXIT_CODE for errors in the job's own input;
that fails the JobSet at once. A preempted or evicted pod restarts the JobSet without
counting against maxRestarts; any other failure restarts it up to maxRestarts times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.api import functions, rollout_split, service_urls
from posttrain.api.spec import USER_ERROR_EXIT_CODE, PostTrainJob
from posttrain.catalog import NODEPOOL_LABEL, Placement
from posttrain.render import gpu, names, pathways, tpu
from posttrain.render.trainer_config import CONFIG_ANNOTATION, CONFIG_FILE_NAME, config_text

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
CONFIG_MOUNT = "/etc/posttrain"
CONFIG_FILE = f"{CONFIG_MOUNT}/{CONFIG_FILE_NAME}"
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"
EXCLUSIVE_TOPOLOGY = pathways.EXCLUSIVE_TOPOLOGY
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_NAME_LABEL = "posttrain.dev/job-name"

# Job failure messages the Job controller writes for podFailurePolicy FailJob rules;
# the JobSet failurePolicy tells the two causes apart by them.
USER_ERROR_PATTERN = f"exit code {USER_ERROR_EXIT_CODE} matching FailJob rule"
DISRUPTION_PATTERN = "condition DisruptionTarget matching FailJob rule"


@dataclass(frozen=True)
class RenderConfig:
    """Operator-level defaults a PostTrainJob may leave out."""

    # Trainer images per accelerator kind (Dockerfile.trainer's ACCELERATOR builds).
    trainer_image_cpu: str = "ghcr.io/posttrain/trainer:0.1.0"
    trainer_image_tpu: str = "ghcr.io/posttrain/trainer:0.1.0-tpu"
    trainer_image_gpu: str = "ghcr.io/posttrain/trainer:0.1.0-cuda12"
    pathways_server_image: str = pathways.SERVER_IMAGE
    pathways_proxy_image: str = pathways.PROXY_IMAGE
    pathways_head_node_pool: str = pathways.HEAD_NODE_POOL  # a CPU node pool
    default_queue: str | None = None
    # The chart's ClusterRole each namespace's trainer ServiceAccount is bound to.
    trainer_cluster_role: str = "posttrain-trainer"
    # Module prefixes reward functions may come from (comma-separated; empty: any but
    # Python's own), given to every trainer pod: posttrain.api.functions.
    allowed_function_modules: str = ""
    # The MLflow tracking server of jobs whose spec.tracking.mlflow sets no trackingUri.
    mlflow_tracking_uri: str = ""

    def trainer_image(self, kind: str) -> str:
        """The default trainer image of an accelerator kind: cpu, tpu or gpu."""
        return getattr(self, f"trainer_image_{kind}")


def common_labels(job: PostTrainJob) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "posttrain",
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/managed-by": "posttrain-operator",
        JOB_NAME_LABEL: job.metadata.name,
    }


def owner_references(job: PostTrainJob) -> list[dict[str, Any]]:
    if not job.metadata.uid:
        return []
    return [
        {
            "apiVersion": job.api_version,
            "kind": job.kind,
            "name": job.metadata.name,
            "uid": job.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def object_meta(job: PostTrainJob, name: str, labels: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "labels": {**common_labels(job), **(labels or {})}}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    if refs := owner_references(job):
        meta["ownerReferences"] = refs
    return meta


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _annotation(key: str) -> str:
    return f"metadata.annotations['{key}']"


def _job_index_env(name: str) -> dict[str, Any]:
    return _field_env(name, _annotation(JOB_INDEX_ANNOTATION))


def _trainer_env(job: PostTrainJob, placement: Placement, pathways_head: str | None) -> list:
    spec = job.spec
    shapes = names.replicated_jobs(spec, placement)
    env: list[dict[str, Any]] = [
        {"name": "POSTTRAIN_JOB_NAME", "value": job.metadata.name},
        _field_env("POSTTRAIN_JOB_NAMESPACE", "metadata.namespace"),
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if pathways_head:
        env += [
            {"name": "JAX_PLATFORMS", "value": "proxy"},
            {
                "name": "JAX_BACKEND_TARGET",
                "value": f"grpc://{pathways_head}:{pathways.PROXY_PORT}",
            },
            {"name": "XCLOUD_ENVIRONMENT", "value": "GCP"},
            {"name": "ENABLE_PATHWAYS_PERSISTENCE", "value": "1"},
            {"name": "JAX_NUM_PROCESSES", "value": "1"},
        ]
    else:
        shape = shapes[0]
        env += [
            {
                "name": "JAX_COORDINATOR_ADDRESS",
                "value": names.coordinator_address(job.metadata.name, spec, placement),
            },
            {"name": "JAX_NUM_PROCESSES", "value": str(shape.replicas * shape.pods)},
            {"name": "POSTTRAIN_PODS_PER_JOB", "value": str(shape.pods)},
            _job_index_env("POSTTRAIN_JOB_INDEX"),
            {"name": "JAX_PLATFORMS", "value": placement.jax_platforms},
        ]
        if placement.is_tpu and spec.resources.slices > 1:
            js = names.jobset_name(job.metadata.name)
            env += _megascale_env(
                spec.resources.slices, f"{names.pod_hostname(js, 'slice', 0, 0)}.{js}"
            )
    if spec.hf_token_secret:
        ref = spec.hf_token_secret
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    return env


def _secret_env(name: str, ref: Any) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


# What spec.tracking's Secrets become in the trainer: the variables each client reads.
MLFLOW_SECRET_ENV = {
    "token_secret": "MLFLOW_TRACKING_TOKEN",
    "username_secret": "MLFLOW_TRACKING_USERNAME",
    "password_secret": "MLFLOW_TRACKING_PASSWORD",
}
MLFLOW_DEFAULT_URI_ENV = "POSTTRAIN_MLFLOW_TRACKING_URI"  # trainer.tracking.DEFAULT_URI_ENV


def _tracking_env(job: PostTrainJob, config: RenderConfig) -> list[dict[str, Any]]:
    """spec.tracking: its Secrets by reference (never a value in the JobSet) and the
    cluster's MLflow tracking URI for a job that sets none."""
    tracking = job.spec.tracking
    env: list[dict[str, Any]] = []
    if tracking is None:
        return env
    if (mlflow := tracking.mlflow) is not None:
        if not mlflow.tracking_uri and config.mlflow_tracking_uri:
            env.append({"name": MLFLOW_DEFAULT_URI_ENV, "value": config.mlflow_tracking_uri})
        for field, name in MLFLOW_SECRET_ENV.items():
            if (ref := getattr(mlflow, field)) is not None:
                env.append(_secret_env(name, ref))
    if tracking.wandb is not None and tracking.wandb.api_key_secret is not None:
        env.append(_secret_env("WANDB_API_KEY", tracking.wandb.api_key_secret))
    return env


def _service_auth_env(job: PostTrainJob) -> list[dict[str, Any]]:
    """The auth Secrets of spec.grpo's verifier services, by reference (never a value in
    the JobSet), in the variables the trainer reads (posttrain.api.service_urls)."""
    grpo = job.spec.grpo
    if grpo is None:
        return []
    env = [
        _secret_env(service_urls.reward_auth_env(i), r.http.auth_secret)
        for i, r in enumerate(grpo.rewards)
        if r.http is not None and r.http.auth_secret is not None
    ]
    tools = grpo.agent.tools if grpo.agent else []
    env += [
        _secret_env(service_urls.tool_auth_env(t.name), t.http.auth_secret)
        for t in tools
        if t.http is not None and t.http.auth_secret is not None
    ]
    return env


def _megascale_env(slices: int, coordinator: str) -> list[dict[str, Any]]:
    return [
        {"name": "MEGASCALE_NUM_SLICES", "value": str(slices)},
        _job_index_env("MEGASCALE_SLICE_ID"),
        {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": coordinator},
    ]


def _resources(job: PostTrainJob, placement: Placement, with_devices: bool) -> dict:
    out: dict[str, dict[str, Any]] = {}
    requests = {
        k: v
        for k, v in (("cpu", job.spec.resources.cpu), ("memory", job.spec.resources.memory))
        if v
    }
    if requests:
        out["requests"] = dict(requests)
    if with_devices and placement.resource_name:
        out["limits"] = {placement.resource_name: placement.devices_per_host}
    return out


def _trainer_container(
    job: PostTrainJob, placement: Placement, config: RenderConfig, pathways_head: str | None
) -> dict[str, Any]:
    mounts = [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    if job.spec.output.persistent_volume_claim:
        mounts.append({"name": "output", "mountPath": job.spec.output.uri})
    image = job.spec.image or config.trainer_image(placement.kind)
    container = {
        "name": "trainer",
        "image": image,
        "command": ["posttrain", "train", "--config", CONFIG_FILE],
        # POSTTRAIN_IMAGE: named by the trainer's device check when JAX sees other devices.
        "env": [
            *_trainer_env(job, placement, pathways_head),
            {"name": "POSTTRAIN_IMAGE", "value": image},
            *(
                [{"name": functions.ALLOWED_ENV, "value": config.allowed_function_modules}]
                if config.allowed_function_modules
                else []
            ),
            *_tracking_env(job, config),
            *_service_auth_env(job),
        ],
        "ports": [{"name": "jax", "containerPort": names.JAX_COORDINATOR_PORT}],
        "volumeMounts": mounts,
    }
    if resources := _resources(job, placement, with_devices=pathways_head is None):
        container["resources"] = resources
    return container


def _volumes(job: PostTrainJob) -> list[dict[str, Any]]:
    # The trainer's config, from its pod's own annotation (trainer_config).
    config = {"path": CONFIG_FILE_NAME, "fieldRef": {"fieldPath": _annotation(CONFIG_ANNOTATION)}}
    vols: list[dict[str, Any]] = [{"name": "config", "downwardAPI": {"items": [config]}}]
    if claim := job.spec.output.persistent_volume_claim:
        vols.append({"name": "output", "persistentVolumeClaim": {"claimName": claim}})
    return vols


def _placement_fields(placement: Placement) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if placement.node_selector:
        fields["nodeSelector"] = dict(placement.node_selector)
    if placement.resource_name:
        fields["tolerations"] = [
            {"key": placement.resource_name, "operator": "Exists", "effect": "NoSchedule"}
        ]
    return fields


def _pod_failure_policy(container: str | None) -> dict[str, Any]:
    rules: list[dict[str, Any]] = []
    if container:
        rules.append(
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": container,
                    "operator": "In",
                    "values": [USER_ERROR_EXIT_CODE],
                },
            }
        )
    rules.append({"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]})
    return {"rules": rules}


def _replicated_job(
    job: PostTrainJob,
    shape: names.ReplicatedJobShape,
    pod_spec: dict,
    trainer_container: str | None,
) -> dict[str, Any]:
    pod_meta: dict[str, Any] = {"labels": common_labels(job)}
    if trainer_container:  # its config, mounted by _volumes
        pod_meta["annotations"] = {CONFIG_ANNOTATION: config_text(job)}
    return {
        "name": shape.name,
        "replicas": shape.replicas,
        "template": {
            "metadata": {"labels": common_labels(job)},
            "spec": {
                "parallelism": shape.pods,
                "completions": shape.pods,
                "completionMode": "Indexed",
                "backoffLimit": 0,
                "podFailurePolicy": _pod_failure_policy(trainer_container),
                "template": {
                    "metadata": pod_meta,
                    "spec": {"restartPolicy": "Never", **pod_spec},
                },
            },
        },
    }


def _pod_common(job: PostTrainJob, *, service_account: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if service_account:
        spec["serviceAccountName"] = names.TRAINER_SERVICE_ACCOUNT
    if job.spec.scheduling.priority_class:
        spec["priorityClassName"] = job.spec.scheduling.priority_class
    return spec


def _direct_jobs(job: PostTrainJob, placement: Placement, config: RenderConfig) -> list[dict]:
    (shape,) = names.replicated_jobs(job.spec, placement)
    pod = {
        **_pod_common(job),
        **_placement_fields(placement),
        "containers": [_trainer_container(job, placement, config, None)],
        "volumes": _volumes(job),
    }
    rjob = _replicated_job(job, shape, pod, "trainer")
    if placement.kind == "gpu":
        gpu.decorate(rjob["template"]["spec"]["template"], placement, job.spec.resources.nodes)
    if placement.is_tpu:
        tpu.decorate(
            rjob["template"]["spec"]["template"], use_host_network=job.spec.resources.host_network
        )
    return [rjob]


def _pathways_jobs(job: PostTrainJob, placement: Placement, config: RenderConfig) -> list[dict]:
    spec = job.spec
    res = spec.resources
    head_shape, worker_shape = names.replicated_jobs(spec, placement)
    js = names.jobset_name(job.metadata.name)
    head = f"{names.pod_hostname(js, head_shape.name, 0, 0)}.{js}"
    scratch = res.pathways.gcs_scratch_location or (
        spec.output.uri.rstrip("/") + "/pathways-scratch"
    )
    server_image = res.pathways.server_image or config.pathways_server_image
    trainer = _trainer_container(job, placement, config, head)
    trainer["resources"] = pathways.trainer_resources(res.cpu, res.memory)
    head_pod = {
        **_pod_common(job),
        "nodeSelector": pathways.head_node_selector(
            res.pathways.head_node_pool or config.pathways_head_node_pool
        ),
        **tpu.host_network(res.host_network),
        "initContainers": pathways.head_sidecars(
            server_image=server_image,
            proxy_image=res.pathways.proxy_image or config.pathways_proxy_image,
            head=head,
            slices=res.slices,
            instance_type=placement.pathways_instance_type,
            scratch=scratch,
        ),
        "containers": [trainer],
        "volumes": _volumes(job),
    }
    worker_pod = {
        **_pod_common(job, service_account=False),
        **_placement_fields(placement),
        "containers": [
            pathways.worker_container(
                server_image=server_image,
                head=head,
                scratch=scratch,
                placement=placement,
                megascale_env=_megascale_env(res.slices, head),
            )
        ],
    }
    head_job = _replicated_job(job, head_shape, head_pod, "trainer")
    worker_job = _replicated_job(job, worker_shape, worker_pod, None)
    tpu.decorate(worker_job["template"]["spec"]["template"], use_host_network=res.host_network)
    pathways.restart_workers_in_place(worker_job, worker_shape.pods)
    pathways.exclusive(head_job, pathways.HEAD_EXCLUSIVE)
    pathways.exclusive(worker_job, pathways.WORKER_EXCLUSIVE)
    return [head_job, worker_job]


def render_jobset(job: PostTrainJob, placement: Placement, config: RenderConfig) -> dict:
    """The JobSet manifest for a valid job (see `posttrain.checks.validate`)."""
    spec = job.spec
    use_pathways = placement.is_tpu and spec.resources.pathways.enabled
    labels: dict[str, str] = {}
    if queue := spec.scheduling.queue or config.default_queue:
        labels[KUEUE_QUEUE_LABEL] = queue
    if spec.scheduling.workload_priority_class:
        labels[KUEUE_PRIORITY_LABEL] = spec.scheduling.workload_priority_class
    meta = object_meta(job, names.jobset_name(job.metadata.name), labels)
    if placement.is_tpu and not use_pathways:  # Pathways: per replicated job
        meta["annotations"] = {EXCLUSIVE_TOPOLOGY: NODEPOOL_LABEL}
    split = rollout_split.describe(spec, rollout_split.job_devices(job, placement))
    if split is not None:  # the slices reserved hold the trainer's and the sampler's
        meta.setdefault("annotations", {})[rollout_split.ANNOTATION] = split
    jobs = (_pathways_jobs if use_pathways else _direct_jobs)(job, placement, config)
    first = jobs[0]["name"]
    jobset_spec: dict[str, Any] = {
        "suspend": spec.scheduling.suspend,
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "coordinator": {"replicatedJob": first, "jobIndex": 0, "podIndex": 0},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [first]}
        if use_pathways
        else {"operator": "All"},
        "failurePolicy": {
            "maxRestarts": spec.scheduling.max_restarts,
            "rules": [
                {
                    "name": "UserError",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                    "onJobFailureMessagePatterns": [USER_ERROR_PATTERN],
                },
                {
                    "name": "Preemption",
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                    "onJobFailureMessagePatterns": [DISRUPTION_PATTERN],
                },
            ],
        },
        "replicatedJobs": jobs,
    }
    if use_pathways:
        jobset_spec["startupPolicy"] = dict(pathways.STARTUP_POLICY)
    if spec.scheduling.ttl_seconds_after_finished is not None:
        jobset_spec["ttlSecondsAfterFinished"] = spec.scheduling.ttl_seconds_after_finished
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": meta,
        "spec": jobset_spec,
    }


def scheduling_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JobSet merge patch for a change of the mutable spec.scheduling fields (wire
    names); empty when nothing the JobSet carries changed."""
    patch: dict[str, Any] = {}
    if bool(old.get("suspend")) != bool(new.get("suspend")):
        patch.setdefault("spec", {})["suspend"] = bool(new.get("suspend"))
    if old.get("ttlSecondsAfterFinished") != new.get("ttlSecondsAfterFinished"):
        patch.setdefault("spec", {})["ttlSecondsAfterFinished"] = new.get("ttlSecondsAfterFinished")
    if old.get("workloadPriorityClass") != new.get("workloadPriorityClass"):
        patch["metadata"] = {"labels": {KUEUE_PRIORITY_LABEL: new.get("workloadPriorityClass")}}
    return patch
