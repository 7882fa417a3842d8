"""Hostile PostTrainJobs: what a careless or malicious user might submit.

Shared by the unit tier (`posttrain validate` must refuse each, naming `field`) and the
integration tier (the real API server with the CRD and the admission webhook must agree
with validate case by case: the same accept/refuse, the same field named). A case with
field None is a valid job at an edge, which both must accept.

A case is a change to a valid job (`mutate`) or, for what only YAML can say (merge
keys, quoted scalars, anchors), the YAML text itself (`text`), which the integration
tier sends through kubectl as is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from invalid_jobs import _all as both
from invalid_jobs import _set as put
from invalid_jobs import valid_job

from posttrain.api.documents import parse_documents

Mutation = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Hostile:
    id: str
    field: str | None  # the field the error names; None: a valid job both must accept
    mutate: Mutation | None = None
    text: str | None = None  # YAML for cases only YAML can express; NAME is replaced

    def doc(self, name: str = "hostile") -> Any:
        if self.text is not None:
            (doc,) = parse_documents(self.yaml(name).encode())
            return doc
        d = copy.deepcopy(valid_job(name))
        assert self.mutate is not None
        self.mutate(d)
        return d

    def yaml(self, name: str = "hostile") -> str:
        assert self.text is not None
        return self.text.replace("NAME", name)


def grpo(*rewards: dict[str, Any], **settings: Any) -> Mutation:
    return both(
        put("spec.technique", "grpo"),
        put("spec.grpo", {"rewards": list(rewards) or [{"type": "exactAnswer"}], **settings}),
    )


FUNCTION = "spec.grpo.rewards[0].function"


def python_reward(function: str) -> Mutation:
    return grpo({"type": "python", "function": function})


def regex_reward(pattern: str) -> Mutation:
    return grpo({"type": "regexFormat", "pattern": pattern})


VERIFIER_URL = "spec.grpo.rewards[0].http.url"
TOOL_URL = "spec.grpo.agent.tools[0].http.url"


def verifier(url: str) -> Mutation:
    return grpo({"type": "http", "http": {"url": url}})


def http_tool(url: str, name: str = "capital", **http: Any) -> Mutation:
    tool = {
        "name": name,
        "type": "http",
        "description": "The capital of a country.",
        "parameters": {"type": "object"},
        "http": {"url": url, **http},
    }
    return grpo({"type": "exactAnswer"}, agent={"maxTurns": 2, "tools": [tool]})


def lora(**settings: Any) -> Mutation:
    return put("spec.lora", settings)


def tpu(accelerator: str, **resources: Any) -> Mutation:
    return put("spec.resources", {"accelerator": accelerator, **resources})


def name_of_length(length: int) -> Mutation:
    """metadata.name padded to `length`, keeping its unique tail (the integration tier
    creates every case under its own name)."""

    def mutate(doc: dict[str, Any]) -> None:
        tail = doc["metadata"]["name"][-6:]
        doc["metadata"]["name"] = ("n" + "x" * length)[: length - len(tail)] + tail

    return mutate


def near_config_limit(margin: int) -> Mutation:
    """Reward patterns, a chat template and an output URI of emoji (12 bytes each as
    JSON, \\ud83d\\ude00) that bring the trainer config `margin` bytes under its limit
    as read from a file, with no namespace and no UID (a cluster adds both)."""

    def size(doc: dict[str, Any]) -> int:
        from posttrain.api.spec import PostTrainJob
        from posttrain.render.trainer_config import CONFIG_ANNOTATION, config_text

        job = PostTrainJob.model_validate(doc)
        return len(CONFIG_ANNOTATION) + len(config_text(job).encode())

    def mutate(doc: dict[str, Any]) -> None:
        from posttrain.render.trainer_config import CONFIG_MAX_BYTES

        emoji = "\U0001f600"
        grpo(*[{"type": "regexFormat", "pattern": emoji * 1024} for _ in range(16)])(doc)
        # Names of 50 emoji (200 bytes): a file name holds at most 255.
        doc["spec"]["data"]["chatTemplate"] = "/t" + f"/{emoji * 50}" * 40
        doc["spec"]["output"]["uri"] = "/o"
        short = CONFIG_MAX_BYTES - margin - size(doc)
        uri = "/o"
        while short > 0:  # "/" is 1 byte as JSON, an emoji 12, "a" 1
            uri, short = uri + "/", short - 1
            k = min(50, short // 12)
            uri, short = uri + emoji * k, short - 12 * k
            if k < 50:
                uri, short = uri + "a" * short, 0
        doc["spec"]["output"]["uri"] = uri

    return mutate


# Local model directories whose config.json is no model's config.
MODELS = Path(__file__).resolve().parent / "hostile_models"
PATHWAYS = {"enabled": True, "gcsScratchLocation": "gs://bucket/scratch"}
H = Hostile
MODEL, DATA, OUT = "spec.model.source", "spec.data.source", "spec.output.uri"
BATCH, STEPS = "spec.training.batchSize", "spec.training.steps"
TARGETS, PATTERN = "spec.lora.targetModules", "spec.grpo.rewards[0].pattern"
ACCEL, SCHED = "spec.resources.accelerator", "spec.scheduling"

META = """apiVersion: posttrain.dev/v1alpha1
kind: PostTrainJob
metadata: {name: NAME}
spec:
"""
REST = """  data: {source: /data/train.jsonl}
  output: {uri: /outputs/run}
