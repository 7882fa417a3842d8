"""Invalid PostTrainJobs, shared by the unit tier (posttrain validate) and the
integration tier (the real API server with the generated CRD).

Each case changes one thing in a valid job and says which field the error must name.
`server` is True when the CRD itself (schema or CEL) must refuse it; the others need the
catalog or derived names, which the admission webhook checks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def valid_job(name: str = "good-job") -> dict[str, Any]:
    return {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "/models/tiny"},
            "data": {"source": "/data/train.jsonl"},
            "output": {"uri": "/outputs/run"},
        },
    }


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[dict[str, Any]], None]
    field: str  # the field path the error must name
    message: str  # a part of the message
    server: bool = True  # refused by the CRD (schema/CEL) on a real API server

    def doc(self, name: str = "bad-job") -> dict[str, Any]:
        d = copy.deepcopy(valid_job(name))
        self.mutate(d)
        return d


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    return mutate


def _del(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = doc
        for p in parents:
            node = node[p]
        del node[leaf]

    return mutate


def _all(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        for m in mutations:
            m(doc)

    return mutate


GRPO = {"rewards": [{"type": "exactAnswer"}]}


def _grpo(extra: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return _all(_set("spec.technique", "grpo"), _set("spec.grpo", {**GRPO, **extra}))


CASES: list[Case] = [
    Case("missing-model", _del("spec.model"), "spec.model", "required"),
    Case("missing-data", _del("spec.data"), "spec.data", "required"),
    Case("missing-output", _del("spec.output"), "spec.output", "required"),
    Case("empty-model-source", _set("spec.model.source", ""), "spec.model.source", "at least 1"),
    Case("unknown-technique", _set("spec.technique", "ppo"), "spec.technique", "sft"),
    Case(
        "orpo-technique",
        _set("spec.technique", "orpo"),
        "spec.technique",
        "ORPO is technique: dpo with dpo.algorithm: orpo",
    ),
    Case(
        "hf-dataset",
        _set("spec.data.source", "hf://HuggingFaceH4/ultrachat_200k"),
        "spec.data.source",
        "save it with datasets' save_to_disk, or as parquet or jsonl",
        server=False,
    ),
    Case(  # Path.exists() raised OSError (File name too long) in validate
        "model-path-name-over-255-bytes",
        _set("spec.model.source", "/models/" + "m" * 256),
        "spec.model.source",
        "is 256 bytes; a file or directory name is at most 255 bytes",
        server=False,
    ),
    Case(
        "data-path-name-over-255-bytes-of-utf8",
        _set("spec.data.source", "/data/" + "ä" * 128 + ".jsonl"),
        "spec.data.source",
        "is 262 bytes",
        server=False,
    ),
    Case("bad-dtype", _set("spec.model.dtype", "int8"), "spec.model.dtype", "bfloat16"),
    Case(
        "lora-rank-zero",
        _set("spec.lora", {"rank": 0}),
        "spec.lora.rank",
        "greater than or equal to 1",
    ),
    Case(
        "lora-alpha-negative", _set("spec.lora", {"alpha": -1}), "spec.lora.alpha", "greater than 0"
    ),
    Case(
        "steps-zero",
        _set("spec.training", {"steps": 0}),
        "spec.training.steps",
        "greater than or equal to 1",
    ),
    Case(
        "lr-zero",
        _set("spec.training", {"learningRate": 0}),
        "spec.training.learningRate",
        "greater than 0",
    ),
    Case(
        "batch-size-string",
        _set("spec.training", {"batchSize": "eight"}),
        "spec.training.batchSize",
        "integer",
    ),
    Case("unknown-field", _set("spec.trainig", {"steps": 5}), "spec.trainig", "unknown field"),
    Case(
        "max-length-tiny",
        _set("spec.data.maxLength", 4),
        "spec.data.maxLength",
        "greater than or equal to 8",
    ),
    Case(
        "keep-zero",
        _set("spec.checkpoint", {"keep": 0}),
        "spec.checkpoint.keep",
        "greater than or equal to 1",
    ),
    Case(
        "grpo-with-sft",
        _set("spec.grpo", GRPO),
        "spec.grpo",
        "only allowed when spec.technique is grpo",
    ),
    Case(
        "grpo-without-block", _set("spec.technique", "grpo"), "spec.grpo", "needs a spec.grpo block"
    ),
    Case(
        "grpo-no-rewards",
        _all(_set("spec.technique", "grpo"), _set("spec.grpo", {"rewards": []})),
        "spec.grpo.rewards",
        "at least 1",
    ),
    Case(
        "grpo-epsilon-too-big",
        _all(_set("spec.technique", "grpo"), _set("spec.grpo", {**GRPO, "epsilon": 2})),
        "spec.grpo.epsilon",
        "less than or equal to 1",
    ),
    Case(
        "grpo-epsilon-high-below-epsilon",
        _all(
            _set("spec.technique", "grpo"),
            _set("spec.grpo", {**GRPO, "epsilon": 0.3, "epsilonHigh": 0.2}),
        ),
        "spec.grpo.epsilonHigh",
        "must be at least grpo.epsilon",
    ),
    Case(
        "grpo-vllm-engine",
        _all(_set("spec.technique", "grpo"), _set("spec.grpo", {**GRPO, "rolloutEngine": "vllm"})),
        "spec.grpo.rolloutEngine",
        "vllm is not available yet",
    ),
    Case(
        "grpo-disaggregated-without-share",
        _grpo({"rollout": {"placement": "disaggregated"}}),
        "spec.grpo.rollout",
        "needs one of samplerFraction",
    ),
    Case(
        "grpo-colocated-with-share",
        _grpo({"rollout": {"samplerFraction": 0.5}}),
        "spec.grpo.rollout",
        "apply to placement disaggregated",
    ),
    Case(
        "grpo-sampler-takes-every-slice",
        _all(
            _grpo({"rollout": {"placement": "disaggregated", "samplerSlices": 2}}),
            _set("spec.resources", {"accelerator": "v6e-8", "slices": 2}),
        ),
        "spec.grpo.rollout.samplerSlices",
        "must leave the trainer at least one",
    ),
    Case(
        "grpo-sampler-fraction-over-slices",
        _all(
            _grpo({"rollout": {"placement": "disaggregated", "samplerFraction": 0.5}}),
            _set("spec.resources", {"accelerator": "v6e-8", "slices": 2}),
        ),
        "spec.grpo.rollout.samplerFraction",
        "use samplerSlices",
    ),
    Case(
        "grpo-stale-colocated",
        _grpo({"maxStaleness": 1}),
        "spec.grpo.maxStaleness",
        "needs grpo.rollout.placement disaggregated",
    ),
    Case(
        "grpo-http-reward-without-service",
        _grpo({"rewards": [{"type": "http"}]}),
        "spec.grpo.rewards[0].http",
        "an http reward needs http",
    ),
    Case(
        "grpo-service-on-a-builtin-reward",
        _grpo({"rewards": [{"type": "exactAnswer", "http": {"url": "http://v:80/s"}}]}),
        "spec.grpo.rewards[0].http",
        "other rewards take none",
    ),
    Case(
        "grpo-http-reward-url-without-scheme",
        _grpo({"rewards": [{"type": "http", "http": {"url": "verifier.default.svc:8080"}}]}),
        "spec.grpo.rewards[0].http.url",
        "must be an http:// or https:// URL",
        server=False,
    ),
    Case(
        "grpo-http-reward-url-with-credentials",
        _grpo({"rewards": [{"type": "http", "http": {"url": "https://u:tok@verifier/score"}}]}),
        "spec.grpo.rewards[0].http.url",
        "URLs carry no credentials",
        server=False,
    ),
    Case(
        "grpo-http-reward-secret-not-a-name",
        _grpo(
            {
                "rewards": [
                    {"type": "http", "http": {"url": "http://v/s", "authSecret": {"name": "a/b"}}}
                ]
            }
        ),
        "spec.grpo.rewards[0].http.authSecret.name",
        "should match pattern",
    ),
    Case(
        "grpo-http-reward-header-with-colon",
        _grpo({"rewards": [{"type": "http", "http": {"url": "http://v/s", "authHeader": "X:Y"}}]}),
        "spec.grpo.rewards[0].http.authHeader",
        "should match pattern",
    ),
    Case(
        "grpo-agent-turns-without-tools",
        _grpo({"agent": {"maxTurns": 3}}),
        "spec.grpo.agent.tools",
        "maxTurns above 1 needs tools",
    ),
    Case(
        "grpo-agent-empty-instructions",
        _grpo({"agent": {"tools": [{"name": "calc", "type": "calculator"}], "instructions": ""}}),
        "spec.grpo.agent.instructions",
        "at least 1",
    ),
    Case(
        "grpo-agent-tool-name-not-identifier",
        _grpo({"agent": {"tools": [{"name": "2-calc", "type": "calculator"}]}}),
        "spec.grpo.agent.tools[0].name",
        "should match pattern",
    ),
    Case(
        "grpo-agent-tool-names-repeat",
        _grpo(
            {
                "agent": {
                    "tools": [
                        {"name": "calc", "type": "calculator"},
                        {"name": "calc", "type": "calculator"},
                    ]
                }
            }
        ),
        "spec.grpo.agent.tools",
        "tool names must be unique",
    ),
    Case(
        "grpo-agent-http-tool-without-service",
        _grpo(
            {
                "agent": {
                    "tools": [
                        {
                            "name": "search",
                            "type": "http",
                            "description": "d",
                            "parameters": {"type": "object"},
                        }
                    ]
                }
            }
        ),
        "spec.grpo.agent.tools[0].http",
        "an http tool needs http",
    ),
    Case(
        "grpo-agent-tool-parameters-not-an-object-schema",
        _grpo(
            {
                "agent": {
                    "tools": [
                        {
                            "name": "capital",
                            "type": "python",
                            "description": "d",
                            "parameters": {"country": "string"},
                            "function": "mytools:capital",
                        }
                    ]
                }
            }
        ),
        "spec.grpo.agent.tools[0].parameters",
        "JSON schema of the arguments object",
        server=False,
    ),
    Case(
        "grpo-agent-http-tool-url-with-credentials",
        _grpo(
            {
                "agent": {
                    "tools": [
                        {
                            "name": "search",
                            "type": "http",
                            "description": "d",
                            "parameters": {"type": "object"},
                            "http": {"url": "http://user:pw@search.default.svc/q"},
                        }
                    ]
                }
            }
        ),
        "spec.grpo.agent.tools[0].http.url",
        "URLs carry no credentials",
        server=False,
    ),
    Case(
        "grpo-agent-python-tool-from-the-standard-library",
        _grpo(
            {
                "agent": {
                    "tools": [
                        {
                            "name": "shell",
                            "type": "python",
                            "description": "d",
                            "parameters": {"type": "object"},
                            "function": "os:system",
                        }
                    ]
                }
            }
        ),
        "spec.grpo.agent.tools[0].function",
        "Python's own os module",
        server=False,
    ),
    Case(
        "grpo-disaggregated-multi-host-without-pathways",
        _all(
            _grpo({"rollout": {"placement": "disaggregated", "samplerFraction": 0.5}}),
            _set("spec.resources", {"accelerator": "v6e-16"}),
        ),
        "spec.grpo.rollout.placement",
        "needs resources.pathways.enabled",
        server=False,
    ),
    Case(
        "grpo-sampler-fraction-not-whole-devices",
        _all(
            _grpo({"rollout": {"placement": "disaggregated", "samplerFraction": 0.3}}),
            _set("spec.resources", {"accelerator": "nvidia-h100-80gb"}),
        ),
        "spec.grpo.rollout.samplerFraction",
        "is 2.4 devices",
        server=False,
    ),
    Case(
        "grpo-sampler-share-of-one-device",
        _all(
            _grpo({"rollout": {"placement": "disaggregated", "samplerFraction": 0.5}}),
            _set("spec.resources", {"accelerator": "nvidia-l4", "gpusPerNode": 1}),
        ),
        "spec.grpo.rollout.samplerFraction",
        "single device",
        server=False,
    ),
    Case(
        "python-reward-without-function",
        _all(_set("spec.technique", "grpo"), _set("spec.grpo", {"rewards": [{"type": "python"}]})),
        "spec.grpo.rewards[0].function",
        "needs function",
    ),
    Case(
        "regex-reward-without-pattern",
        _all(
            _set("spec.technique", "grpo"),
            _set("spec.grpo", {"rewards": [{"type": "regexFormat"}]}),
        ),
        "spec.grpo.rewards[0].pattern",
        "needs pattern",
    ),
    Case(
        "length-penalty-without-target",
        _all(
            _set("spec.technique", "grpo"),
            _set("spec.grpo", {"rewards": [{"type": "lengthPenalty"}]}),
        ),
        "spec.grpo.rewards[0].targetLength",
        "needs targetLength",
    ),
    Case(
        "reward-function-not-import-path",
        _all(
            _set("spec.technique", "grpo"),
            _set("spec.grpo", {"rewards": [{"type": "python", "function": "not a path"}]}),
        ),
        "spec.grpo.rewards[0].function",
        "match",
    ),
    Case(
        "dpo-with-sft",
        _set("spec.dpo", {"beta": 0.1}),
        "spec.dpo",
        "only allowed when spec.technique is dpo",
    ),
    Case(
        "distill-without-block",
        _set("spec.technique", "distill"),
        "spec.distill",
        "needs a spec.distill block",
    ),
    Case(
        "adapter-export-without-lora",
        _set("spec.output.exportHF", "adapter"),
        "spec.output.exportHF",
        "needs spec.lora",
    ),
    Case(
        "pvc-with-relative-uri",
        _set("spec.output", {"uri": "gs://bucket/out", "persistentVolumeClaim": "outputs"}),
        "spec.output.uri",
        "absolute mount path",
    ),
    Case(
        "warmup-not-below-steps",
        _set("spec.training", {"steps": 10, "warmupSteps": 10}),
        "spec.training.warmupSteps",
        "training.warmupSteps (10) must be less than training.steps (10)",
    ),
    Case(
        "batch-not-multiple-of-accumulation",
        _set("spec.training", {"batchSize": 10, "gradientAccumulation": 4}),
        "spec.training.gradientAccumulation",
        "multiple of",
    ),
    Case(
        "pathways-on-gpu",
        _set("spec.resources", {"accelerator": "nvidia-h100-80gb", "pathways": {"enabled": True}}),
        "spec.resources.pathways",
        "needs a TPU accelerator",
    ),
    Case(
        "pathways-without-gcs",
        _set("spec.resources", {"accelerator": "v6e-16", "pathways": {"enabled": True}}),
        "spec.resources.pathways",
        "gs:// scratch location",
    ),
    Case(
        "restricted-egress-on-the-nodes-network",
        lambda d: (
            _set("spec.resources", {"accelerator": "v5e-8"})(d),
            _set("spec.network", {"restrictEgress": True})(d),
        ),
        "spec.network.restrictEgress",
        "needs resources.hostNetwork: false",
    ),
    Case(
        "slices-on-cpu",
        _set("spec.resources", {"slices": 2}),
        "spec.resources.slices",
        "needs a TPU",
    ),
    Case(
        "flash-attention-on-cpu",
        _set("spec.training", {"attention": "flash"}),
        "spec.training.attention",
        "needs a TPU or GPU",
    ),
    Case(
        "attention-unknown",
        _set("spec.training", {"attention": "sdpa"}),
        "spec.training.attention",
        "auto",
    ),
    Case(
        "layer-loop-unknown",
        _set("spec.training", {"layerLoop": "vmap"}),
        "spec.training.layerLoop",
        "unroll",
    ),
    Case(
        "layer-loop-scan-with-grpo",
        _all(
            _set("spec.technique", "grpo"),
            _set("spec.grpo", {"rewards": [{"type": "exactAnswer"}]}),
            _set("spec.training", {"layerLoop": "scan"}),
        ),
        "spec.training.layerLoop",
        "not for grpo",
    ),
    Case(
        "layer-loop-scan-of-gemma",
        _all(
            _set("spec.model", {"source": "/models/tiny", "family": "gemma3"}),
            _set("spec.training", {"layerLoop": "scan"}),
        ),
        "spec.training.layerLoop",
        "layers alike",
    ),
    Case(
        "gpus-per-node-on-tpu",
        _set("spec.resources", {"accelerator": "v5p-8", "gpusPerNode": 4}),
        "spec.resources.gpusPerNode",
        "nvidia-* accelerators only",
    ),
    Case(
        "nodes-on-tpu",
        _set("spec.resources", {"accelerator": "v6e-8", "nodes": 2}),
        "spec.resources.nodes",
        "host count comes from its size",
    ),
    Case(
        "topology-not-a-shape",
        _set("spec.resources", {"accelerator": "v6e-16", "topology": "banana"}),
        "spec.resources.topology",
        "match",
    ),
    # Only the catalog or the renderer knows these: the admission webhook refuses them.
    Case(
        "unknown-tpu-size",
        _set("spec.resources.accelerator", "v6e-300"),
        "spec.resources.accelerator",
        "v6e-256",
        server=False,
    ),
    Case(
        "unknown-accelerator",
        _set("spec.resources.accelerator", "tpu-v9-8"),
        "spec.resources.accelerator",
        "nvidia-h100-80gb",
        server=False,
    ),
    Case(
        "keep-best-without-eval",
        _set("spec.checkpoint", {"keepBest": "loss"}),
        "spec.checkpoint.keepBest",
        "needs spec.eval",
    ),
    Case(
        "keep-best-metric-of-another-technique",
        _all(
            _set("spec.eval", {"fraction": 0.1}), _set("spec.checkpoint", {"keepBest": "pass_rate"})
        ),
        "spec.checkpoint.keepBest",
        "a metric the technique reports",
    ),
    Case(
        "export-best-without-keep-best",
        _all(_set("spec.eval", {"fraction": 0.1}), _set("spec.output.exportFrom", "best")),
        "spec.output.exportFrom",
        "needs checkpoint.keepBest",
    ),
    Case(
        "eval-fraction-above-half",
        _set("spec.eval", {"fraction": 0.9}),
        "spec.eval.fraction",
        "less than or equal to 0.5",
    ),
    Case(
        "3d-topology-for-v6e",
        _set("spec.resources", {"accelerator": "v6e-64", "topology": "4x4x4"}),
        "spec.resources.topology",
        "valid: 1x1, 2x2",
        server=False,
    ),
    Case(
        "too-many-gpus-per-node",
        _set("spec.resources", {"accelerator": "nvidia-l4", "gpusPerNode": 12}),
        "spec.resources.gpusPerNode",
        "at most 8 GPUs",
        server=False,
    ),
    Case(
        "name-too-long-for-pathways",
        _all(
            _set("metadata.name", "a-very-long-post-training-job-name-for-pathways-x"),
            _set("spec.output.uri", "gs://b/o"),
            _set(
                "spec.resources",
                {"accelerator": "v6e-256", "slices": 16, "pathways": {"enabled": True}},
            ),
        ),
        "metadata.name",
        "at most 22 characters",
    ),
    Case(
        "data-source-and-sources",
        _set("spec.data.sources", [{"source": "/data/other.jsonl"}]),
        "spec.data.source",
        "exactly one of spec.data.source and spec.data.sources",
    ),
    Case(
        "data-without-a-source",
        _set("spec.data", {"maxLength": 64}),
        "spec.data.source",
        "exactly one of spec.data.source and spec.data.sources",
    ),
    Case(
        "images-with-dpo",
        _all(
            _set("spec.technique", "dpo"),
            _set("spec.data.columns", {"images": "images"}),
        ),
        "spec.data.columns.images",
        "only supported with spec.technique sft",
    ),
    Case(
        "images-for-a-text-family",
        _all(
            _set("spec.model.family", "qwen3"),
            _set("spec.data.columns", {"images": "images"}),
        ),
        "spec.data.columns.images",
        "need a model with a vision tower",
    ),
    Case(
        "images-for-a-text-only-gemma",
        _all(
            _set("spec.model.source", "hf://google/gemma-3-1b-it"),
            _set("spec.data.columns", {"images": "images"}),
        ),
        "spec.data.columns.images",
        "has none",
        server=False,
    ),
    Case(
        "vision-tower-without-images",
        _set("spec.training.trainVisionTower", True),
        "spec.training.trainVisionTower",
        "needs images",
    ),
    Case(
        "vision-tower-with-lora",
        _all(
            _set("spec.training.trainVisionTower", True),
            _set("spec.data.columns", {"images": "images"}),
            _set("spec.lora", {"rank": 4}),
        ),
        "spec.training.trainVisionTower",
        "for a full fine-tune",
    ),
    Case(
        "eval-samples-with-images",
        _all(
            _set("spec.data.columns", {"images": "images"}),
            _set("spec.eval", {"fraction": 0.1}),
        ),
        "spec.eval.samples",
        "do not see images",
    ),
    Case("tracking-empty", _set("spec.tracking", {}), "spec.tracking", "mlflow, wandb or both"),
    Case(
        "tracking-mlflow-username-without-password",
        _set("spec.tracking", {"mlflow": {"usernameSecret": {"name": "basic", "key": "u"}}}),
        "spec.tracking.mlflow",
        "both usernameSecret and passwordSecret",
    ),
    Case(
        "tracking-mlflow-token-and-basic-auth",
        _set(
            "spec.tracking",
            {
                "mlflow": {
                    "tokenSecret": {"name": "t"},
                    "usernameSecret": {"name": "b", "key": "u"},
                    "passwordSecret": {"name": "b", "key": "p"},
                }
            },
        ),
        "spec.tracking.mlflow",
        "not both",
    ),
    Case(
        "tracking-uri-with-credentials",
        _set("spec.tracking", {"mlflow": {"trackingUri": "https://u:p@mlflow.example.com"}}),
        "spec.tracking.mlflow.trackingUri",
        "no credentials",
        server=False,
    ),
    Case(
        "tracking-run-name-unknown-field",
        _set("spec.tracking", {"wandb": {"project": "p", "runName": "{pod}"}}),
        "spec.tracking.wandb.runName",
        "not a run name field",
        server=False,
    ),
    Case(
        "tracking-wandb-bad-mode",
        _set("spec.tracking", {"wandb": {"project": "p", "mode": "sometimes"}}),
        "spec.tracking.wandb.mode",
        "offline",
    ),
    Case(
        "tracking-wandb-without-project",
        _set("spec.tracking", {"wandb": {"mode": "offline"}}),
        "spec.tracking.wandb.project",
        "required",
    ),
]
