"""The PostTrainJob API: pydantic models that are the one source of truth for the schema.

The CRD in crds/ is generated from these models (see `posttrain.api.crd`). Each field's
docstring becomes its description in `kubectl explain`. Field names are camelCase on the
wire (aliases) and snake_case in Python. This module must not import JAX or Kubernetes
client code: the operator image and the trainer both depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from posttrain.api import kube_values, locations, patterns, service_urls

GROUP = "posttrain.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PostTrainJob"
PLURAL = "posttrainjobs"
SINGULAR = "posttrainjob"
SHORT_NAMES = ["ptj"]

# Exit code the trainer uses for errors the user must fix (bad data, bad config).
# The rendered JobSet fails at once on it instead of restarting.
USER_ERROR_EXIT_CODE = 65

URI_MAX = 2048
NAME_MAX = 253
REGEX_MAX = 1024
INT32_MAX = 2**31 - 1
LENGTH_MAX = 1048576  # tokens


def _checked(check: Callable[..., str | None], *args: Any) -> AfterValidator:
    """A validator from a pure check that returns why a value is bad (or None)."""

    def validate(value: str) -> str:
        if (problem := check(value, *args)) is not None:
            raise ValueError(problem)
        return value

    return AfterValidator(validate)


def _not_root(uri: str) -> str | None:
    if uri.startswith("/") and uri.strip("/") == "":
        return "cannot be / (outputs go to a directory of their own)"
    return None


# Field types whose values are checked beyond the CRD's schema (see posttrain.api.locations,
# patterns and kube_values): validate, the admission webhook and the trainer run them.
ModelLocation = Annotated[
    str, _checked(locations.location_error, (locations.PATH, locations.GS, locations.HF))
]
FileLocation = Annotated[str, _checked(locations.location_error, (locations.PATH, locations.GS))]
OutputLocation = Annotated[FileLocation, _checked(_not_root)]
GcsLocation = Annotated[str, _checked(locations.location_error, (locations.GS,))]
ImageReference = Annotated[str, _checked(locations.image_error)]
UserRegex = Annotated[str, _checked(patterns.regex_error)]
Quantity = Annotated[str, _checked(kube_values.quantity_error)]
CpuQuantity = Annotated[str, _checked(kube_values.cpu_error)]
PriorityClassName = Annotated[str, _checked(kube_values.priority_class_error)]


class KubeModel(BaseModel):
    """Base for API objects: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        use_enum_values=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    def to_wire(self) -> dict[str, Any]:
        """The object as Kubernetes stores it: camelCase keys, unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class Technique(StrEnum):
    sft = "sft"
    grpo = "grpo"
    dpo = "dpo"
    distill = "distill"


class ModelFamily(StrEnum):
    auto = "auto"
    llama3 = "llama3"
    qwen2 = "qwen2"
    qwen3 = "qwen3"
    gemma2 = "gemma2"
    gemma3 = "gemma3"


class DType(StrEnum):
    bfloat16 = "bfloat16"
    float32 = "float32"
    float16 = "float16"


class ModelSpec(KubeModel):
    """The base model to post-train."""

    source: ModelLocation = Field(min_length=1, max_length=URI_MAX)
    """Where the Hugging Face safetensors checkpoint lives: a local or mounted path
    (/models/qwen3), gs://bucket/path, or hf://org/name (downloaded by the trainer, using
    hfTokenSecret when set)."""

    family: ModelFamily = ModelFamily.auto
    """Model architecture. auto reads model_type from the checkpoint's config.json."""

    dtype: DType = DType.bfloat16
    """Dtype of the forward and backward passes, and of frozen weights (the LoRA base, a
    DPO/GRPO reference copy, a distillation teacher). Trained weights are float32 master
    copies, cast to this dtype for each forward pass: every weight of a full fine-tune,
    or the LoRA adapters. Optimizer state, checkpoints, logits and losses are float32.
    Exports: a LoRA adapter in float32, a merged LoRA model in this dtype, a full
    fine-tune in float32."""

    layers: int | None = Field(default=None, ge=1, le=1000)
    """Use only the first N decoder layers of the source: a smaller model initialised from
    it (a distillation student, a quick experiment). Exports say N layers. Default: all."""


class LoraSpec(KubeModel):
    """Low-rank adapters. When this block is absent the whole model is fine-tuned."""

    rank: int = Field(default=16, ge=1, le=1024)
    """Rank r of the adapter matrices."""

    alpha: float = Field(default=32.0, gt=0, le=1_000_000)
    """Scaling numerator: adapters are scaled by alpha / rank (as in PEFT's lora_alpha)."""

    target_modules: UserRegex | None = Field(default=None, min_length=1, max_length=REGEX_MAX)
    """Regular expression over module paths that get adapters. Default: the attention and
    MLP projections of the model family. A pattern that matches no module is an error."""

    restore_from: ModelLocation | None = Field(default=None, min_length=1, max_length=URI_MAX)
    """A PEFT adapter directory (adapter_model.safetensors + adapter_config.json) to start
    from instead of zero-initialised adapters."""


class DataFormat(StrEnum):
    auto = "auto"
    jsonl = "jsonl"
    json = "json"
    parquet = "parquet"
    arrow = "arrow"
    arrayrecord = "arrayrecord"