"""
SPEC = META + "  model: {source: /models/tiny}\n" + REST

CASES: list[Hostile] = [
    # -- strict types: the CRD coerces nothing, so neither does validate --------------
    H("steps-quoted", STEPS, put(STEPS, "100")),
    H("batch-quoted", BATCH, put(BATCH, "8")),
    H("lr-quoted", "spec.training.learningRate", put("spec.training.learningRate", "1e-4")),
    H("packing-quoted", "spec.data.packing", put("spec.data.packing", "true")),
    H("shuffle-yes-string", "spec.data.shuffle", put("spec.data.shuffle", "yes")),
    H("suspend-int", f"{SCHED}.suspend", put(f"{SCHED}.suspend", 1)),
    H("async-quoted", "spec.checkpoint.async", put("spec.checkpoint", {"async": "false"})),
    H("rank-quoted", "spec.lora.rank", lora(rank="16")),
    H("rank-fraction", "spec.lora.rank", lora(rank=16.5)),
    H("steps-bool", STEPS, put(STEPS, True)),
    H("steps-list", STEPS, put(STEPS, [10])),
    H("steps-null-object", STEPS, put(STEPS, {"value": 10})),
    H("model-source-int", MODEL, put(MODEL, 42)),
    H("technique-int", "spec.technique", put("spec.technique", 1)),
    H("technique-caps", "spec.technique", put("spec.technique", "SFT")),
    H("dtype-bf16", "spec.model.dtype", put("spec.model.dtype", "bf16")),
    H("labels-int", "metadata.labels.team", put("metadata.labels", {"team": 7})),
    # -- metadata as the API server checks it --------------------------------------------
    H("label-key-with-space", "metadata.labels", put("metadata.labels", {"bad key": "x"})),
    H("label-key-bad-prefix", "metadata.labels", put("metadata.labels", {"Ex_ample/k": "x"})),
    H("label-value-64", "metadata.labels", put("metadata.labels", {"team": "a" * 64})),
    H("label-value-slash", "metadata.labels", put("metadata.labels", {"team": "a/b"})),
    H("labels-ok", None, put("metadata.labels", {"example.com/team": "a_b.c-1", "empty": ""})),
    H("annotation-key-bang", "metadata.annotations", put("metadata.annotations", {"a!": "x"})),
    H(
        "annotations-over-256k",
        "metadata.annotations",
        put("metadata.annotations", {"a": "x" * 140_000, "b": "y" * 140_000}),
    ),
    H("annotation-value-free", None, put("metadata.annotations", {"note": "any text; at all\n"})),
    H("alpha-string", "spec.lora.alpha", lora(alpha="32")),
    H("weight-string", "spec.grpo.rewards[0].weight", grpo({"type": "exactAnswer", "weight": "2"})),
    H("columns-list", "spec.data.columns", put("spec.data.columns", ["prompt"])),
    H("rewards-object", "spec.grpo.rewards", grpo(rewards={"type": "exactAnswer"})),
    # -- camelCase only: snake_case is an unknown field to the CRD -------------------
    H("snake-batch-size", "spec.training.batch_size", put("spec.training.batch_size", 4)),
    H("snake-learning-rate", "spec.training.learning_rate", put("spec.training.learning_rate", 1)),
    H("snake-max-length", "spec.data.max_length", put("spec.data.max_length", 64)),
    H("snake-target-modules", "spec.lora.target_modules", lora(target_modules="q_proj")),
    H("snake-hf-token", "spec.hf_token_secret", put("spec.hf_token_secret", {"name": "hf"})),
    H("snake-export", "spec.output.export_hf", put("spec.output.export_hf", "merged")),
    H("snake-queue-block", f"{SCHED}.max_restarts", put(f"{SCHED}.max_restarts", 1)),
    H("lower-exporthf", "spec.output.exporthf", put("spec.output.exporthf", "merged")),
    H("async-underscore", "spec.checkpoint.async_", put("spec.checkpoint", {"async_": True})),
    H("unknown-top-level", "spec.extra", put("spec.extra", 1)),
    H(
        "unknown-nested-reward",
        "spec.grpo.rewards[0].code",
        grpo({"type": "python", "function": "m:f", "code": "x"}),
    ),  # fmt: skip
    # -- bounds the CRD has, and the ones it lacked ------------------------------------
    H("steps-2-63", STEPS, put(STEPS, 2**63 - 1)),
    H("steps-above-max", STEPS, put(STEPS, 10_000_001)),
    H("batch-zero", BATCH, put(BATCH, 0)),
    H("batch-negative", BATCH, put(BATCH, -8)),
    H("warmup-huge", "spec.training.warmupSteps", put("spec.training.warmupSteps", 2**40)),
    H("seed-2-63", "spec.training.seed", put("spec.training.seed", 2**63 - 1)),
    H("seed-negative", "spec.training.seed", put("spec.training.seed", -1)),
    H("log-every-huge", "spec.training.logEverySteps", put("spec.training.logEverySteps", 2**40)),
    H(
        "every-steps-huge",
        "spec.checkpoint.everySteps",
        put("spec.checkpoint", {"everySteps": 2**40}),
    ),  # fmt: skip
    H("keep-huge", "spec.checkpoint.keep", put("spec.checkpoint", {"keep": 100000})),
    H("lr-huge", "spec.training.learningRate", put("spec.training.learningRate", 1e300)),
    H("lr-negative", "spec.training.learningRate", put("spec.training.learningRate", -0.1)),
    H("weight-decay-huge", "spec.training.weightDecay", put("spec.training.weightDecay", 1e9)),
    H("grad-norm-huge", "spec.training.maxGradNorm", put("spec.training.maxGradNorm", 1e300)),
    H("grad-norm-negative", "spec.training.maxGradNorm", put("spec.training.maxGradNorm", -1)),
    H("alpha-huge", "spec.lora.alpha", lora(alpha=1e300)),
    H("alpha-zero", "spec.lora.alpha", lora(alpha=0)),
    H("rank-huge", "spec.lora.rank", lora(rank=4096)),
    H("max-length-huge", "spec.data.maxLength", put("spec.data.maxLength", 2**31)),
    H(
        "target-length-huge",
        "spec.grpo.rewards[0].targetLength",
        grpo({"type": "lengthPenalty", "targetLength": 2**40}),
    ),  # fmt: skip
    H(
        "reward-weight-huge",
        "spec.grpo.rewards[0].weight",
        grpo({"type": "exactAnswer", "weight": 1e308}),
    ),  # fmt: skip
    H("generations-one", "spec.grpo.numGenerations", grpo(numGenerations=1)),
    H("generations-huge", "spec.grpo.numGenerations", grpo(numGenerations=100000)),
    H("grpo-beta-huge", "spec.grpo.beta", grpo(beta=1e9)),
    H("grpo-temperature-zero", "spec.grpo.temperature", grpo(temperature=0)),
    H("grpo-prompt-len-huge", "spec.grpo.maxPromptLength", grpo(maxPromptLength=2**40)),
    H(
        "grpo-completion-len-huge", "spec.grpo.maxCompletionLength", grpo(maxCompletionLength=2**40)
    ),  # fmt: skip
    H("too-many-rewards", "spec.grpo.rewards", grpo(*[{"type": "exactAnswer"}] * 17)),
    H(
        "dpo-beta-huge",
        "spec.dpo.beta",
        both(put("spec.technique", "dpo"), put("spec.dpo", {"beta": 1e9})),
    ),  # fmt: skip
    H(
        "dpo-prompt-len-huge",
        "spec.dpo.maxPromptLength",
        both(put("spec.technique", "dpo"), put("spec.dpo", {"maxPromptLength": 2**40})),
    ),  # fmt: skip
    H(
        "distill-temperature-huge",
        "spec.distill.temperature",
        both(
            put("spec.technique", "distill"),
            put("spec.distill", {"teacher": {"source": "/models/t"}, "temperature": 1e9}),
        ),
    ),  # fmt: skip
    H(
        "distill-alpha-two",
        "spec.distill.alpha",
        both(
            put("spec.technique", "distill"),
            put("spec.distill", {"teacher": {"source": "/models/t"}, "alpha": 2}),
        ),
    ),  # fmt: skip
    H("max-restarts-huge", f"{SCHED}.maxRestarts", put(f"{SCHED}.maxRestarts", 2**40)),
    H(
        "ttl-beyond-int32",
        f"{SCHED}.ttlSecondsAfterFinished",
        put(f"{SCHED}.ttlSecondsAfterFinished", 2**40),
    ),  # fmt: skip
    H(
        "ttl-negative",
        f"{SCHED}.ttlSecondsAfterFinished",
        put(f"{SCHED}.ttlSecondsAfterFinished", -1),
    ),  # fmt: skip
    H("ttl-int32-max", None, put(f"{SCHED}.ttlSecondsAfterFinished", 2**31 - 1)),
    H("slices-huge", "spec.resources.slices", tpu("v6e-8", slices=65)),
    H("nodes-huge", "spec.resources.nodes", put("spec.resources", {"nodes": 100000})),
    H("gpus-zero", "spec.resources.gpusPerNode", tpu("nvidia-l4", gpusPerNode=0)),
    H("source-too-long", MODEL, put(MODEL, "/models/" + "a" * 3000)),
    H("regex-too-long", TARGETS, lora(targetModules="a" * 2000)),
    H("name-254-chars", "metadata.name", put("metadata.name", "a" * 254)),
    # -- names --------------------------------------------------------------------------
    H("name-trailing-newline", "metadata.name", put("metadata.name", "adv-nl\n")),
    H("name-uppercase", "metadata.name", put("metadata.name", "Bad-Name")),
    H("name-with-dot", "metadata.name", put("metadata.name", "a.b")),
    H("name-starts-with-digit", "metadata.name", put("metadata.name", "1abc")),
    H("name-64-chars", "metadata.name", put("metadata.name", "a" * 64)),
    H("name-unicode", "metadata.name", put("metadata.name", "jöb")),
    H("name-ends-with-dash", "metadata.name", put("metadata.name", "job-")),
    # JobSet's coordinator label `<name>-<replicatedJob>-0-0.<name>` fits 63 characters
    H("name-26-node-ok", None, name_of_length(26)),
    H("name-27-node", "metadata.name", name_of_length(27)),
    H("name-26-slice-ok", None, both(tpu("v6e-8"), name_of_length(26))),
    H("name-27-slice", "metadata.name", both(tpu("v6e-8"), name_of_length(27))),
    H("name-22-pathways-ok", None, both(tpu("v6e-16", pathways=PATHWAYS), name_of_length(22))),
    H(
        "name-23-pathways",
        "metadata.name",
        both(tpu("v6e-16", pathways=PATHWAYS), name_of_length(23)),
    ),
    # -- user regexes: compiled, and bounded (nested quantifiers, repeat counts) --------
    H("regex-huge-repeat", TARGETS, lora(targetModules="a{4294967296}")),
    H("regex-thousand-groups", TARGETS, lora(targetModules="(" * 1000)),
    H("regex-deep-groups", TARGETS, lora(targetModules="(" * 200 + "a" + ")" * 200)),
    H("regex-unclosed-group", TARGETS, lora(targetModules="q_proj(")),
    H("regex-nested-plus", TARGETS, lora(targetModules="(a+)+$")),
    H("regex-nested-star", TARGETS, lora(targetModules="(.*)*q_proj")),
    H("regex-optional-repeat", TARGETS, lora(targetModules="(?:a?){40}a{40}")),
    H("regex-bad-escape", TARGETS, lora(targetModules="q_proj\\")),
    H("regex-bad-range", TARGETS, lora(targetModules="[z-a]")),
    H("regex-bad-lookbehind", TARGETS, lora(targetModules="(?<=a+)b")),
    H("regex-empty", TARGETS, lora(targetModules="")),
    H("regex-big-count", TARGETS, lora(targetModules="x{1001}")),
    H("regex-ok-path", None, lora(targetModules="layers/[0-9]+/attn/(q_proj|v_proj)")),
    H("reward-catastrophic", PATTERN, regex_reward("^(a|a?)+$")),
    H("reward-nested-quantifier", PATTERN, regex_reward("(x+x+)+y")),
    H("reward-invalid", PATTERN, regex_reward("<answer>(")),
    H("reward-huge-repeat", PATTERN, regex_reward("a{99999999999}")),
    H("reward-ok", None, regex_reward(r"<answer>\s*-?[0-9]+\s*</answer>")),
    H("reward-adjacent-groups", PATTERN, regex_reward("(.*)(.*)(.*)(.*)(.*)X")),
    H("reward-adjacent-words", PATTERN, regex_reward(r"\w+\w+\w+!")),
    H("reward-three-wildcards", PATTERN, regex_reward(".*a.*a.*aX")),
    H("reward-same-alternatives", PATTERN, regex_reward("(a|a)*X")),
    H("reward-prefix-alternatives", PATTERN, regex_reward("(a|ab)*c")),
    H("reward-digit-alternatives", PATTERN, regex_reward(r"(\d|\d\d)+$")),
    H("reward-one-class-alternatives-ok", None, regex_reward(r"(\w|\d)+$")),
    H("reward-think-answer-ok", None, regex_reward(r"^<think>.*</think>\s*<answer>.*</answer>$")),
    H(
        "lora-unknown-module",
        TARGETS,
        both(put("spec.model.family", "gemma3"), lora(targetModules="q_proj,query_key_value")),
    ),  # fmt: skip
    # -- locations: parsed, per field ---------------------------------------------------
    H("hf-credentials", MODEL, put(MODEL, "hf://user:hf_TOKEN@org/name")),
    H("hf-token-user", MODEL, put(MODEL, "hf://hf_abcdef@org/name")),
    H("gs-credentials", DATA, put(DATA, "gs://key:secret@bucket/data.jsonl")),
    H("https-credentials", MODEL, put(MODEL, "https://user:pw@huggingface.co/org/name")),
    H("hf-no-org", MODEL, put(MODEL, "hf://name-only")),
    H("hf-too-deep", MODEL, put(MODEL, "hf://org/name/extra")),
    H("hf-empty", MODEL, put(MODEL, "hf://")),
    H("hf-query-token", MODEL, put(MODEL, "hf://org/name?token=hf_x")),
    H("hf-revision-ok", None, put(MODEL, "hf://Qwen/Qwen3-0.6B@main")),
    H("hf-revision-bad", MODEL, put(MODEL, "hf://org/name@../../x")),
    H("hf-for-data", DATA, put(DATA, "hf://org/dataset")),
    H("hf-for-output", OUT, put(OUT, "hf://org/out")),
    H("file-scheme", MODEL, put(MODEL, "file:///models/tiny")),
    H("s3-scheme", DATA, put(DATA, "s3://bucket/data.jsonl")),
    H("http-metadata-server", MODEL, put(MODEL, "http://169.254.169.254/computeMetadata/v1/")),
    H("http-metadata-name", DATA, put(DATA, "http://metadata.google.internal/x")),
    H(
        "verifier-metadata-server",
        VERIFIER_URL,
        verifier("http://169.254.169.254/computeMetadata/v1/"),
    ),
    H("verifier-metadata-name", VERIFIER_URL, verifier("http://metadata.google.internal/x")),
    H("verifier-credentials", VERIFIER_URL, verifier("https://user:pw@verifier.default.svc/score")),
    H("verifier-token-in-query", VERIFIER_URL, verifier("https://verifier/score?token=abc")),
    H("verifier-file-scheme", VERIFIER_URL, verifier("file:///etc/passwd")),
    H("verifier-cluster-dns-ok", None, verifier("http://verifier.team.svc.cluster.local:8080/s")),
    H("tool-metadata-ipv6", TOOL_URL, http_tool("http://[fe80::a9fe:a9fe]/latest/")),
    H("tool-url-without-scheme", TOOL_URL, http_tool("tools.default.svc:8080/capital")),
    H(
        "tool-name-with-dash",
        "spec.grpo.agent.tools[0].name",
        http_tool("http://t/c", name="get-capital"),
    ),
    H(
        "tool-secret-not-name-key",
        "spec.grpo.agent.tools[0].http.authSecret.name",
        http_tool("http://t/c", authSecret={"name": "tokens/prod", "key": "token"}),
    ),
    H("gs-no-bucket", DATA, put(DATA, "gs:///data.jsonl")),
    H("gs-empty", OUT, put(OUT, "gs://")),
    H("gs-ip-bucket", MODEL, put(MODEL, "gs://169.254.169.254/m")),
    H("gs-metadata-bucket", MODEL, put(MODEL, "gs://metadata.google.internal/m")),
    H("gs-uppercase-bucket", DATA, put(DATA, "gs://MyBucket/data.jsonl")),
    H("gs-port", OUT, put(OUT, "gs://bucket:443/out")),
    H("gs-fragment", OUT, put(OUT, "gs://bucket/out#frag")),
    H("gs-traversal", OUT, put(OUT, "gs://bucket/a/../../b")),
    H("config-zero-heads", MODEL, put(MODEL, str(MODELS / "zero-heads"))),
    H("config-hidden-overflow", MODEL, put(MODEL, str(MODELS / "hidden-overflow"))),
    H("config-list", MODEL, put(MODEL, str(MODELS / "list"))),
    H("config-not-json", MODEL, put(MODEL, str(MODELS / "not-json"))),
    H("config-vision-list", MODEL, put(MODEL, str(MODELS / "vision-list"))),
    H(
        "config-teacher-zero-heads",
        "spec.distill.teacher.source",
        both(
            put("spec.technique", "distill"),
            put("spec.distill", {"teacher": {"source": str(MODELS / "zero-heads")}}),
        ),
    ),
    # -- sizes and values as a cluster holds them ----------------------------------------
    H("config-size-live-metadata", "spec.grpo.rewards", near_config_limit(20)),
    H("config-size-live-ok", None, near_config_limit(200)),
    H("memory-1e400", "spec.resources.memory", put("spec.resources", {"memory": "1e400"})),
    H("cpu-beyond-int64", "spec.resources.cpu", put("spec.resources", {"cpu": "10E"})),
    H("memory-exabytes-ok", None, put("spec.resources", {"memory": "7Ei"})),
    H(
        "machine-type-of-gpu",
        "spec.resources.machineType",
        tpu("v6e-8", machineType="a3-highgpu-8g"),
    ),
    H(
        "machine-type-on-cpu",
        "spec.resources.machineType",
        put("spec.resources", {"machineType": "n2-standard-8"}),
    ),
    H("gs-upper-scheme-output", OUT, put(OUT, "GS://bucket/out")),
    H("gs-mixed-scheme-data", DATA, put(DATA, "Gs://bucket/data.jsonl")),
    H("hf-upper-scheme-model", MODEL, put(MODEL, "HF://org/name")),
    H("gs-ok", None, put(OUT, "gs://my-runs/qwen3/run-1")),
    H(
        "data-traversal",
        DATA,
        put(DATA, "/data/../var/run/secrets/kubernetes.io/serviceaccount/token"),
    ),  # fmt: skip
    H("data-relative-traversal", DATA, put(DATA, "../../etc/passwd")),
    H("model-dot-segment", MODEL, put(MODEL, "/models/./tiny")),
    H("model-tilde", MODEL, put(MODEL, "~/models/tiny")),
    H("nul-in-source", MODEL, put(MODEL, "/models/tiny\x00.bin")),
    H("newline-in-source", DATA, put(DATA, "/data/train.jsonl\nvalid: true")),
    H("tab-in-source", DATA, put(DATA, "/data/train\t.jsonl")),
    H("space-in-source", DATA, put(DATA, "/data/my train.jsonl")),
    H("rtl-override-in-source", MODEL, put(MODEL, "/models/\u202egpj.exe")),
    H("zero-width-in-source", MODEL, put(MODEL, "/models/ti\u200bny")),
    H("esc-in-output", OUT, put(OUT, "/outputs/\x1b[2Jrun")),
    H("output-root", OUT, put(OUT, "/")),
    H("output-double-slash", OUT, put(OUT, "//")),
    H(
        "output-pvc-token-dir",
        OUT,
        put(
            "spec.output",
            {
                "uri": "/var/run/secrets/kubernetes.io/serviceaccount",
                "persistentVolumeClaim": "outs",
            },
        ),
    ),  # fmt: skip
    H(
        "output-pvc-over-config",
        OUT,
        put("spec.output", {"uri": "/etc/posttrain", "persistentVolumeClaim": "outs"}),
    ),  # fmt: skip
    H(
        "output-pvc-traversal",
        OUT,
        put("spec.output", {"uri": "/outputs/../etc", "persistentVolumeClaim": "outs"}),
    ),  # fmt: skip
    H(
        "output-pvc-proc",
        OUT,
        put("spec.output", {"uri": "/proc/self", "persistentVolumeClaim": "outs"}),
    ),  # fmt: skip
    H(
        "output-pvc-tmp-h100",
        OUT,
        both(
            put("spec.output", {"uri": "/tmp", "persistentVolumeClaim": "outs"}),
            put("spec.resources", {"accelerator": "nvidia-h100-80gb", "nodes": 2}),
            put(BATCH, 16),
        ),
    ),  # two volumes at /tmp: an invalid Job that only JobSet's Events reported
    H("output-pvc-tmp", OUT, put("spec.output", {"uri": "/tmp/", "persistentVolumeClaim": "outs"})),
    H(
        "output-pvc-under-tmp-ok",
        None,
        put("spec.output", {"uri": "/tmp/run", "persistentVolumeClaim": "outs"}),
    ),
    H(
        "output-pvc-ok",
        None,
        put("spec.output", {"uri": "/outputs/run", "persistentVolumeClaim": "outs"}),
    ),  # fmt: skip
    H(
        "pvc-bad-name",
        "spec.output.persistentVolumeClaim",
        put("spec.output", {"uri": "/outputs", "persistentVolumeClaim": "Outs_1"}),
    ),  # fmt: skip
    H(
        "chat-template-s3",
        "spec.data.chatTemplate",
        put("spec.data.chatTemplate", "s3://b/t.jinja"),
    ),  # fmt: skip
    H(
        "restore-from-credentials",
        "spec.lora.restoreFrom",
        lora(restoreFrom="hf://u:t@org/adapter"),
    ),  # fmt: skip
    H(
        "teacher-file-scheme",
        "spec.distill.teacher.source",
        both(
            put("spec.technique", "distill"),
            put("spec.distill", {"teacher": {"source": "file:///t"}}),
        ),
    ),  # fmt: skip
    H(
        "scratch-not-gs",
        "spec.resources.pathways.gcsScratchLocation",
        put(
            "spec.resources",
            {
                "accelerator": "v6e-16",
                "pathways": {"enabled": True, "gcsScratchLocation": "s3://x"},
            },
        ),
    ),  # fmt: skip
    H(
        "scratch-gs-credentials",
        "spec.resources.pathways.gcsScratchLocation",
        put(
            "spec.resources",
            {
                "accelerator": "v6e-16",
                "pathways": {"enabled": True, "gcsScratchLocation": "gs://k:s@bucket/x"},
            },
        ),
    ),  # fmt: skip
    # -- what the API server refuses in the Jobs' pods, after the JobSet was made ---------
    H(
        "secret-key-dotdot",
        "spec.hfTokenSecret.key",
        put("spec.hfTokenSecret", {"name": "hf", "key": ".."}),
    ),
    H(
        "secret-key-dot",
        "spec.hfTokenSecret.key",
        put("spec.hfTokenSecret", {"name": "hf", "key": "."}),
    ),
    H(
        "secret-key-leading-dots",
        "spec.hfTokenSecret.key",
        put("spec.hfTokenSecret", {"name": "hf", "key": "..x"}),
    ),
    H("secret-key-dotfile-ok", None, put("spec.hfTokenSecret", {"name": "hf", "key": ".token"})),
    H(
        "head-node-pool-dash",
        "spec.resources.pathways.headNodePool",
        tpu("v6e-16", pathways={**PATHWAYS, "headNodePool": "-cpu-"}),
    ),
    H("head-node-pool-ok", None, tpu("v6e-16", pathways={**PATHWAYS, "headNodePool": "cpu-1"})),
    H("image-with-scheme", "spec.image", put("spec.image", "https://ghcr.io/x/trainer:1")),
    H("image-with-space", "spec.image", put("spec.image", "trainer:1 --privileged")),
    H("image-newline", "spec.image", put("spec.image", "trainer:1\nrm")),
    H("image-ok", None, put("spec.image", "us-docker.pkg.dev/p/r/trainer:1.2.3")),
    H(
        "server-image-bad",
        "spec.resources.pathways.serverImage",
        put(
            "spec.resources",
            {
                "accelerator": "v6e-16",
                "pathways": {
                    "enabled": True,
                    "gcsScratchLocation": "gs://bucket/scratch",
                    "serverImage": "UPPER/Case",
                },
            },
        ),
    ),
    H(
        "secret-name-bad",
        "spec.hfTokenSecret.name",
        put("spec.hfTokenSecret", {"name": "Bad Name"}),
    ),  # fmt: skip
    H(
        "secret-key-bad",
        "spec.hfTokenSecret.key",
        put("spec.hfTokenSecret", {"name": "hf", "key": "a/b"}),
    ),  # fmt: skip
    # -- contradictions known at admission ----------------------------------------------
    H("batch-vs-v6e-16-hosts", BATCH, both(tpu("v6e-16"), put(BATCH, 6))),
    H("batch-vs-v5p-128-devices", BATCH, both(tpu("v5p-128"), put(BATCH, 96))),
    H("batch-vs-multislice", BATCH, both(tpu("v6e-8", slices=2), put(BATCH, 8))),
    H(
        "batch-vs-gpu-nodes",
        BATCH,
        both(
            put("spec.resources", {"accelerator": "nvidia-h100-80gb", "nodes": 2}), put(BATCH, 12)
        ),
    ),  # fmt: skip
    H("batch-vs-cpu-nodes", BATCH, both(put("spec.resources", {"nodes": 3}), put(BATCH, 8))),
    H(
        "batch-per-host-accumulation",
        BATCH,
        both(tpu("v6e-16"), put("spec.training", {"batchSize": 32, "gradientAccumulation": 16})),
    ),  # fmt: skip
    H("batch-ok-v6e-16", None, both(tpu("v6e-16"), put(BATCH, 32))),
    H(
        "chosen-equals-rejected",
        "spec.data.columns.rejected",
        both(
            put("spec.technique", "dpo"),
            put("spec.data.columns", {"chosen": "resp", "rejected": "resp"}),
        ),
    ),  # fmt: skip
    H(
        "prompt-equals-chosen",
        "spec.data.columns.chosen",
        both(put("spec.technique", "dpo"), put("spec.data.columns", {"chosen": "prompt"})),
    ),  # fmt: skip
    H(
        "prompt-equals-completion",
        "spec.data.columns.completion",
        put("spec.data.columns", {"completion": "prompt"}),
    ),  # fmt: skip
    H(
        "prompt-equals-answer",
        "spec.data.columns.answer",
        both(grpo(), put("spec.data.columns", {"answer": "q", "prompt": "q"})),
    ),  # fmt: skip
    H("empty-column", "spec.data.columns.prompt", put("spec.data.columns", {"prompt": ""})),
    H(
        "system-node-critical",
        f"{SCHED}.priorityClass",
        put(f"{SCHED}.priorityClass", "system-node-critical"),
    ),  # fmt: skip
    H(
        "system-cluster-critical",
        f"{SCHED}.priorityClass",
        put(f"{SCHED}.priorityClass", "system-cluster-critical"),
    ),  # fmt: skip
    H(
        "priority-class-bad-name",
        f"{SCHED}.priorityClass",
        put(f"{SCHED}.priorityClass", "High Priority"),
    ),  # fmt: skip
    H("queue-not-label-value", f"{SCHED}.queue", put(f"{SCHED}.queue", "team a/queue")),
    H("queue-too-long", f"{SCHED}.queue", put(f"{SCHED}.queue", "q" * 64)),
    H("queue-newline", f"{SCHED}.queue", put(f"{SCHED}.queue", "team\n")),
    H(
        "kueue-priority-bad",
        f"{SCHED}.workloadPriorityClass",
        put(f"{SCHED}.workloadPriorityClass", "-high-"),
    ),
    H(
        "kueue-priority-long",
        f"{SCHED}.workloadPriorityClass",
        put(f"{SCHED}.workloadPriorityClass", "p" * 64),
    ),
    H("queue-ok", None, put(SCHED, {"queue": "team-a", "suspend": True})),
    H("accelerator-leading-zero", ACCEL, tpu("v6e-08")),
    H("accelerator-uppercase", ACCEL, tpu("V6E-8")),
    H("accelerator-newline", ACCEL, tpu("v6e-8\n")),
    H("accelerator-spaces", ACCEL, tpu(" v6e-8")),
    H("accelerator-unknown-gpu", ACCEL, tpu("nvidia-h900")),
    H("accelerator-empty", ACCEL, tpu("")),
    H("cpu-lots", "spec.resources.cpu", put("spec.resources", {"cpu": "lots"})),
    H("cpu-negative", "spec.resources.cpu", put("spec.resources", {"cpu": "-2"})),
    H("cpu-zero", "spec.resources.cpu", put("spec.resources", {"cpu": "0"})),
    H("cpu-number", "spec.resources.cpu", put("spec.resources", {"cpu": 8})),
    H("memory-lots", "spec.resources.memory", put("spec.resources", {"memory": "lots"})),
    H("memory-negative", "spec.resources.memory", put("spec.resources", {"memory": "-64Gi"})),
    H("memory-bad-suffix", "spec.resources.memory", put("spec.resources", {"memory": "64GB"})),
    H("memory-ok", None, put("spec.resources", {"cpu": "500m", "memory": "1.5Gi"})),
    H(
        "lora-rank-above-hidden",
        "spec.lora.rank",
        both(put(MODEL, "hf://HuggingFaceTB/SmolLM2-135M-Instruct"), lora(rank=1024)),
    ),  # fmt: skip
    H("lora-rank-ok-unknown-model", None, lora(rank=1024)),
    H("does-not-fit", ACCEL, both(put(MODEL, "gs://models/Llama-3.1-70B"), tpu("v6e-8"))),
    H("topology-trailing-newline", "spec.resources.topology", tpu("v6e-16", topology="4x4\n")),
    H("gpus-on-cpu", "spec.resources.gpusPerNode", put("spec.resources", {"gpusPerNode": 2})),
    H(
        "warmup-equals-steps",
        "spec.training.warmupSteps",
        put("spec.training", {"steps": 5, "warmupSteps": 5}),
    ),  # fmt: skip
    # -- control characters in what is echoed ------------------------------------------
    H("unknown-key-escape", "spec.x\x1b[0m\nvalid", put("spec.x\x1b[0m\nvalid", 1)),
    H("unknown-key-rtl", "spec.\u202edilav", put("spec.\u202edilav", 1)),
    H(
        "reward-function-newline",
        "spec.grpo.rewards[0].function",
        grpo({"type": "python", "function": "m:f\n"}),
    ),  # fmt: skip
    # -- reward functions that would run the model's output -----------------------------
    *(
        H(f"reward-function-{f.replace(':', '-').replace('.', '-')}", FUNCTION, python_reward(f))
        for f in (
            "builtins:exec",
            "builtins:eval",
            "subprocess:run",
            "os:system",
            "importlib:import_module",
            "shutil:rmtree",
            "sys:exit",
            "posix:system",
            "os.path:join",
            "runpy:run_path",
            "pickle:loads",
            "ctypes:CDLL",
        )
    ),  # fmt: skip
    H("reward-function-own-module", None, python_reward("acme_rewards.math:score")),
    # Python's \w takes ä, the CRD's RE2 does not: both refuse it now.
    H("reward-function-non-ascii", FUNCTION, python_reward("rewärd:score")),
    # -- YAML that kubectl and validate must read alike ----------------------------------
    H(
        "yaml-merge-key-later-wins",
        STEPS,
        text=SPEC + "  training: {steps: 10, <<: {steps: 0}}\n",
    ),
    H(
        "yaml-merge-key-explicit-after",
        None,
        text=SPEC + "  training: {<<: {steps: 0}, steps: 10}\n",
    ),
    H(
        "yaml-merge-anchor",
        "spec.training.everySteps",
        text=SPEC
        + """  checkpoint: &b {everySteps: 5}
  training: {<<: *b}
