"""Cross-field rules of PostTrainJobSpec, written once and enforced twice.

Each rule carries a CEL expression (put into the CRD, so the API server refuses a bad
object at `kubectl apply`) and the same check in Python (so `posttrain validate` and
`posttrain run` refuse it without a cluster). A test holds the two in step by sending
every bad example to a real API server.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from posttrain.api.spec import EVAL_METRICS, PostTrainJobSpec, RewardSpec

TPU_NAME_CEL = r"^(v4|v5e|v5litepod|v5p|v6e|tpu7x)-[0-9]+$"


@dataclass(frozen=True)
class Rule:
    field: str  # path under the object the rule is on, e.g. "training.warmupSteps"
    cel: str  # evaluated with self = that object
    check: Callable[..., bool]  # the same check in Python: True when valid
    message: str
    # A message that shows the values, as CEL (the CRD's messageExpression; `message`
    # stays the API server's fallback) and in Python: the same text from both. CEL's
    # string() of a field is refused by the API server's cost estimate; format() (the
    # strings library, Kubernetes 1.30 on) is not.
    message_cel: str | None = None
    detail: Callable[..., str] | None = None

    def message_for(self, obj: object) -> str:
        return self.detail(obj) if self.detail else self.message


def _only_with_its_technique(section: str) -> Rule:
    """spec.<section> (a technique's settings) only when spec.technique is that technique."""
    return Rule(
        section,
        f"!has(self.{section}) || self.technique == '{section}'",
        lambda s: getattr(s, section) is None or s.technique == section,
        f"spec.{section} is only allowed when spec.technique is {section}",
    )


def _needed_by_its_technique(section: str, what: str) -> Rule:
    """Technique <section> needs its spec.<section> settings."""
    return Rule(
        section,
        f"self.technique != '{section}' || has(self.{section})",
        lambda s: s.technique != section or getattr(s, section) is not None,
        f"technique {section} needs a spec.{section} block with {what}",
    )


def _is_tpu(spec: PostTrainJobSpec) -> bool:
    return re.fullmatch(TPU_NAME_CEL.strip("^$"), spec.resources.accelerator) is not None


def _disaggregated(spec: PostTrainJobSpec) -> bool:
    return spec.grpo is not None and spec.grpo.rollout.placement == "disaggregated"


RULES: list[Rule] = [
    _only_with_its_technique("grpo"),
    _needed_by_its_technique("grpo", "at least one reward"),
    _only_with_its_technique("dpo"),
    _only_with_its_technique("distill"),
    _needed_by_its_technique("distill", "a teacher"),
    Rule(
        "grpo.epsilonHigh",
        "!has(self.grpo) || !has(self.grpo.epsilonHigh) || "
        "self.grpo.epsilonHigh >= self.grpo.epsilon",
        lambda s: (
            s.grpo is None or s.grpo.epsilon_high is None or s.grpo.epsilon_high >= s.grpo.epsilon
        ),
        "grpo.epsilonHigh (the upper clip) must be at least grpo.epsilon",
    ),
    Rule(
        "grpo.rolloutEngine",
        "!has(self.grpo) || self.grpo.rolloutEngine != 'vllm'",
        lambda s: s.grpo is None or s.grpo.rollout_engine != "vllm",
        "grpo.rolloutEngine vllm is not available yet: no vLLM build matches the trainer "
        "image's JAX (vllm with tpu-inference pins its own jax); use vanilla (Tunix's JAX "
        "sampler)",
    ),
    Rule(
        "grpo.rollout",
        "!has(self.grpo) || self.grpo.rollout.placement != 'disaggregated' || "
        "has(self.grpo.rollout.samplerFraction) != has(self.grpo.rollout.samplerSlices)",
        lambda s: (
            not _disaggregated(s)
            or (s.grpo.rollout.sampler_fraction is None) != (s.grpo.rollout.sampler_slices is None)
        ),
        "grpo.rollout: placement disaggregated needs one of samplerFraction (a share of the "
        "devices) or samplerSlices (whole slices)",
    ),
    Rule(
        "grpo.rollout",
        "!has(self.grpo) || self.grpo.rollout.placement == 'disaggregated' || "
        "(!has(self.grpo.rollout.samplerFraction) && !has(self.grpo.rollout.samplerSlices))",
        lambda s: (
            s.grpo is None
            or _disaggregated(s)
            or (s.grpo.rollout.sampler_fraction is None and s.grpo.rollout.sampler_slices is None)
        ),
        "grpo.rollout: samplerFraction and samplerSlices apply to placement disaggregated",
    ),
    Rule(
        "grpo.rollout.samplerSlices",
        "!has(self.grpo) || !has(self.grpo.rollout.samplerSlices) || "
        "self.grpo.rollout.samplerSlices < self.resources.slices",
        lambda s: (
            s.grpo is None
            or s.grpo.rollout.sampler_slices is None
            or s.grpo.rollout.sampler_slices < s.resources.slices
        ),
        "grpo.rollout.samplerSlices must leave the trainer at least one of resources.slices",
    ),
    Rule(
        "grpo.rollout.samplerFraction",
        "!has(self.grpo) || !has(self.grpo.rollout.samplerFraction) || self.resources.slices == 1",
        lambda s: (
            s.grpo is None or s.grpo.rollout.sampler_fraction is None or s.resources.slices == 1
        ),
        "grpo.rollout.samplerFraction splits one slice; with resources.slices above 1 the "
        "sampler takes whole slices: use samplerSlices",
    ),
    Rule(
        "grpo.maxStaleness",
        "!has(self.grpo) || self.grpo.maxStaleness == 0 || "
        "self.grpo.rollout.placement == 'disaggregated'",
        lambda s: s.grpo is None or s.grpo.max_staleness == 0 or _disaggregated(s),
        "grpo.maxStaleness above 0 needs grpo.rollout.placement disaggregated (a colocated "
        "sampler samples with the very weights the trainer updates)",
    ),
    Rule(
        "output.exportHF",
        "self.output.exportHF != 'adapter' || has(self.lora)",
        lambda s: s.output.export_hf != "adapter" or s.lora is not None,
        "exportHF adapter needs spec.lora (a full fine-tune has no adapter; use merged)",
    ),
    Rule(
        "output.uri",
        "!has(self.output.persistentVolumeClaim) || self.output.uri.startsWith('/')",
        lambda s: s.output.persistent_volume_claim is None or s.output.uri.startswith("/"),
        "with output.persistentVolumeClaim, output.uri must be the absolute mount path",
    ),
    Rule(
        "checkpoint.keepBest",
        "!has(self.checkpoint.keepBest) || has(self.eval)",
        lambda s: s.checkpoint.keep_best is None or s.eval is not None,
        "checkpoint.keepBest needs spec.eval (the held-out metric it keeps the best of)",
    ),
    Rule(
        "checkpoint.keepBest",
        "!has(self.checkpoint.keepBest) || "
        + " || ".join(
            f"(self.technique == '{t}' && self.checkpoint.keepBest in {list(m)})"
            for t, m in EVAL_METRICS.items()
        ),
        lambda s: (
            s.checkpoint.keep_best is None
            or str(s.checkpoint.keep_best) in EVAL_METRICS[str(s.technique)]
        ),
        "checkpoint.keepBest must be a metric the technique reports: "
        + "; ".join(f"{t}: {', '.join(m)}" for t, m in EVAL_METRICS.items()),
    ),
    Rule(
        "output.exportFrom",
        "self.output.exportFrom != 'best' || has(self.checkpoint.keepBest)",
        lambda s: s.output.export_from != "best" or s.checkpoint.keep_best is not None,
        "output.exportFrom best needs checkpoint.keepBest",
    ),
    Rule(
        "training.warmupSteps",
        "self.training.warmupSteps < self.training.steps",
        lambda s: s.training.warmup_steps < s.training.steps,
        "training.warmupSteps must be less than training.steps",
        "'training.warmupSteps (%d) must be less than training.steps (%d)'"
        ".format([self.training.warmupSteps, self.training.steps])",
        lambda s: (
            f"training.warmupSteps ({s.training.warmup_steps}) must be less than "
            f"training.steps ({s.training.steps})"
        ),
    ),
    Rule(
        "training.gradientAccumulation",
        "self.training.batchSize % self.training.gradientAccumulation == 0",
        lambda s: s.training.batch_size % s.training.gradient_accumulation == 0,
        "training.batchSize must be a multiple of training.gradientAccumulation",
    ),
    Rule(
        "resources.pathways",
        f"!self.resources.pathways.enabled || self.resources.accelerator.matches('{TPU_NAME_CEL}')",
        lambda s: not s.resources.pathways.enabled or _is_tpu(s),
        "resources.pathways needs a TPU accelerator",
    ),
    Rule(
        "resources.pathways",
        "!self.resources.pathways.enabled || has(self.resources.pathways.gcsScratchLocation)"
        " || self.output.uri.startsWith('gs://')",
        lambda s: (
            not s.resources.pathways.enabled
            or s.resources.pathways.gcs_scratch_location is not None
            or s.output.uri.startswith("gs://")
        ),
        "Pathways needs a gs:// scratch location: set resources.pathways.gcsScratchLocation"
        " or a gs:// output.uri",
    ),
    Rule(
        "resources.slices",
        f"self.resources.slices == 1 || self.resources.accelerator.matches('{TPU_NAME_CEL}')",
        lambda s: s.resources.slices == 1 or _is_tpu(s),
        "resources.slices above 1 needs a TPU accelerator (use resources.nodes for GPU/CPU)",
    ),
    Rule(
        "training.attention",
        "self.training.attention != 'flash' || self.resources.accelerator != 'cpu'",
        lambda s: s.training.attention != "flash" or s.resources.accelerator != "cpu",
        "training.attention flash needs a TPU or GPU accelerator (use auto or dense on cpu)",
    ),
    Rule(
        "training.layerLoop",
        "self.training.layerLoop != 'scan' || !has(self.grpo)",
        lambda s: s.training.layer_loop != "scan" or s.grpo is None,
        "training.layerLoop scan is not for grpo (its rollouts decode with a KV cache per "
        "layer; use auto or unroll)",
    ),
    Rule(
        "training.layerLoop",
        "self.training.layerLoop != 'scan' || !(self.model.family in ['gemma2', 'gemma3'])",
        lambda s: s.training.layer_loop != "scan" or s.model.family not in ("gemma2", "gemma3"),
        "training.layerLoop scan needs layers alike (llama3, qwen2, qwen3); Gemma's "
        "alternate local and global attention (use auto or unroll)",
    ),
    Rule(
        "resources.gpusPerNode",
        "!has(self.resources.gpusPerNode) || self.resources.accelerator.startsWith('nvidia-')",
        lambda s: (
            s.resources.gpus_per_node is None or s.resources.accelerator.startswith("nvidia-")
        ),
        "resources.gpusPerNode applies to nvidia-* accelerators only",
    ),
    Rule(
        "network.restrictEgress",
        "!has(self.network) || !self.network.restrictEgress || !self.resources.hostNetwork || "
        f"!self.resources.accelerator.matches('{TPU_NAME_CEL}')",
        lambda s: (
            s.network is None
            or not s.network.restrict_egress
            or not s.resources.host_network
            or not _is_tpu(s)
        ),
        "network.restrictEgress on a TPU needs resources.hostNetwork: false (pods on their "
        "node's network are outside NetworkPolicies)",
    ),
    Rule(
        "resources.nodes",
        f"self.resources.nodes == 1 || !self.resources.accelerator.matches('{TPU_NAME_CEL}')",
        lambda s: s.resources.nodes == 1 or not _is_tpu(s),
        "resources.nodes is for GPU/CPU; a TPU slice's host count comes from its size",
    ),
    Rule(
        "data.source",
        "has(self.data.source) != has(self.data.sources)",
        lambda s: (s.data.source is None) != (s.data.sources is None),
        "set exactly one of spec.data.source and spec.data.sources",
    ),
    Rule(
        "data.columns.images",
        "!has(self.data.columns) || !has(self.data.columns.images) || self.technique == 'sft'",
        lambda s: s.data.columns.images is None or s.technique == "sft",
        "images (spec.data.columns.images) are only supported with spec.technique sft",
    ),
    Rule(
        "data.columns.images",
        "!has(self.data.columns) || !has(self.data.columns.images) || "
        "!has(self.model.family) || self.model.family in ['auto', 'gemma3']",
        lambda s: s.data.columns.images is None or s.model.family in ("auto", "gemma3"),
        "images (spec.data.columns.images) need a model with a vision tower: "
        "spec.model.family gemma3 (a Gemma3ForConditionalGeneration checkpoint)",
    ),
    Rule(
        "training.trainVisionTower",
        "!self.training.trainVisionTower || (has(self.data.columns) && "
        "has(self.data.columns.images))",
        lambda s: not s.training.train_vision_tower or s.data.columns.images is not None,
        "training.trainVisionTower needs images (spec.data.columns.images)",
    ),
    Rule(
        "training.trainVisionTower",
        "!self.training.trainVisionTower || !has(self.lora)",
        lambda s: not s.training.train_vision_tower or s.lora is None,
        "training.trainVisionTower is for a full fine-tune; LoRA (spec.lora) adapts the "
        "language model only",
    ),
    Rule(
        "eval.samples",
        "!has(self.eval) || self.eval.samples == 0 || !has(self.data.columns) || "
        "!has(self.data.columns.images)",
        lambda s: s.eval is None or s.eval.samples == 0 or s.data.columns.images is None,
        "eval.samples: sample generations do not see images yet; set eval.samples: 0 with "
        "spec.data.columns.images (the held-out loss does see them)",
    ),
    Rule(
        "tracking",
        "!has(self.tracking) || has(self.tracking.mlflow) || has(self.tracking.wandb)",
        lambda s: (
            s.tracking is None or s.tracking.mlflow is not None or s.tracking.wandb is not None
        ),
        "tracking needs mlflow, wandb or both",
    ),
    Rule(
        "tracking.mlflow",
        "!has(self.tracking) || !has(self.tracking.mlflow) || "
        "has(self.tracking.mlflow.usernameSecret) == has(self.tracking.mlflow.passwordSecret)",
        lambda s: (
            s.tracking is None
            or s.tracking.mlflow is None
            or (s.tracking.mlflow.username_secret is None)
            == (s.tracking.mlflow.password_secret is None)
        ),
        "tracking.mlflow: basic auth needs both usernameSecret and passwordSecret",
    ),
    Rule(
        "tracking.mlflow",
        "!has(self.tracking) || !has(self.tracking.mlflow) || "
        "!has(self.tracking.mlflow.tokenSecret) || !has(self.tracking.mlflow.usernameSecret)",
        lambda s: (
            s.tracking is None
            or s.tracking.mlflow is None
            or s.tracking.mlflow.token_secret is None
            or s.tracking.mlflow.username_secret is None
        ),
        "tracking.mlflow: tokenSecret or usernameSecret/passwordSecret, not both",
    ),
]


# The longest job name for each layout (posttrain.render.names.max_name_length: JobSet's
# coordinator label `<name>-<replicatedJob>-0-0.<name>` is a label value, at most 63).
NAME_MAX, NAME_MAX_PATHWAYS = 26, 22
NAME_CEL = (
    f"size(self.metadata.name) <= (self.spec.resources.pathways.enabled ? "
    f"{NAME_MAX_PATHWAYS} : {NAME_MAX})"
)
NAME_MESSAGE = (
    f"metadata.name may have at most {NAME_MAX} characters ({NAME_MAX_PATHWAYS} with "
    "Pathways): JobSet labels every pod with its coordinator's address "
    "`<name>-<replicatedJob>-0-0.<name>`, a label value of at most 63 characters"
)


# Rules on each entry of spec.grpo.rewards.
REWARD_RULES: list[Rule] = [
    Rule(
        "function",
        "self.type != 'python' || has(self.function)",
        lambda r: r.type != "python" or r.function is not None,
        "a python reward needs function (module:callable)",
    ),
    Rule(
        "pattern",
        "self.type != 'regexFormat' || has(self.pattern)",
        lambda r: r.type != "regexFormat" or r.pattern is not None,
        "a regexFormat reward needs pattern",
    ),
    Rule(
        "targetLength",
        "self.type != 'lengthPenalty' || has(self.targetLength)",
        lambda r: r.type != "lengthPenalty" or r.target_length is not None,
        "a lengthPenalty reward needs targetLength (tokens)",
    ),
    Rule(
        "http",
        "self.type == 'http' ? has(self.http) : !has(self.http)",
        lambda r: (r.type == "http") == (r.http is not None),
        "an http reward needs http (url of the verifier service); other rewards take none",
    ),
]


# Rules on spec.grpo.agent and on each of its tools.
AGENT_RULES: list[Rule] = [
    Rule(
        "tools",
        "self.maxTurns <= 1 || (has(self.tools) && size(self.tools) > 0)",
        lambda a: a.max_turns <= 1 or len(a.tools) > 0,
        "maxTurns above 1 needs tools (a turn without a tool call ends the episode)",
    ),
    Rule(
        "tools",
        "!has(self.tools) || self.tools.all(t, self.tools.exists_one(u, u.name == t.name))",
        lambda a: len({t.name for t in a.tools}) == len(a.tools),
        "tool names must be unique",
    ),
]
TOOL_RULES: list[Rule] = [
    Rule(
        "http",
        "self.type == 'http' ? has(self.http) : !has(self.http)",
        lambda t: (t.type == "http") == (t.http is not None),
        "an http tool needs http (url of its service); other tools take none",
    ),
    Rule(
        "function",
        "self.type == 'python' ? has(self.function) : !has(self.function)",
        lambda t: (t.type == "python") == (t.function is not None),
        "a python tool needs function (module:callable); other tools take none",
    ),
    Rule(
        "description",
        "self.type == 'calculator' || has(self.description)",
        lambda t: t.type == "calculator" or t.description is not None,
        "an http or python tool needs a description (shown to the model)",
    ),
    Rule(
        "parameters",
        "self.type == 'calculator' || has(self.parameters)",
        lambda t: t.type == "calculator" or t.parameters is not None,
        "an http or python tool needs parameters (a JSON schema object)",
    ),
]


def errors(spec: PostTrainJobSpec) -> list[tuple[str, str]]:
    """(field path, message) for every rule the spec breaks."""
    out = [(f"spec.{r.field}", r.message_for(spec)) for r in RULES if not r.check(spec)]
    rewards: list[RewardSpec] = spec.grpo.rewards if spec.grpo else []
    for i, reward in enumerate(rewards):
        out += [
            (f"spec.grpo.rewards[{i}].{r.field}", r.message_for(reward))
            for r in REWARD_RULES
            if not r.check(reward)
        ]
    agent = spec.grpo.agent if spec.grpo else None
    if agent is not None:
        out += [
            (f"spec.grpo.agent.{r.field}", r.message_for(agent))
            for r in AGENT_RULES
            if not r.check(agent)
        ]
        for i, tool in enumerate(agent.tools):
            out += [
                (f"spec.grpo.agent.tools[{i}].{r.field}", r.message_for(tool))
                for r in TOOL_RULES
                if not r.check(tool)
            ]
    return out


# Fields of spec that cannot change once the job exists (a running job would silently
# diverge from its spec; JobSet's own failurePolicy, where maxRestarts goes, cannot
# change either). Everything else in scheduling may change: suspend, priority, ttl.
IMMUTABLE: list[str] = [
    "technique",
    "model",
    "lora",
    "data",
    "training",
    "grpo",
    "dpo",
    "distill",
    "eval",
    "checkpoint",
    "output",
    "resources",
    "image",
    "hfTokenSecret",
    "tracking",
    "network",
    "preflight",
    "scheduling.queue",
    "scheduling.priorityClass",
    "scheduling.maxRestarts",
]


def immutable_cel(path: str) -> str:
    """A CEL expression of the admission policy (`crd.immutable_fields_policy`) that holds
    when spec.`path` was neither set, removed nor changed by an update."""
    parts = path.split(".")

    def present(root: str) -> str:
        has = [f"has({root}.spec.{'.'.join(parts[: i + 1])})" for i in range(len(parts))]
        return has[0] if len(has) == 1 else f"({' && '.join(has)})"

    new, old = present("object"), present("oldObject")
    return f"{new} == {old} && (!{new} || object.spec.{path} == oldObject.spec.{path})"


def immutable_message(path: str) -> str:
    return f"spec.{path} cannot change after the job is created; create a new PostTrainJob"