class DataColumns(KubeModel):
    """Names of the dataset columns the trainer reads. Only the columns the technique
    needs must exist."""

    prompt: str = Field(default="prompt", min_length=1, max_length=NAME_MAX)
    """Prompt text (sft with prompt/completion, grpo, dpo)."""

    completion: str = Field(default="completion", min_length=1, max_length=NAME_MAX)
    """Completion text for prompt/completion SFT and distillation."""

    messages: str = Field(default="messages", min_length=1, max_length=NAME_MAX)
    """Chat messages, a list of {role, content}. Used when the column exists."""

    chosen: str = Field(default="chosen", min_length=1, max_length=NAME_MAX)
    """Preferred completion (dpo)."""

    rejected: str = Field(default="rejected", min_length=1, max_length=NAME_MAX)
    """Dispreferred completion (dpo)."""

    answer: str = Field(default="answer", min_length=1, max_length=NAME_MAX)
    """Reference answer that rewards check (grpo)."""

    images: str | None = Field(default=None, min_length=1, max_length=NAME_MAX)
    """Images of multimodal SFT (Gemma 3 with its vision tower): the column holding each
    row's images, in the order of the messages' `{"type": "image"}` parts. An image is a
    path (relative paths resolve against the dataset's directory), a gs:// URI, or the
    image itself (bytes, or `{bytes, path}` as `datasets` stores an Image feature); a
    row may hold one image or a list. Unset: the job is text-only."""


class DataSourceSpec(KubeModel):
    """One source of a weighted mixture (spec.data.sources)."""

    source: FileLocation = Field(min_length=1, max_length=URI_MAX)
    """A data file, a directory of them, or a `datasets` save_to_disk directory, as
    spec.data.source."""

    weight: float = Field(default=1.0, gt=0, le=1_000_000)
    """Share of the examples drawn from this source, relative to the others' weights.
    May change when a run resumes: the position in every source is kept."""

    name: str | None = Field(
        default=None, min_length=1, max_length=NAME_MAX, pattern=r"^[A-Za-z0-9_.-]+$"
    )
    """Name in TensorBoard (data/source/<name>) and in held-out metrics. Default: the
    source's file or directory name."""


class DataSpec(KubeModel):
    """Training data."""

    source: FileLocation | None = Field(default=None, min_length=1, max_length=URI_MAX)
    """A .jsonl, .json, .parquet, .arrow or .array_record file, a directory of them, or a
    Hugging Face `datasets` directory made by save_to_disk; local or gs://. Rows are read
    when a batch needs them. Either source or sources."""

    sources: list[DataSourceSpec] | None = Field(default=None, min_length=1, max_length=32)
    """A weighted mixture of sources (same columns), interleaved deterministically by
    weight. Either source or sources."""

    format: DataFormat = DataFormat.auto
    """File format; auto decides from the file extension. arrayrecord: one JSON object a
    record."""

    max_bad_rows: int = Field(default=0, ge=0, le=1_000_000_000)
    """Malformed rows (invalid JSON, missing columns, bad messages) to skip, each logged
    with its file and line, before the run fails; 0: the first one fails it."""

    split: str = Field(default="train", min_length=1, max_length=NAME_MAX)
    """Split to read from a `datasets` DatasetDict directory."""

    columns: DataColumns = Field(default_factory=DataColumns)
    """Column mapping."""

    chat_template: FileLocation | None = Field(default=None, min_length=1, max_length=URI_MAX)
    """A Jinja chat template file. Default: the tokenizer's own chat template."""

    max_length: int = Field(default=1024, ge=8, le=LENGTH_MAX)
    """Longest tokenized sequence; longer examples are truncated."""

    packing: bool = False
    """Pack several short examples into each sequence (attention stays within an example)."""

    completion_only_loss: bool = True
    """Compute the loss on completion (assistant) tokens only."""

    shuffle: bool = True
    """Shuffle examples each epoch, deterministically from training.seed."""