""",
    ),
    H(
        "yaml-quoted-number",
        BATCH,
        text=SPEC + '  training: {batchSize: "16"}\n',
    ),
    H(
        "yaml-yes-is-bool",
        "spec.model.source",
        text=META + "  model: {source: yes}\n" + REST,
    ),
    H(
        "yaml-null-source",
        "spec.model.source",
        text=META + "  model: {source: ~}\n" + REST,
    ),
    H(
        "yaml-nan",
        "spec.training.learningRate",
        text=SPEC + "  training: {learningRate: .nan}\n",
    ),
    H(
        "yaml-inf",
        "spec.lora.alpha",
        text=SPEC + "  lora: {alpha: .inf}\n",
    ),
    H(
        "yaml-negative-inf",
        "spec.grpo.rewards[0].weight",
        text=SPEC
        + """  technique: grpo
  grpo: {rewards: [{type: exactAnswer, weight: -.inf}]}
""",
    ),
    H(
        "yaml-sexagesimal",
        "spec.training.steps",
        text=SPEC + "  training: {steps: 1:30}\n",
    ),
    H(
        "yaml-timestamp-string",
        None,
        text=META + "  model: {source: 2001-12-14}\n" + REST,
    ),
    H(
        "yaml-octal-ok",
        None,
        text=SPEC + "  training: {steps: 0755}\n",
    ),
    # -- go-yaml v2's scalars, as kubectl sends them (measured with kubectl 1.36) ----------
    H(
        "yaml-y-is-true-ok",
        None,
        text=META + "  model: {source: /models/tiny}\n"
        "  data: {source: /data/train.jsonl, packing: y}\n  output: {uri: /outputs/run}\n",
    ),
    H("yaml-n-is-false-ok", None, text=SPEC + "  scheduling: {suspend: n}\n"),
    H("yaml-off-is-false-ok", None, text=SPEC + "  checkpoint: {async: off}\n"),
    H("yaml-0o-octal-ok", None, text=SPEC + "  training: {steps: 0o10}\n"),
    H("yaml-hex-ok", None, text=SPEC + "  training: {steps: 0x1F}\n"),
    H("yaml-underscores-ok", None, text=SPEC + "  training: {steps: 1_000}\n"),
    H("yaml-exponent-int-ok", None, text=SPEC + "  training: {steps: 1e3}\n"),
    H("yaml-float-int-ok", None, text=SPEC + "  training: {batchSize: 8.0}\n"),
    H("yaml-fraction-refused", BATCH, text=SPEC + "  training: {batchSize: 8.5}\n"),
    H("yaml-exponent-overflow-string", STEPS, text=SPEC + "  training: {steps: 1e400}\n"),
    H("yaml-null-optional-ok", None, text=SPEC + "  lora: null\n  training: {steps: null}\n"),
    H("yaml-null-queue-ok", None, text=SPEC + "  scheduling: {queue: ~, suspend: false}\n"),
    H("yaml-duplicate-last-wins-ok", None, text=SPEC + "  training: {steps: 0, steps: 10}\n"),
    H("yaml-duplicate-last-wins", STEPS, text=SPEC + "  training: {steps: 10, steps: 0}\n"),
    H(
        "yaml-binary-image-ok",
        None,
        text=SPEC + "  image: !!binary dXMtZG9ja2VyLnBrZy5kZXYvcC9yL3RyYWluZXI6MQ==\n",
    ),
    H(
        "yaml-binary-image-bad",
        "spec.image",
        text=SPEC + "  image: !!binary dHJhaW5lcjoxIC0tcHJpdmlsZWdlZA==\n",
    ),
    H(
        "yaml-anchor-reuse-ok",
        None,
        text=META
        + """  model: &m {source: /models/tiny}
  distill: {teacher: *m}
  technique: distill
"""
        + REST,
    ),
]