class Schedule(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class Optimizer(StrEnum):
    adamw = "adamw"
    adafactor = "adafactor"
    sgd = "sgd"


class Remat(StrEnum):
    auto = "auto"
    none = "none"
    block = "block"
    layer = "layer"
    dots = "dots"


class Attention(StrEnum):
    auto = "auto"
    dense = "dense"
    flash = "flash"


class LayerLoop(StrEnum):
    auto = "auto"
    scan = "scan"
    unroll = "unroll"


class TrainingSpec(KubeModel):
    """Optimisation settings."""

    steps: int = Field(default=1000, ge=1, le=10_000_000)
    """Number of optimizer steps."""

    batch_size: int = Field(default=8, ge=1, le=1_000_000)
    """Global batch size per optimizer step, split across hosts: sequences for sft,
    dpo and distill (a preference pair counts once), prompts for grpo (each sampled
    grpo.numGenerations times)."""

    gradient_accumulation: int = Field(default=1, ge=1, le=4096)
    """Micro-batches per optimizer step; batchSize must divide by it."""

    remat: Remat = Remat.auto
    """Rematerialisation (activation checkpointing): what the backward pass recomputes
    rather than keeps. layer: keep only each decoder layer's input and recompute the
    layer during backward (about a third more compute, a fraction of the memory); block:
    recompute the attention and the MLP of each layer separately (keeps a little more);
    none: keep every layer's activations (fastest, most memory); dots: layer, but keep
    the outputs of the layer's projections (its matmuls without a batch dimension), so
    backward recomputes only element-wise work and the attention scores: about as fast as
    none, with memory between layer and none. auto: layer on TPUs and GPUs, none on
    CPU."""

    attention: Attention = Attention.auto
    """How attention is computed in training forward passes. flash: a fused kernel that
    never materialises the [sequence x sequence] scores (Pallas splash attention on TPU,
    cuDNN flash attention on GPU), keeping packed examples apart by their segment ids
    and Gemma's local layers to their sliding window; dense: the scores in full (the
    memory grows with the square of data.maxLength). auto: flash on TPUs and GPUs, dense
    on CPU. Decoding with a KV cache (generation, GRPO sampling) is always dense."""

    layer_loop: LayerLoop = LayerLoop.auto
    """How the decoder layers are compiled. scan: the layers' weights stacked and one layer
    run in a loop over them, so the program holds one layer's code whatever the depth
    (the compile and a restarted job's reload of the compiled step take a fraction of
    unroll's; Llama 3, Qwen2 and Qwen3, not with grpo); unroll: every layer its own code.
    auto: scan on TPUs where it applies (a v5e ran the scanned step within 1.2% of
    unroll's time, compiled it in 16 s instead of 104 s and restarted a job in half the
    time), unroll elsewhere."""

    learning_rate: float = Field(default=1e-4, gt=0, le=1.0)
    """Peak learning rate."""

    warmup_steps: int = Field(default=0, ge=0, le=10_000_000)
    """Linear warmup steps from 0 to learningRate."""

    schedule: Schedule = Schedule.cosine
    """Decay after warmup."""

    optimizer: Optimizer = Optimizer.adamw
    """Optimizer."""

    weight_decay: float = Field(default=0.0, ge=0, le=10)
    """Decoupled weight decay (adamw)."""

    max_grad_norm: float = Field(default=1.0, ge=0, le=1_000_000)
    """Clip gradients to this global norm; 0 disables clipping."""

    seed: int = Field(default=0, ge=0, le=INT32_MAX)
    """Seed for initialisation, shuffling and sampling."""

    log_every_steps: int = Field(default=10, ge=1, le=10_000_000)
    """How often to write TensorBoard scalars and report progress."""

    train_vision_tower: bool = False
    """Multimodal SFT (data.columns.images), full fine-tune: train the vision tower's
    weights too. By default the vision tower is frozen and the multimodal projector and
    the language model train; LoRA (spec.lora) adapts the language model only."""


class PreflightSpec(KubeModel):
    """The check before a TPU job takes its TPUs: the operator compiles the job's train
    step for its slice topology with the TPU compiler, in a short CPU pod of the trainer
    image (no TPU used), and fails the job with the compiler's figures when it does not
    fit in HBM, before its JobSet and Kueue Workload exist."""

    compile: bool | None = None
    """true: compile before the JobSet is made; false: do not (the fast estimate decides
    alone); unset: the installation's default (the chart's preflight.compile, on in the
    chart). TPU jobs only: CPU and GPU jobs are never compiled ahead."""


class SecretKeyRef(KubeModel):
    """A key of a Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=NAME_MAX, pattern=kube_values.DNS_SUBDOMAIN)
    """Secret name."""

    key: str = Field(
        default="token",
        min_length=1,
        max_length=NAME_MAX,
        # A Secret key as the API server checks one in a pod (IsConfigMapKey): not `.`,
        # `..` or starting with `..`, else the JobSet is made and its Jobs are refused.
        pattern=r"^([-_a-zA-Z0-9][-._a-zA-Z0-9]*|\.[-_a-zA-Z0-9][-._a-zA-Z0-9]*)$",
    )
    """Key within the Secret (letters, digits, `-`, `_`, `.`; not `.`, `..` or `..x`)."""


class RewardType(StrEnum):
    exact_answer = "exactAnswer"
    regex_format = "regexFormat"
    length_penalty = "lengthPenalty"
    python = "python"
    http = "http"


ServiceUrl = Annotated[str, _checked(service_urls.service_url_error)]
HeaderName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$")]


class ServiceSpec(KubeModel):
    """An HTTP service the trainer calls: where, how long to wait, how to authenticate."""

    url: ServiceUrl = Field(max_length=URI_MAX)
    """http(s):// URL: a Kubernetes Service by its cluster DNS name
    (http://verifier.default.svc:8080/score) or any address, without credentials."""

    timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Seconds to wait for one request."""

    retries: int = Field(default=3, ge=0, le=10)
    """Further tries of a request that failed (connection refused, timeout, an HTTP 5xx
    or 429, a malformed answer), after 0.5 s, 1 s, 2 s ... (at most 30 s)."""

    auth_secret: SecretKeyRef | None = None
    """A Secret whose value is sent in authHeader (with Authorization, as
    `Bearer <value>`). Never in the URL, the job's config, logs or status."""

    auth_header: HeaderName = "Authorization"
    """The header that carries authSecret's value."""


class HttpRewardSpec(ServiceSpec):
    """A verifier service that scores completions. It gets POSTs of
    {"items": [{"prompt", "completion", "answer", "metadata"}]} and answers
    {"rewards": [number or null, ...]}, one per item (null: no reward for that item).
    `posttrain run` reads authSecret's value from POSTTRAIN_REWARD_<index>_AUTH."""

    batch_size: int = Field(default=16, ge=1, le=4096)
    """Completions per POST."""

    concurrency: int = Field(default=4, ge=1, le=64)
    """POSTs in flight at once."""

    max_failure_fraction: float = Field(default=0.5, ge=0, le=1)
    """When more than this share of a step's completions got no reward, the step's
    missing rewards are asked for again (twice at most, after the retries' backoff);
    completions still without one are dropped from their groups and counted
    (train/reward_failures), never scored 0."""

    max_failures: int = Field(default=1000, ge=0, le=INT32_MAX)
    """Once more completions than this went without a reward since the trainer started,
    the job fails, naming the service and its last error."""


class RewardSpec(KubeModel):
    """One reward function; GRPO sums the weighted rewards."""

    type: RewardType
    """exactAnswer: 1 when the last number in the completion (with spec.grpo.agent, in
    the model's last turn, not a tool's result) equals the answer column; regexFormat: 1
    when the completion matches pattern; lengthPenalty: minus the fraction by which the
    completion exceeds targetLength; python: a user function; http: a verifier service
    at url scores batches of completions."""

    weight: float = Field(default=1.0, ge=-1000, le=1000)
    """Multiplier for this reward."""

    pattern: UserRegex | None = Field(default=None, min_length=1, max_length=REGEX_MAX)
    """Regular expression for regexFormat."""

    target_length: int | None = Field(default=None, ge=1, le=LENGTH_MAX)
    """Completion length in tokens above which lengthPenalty applies."""

    function: str | None = Field(
        default=None,
        max_length=NAME_MAX,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
    )
    """Import path module:callable of fn(prompts, completions, **columns) -> list[float]."""

    http: HttpRewardSpec | None = None
    """http: the verifier service and how to call it."""


class ToolType(StrEnum):
    calculator = "calculator"
    http = "http"
    python = "python"


class ToolSpec(KubeModel):
    """A tool the model may call during an episode (spec.grpo.agent)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The name the model calls it by: a Python identifier, unique in the job."""

    type: ToolType
    """calculator: built in, deterministic ({"a": number, "b": number, "op": "+", "-",
    "*" or "/"}); http: a service at http.url gets a POST of the call's arguments (JSON)
    and answers the tool's result; python: function(**arguments) -> result, imported in
    the trainer."""

    description: str | None = Field(default=None, min_length=1, max_length=1024)
    """What the tool does, shown to the model. Default: the calculator's own; needed
    for http and python tools."""

    parameters: dict[str, Any] | None = Field(
        default=None, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
    """The arguments as a JSON schema object ({"type": "object", "properties": ...}),
    shown to the model. Default: the calculator's own; needed for http and python."""

    http: ServiceSpec | None = None
    """http: the tool's service. `posttrain run` reads authSecret's value from
    POSTTRAIN_TOOL_<NAME>_AUTH."""

    function: str | None = Field(
        default=None,
        max_length=NAME_MAX,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
    )
    """python: import path module:callable, called with the call's arguments."""


class ToolFormat(StrEnum):
    auto = "auto"
    chatml = "chatml"
    llama3 = "llama3"
    gemma = "gemma"


class AgentSpec(KubeModel):
    """Multi-turn episodes: the model's turn is read for tool calls, each call runs and
    its result is appended as a tool message, and the episode goes on until a turn calls
    no tool, maxTurns turns, or maxCompletionLength tokens after the prompt (the model's
    and the tools' together). Only the model's tokens carry loss."""

    max_turns: int = Field(default=4, ge=1, le=64)
    """Model turns per episode at most."""

    tools: list[ToolSpec] = Field(default_factory=list, max_length=32)
    """The tools the model may call."""

    tool_format: ToolFormat = ToolFormat.auto
    """How tool calls and results are written: chatml (Qwen2/3, SmolLM2:
    <tool_call>{"name", "arguments"}</tool_call>, results in <tool_response>), llama3
    (a turn that is one JSON object {"name", "parameters"}, results as an ipython
    message) or gemma (```tool_code name(a=1) ```, results in ```tool_output```).
    auto: from the chat template's turn markers."""

    max_tool_output_chars: int = Field(default=2000, ge=16, le=1048576)
    """A tool result longer than this is cut (and said so to the model)."""

    turn_length: int | None = Field(default=None, ge=1, le=LENGTH_MAX)
    """Tokens the model may write in one turn. Default: maxCompletionLength."""

    instructions: str | None = Field(default=None, min_length=1, max_length=16384)
    """What the model is told about its tools and how to call them, put before the
    prompt as a system turn (gemma: at the start of the first user turn). Default: the
    family's standard text listing every tool's JSON schema (Qwen's for chatml). Set it
    to the text a model was fine-tuned with, or to a shorter one: the standard text
    takes about 100 tokens plus each tool's schema, in every episode's context."""


class GrpoLoss(StrEnum):
    grpo = "grpo"
    gspo_token = "gspo-token"
    dapo = "dapo"
    dr_grpo = "dr-grpo"


class RolloutEngine(StrEnum):
    vanilla = "vanilla"
    vllm = "vllm"


class RolloutPlacement(StrEnum):
    colocated = "colocated"
    disaggregated = "disaggregated"


class RolloutSpec(KubeModel):
    """Where GRPO's rollouts run: on the trainer's devices, or on a disjoint share of the
    job's devices (the sampler), fed the policy's trainable weights at each sync."""

    placement: RolloutPlacement = RolloutPlacement.colocated
    """colocated: the sampler shares the trainer's devices and weights. disaggregated: the
    job's devices are split into a trainer mesh and a sampler mesh (one program: one
    process, or Pathways on multi-host), sized by samplerFraction or samplerSlices."""

    sampler_fraction: float | None = Field(default=None, gt=0, lt=1)
    """Share of the job's devices for the sampler (one slice; a whole number of devices,
    e.g. 0.25 of 8 = 2)."""

    sampler_slices: int | None = Field(default=None, ge=1, le=63)
    """Whole slices for the sampler, out of resources.slices (TPU multi-slice)."""


class GrpoSpec(KubeModel):
    """Group Relative Policy Optimization settings (technique grpo)."""

    num_generations: int = Field(default=4, ge=2, le=1024)
    """Completions sampled per prompt; advantages are relative within the group."""

    beta: float = Field(default=0.04, ge=0, le=100)
    """KL penalty to the reference model; 0 skips the reference model."""

    epsilon: float = Field(default=0.2, gt=0, le=1)
    """Clipping range of the policy ratio: [1 - epsilon, 1 + epsilonHigh]."""

    epsilon_high: float | None = Field(default=None, gt=0, le=1)
    """Upper clip of the policy ratio (DAPO's clip-higher). Default: 0.28 with
    lossAlgorithm dapo, else epsilon."""

    loss_algorithm: GrpoLoss = GrpoLoss.grpo
    """grpo (per-sequence token mean, std-normalised advantages), gspo-token (GSPO's
    sequence-level ratio), dapo (clip-higher, token-level loss over the batch, dynamic
    sampling: prompt groups whose rewards are all equal are resampled) or dr-grpo
    (Dr. GRPO: no std normalisation of advantages, no per-sequence length
    normalisation)."""

    max_prompt_length: int = Field(default=256, ge=1, le=LENGTH_MAX)
    """Prompt tokens kept (left-truncated)."""

    max_completion_length: int = Field(default=256, ge=1, le=LENGTH_MAX)
    """Tokens generated per completion."""

    temperature: float = Field(default=0.9, gt=0, le=10)
    """Sampling temperature for rollouts."""

    rollout_engine: RolloutEngine = RolloutEngine.vanilla
    """vanilla (Tunix's JAX sampler, runs anywhere). vllm is refused until a vLLM build
    matches the trainer image's JAX."""

    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """Placement of the sampler: colocated (default) or disaggregated."""

    max_staleness: int = Field(default=0, ge=0, le=8)
    """Asynchronous rollouts: with k >= 1 the sampler generates the rollouts of the next k
    steps while the current step trains, from a policy at most k versions old (the loss
    corrects the gap, decoupled PPO). 0: on-policy, each step waits for its rollouts."""

    rewards: list[RewardSpec] = Field(min_length=1, max_length=16)
    """Reward functions, summed with their weights."""

    agent: AgentSpec | None = None
    """Multi-turn episodes with tools; absent: one completion per rollout."""


class DpoAlgorithm(StrEnum):
    dpo = "dpo"
    orpo = "orpo"


class DpoSpec(KubeModel):
    """Preference optimisation settings (technique dpo)."""

    algorithm: DpoAlgorithm = DpoAlgorithm.dpo
    """dpo (with a frozen reference model) or orpo (reference-free)."""

    beta: float = Field(default=0.1, gt=0, le=100)
    """Strength of the preference term."""

    max_prompt_length: int = Field(default=512, ge=1, le=LENGTH_MAX)
    """Prompt tokens kept (left-truncated)."""


class DistillSpec(KubeModel):
    """Knowledge distillation settings (technique distill)."""

    teacher: ModelSpec
    """The teacher model; it shares the student's tokenizer."""

    temperature: float = Field(default=2.0, gt=0, le=100)
    """Softmax temperature applied to both teacher and student logits."""

    alpha: float = Field(default=0.5, ge=0, le=1)
    """Weight of the distillation loss; 1 - alpha weighs the hard-label loss."""


class EvalMetric(StrEnum):
    loss = "loss"
    perplexity = "perplexity"
    preference_accuracy = "preference_accuracy"
    reward_margin = "reward_margin"
    mean_reward = "mean_reward"
    pass_rate = "pass_rate"


# The held-out metrics each technique reports (spec.eval), and those where lower is better.
EVAL_METRICS: dict[str, tuple[str, ...]] = {
    "sft": ("loss", "perplexity"),
    "distill": ("loss", "perplexity"),
    "dpo": ("loss", "preference_accuracy", "reward_margin"),
    "grpo": ("mean_reward", "pass_rate"),
}
LOWER_IS_BETTER = frozenset({"loss", "perplexity"})


class CheckpointSpec(KubeModel):
    """Orbax checkpoints (params, optimizer state and data position)."""

    every_steps: int = Field(default=500, ge=1, le=10_000_000)
    """Save every N steps, and at the end and on SIGTERM."""

    keep: int = Field(default=3, ge=1, le=1000)
    """Number of most recent checkpoints kept."""

    async_: bool = Field(default=True, alias="async")
    """Write checkpoints in the background while training continues. Where the job leaves
    it unset, a CPU job saves in the foreground: there a background save's copy of the
    trained state is a second one in the host's memory."""

    keep_best: EvalMetric | None = None
    """Also keep the checkpoint with the best held-out value of this spec.eval metric
    (lowest loss or perplexity, highest of the others) under checkpoints-best/. Resume
    still continues from the newest checkpoint."""


class EvalSpec(KubeModel):
    """Held-out evaluation during training: every everySteps steps and at the end. Metrics
    go to TensorBoard (eval/...), eval.json under output.uri and status.progress.eval*."""

    source: FileLocation | None = Field(default=None, min_length=1, max_length=URI_MAX)
    """Held-out data in the same format and columns as spec.data. Absent: `fraction` of
    the training data is held out (the same rows on every host, never trained on)."""

    split: str = Field(default="test", min_length=1, max_length=NAME_MAX)
    """Split of a Hugging Face `save_to_disk` dataset at source."""

    fraction: float = Field(default=0.05, gt=0, le=0.5)
    """Share of the training examples held out when there is no source."""

    every_steps: int = Field(default=0, ge=0, le=10_000_000)
    """Evaluate every N optimizer steps; 0: only at the end."""

    max_batches: int = Field(default=8, ge=1, le=100_000)
    """At most this many batches of spec.training.batchSize per evaluation."""

    samples: int = Field(default=2, ge=0, le=16)
    """Greedy generations for the first held-out prompts, written to TensorBoard as text
    and eval.json (single-host runs). GRPO's are the completions its evaluation scored
    (whole episodes with spec.grpo.agent)."""

    max_new_tokens: int = Field(default=64, ge=1, le=4096)
    """Length limit of those generations (GRPO's: spec.grpo.maxCompletionLength)."""


class ExportFormat(StrEnum):
    auto = "auto"
    adapter = "adapter"
    merged = "merged"
    none = "none"


class ExportFrom(StrEnum):
    last = "last"
    best = "best"


class OutputSpec(KubeModel):
    """Where results go: checkpoints/, tensorboard/ and hf/ under one URI."""

    uri: OutputLocation = Field(min_length=1, max_length=URI_MAX)
    """gs://bucket/prefix, or a path (on a mounted volume in the cluster)."""

    export_hf: ExportFormat = Field(default=ExportFormat.auto, alias="exportHF")
    """Hugging Face export at the end: adapter (PEFT format, LoRA only), merged (full
    safetensors model), none; auto is adapter with LoRA and merged without."""

    export_from: ExportFrom = ExportFrom.last
    """Which weights the end-of-run export holds: last (the final step) or best (the
    checkpoint.keepBest checkpoint)."""

    persistent_volume_claim: str | None = Field(
        default=None, max_length=NAME_MAX, pattern=kube_values.DNS_SUBDOMAIN
    )
    """A PersistentVolumeClaim mounted at uri in the trainer pods (uri is then a path)."""


class PathwaysSpec(KubeModel):
    """Run the job through Pathways (TPU only): a head pod with resource manager and
    proxy sidecars drives the TPU workers."""

    enabled: bool = False
    """Use Pathways."""

    server_image: ImageReference | None = Field(default=None, max_length=URI_MAX)
    """Image of pathways-rm and pathways-worker. Default: the operator's setting."""

    proxy_image: ImageReference | None = Field(default=None, max_length=URI_MAX)
    """Image of pathways-proxy. Default: the operator's setting."""

    gcs_scratch_location: GcsLocation | None = Field(
        default=None, max_length=URI_MAX, pattern=r"^gs://"
    )
    """gs:// scratch space for the proxy. Default: <output.uri>/pathways-scratch."""

    head_node_pool: str | None = Field(
        default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
    )
    """GKE node pool (label cloud.google.com/gke-nodepool) of the pathways-head pod, a CPU
    pool. Default: the operator's setting (chart value defaults.pathwaysHeadNodePool)."""


class ResourcesSpec(KubeModel):
    """What the job runs on."""

    accelerator: str = Field(
        default="cpu", min_length=1, max_length=63, pattern=kube_values.DNS_LABEL
    )
    """A TPU slice by device name (v6e-256, v5p-128, v5litepod-8, v4-32, tpu7x-128), a GPU
    type (nvidia-h100-80gb, nvidia-a100-80gb, nvidia-h200-141gb, nvidia-b200, nvidia-l4),
    or cpu."""

    topology: str | None = Field(default=None, max_length=32, pattern=r"^[0-9]+(x[0-9]+){1,2}$")
    """TPU topology (e.g. 4x8). Default: the shape GKE offers for the device's chip count
    (the most compact one where there are several)."""

    machine_type: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9-]+$")
    """TPU VM type, for slices GKE builds from different VMs: a 2x4 slice is two
    ct6e-standard-4t hosts (the default) or one ct6e-standard-8t host. The pods select
    it with the node label node.kubernetes.io/instance-type."""

    host_network: bool = True
    """TPU pods use their node's network (hostNetwork, dnsPolicy ClusterFirstWithHostNet),
    as GKE and xpk run multi-host TPU jobs; false keeps pod networking."""

    slices: int = Field(default=1, ge=1, le=64)
    """Number of TPU slices (multi-slice over DCN)."""

    nodes: int = Field(default=1, ge=1, le=1024)
    """Number of GPU or CPU nodes."""

    gpus_per_node: int | None = Field(default=None, ge=1, le=16)
    """GPUs per node. Default: the most the GPU type offers in one node."""

    cpu: CpuQuantity | None = Field(default=None, max_length=32, pattern=kube_values.QUANTITY)
    """CPU request of each trainer container, e.g. "8"."""

    memory: Quantity | None = Field(default=None, max_length=32, pattern=kube_values.QUANTITY)
    """Memory request of each trainer container, e.g. "64Gi"."""

    pathways: PathwaysSpec = Field(default_factory=PathwaysSpec)
    """Pathways settings."""


class SchedulingSpec(KubeModel):
    """Queueing, priority and restarts."""

    queue: str | None = Field(
        default=None, max_length=kube_values.LABEL_VALUE_MAX, pattern=kube_values.DNS_SUBDOMAIN
    )
    """Kueue LocalQueue name; the JobSet waits (phase Queued) until Kueue admits it."""

    priority_class: PriorityClassName | None = Field(
        default=None, max_length=NAME_MAX, pattern=kube_values.DNS_SUBDOMAIN
    )
    """PriorityClass (scheduling.k8s.io) of the job's pods: the scheduler may preempt
    lower-priority pods for them, and Kueue takes the job's priority from it unless
    workloadPriorityClass is set. It must exist."""

    workload_priority_class: str | None = Field(
        default=None, max_length=kube_values.LABEL_VALUE_MAX, pattern=kube_values.DNS_SUBDOMAIN
    )
    """Kueue WorkloadPriorityClass (label kueue.x-k8s.io/priority-class): the job's
    priority in Kueue's queueing and preemption, without changing the pods' priority. It
    must exist."""

    max_restarts: int = Field(default=3, ge=0, le=1000)
    """Whole-job restarts after failures. Preemptions do not count; errors in the job's
    own input (exit code 65) fail at once."""

    suspend: bool = False
    """Suspend the job (its pods are removed); set back to false to resume from the last
    checkpoint."""

    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=INT32_MAX)
    """Delete the JobSet (not the PostTrainJob) this long after it finishes."""

    progress_deadline_seconds: int = Field(default=1800, ge=0, le=INT32_MAX)
    """Restart the job when its trainer reports no progress (a step, an evaluation, a
    checkpoint) for this long: a hung collective or host. Counted against maxRestarts;
    with none left the job fails. Before the first step of each start (loading, the
    first compile) and while exporting, 3 times as long. The trainer's own watchdog
    exits with every thread's stack after the same deadline. 0: never."""


TrackingUri = Annotated[str, _checked(locations.tracking_uri_error)]
RUN_NAME_FIELDS = ("name", "namespace", "uid", "technique")


def _run_name_error(template: str) -> str | None:
    """Why a run name template is not one (only {name}, {namespace}, {uid}, {technique})."""
    import string

    try:
        fields = [f for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return f"is not a run name template ({e}); write {{name}}, {{namespace}}, {{uid}}"
    for field in fields:
        if field not in RUN_NAME_FIELDS:
            return f"{{{field}}} is not a run name field; use {', '.join(RUN_NAME_FIELDS)}"
    return None


RunNameTemplate = Annotated[str, _checked(_run_name_error)]


class MlflowSpec(KubeModel):
    """An MLflow tracking server that the trainer (process 0) reports the run to."""

    tracking_uri: TrackingUri | None = Field(default=None, max_length=URI_MAX)
    """http(s)://host[:port][/path] of the tracking server, without credentials. Default:
    the cluster's (the operator's chart value tracking.mlflow.trackingUri)."""

    experiment: str | None = Field(default=None, min_length=1, max_length=500)
    """Experiment name (created when missing). Default: the job's namespace (`default`
    for `posttrain run`)."""

    run_name: RunNameTemplate = Field(default="{name}", min_length=1, max_length=250)
    """Run name: a template of {name}, {namespace}, {uid} and {technique}."""

    token_secret: SecretKeyRef | None = None
    """Secret holding a bearer token (MLFLOW_TRACKING_TOKEN)."""

    username_secret: SecretKeyRef | None = None
    """Secret holding the basic-auth user name (MLFLOW_TRACKING_USERNAME), with
    passwordSecret."""

    password_secret: SecretKeyRef | None = None
    """Secret holding the basic-auth password (MLFLOW_TRACKING_PASSWORD), with
    usernameSecret."""


class WandbMode(StrEnum):
    online = "online"
    offline = "offline"


class WandbSpec(KubeModel):
    """A Weights & Biases project that the trainer (process 0) reports the run to."""

    project: str = Field(min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$")
    """Project name."""

    entity: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$")
    """Team or user that owns the project. Default: the API key's default entity."""

    run_name: RunNameTemplate = Field(default="{name}", min_length=1, max_length=128)
    """Run name: a template of {name}, {namespace}, {uid} and {technique}."""

    mode: WandbMode = WandbMode.online
    """online (report as the run goes) or offline (write the run under
    output.uri/wandb/, for `wandb sync` later)."""

    base_url: TrackingUri | None = Field(default=None, max_length=URI_MAX)
    """A W&B server of your own (WANDB_BASE_URL), without credentials. Default: W&B's."""

    api_key_secret: SecretKeyRef | None = None
    """Secret holding the API key (WANDB_API_KEY); needed online."""


class NetworkSpec(KubeModel):
    """The job's network (spec.network)."""

    restrict_egress: bool = False
    """Make a NetworkPolicy for the job's pods that lets them reach only the cluster's
    DNS, the job's own pods, the namespaces of the services the job names (spec.grpo's
    verifier and tool URLs, the MLflow URI), HTTPS (TCP 443 and 6443: the API server,
    object stores, model hubs), the other ports of services outside the cluster that it
    names, and the node's metadata server (Workload Identity). Enforced where the
    cluster's network plugin enforces NetworkPolicies."""


class TrackingSpec(KubeModel):
    """Experiment tracking: the spec as parameters, every TensorBoard metric at its step,
    the final phase and goodput, the exported adapter's config and model card and
    eval.json as artifacts. A tracker that is down never stops training."""

    mlflow: MlflowSpec | None = None
    """Report to an MLflow tracking server (the trainer image needs posttrain[mlflow])."""

    wandb: WandbSpec | None = None
    """Report to Weights & Biases (the trainer image needs posttrain[wandb])."""

    log_weights: bool = False
    """Also upload the exported weights (hf/) as artifacts; they can be large."""


# Cross-field rules live in posttrain.api.rules (one list, enforced both as CEL in the CRD
# and in Python by `posttrain.api.validate`).


class PostTrainJobSpec(KubeModel):
    """What to train, on what, and where results go."""

    technique: Technique = Technique.sft
    """sft (supervised fine-tuning), grpo, dpo or distill."""

    model: ModelSpec
    """The base model."""

    lora: LoraSpec | None = None
    """LoRA adapters; absent means a full fine-tune."""

    data: DataSpec
    """Training data."""

    training: TrainingSpec = Field(default_factory=TrainingSpec)
    """Optimisation settings."""

    grpo: GrpoSpec | None = None
    """GRPO settings; required for, and only allowed with, technique grpo."""

    dpo: DpoSpec | None = None
    """DPO/ORPO settings; only allowed with technique dpo."""

    distill: DistillSpec | None = None
    """Distillation settings; required for, and only allowed with, technique distill."""

    eval: EvalSpec | None = None
    """Held-out evaluation; absent: none."""

    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpointing."""

    output: OutputSpec
    """Where outputs go."""

    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Accelerators."""

    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Queueing, priority and restarts."""

    preflight: PreflightSpec | None = None
    """The TPU compiler's check before the job takes TPUs; absent: the installation's
    default."""

    image: ImageReference | None = Field(default=None, max_length=URI_MAX)
    """Trainer image. Default: the operator's configured trainer image."""

    hf_token_secret: SecretKeyRef | None = Field(default=None, alias="hfTokenSecret")
    """Secret holding a Hugging Face token, passed to the trainer as HF_TOKEN."""

    tracking: TrackingSpec | None = None
    """Experiment tracking (MLflow, Weights & Biases); absent: TensorBoard only."""

    network: NetworkSpec | None = None
    """What the job's pods may reach; absent: what the namespace's policies allow."""


class Phase(StrEnum):
    pending = "Pending"
    queued = "Queued"
    running = "Running"
    restarting = "Restarting"
    suspended = "Suspended"
    succeeded = "Succeeded"
    failed = "Failed"


class Condition(KubeModel):
    """A Kubernetes-style condition."""

    model_config = ConfigDict(extra="allow")

    type: str
    """Ready, Running, Succeeded, Failed, Suspended, Queued."""

    status: str
    """True, False or Unknown."""

    reason: str | None = None
    """CamelCase reason."""

    message: str | None = None
    """Human-readable detail."""

    last_transition_time: str | None = None
    """When status last changed (RFC 3339)."""

    observed_generation: int | None = None
    """The spec generation this condition was set for."""


class TrackerRun(KubeModel):
    """The run a tracker (spec.tracking) holds for the job, as the trainer last saw it."""

    model_config = ConfigDict(extra="allow")

    run_id: str | None = None
    """The tracker's run id (kept across restarts)."""

    url: str | None = None
    """A link to the run in the tracker's UI."""

    failures: int | None = None
    """Reports that failed (retried until the run ends; training never waits for them)."""

    error: str | None = None
    """The first failure."""

    dropped: int | None = None
    """Metric reports dropped while the tracker was down (the buffer is bounded)."""


class Progress(KubeModel):
    """Training progress, written by the trainer (process 0) only."""

    model_config = ConfigDict(extra="allow")

    step: int | None = None
    """Last completed optimizer step."""

    phase: str | None = None
    """What the trainer is doing: loading, compiling, training, evaluating,
    checkpointing or exporting (its heartbeat, with updatedAt; see
    spec.scheduling.progressDeadlineSeconds)."""

    total_steps: int | None = None
    """Steps the job will run."""

    loss: float | None = None
    """Training loss at step."""

    learning_rate: float | None = None
    """Learning rate at step."""

    tokens_per_second: float | None = None
    """Throughput over the last logging interval."""

    bad_rows: int | None = None
    """Malformed data rows skipped so far by process 0 (spec.data.maxBadRows)."""

    eta_seconds: int | None = None
    """Estimated seconds to finish."""

    last_checkpoint_step: int | None = None
    """Step of the newest complete checkpoint."""

    eval_step: int | None = None
    """Step of the latest held-out evaluation (spec.eval)."""

    eval_loss: float | None = None
    """Held-out loss at evalStep (sft, distill, dpo)."""

    eval_metrics: dict[str, float] | None = None
    """Every held-out metric at evalStep, e.g. perplexity, preference_accuracy."""

    rollout: dict[str, float] | None = None
    """GRPO with a disaggregated sampler: staleness (policy versions between the rollouts
    trained on and the learner), samplerBusy and learnerBusy (fractions of the wall time),
    weightSyncSeconds (the last sync of trainable weights to the sampler). With
    spec.grpo.agent: turns (mean per episode), toolCalls and toolErrors of the step. With
    an http reward: rewardFailures (rollouts dropped, no reward) and rewardServiceSeconds
    (time spent waiting on the verifier)."""

    goodput: float | None = None
    """Fraction of the run's wall time, over every restart, spent on optimizer steps it
    kept (0 to 1)."""

    goodput_breakdown: dict[str, float] | None = None
    """Fraction of the wall time per part: productive, compile, dataWait, checkpoint, eval,
    startup, restart, lost, other (they add up to 1)."""

    lost_steps: int | None = None
    """Steps done after a checkpoint and redone after a restart, counted once."""

    updated_at: str | None = None
    """When the trainer last reported (RFC 3339)."""

    tracking: dict[str, TrackerRun] | None = None
    """spec.tracking: per tracker (mlflow, wandb), its run and the reports that failed."""


class Outputs(KubeModel):
    """Where the results are."""

    model_config = ConfigDict(extra="allow")

    checkpoints: str | None = None
    """Orbax checkpoint directory."""

    hf_export: str | None = Field(default=None, alias="hfExport")
    """Hugging Face export (PEFT adapter or merged model)."""

    tensorboard: str | None = None
    """TensorBoard log directory."""


class PreflightStatus(KubeModel):
    """The TPU compiler's answer for the job's train step (spec.preflight), per device."""

    model_config = ConfigDict(extra="allow")

    result: str | None = None
    """Compiling, Fits, DoesNotFit, or Unknown (the check gave no answer: the fast
    estimate decided)."""

    key: str | None = None
    """Hash of the spec fields that change the compiled program (model, technique, LoRA,
    batch, sequence length, remat, attention, accumulation, accelerator, topology,
    slices, image): a job with the same key is not compiled again."""

    job: str | None = None
    """The preflight Job (batch/v1) that compiled it."""

    cached: bool | None = None
    """The answer came from an earlier compile of the same program (the namespace's
    ConfigMap posttrain-preflight)."""

    peak_gi_b: float | None = Field(default=None, alias="peakGiB")
    """The compiler's total per device: arguments, temporaries and outputs."""

    hbm_gi_b: float | None = Field(default=None, alias="hbmGiB")
    """HBM per device the compiler had."""

    arguments_gi_b: float | None = Field(default=None, alias="argumentsGiB")
    """Per device: the step's arguments (weights, optimizer state, batch)."""

    temporaries_gi_b: float | None = Field(default=None, alias="temporariesGiB")
    """Per device: the step's temporaries (activations, gradients)."""

    outputs_gi_b: float | None = Field(default=None, alias="outputsGiB")
    """Per device: the step's outputs not in donated arguments' buffers."""

    flops: float | None = None
    """The compiler's flops per step and device."""

    compiler: str | None = None
    """The compiler that answered (libtpu's version)."""

    sampler_peak_gi_b: float | None = Field(default=None, alias="samplerPeakGiB")
    """GRPO: the sampler's total per device (its decoding loop with the rollouts' KV
    cache), with the optimizer's state that stays beside it when colocated."""

    start_time: str | None = None
    """When the preflight Job was made (RFC 3339)."""

    message: str | None = None
    """The answer in words."""


class PostTrainJobStatus(KubeModel):
    """Observed state, written by the operator (and progress by the trainer)."""

    model_config = ConfigDict(extra="allow")

    phase: Phase | None = None
    """Pending, Queued, Running, Restarting, Suspended, Succeeded or Failed."""

    message: str | None = None
    """Why the job is in its phase."""

    conditions: list[Condition] = Field(default_factory=list)
    """Conditions: Running, Succeeded, Failed, Suspended, Queued."""

    observed_generation: int | None = None
    """The spec generation the operator last acted on."""

    job_set_name: str | None = Field(default=None, alias="jobSetName")
    """Name of the JobSet running the job."""

    restarts: int | None = None
    """Whole-job restarts so far."""

    start_time: str | None = None
    """When the job first ran."""

    completion_time: str | None = None
    """When the job finished."""

    progress: Progress | None = None
    """Training progress reported by the trainer."""

    outputs: Outputs | None = None
    """Output locations."""

    preflight: PreflightStatus | None = None
    """The TPU compiler's check before the job took TPUs (spec.preflight)."""


class ObjectMeta(BaseModel):
    """The parts of metadata posttrain reads; the rest is kept as is."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class PostTrainJob(BaseModel):
    """A post-training job: one model, one technique, one output."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: str = Field(default=API_VERSION, alias="apiVersion")
    kind: str = KIND
    metadata: ObjectMeta
    spec: PostTrainJobSpec
    status: PostTrainJobStatus | None = None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
