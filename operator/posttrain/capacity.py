"""Will a job fit in accelerator memory? A pure estimate of what the trainer holds per device.

The architecture comes from `posttrain.api.model_shapes` (the checkpoint's config.json when
spec.model.source is a local directory, else the table of well-known models); without
one, no estimate is made and admission says so. Per device, as the trainer holds it:

- mesh (`posttrain.trainer.mesh`): parameters are replicated over `dp` (one entry per
  slice: a TPU slice, a GPU node) and sharded over `fsdp` (the devices of a slice);
  every batch row, and so every activation and logit, is sharded over all devices.
- weights: a full fine-tune trains float32 masters, cast to spec.model.dtype for each
  forward pass (the cast copy is counted too); LoRA keeps the frozen base in
  spec.model.dtype plus float32 adapters (rank x (in + out) per targeted projection).
  Over several fsdp devices, a matmul needs its whole weight: XLA gathers the
  (vocabulary x hidden) embedding and a decoder layer at a time in the compute dtype,
  with gradientAccumulation above 1 too (inside each micro-batch:
  posttrain.trainer.optim.accumulate keeps the gathers in the loop).
- optimizer: AdamW two float32 moments per trained weight, SGD one, Adafactor factored
  (about two float32 vectors per matrix). Gradients: float32, a second copy (the
  accumulator) with gradientAccumulation above 1; over several fsdp devices, the whole
  float32 gradient of the gathered embedding and layer before it is reduce-scattered.
- activations: per spec.training.remat (auto: layer on accelerators). Without
  rematerialisation (none) the trainer's dense attention keeps, per decoder layer and
  micro-batch row, the projections' inputs and outputs (and float32 copies of some) and
  the [heads, L, L] attention scores and probabilities (float32, and their cast to the
  compute dtype). With layer (or block) it keeps per layer the layer's input and, as
  XLA's CPU compiles show, up to two float32 [heads, L, L] copies (how many depends on
  the program around the layers: SAVED_PER_SCORE and below), and recomputes the rest
  one layer at a time in backward. The accumulation scan holds one micro-batch's
  activations and logits at a time (posttrain.trainer.optim.accumulate).
- logits: [rows, L, vocab] in the compute dtype and their float32 cast; over the tokens
  the loss scores (every token for SFT, the completion for DPO and GRPO) the float32
  gradient, and for DPO and GRPO the log-softmax too (SFT's loss is logsumexp minus the
  target's logit); less with LoRA, whose gradient does not reach the embedding; a
  distillation teacher's logits, their float32 cast and log-softmax as well.
- reference / teacher: a frozen spec.model.dtype copy for DPO and GRPO (beta > 0) full
  fine-tunes (LoRA zeroes its adapters instead), the distillation teacher.
- rollout cache: GRPO's KV cache, every generation of the step's prompts at
  maxPromptLength + maxCompletionLength; with spec.grpo.agent a turn and a prefill block
  more (``rollout_cache_length``).
- vision tower: with spec.data.columns.images, Gemma 3's SigLIP tower and projector
  (frozen: in spec.model.dtype under LoRA, a float32 copy and its cast in a full
  fine-tune), and its forward activations in `activations` (one layer at a time, one
  image a row); with spec.training.trainVisionTower also its float32 gradient and adam
  moments and every layer's activations; the images' soft tokens are part of maxLength already. Not checked
  against XLA (test_capacity_xla.py covers the text steps).

On a TPU the terms are the TPU compiler's instead (compiler_of, tpu_parts): what the step
holds as it is (masters or frozen base, optimizer moments, adapters, the accumulator,
reference or teacher, rollout cache, vision tower, the whole model gathered once for every
micro-batch with accumulation over fsdp devices), the temporaries of the one phase of the
step where they peak (tpu_phases: the loss, with the gathered embedding, the logits and
their float32 copy and what the forward saved; or the backward of a LoRA step on 8 or more
chips that are not v5e, which holds every layer's activations at once; or a frozen vision
tower's forward), counted from the compiler's buffer assignment, a fixed compiler overhead
(TPU_OVERHEAD_GIB), and TPU_CONSTANTS, two constants each scaling one physical quantity
(the float32 gradient live at the peak, the all-reduce over slices), fitted on
bench/tpu_memory_table.json (the trainer's steps at published shapes compiled by libtpu
for each job's topology; bench/tpu_calibration.py). Dense attention has no [heads, L, L]
term there: the table's two dense steps (GRPO's learner) show none. Admission refuses a
TPU job above TPU_REFUSE_ABOVE x HBM (tests/unit/test_capacity_tpu_table.py holds both to
the table).

Elsewhere (a GPU job, which XLA:GPU cannot compile without a GPU, and a CPU job's host
estimate) the per-token, per-attention-element and per-logit byte counts are XLA's own figures for
the trainer's steps, compiled as the trainer runs them (posttrain.trainer.step_memory:
its optimizer chain with gradient clipping, accumulation, remat, reference or teacher):
tests/trainer/test_capacity_xla.py compiles the SFT (full and LoRA), DPO, GRPO and
distillation steps on 1, 4 and 8 simulated devices and holds this estimate within 25% of
`memory_analysis()`; bench/memory.py does so at published shapes and full depth. So a job whose total is more than that band (BAND) above memory is
refused; one whose total is within BAND of memory (above 1 - BAND of it) is admitted
with a warning naming the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from posttrain.api import model_shapes, rollout_split
from posttrain.api.model_shapes import ModelShape
from posttrain.api.spec import GrpoSpec, LoraSpec, PostTrainJobSpec
from posttrain.catalog import Placement

GIB = 1024**3
BAND = 0.25  # the estimate's uncertainty: within this of XLA's figure (test_capacity_xla.py)
REFUSE_ABOVE = 1 + BAND  # total / memory above which a job is refused
WARN_ABOVE = 1 - BAND  # total / memory above which a job is admitted with a warning
# Rematerialised (spec.training.remat): what XLA keeps per layer, per token in units of
# (w + 2) x hidden bytes (layer: its input; block: its attention's and MLP's inputs, not
# checked against XLA) and per [heads, L, L] attention element (XLA keeps between one and
# two float32 copies: 8 bytes at 28 layers of Qwen3 0.6B at 4k and at 2-4 small layers,
# 6.7 under LoRA at 16 layers of Llama 3.2 1B at 8k; bench/memory.py,
# test_capacity_xla.py), and the share of one layer's working set (test_capacity_xla.py).
SAVED_PER_LAYER = 2.0
SAVED_PER_BLOCK = 4.0
SAVED_PER_SCORE = 7.0
# SAVED_PER_SCORE is SFT's and distillation's with gradient clipping (the default), and
# DPO's and GRPO's under LoRA with clipping (Qwen3 0.6B, 28 layers: LoRA DPO at 2k 32.0
# GiB against 17.9 GiB for the full fine-tune, LoRA GRPO 70.4 against 39.8; Qwen3 1.7B
# LoRA GRPO 59.8 GiB clipped, 25.5 unclipped; bench/memory.py). Without clipping
# (spec.training.maxGradNorm: 0), and in the full fine-tune DPO and GRPO steps, XLA's CPU
# scheduler keeps far less per rematerialised layer: 1.5 bytes per attention element
# (Qwen3 0.6B, 28 layers: SFT at 4k 19.7 GiB against 57.2 GiB clipped, DPO at 2k 17.9 GiB;
# bench/memory.py).
SAVED_PER_SCORE_UNCLIPPED = 1.5
# With gradientAccumulation above 1 the layers run inside the micro-batch scan, which XLA
# schedules apart from the update: only the layers' inputs are kept, plus one layer's whole
# working set while it is recomputed (Qwen3 0.6B, 28 layers, 4k, accumulation 4: 9.9 GiB,
# bench/memory.py).
REMAT_WORKING_SET = 0.1
# The TPU compiler's figure is the step's own (bench/tpu_calibration.py holds the estimate
# to it, within 0.8-1.25 on most of its table): a TPU job is refused once the estimate is
# above TPU_REFUSE_ABOVE x HBM and warned above TPU_WARN_ABOVE x HBM, so that one the
# compiler fits within 90% of HBM is admitted without a warning and one over HBM refused
# (tests/unit/test_capacity_tpu_table.py); `posttrain estimate --compile` gives the figure.
TPU_WARN_ABOVE = 0.95
TPU_REFUSE_ABOVE = 1.05
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_OPTIMIZER_BYTES = {"adamw": 8, "sgd": 4}
TERMS = (
    "weights",
    "optimizer",
    "gradients",
    "activations",
    "logits",
    "reference/teacher",
    "rollout cache",
    "vision tower",
)
TPU_TERMS = (*TERMS, "compiler overhead")  # a TPU job's: tpu_parts
# TPU accelerators: the estimate is calibrated against the TPU compiler (libtpu, compile-only
# for the job's topology: bench/tpu_calibration.py, its figures in bench/tpu_memory_table.json),
# not XLA:CPU, whose scheduler keeps 2-5x more. Held state (float32 masters or the frozen
# base, optimizer moments, adapters, the accumulator, reference or teacher, GRPO's rollout
# cache, a vision tower) is counted as it is. The compiler's temporaries peak in one phase of
# the step, not in all at once (its buffer assignment and live ranges,
# XLA_FLAGS=--xla_dump_to: bench/tpu_calibration.py), so the estimate counts the largest of
# them (tpu_phases):
# - the loss: the embedding gathered whole over fsdp devices for the logits' matmul, the
#   logits in the compute dtype and their float32 copy shifted a token for the next-token
#   loss (TPU_LOGIT_EXTRA_BYTES a logit beyond the compute dtype's; a distillation
#   teacher's logits too), and what the forward saved: each rematerialised layer's input (two
#   with block, and the projections' outputs with dots), every layer's activations with
#   remat none (layer_activation_bytes);
# - the backward of a LoRA step on a slice of DEFERRED_FSDP or more chips (not v5e): the
#   adapters' gradients of every layer are all-reduced together after the last layer, and
#   the compiler schedules each adapter-gradient matmul just before that all-reduce, so the
#   operands they read stay live for every layer at once (layer_activation_bytes a layer;
#   the loss's logits are freed by then; a full fine-tune's weight gradients are reduce-
#   scattered layer by layer instead);
# - a frozen vision tower's forward, one encoder layer of the images at a time.
# Beside the peak phase, TPU_OVERHEAD_GIB: what the compiler's figure holds beyond the
# buffers live at its peak (heap fragmentation, buffers under 1 MiB, its reserve).
TPU_LOGIT_EXTRA_BYTES = 4
TPU_OVERHEAD_GIB = 0.84
DEFERRED_FSDP = 8
DEFERRED_NOT_ON = ("v5e",)
PEAKS = {
    "loss": "the loss (the logits beside what the forward saved)",
    "backward": "the backward (every layer's activations: LoRA's adapter gradients are "
    "computed after the last layer)",
    "vision tower": "the vision tower's forward",
}
# A decoder layer's activations per token as the TPU compiler keeps them, in units of the
# compute dtype: (hidden, intermediate, query heads x head dim, kv heads x head dim).
LAYER_ACTIVATIONS = (4, 4, 2, 2)
# The counts above were read from the compiler's dumps of bench/tpu_calibration.py cases
# (GiB live at the peak; docs/user-guide.md, "The TPU calibration"):
# - l1b-sft-lora-8k-r64-v6e8 (Llama 3.2 1B, 16 layers, 8192 tokens a chip): the backward
#   holds 13.5 GiB (4 [t, intermediate], 4 [t, hidden] and the q/k/v arrays a layer; the
#   arrays of head dim 64 padded to 128 lanes, which the count leaves out: 11.25 GiB),
#   its loss 9.0 GiB (5.9 GiB of logits, the gathered embedding 0.5);
# - g1b-sft-lora-2k-v6e8 (Gemma 3 1B, 26 layers, 2048 tokens): backward 3.5 GiB (4
#   [t, intermediate], 4 [t, hidden], 2 [t, q], 2 [t, kv] a layer), loss 3.7 GiB (the
#   gathered [262144, 1152] embedding 0.56, logits 1 + 2 GiB, the layers' inputs 0.12);
# - g4b-vision-lora-1k-v6e8: backward 3.2 GiB, loss 2.9 GiB (the gathered embedding 1.25),
#   the tower's forward 1.0 GiB (its [16, 4096, 4096] float32 attention);
# - on v5e-8 the same LoRA steps compute each layer's adapter gradients in its own
#   backward (g1b-sft-lora-2k-v5e8, l1b-sft-lora-2k-v5e8: at most 0.8 GiB after the loss);
#   so does l1b-sft-lora-1k-r64-v6e8 at 1024 tokens a chip (0.2 GiB), which the count
#   over-counts (its loss 1.3 GiB, the count's backward 1.4);
# - l1b-sft-full-8k-v6e8, a full fine-tune on v6e-8 at 8192 tokens a chip: its backward
#   holds about half of every layer's activations (6.9 GiB) and the logits' gradient with
#   a padded copy (3.9 GiB, for the tied embedding's gradient after the last layer), not
#   counted (the estimate is 0.72 of the compiler's; the other full fine-tunes on v6e-8
#   are within the band: q17-sft-full-layer-4k-v6e8 0.97);
# - the compiler's temporaries beyond the buffers of 1 MiB or more live at the peak: 0.49
#   to 1.51 GiB over the seven dumps, 0.84 on average (TPU_OVERHEAD_GIB).
# What the schedule keeps beside that is TPU_CONSTANTS, each scaling one physical quantity
# per device, fitted on the table's cases outside bench/tpu_calibration.HELD_OUT
# (`python bench/tpu_calibration.py --fit`):
TPU_CONSTANTS = {
    # share of the float32 gradient (and a full fine-tune's compute-dtype cast of the
    # masters) live at the peak: the compiler frees each layer's as it is applied
    "gradient_share": 0.777,
    # bytes per trained parameter (of a device's fsdp share) over several slices (dp > 1):
    # the float32 gradient's all-reduce over slices and its buffers
    "slice_bytes": 29.367,
}


@dataclass(frozen=True)
class Layout:
    """How the job's devices form the trainer's mesh."""

    slices: int  # dp
    per_slice: int  # fsdp

    @property
    def devices(self) -> int:
        return self.slices * self.per_slice


def layout(spec: PostTrainJobSpec, placement: Placement) -> Layout:
    """The trainer's mesh: every device of the job, less a disaggregated sampler's."""
    res = spec.resources
    if placement.is_tpu:
        lay = Layout(res.slices, max(1, placement.hosts * placement.devices_per_host))
    else:
        lay = Layout(res.nodes, max(1, placement.devices_per_host))  # one slice per GPU node
    found, _ = rollout_split.split(spec, lay.devices)
    if found is None:
        return lay
    if found.sampler_slices:
        return Layout(lay.slices - found.sampler_slices, lay.per_slice)
    return Layout(lay.slices, max(1, found.trainer_devices // lay.slices))


def sampler_need_gib(spec: PostTrainJobSpec, placement: Placement) -> float | None:
    """GiB per device a disaggregated sampler needs on its share of the devices: its copy
    of the model (sharded over its devices, as the trainer's: FSDP) and the rollouts'
    KV cache. None when colocated or unknown."""
    shape = shape_of(spec)
    if shape is None or placement.kind == "cpu" or not placement.memory_gib_per_device:
        return None
    res = spec.resources
    if placement.is_tpu:
        devices = placement.hosts * placement.devices_per_host * res.slices
    else:
        devices = res.nodes * max(1, placement.devices_per_host)
    found, _ = rollout_split.split(spec, devices)
    if found is None:
        return None
    w = _DTYPE_BYTES[spec.model.dtype]
    n = found.sampler_devices
    weights = shape.params * w + (lora_params(shape, spec) * 4 if spec.lora else 0)
    whole = shape.vocab * shape.hidden + shape.layer_params if n > 1 else 0
    g = spec.grpo
    length = rollout_cache_length(g)
    kv = shape.kv_heads * shape.head_dim
    cache = spec.training.batch_size * g.num_generations * length * shape.layers * 2 * kv * w
    return (weights / n + whole * w + cache / n) / GIB


# The episode sampler (trainer/posttrain/trainer/episode_sampler.py) prefills the tokens
# a turn adds in blocks of this width.
EPISODE_PREFILL_BLOCK = 32


def rollout_cache_length(g: GrpoSpec) -> int:
    """Slots a GRPO rollout's KV cache holds a sequence (spec.grpo): the prompt and the
    completion; with spec.grpo.agent, the episode sampler's cache, a turn (turnLength)
    and a prefill block's padding more, so that no turn within the episode's budget has
    to prefill the whole context again."""
    length = int(g.max_prompt_length) + int(g.max_completion_length)
    if g.agent is None:
        return length
    return length + int(g.agent.turn_length or g.max_completion_length) + EPISODE_PREFILL_BLOCK


def lora_params(shape: ModelShape, spec: PostTrainJobSpec) -> int:
    """Adapter weights: rank x (in + out) of each targeted projection, every layer. A
    targetModules regex is counted as the default (every attention and MLP projection)."""
    d, f = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    sizes = {
        "q_proj": d + q, "k_proj": d + kv, "v_proj": d + kv, "o_proj": q + d,
        "q_einsum": d + q, "kv_einsum": 2 * (d + kv), "attn_vec_einsum": q + d,
        "qkv_einsum": 3 * d + q + 2 * kv,
        "gate_proj": d + f, "up_proj": d + f, "down_proj": f + d,
    }  # fmt: skip
    default = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    names = [n.strip() for n in (spec.lora.target_modules or "").split(",")]
    if not all(n in sizes or n == "lm_head" for n in names):
        names = list(default)
    per_layer = sum(sizes.get(n, 0) for n in names)
    head = (d + shape.vocab) if "lm_head" in names else 0
    return spec.lora.rank * (shape.layers * per_layer + head)


@dataclass(frozen=True)
class MemoryEstimate:
    source: str
    shape: ModelShape
    layout: Layout
    rows: int  # micro-batch rows per device
    length: int  # tokens per row
    terms: dict[str, float] = field(default_factory=dict)  # GiB per device, by TERMS
    available_gib: float = 0.0
    accelerator: str = ""
    remat: str = "none"  # spec.training.remat as the trainer applies it
    compiler: str = "xla-cpu"  # whose figures the terms are calibrated to: "tpu" or "xla-cpu"
    peak: str = ""  # a TPU step's phase whose temporaries are counted (tpu_phases)

    @property
    def total_gib(self) -> float:
        return sum(self.terms.values())

    @property
    def verdict(self) -> str:
        """'over' (refused): the total is more than BAND above memory, so even an estimate
        BAND too high leaves the job out of memory; 'tight' (admitted with a warning): the
        total is within BAND of memory; 'fits' otherwise."""
        refuse, warn = self.thresholds
        if self.total_gib > refuse * self.available_gib:
            return "over"
        return "tight" if self.total_gib > warn * self.available_gib else "fits"

    @property
    def thresholds(self) -> tuple[float, float]:
        """(refused above, warned above) as shares of a device's memory."""
        if self.compiler == "tpu":
            return TPU_REFUSE_ABOVE, TPU_WARN_ABOVE
        return REFUSE_ABOVE, WARN_ABOVE

    @property
    def fits(self) -> bool:
        return self.verdict != "over"

    @property
    def origin(self) -> str:
        if self.shape.origin == "config.json":
            return "shape from its config.json"
        return "shape from posttrain's table of known models, no config.json read"

    def explain(self) -> str:
        """One line: the need, its parts and the memory a device has."""
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.terms.items() if v >= 0.05)
        return (
            f"about {self.total_gib:.1f} GiB per device ({parts} GiB) for "
            f"{self.shape.params / 1e9:.2f}B parameters over {self.layout.devices} devices, "
            f"{self.rows:g} rows x {self.length} tokens per device, remat {self.remat}, "
            f"but a {self.accelerator} "
            f"device has {self.available_gib:g} GiB ({self.origin})"
        )

    def table(self) -> str:
        """The breakdown, one term a line, as `posttrain estimate` prints it."""
        lay = self.layout
        lines = [
            f"{self.source}: {self.shape.params / 1e9:.2f}B parameters, {self.shape.layers} "
            f"layers, vocabulary {self.shape.vocab} ({self.origin})",
            f"{lay.devices} {self.accelerator} devices: {lay.slices} x {lay.per_slice} "
            f"(dp x fsdp); {self.rows:g} rows x {self.length} tokens per device per micro-batch, "
            f"remat {self.remat}",
            "per device:",
        ]
        names = TPU_TERMS if self.compiler == "tpu" else TERMS
        lines += [f"  {name:<18}{self.terms.get(name, 0.0):8.2f} GiB" for name in names]
        lines.append(
            f"  {'total':<18}{self.total_gib:8.2f} GiB of {self.available_gib:g} GiB "
            f"({self.total_gib / self.available_gib:.0%})"
        )
        if self.compiler == "tpu":
            lines.append(
                f"terms calibrated to the TPU compiler, at the step's peak: {PEAKS[self.peak]}; "
                "posttrain estimate --compile gives its own figure"
            )
        return "\n".join(lines)


def remat_of(spec: PostTrainJobSpec) -> str:
    """spec.training.remat as the trainer applies it on an accelerator (auto: layer)."""
    remat = str(spec.training.remat)
    return "layer" if remat == "auto" else remat


def attention_is_flash(spec: PostTrainJobSpec, placement: Placement) -> bool:
    """Whether the trainer's step runs a flash kernel (spec.training.attention auto or
    flash, as models/attention.py resolves it): on a TPU or GPU, for SFT, DPO and
    distillation (GRPO's learner builds Tunix's dense mask), without images."""
    if str(spec.training.attention) == "dense" or placement.kind not in ("tpu", "gpu"):
        return False
    return spec.technique != "grpo" and spec.data.columns.images is None


def shape_of(spec: PostTrainJobSpec) -> ModelShape | None:
    return model_shapes.shape(spec.model.source, spec.model.layers)


def compiler_of(placement: Placement) -> str:
    """Whose figures the estimate is calibrated to on this placement: the TPU compiler's on
    a TPU, XLA:CPU's elsewhere (a GPU job's, which XLA:GPU cannot compile without a GPU,
    and a CPU job's host estimate)."""
    return "tpu" if placement.is_tpu else "xla-cpu"


def _rows_and_lengths(spec: PostTrainJobSpec, lay: Layout) -> tuple[int, int, int]:
    """Micro-batch rows per device, tokens per row and scored tokens per row."""
    t = spec.training
    length, per_example = spec.data.max_length, 1
    scored = length  # tokens per row whose log-probabilities the loss takes
    if spec.technique == "dpo":
        per_example = 2  # chosen and rejected
        scored = length - min(spec.dpo.max_prompt_length if spec.dpo else 512, length // 2)
    elif spec.technique == "grpo":
        per_example = spec.grpo.num_generations
        length = spec.grpo.max_prompt_length + spec.grpo.max_completion_length
        scored = spec.grpo.max_completion_length
    rows = max(1, math.ceil(t.batch_size / t.gradient_accumulation * per_example / lay.devices))
    return rows, length, scored


def layer_activation_bytes(shape: ModelShape, w: int) -> float:
    """Bytes per token of one decoder layer's activations as the TPU compiler keeps them:
    LAYER_ACTIVATIONS arrays of the hidden size, the intermediate size and the query and
    key/value heads' widths in the compute dtype (w bytes), what the layer's backward reads:
    its projections' inputs and the gradients of their outputs."""
    d, f, q, kv = LAYER_ACTIVATIONS
    widths = (
        shape.hidden,
        shape.intermediate,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    )
    return w * sum(n * width for n, width in zip((d, f, q, kv), widths, strict=True))


def backward_is_deferred(spec: PostTrainJobSpec, lay: Layout, generation: str = "") -> bool:
    """Whether the TPU compiler holds every layer's activations in a LoRA step's backward
    (tpu_phases): rematerialised, one micro-batch a step, DEFERRED_FSDP or more chips of a
    slice, not a generation of DEFERRED_NOT_ON ("" when not known: counted)."""
    return (
        spec.lora is not None
        and lay.per_slice >= DEFERRED_FSDP
        and generation not in DEFERRED_NOT_ON
        and remat_of(spec) != "none"
        and spec.training.gradient_accumulation == 1
    )


def tpu_phases(
    spec: PostTrainJobSpec, shape: ModelShape, lay: Layout, generation: str = ""
) -> dict[str, dict[str, float]]:
    """A TPU step's temporaries in each phase where they can peak (bytes per device, by
    term): "loss" always, "backward" where backward_is_deferred, "vision tower" with a
    frozen tower (a trained one keeps every encoder layer's activations through the step,
    counted in every phase). The estimate counts the largest (tpu_peak)."""
    t = spec.training
    w = _DTYPE_BYTES[spec.model.dtype]
    d, f = shape.hidden, shape.intermediate
    rows, length, _ = _rows_and_lengths(spec, lay)
    tokens = rows * length
    logit_units = tokens * shape.vocab
    if spec.technique == "distill":
        teacher = model_shapes.shape(spec.distill.teacher.source, spec.distill.teacher.layers)
        logit_units += tokens * (teacher or shape).vocab
    remat = remat_of(spec)
    if remat == "none":  # every layer's activations, as the backward reads them
        saved = layer_activation_bytes(shape, w)
    else:  # each layer's input (block: its attention's and its MLP's)
        saved = w * d * (2 if remat == "block" else 1)
        if remat == "dots":  # and every projection's output (the trainer's models/remat.py)
            q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
            saved += w * (q + 2 * kv + 2 * d + 2 * f)
    phases = {
        "loss": {
            # the embedding gathered whole for the logits' matmul
            "weights": shape.vocab * d * w if lay.per_slice > 1 else 0.0,
            "activations": shape.layers * tokens * saved,
            "logits": logit_units * (w + TPU_LOGIT_EXTRA_BYTES),
        }
    }
    if backward_is_deferred(spec, lay, generation):
        phases["backward"] = {
            "activations": shape.layers * tokens * layer_activation_bytes(shape, w)
        }
    vision = model_shapes.vision_shape(spec.model.source) if spec.data.columns.images else None
    if vision is not None:
        p, vw = vision.patches, vision.width
        tower = rows * (vision.heads * p * p * 4 + p * (6 * vw + vision.mlp) * 4)
        if t.train_vision_tower:
            for phase in phases.values():
                phase["activations"] += tower * vision.depth
        else:
            phases["vision tower"] = {"activations": tower}
    return phases


def tpu_peak(phases: dict[str, dict[str, float]]) -> str:
    """The phase of tpu_phases whose temporaries are the largest."""
    return max(phases, key=lambda name: sum(phases[name].values()))


def tpu_parts(
    spec: PostTrainJobSpec, shape: ModelShape, lay: Layout, generation: str = ""
) -> tuple[dict[str, float], dict[str, tuple[str, float]]]:
    """A TPU job's memory per device in two parts (bytes): what it holds as it is, by term
    (held state, the peak phase's temporaries of tpu_phases, TPU_OVERHEAD_GIB), and for each
    of TPU_CONSTANTS the term it adds to and the quantity it scales
    (bench/tpu_calibration.py fits the constants on these). generation: the TPU's (v5e,
    v6e, ...; "" when not known)."""
    t = spec.training
    w = _DTYPE_BYTES[spec.model.dtype]
    params, fsdp = shape.params, lay.per_slice
    full = spec.lora is None
    trained = params if full else lora_params(shape, spec)
    held = params * 4 if full else params * w + trained * 4
    if t.optimizer == "adafactor":
        opt_bytes = 8 * trained / shape.hidden
    else:
        opt_bytes = _OPTIMIZER_BYTES[t.optimizer] * trained
    _, length, _ = _rows_and_lengths(spec, lay)
    frozen, cache, tower = 0.0, 0.0, 0.0
    if spec.technique == "distill":
        teacher = model_shapes.shape(spec.distill.teacher.source, spec.distill.teacher.layers)
        teacher = teacher or shape
        frozen = teacher.params * _DTYPE_BYTES[spec.distill.teacher.dtype] / fsdp
    elif full and (
        (spec.technique == "dpo" and spec.dpo.algorithm == "dpo")
        or (spec.technique == "grpo" and spec.grpo.beta > 0)
    ):
        frozen = params * w / fsdp
    if spec.technique == "grpo" and not rollout_split.is_disaggregated(spec):
        kv = shape.kv_heads * shape.head_dim
        sequences = t.batch_size * spec.grpo.num_generations / lay.devices
        cache = sequences * rollout_cache_length(spec.grpo) * shape.layers * 2 * kv * w
    vision = model_shapes.vision_shape(spec.model.source) if spec.data.columns.images else None
    if vision is not None:
        tower = vision.params * (w if spec.lora else 4 + (w if w < 4 else 0)) / fsdp
        if t.train_vision_tower:
            tower += vision.params * 12 / fsdp
    grads = trained * 4 / fsdp
    # gradientAccumulation above 1 over fsdp devices: the compiler hoists the weights'
    # all-gathers out of the micro-batch scan, the whole model in the compute dtype
    hoisted = params * w if t.gradient_accumulation > 1 and fsdp > 1 else 0.0
    fixed = dict.fromkeys(TPU_TERMS, 0.0) | {
        "weights": held / fsdp + hoisted,
        "optimizer": opt_bytes / fsdp,
        # the accumulator: a second float32 gradient, the micro-batch scan's carry
        "gradients": grads if t.gradient_accumulation > 1 else 0.0,
        "reference/teacher": frozen,
        "rollout cache": cache,
        "vision tower": tower,
        "compiler overhead": TPU_OVERHEAD_GIB * GIB,
    }
    phases = tpu_phases(spec, shape, lay, generation)
    for term, value in phases[tpu_peak(phases)].items():
        fixed[term] += value
    scaled = {
        "gradient_share": ("gradients", grads + (params * w / fsdp if full else 0.0)),
        "slice_bytes": ("gradients", trained / fsdp if lay.slices > 1 else 0.0),
    }
    return fixed, scaled


def _tpu_terms(
    spec: PostTrainJobSpec, shape: ModelShape, lay: Layout, generation: str
) -> dict[str, float]:
    terms, scaled = tpu_parts(spec, shape, lay, generation)
    for name, (term, units) in scaled.items():
        terms[term] += TPU_CONSTANTS[name] * units
    return terms


def estimate(
    spec: PostTrainJobSpec,
    placement: Placement,
    lay: Layout | None = None,
    compiler: str | None = None,
) -> MemoryEstimate | None:
    """None for CPU jobs (host memory is not in the catalog) or with no known shape.
    compiler: whose figures the terms are calibrated to ("tpu" or "xla-cpu"; by default
    compiler_of(placement))."""
    shape = shape_of(spec)
    if shape is None or placement.kind == "cpu" or not placement.memory_gib_per_device:
        return None
    lay = lay or layout(spec, placement)
    compiler = compiler or compiler_of(placement)
    if compiler == "tpu":
        rows, length, _ = _rows_and_lengths(spec, lay)
        generation = placement.accelerator.split("-")[0] if placement.is_tpu else ""
        return MemoryEstimate(
            spec.model.source,
            shape,
            lay,
            rows,
            length,
            {k: v / GIB for k, v in _tpu_terms(spec, shape, lay, generation).items()},
            float(placement.memory_gib_per_device),
            placement.accelerator.split("-")[0] if placement.is_tpu else placement.accelerator,
            remat_of(spec),
            compiler,
            tpu_peak(tpu_phases(spec, shape, lay, generation)),
        )
    t = spec.training
    w = _DTYPE_BYTES[spec.model.dtype]
    params, fsdp = shape.params, lay.per_slice
    if spec.lora is None:
        trained = params
        weights = params * (4 + (w if w < 4 else 0))
    else:
        trained = lora_params(shape, spec)
        weights = params * w + trained * 4
    if t.optimizer == "adafactor":
        opt_bytes = 8 * trained / shape.hidden
    else:
        opt_bytes = _OPTIMIZER_BYTES[t.optimizer] * trained
    grads = trained * 4 * (2 if t.gradient_accumulation > 1 else 1)

    rows, length, scored = _rows_and_lengths(spec, lay)
    tokens = rows * length
    d, f = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # Bytes kept per token and decoder layer, per attention-probability element, per
    # logit: XLA's figures for the trainer's SFT step (tests/trainer/test_capacity_xla.py).
    per_token = (w + 2) * (7 * d + 5 * q + 3.5 * kv + 2.7 * f)
    # A flash kernel keeps no [heads, length, length] scores (attention_is_flash).
    squares = 0 if attention_is_flash(spec, placement) else rows * shape.heads * length * length
    per_layer = tokens * per_token + squares * (8 + w)
    remat = remat_of(spec)
    if remat == "none":
        activations = shape.layers * per_layer
    else:
        # Backward recomputes a layer (layer), or its attention and its MLP (block), from
        # what the forward kept: per layer the layer's inputs and what XLA keeps beside
        # them (XLA's figures for SFT, tests/trainer/test_capacity_xla.py), plus one
        # layer's whole working set while it is recomputed.
        kept = tokens * (w + 2) * d * (SAVED_PER_BLOCK if remat == "block" else SAVED_PER_LAYER)
        if remat == "dots":  # and every projection's output (the trainer's models/remat.py)
            kept += tokens * w * (q + 2 * kv + 2 * d + 2 * f)
        score, working = SAVED_PER_SCORE_UNCLIPPED, REMAT_WORKING_SET
        if t.gradient_accumulation > 1:  # the layers run in the micro-batch scan's body
            score, working = 0.0, 1.0
        elif t.max_grad_norm > 0 and (spec.technique in ("sft", "distill") or spec.lora):
            score = SAVED_PER_SCORE
        kept += squares * score
        activations = shape.layers * kept + working * per_layer
    activations += tokens * (w + 2) * 10 * d
    # Per scored logit: SFT's loss (logsumexp minus the target's logit) keeps its float32
    # gradient, the log-softmax of DPO's and GRPO's log-probs (and distillation's student
    # at the temperature) is kept as well, and GRPO's policy loss (Tunix's: the
    # temperature-scaled log-softmax and the entropy over the vocabulary) keeps two more
    # float32 copies (Qwen3 0.6B, 28 layers, bench/memory.py); LoRA keeps fewer float32
    # copies, its gradient not reaching the embedding (XLA's figures).
    per_scored = {"sft": 4, "grpo": 16}.get(str(spec.technique), 8) - (2 if spec.lora else 0)
    # GRPO's learner projects only the completion's positions (and the one before it)
    # onto the vocabulary (the trainer's models.last_positions); the others project all.
    projected = rows * (scored + 1) if spec.technique == "grpo" else tokens
    logits = projected * shape.vocab * (w + 4) + rows * scored * shape.vocab * per_scored
    whole = 0  # weights gathered whole over fsdp: the embedding and one decoder layer
    if fsdp > 1:
        whole = shape.vocab * shape.hidden + shape.layer_params

    frozen = 0.0
    if spec.technique == "distill":
        teacher = model_shapes.shape(spec.distill.teacher.source, spec.distill.teacher.layers)
        teacher = teacher or shape
        frozen = teacher.params * _DTYPE_BYTES[spec.distill.teacher.dtype] / fsdp
        # the teacher's logits, their float32 cast and the float32 log-softmax at the
        # temperature that the KL's gradient reads (XLA's figures, test_capacity_xla.py)
        logits += tokens * teacher.vocab * (w + 8)
    elif spec.lora is None and (
        (spec.technique == "dpo" and spec.dpo.algorithm == "dpo")
        or (spec.technique == "grpo" and spec.grpo.beta > 0)
    ):
        frozen = params * w / fsdp
    cache = 0.0
    if spec.technique == "grpo" and not rollout_split.is_disaggregated(spec):
        sequences = t.batch_size * spec.grpo.num_generations / lay.devices
        cache = sequences * rollout_cache_length(spec.grpo) * shape.layers * 2 * kv * w
    tower = 0.0
    vision = model_shapes.vision_shape(spec.model.source) if spec.data.columns.images else None
    if vision is not None:
        # Frozen (LoRA base in spec.model.dtype; a full fine-tune's float32 copy and its
        # cast), forward only: one encoder layer of the micro-batch's images at a time
        # (one image a row assumed), its [heads, patches, patches] float32 attention.
        held = vision.params * (w if spec.lora else 4 + (w if w < 4 else 0))
        tower = held / fsdp
        p, vw = vision.patches, vision.width
        tower_layer = rows * (vision.heads * p * p * 4 + p * (6 * vw + vision.mlp) * 4)
        activations += tower_layer
        if t.train_vision_tower:  # trained too: adam's moments, its gradient, every layer kept
            tower += vision.params * 12 / fsdp
            activations += (vision.depth - 1) * tower_layer
    terms = {
        "weights": weights / fsdp + whole * w,
        "optimizer": opt_bytes / fsdp,
        "gradients": grads / fsdp + (0 if spec.lora else whole * 4),
        "activations": activations,
        "logits": logits,
        "reference/teacher": frozen,
        "rollout cache": cache,
        "vision tower": tower,
    }
    return MemoryEstimate(
        spec.model.source,
        shape,
        lay,
        rows,
        length,
        {k: v / GIB for k, v in terms.items()},
        float(placement.memory_gib_per_device),
        placement.accelerator.split("-")[0] if placement.is_tpu else placement.accelerator,
        remat,
        compiler,
    )


def suggestions(spec: PostTrainJobSpec, placement: Placement, est: MemoryEstimate) -> list[str]:
    """Changes that would bring the estimate under memory, each with its new total."""
    limit = est.available_gib * est.thresholds[1]
    t = spec.training
    out = []

    def total(new_spec: PostTrainJobSpec, lay: Layout | None = None) -> float:
        found = estimate(new_spec, placement, lay, est.compiler)
        return found.total_gib if found else float("inf")

    if spec.lora is None:
        lora = spec.model_copy(update={"lora": LoraSpec()})
        out.append(f"LoRA (spec.lora: {{rank: 16}}): {total(lora):.1f} GiB")
    for factor in (2, 4, 8):
        lay = replace(est.layout, slices=est.layout.slices * factor)
        if (need := total(spec, lay)) <= limit or factor == 8:
            where = "spec.resources.slices" if placement.is_tpu else "spec.resources.nodes"
            out.append(f"{factor}x the devices ({where}: {lay.slices}): {need:.1f} GiB")
            break
    rows = t.batch_size * (spec.grpo.num_generations if spec.grpo else 2 if spec.dpo else 1)
    for accumulation in range(t.gradient_accumulation * 2, t.batch_size + 1):
        if t.batch_size % accumulation:
            continue
        if rows // accumulation < est.layout.devices:  # a row is not split over devices
            break
        micro = spec.model_copy(
            update={"training": t.model_copy(update={"gradient_accumulation": accumulation})}
        )
        if (need := total(micro)) <= limit or rows // accumulation < 2 * est.layout.devices:
            out.append(
                f"a smaller micro-batch (spec.training.gradientAccumulation: {accumulation}, "
                f"{t.batch_size // accumulation} examples a micro-batch): {need:.1f} GiB"
            )
            break
    if remat_of(spec) != "layer":  # none or block: recompute whole layers instead
        layer = spec.model_copy(update={"training": t.model_copy(update={"remat": "layer"})})
        out.append(f"spec.training.remat: layer: {total(layer):.1f} GiB")
    half = max(8, spec.data.max_length // 2)
    if spec.technique != "grpo" and half < spec.data.max_length:
        short = spec.model_copy(update={"data": spec.data.model_copy(update={"max_length": half})})
        out.append(f"spec.data.maxLength: {half}: {total(short):.1f} GiB")
    return out


def refusal(spec: PostTrainJobSpec, placement: Placement, est: MemoryEstimate) -> str:
    """The one-line message of a job that does not fit (webhook and CLI alike)."""
    hints = "; ".join(suggestions(spec, placement, est))
    return f"the job does not fit: {est.explain()}; estimates with one change: {hints}"


def warning(
    spec: PostTrainJobSpec, placement: Placement, compiler: str | None = None
) -> str | None:
    """The admission warning of a job the estimate cannot clear: within the uncertainty
    band, or not checked at all for want of a known architecture."""
    if placement.kind == "cpu" or not placement.memory_gib_per_device:
        return None
    est = estimate(spec, placement, compiler=compiler)
    if est is None:
        return (
            f"spec.model.source: no memory check was made: posttrain knows no architecture "
            f"for {spec.model.source!r} (no readable config.json and not a model it knows "
            "by name); run posttrain estimate on a local copy"
        )
    if est.verdict == "tight" and est.compiler == "tpu":
        how = "may not fit" if est.total_gib <= est.available_gib else "may run out of memory"
        return (
            f"spec.resources.accelerator: the job {how}: {est.explain()}; the estimate is "
            f"within 25% of the TPU compiler's on posttrain's table, so the job is admitted "
            f"(refused above {est.thresholds[0] * est.available_gib:.1f} GiB); posttrain "
            "estimate --compile gives the compiler's own figure"
        )
    if est.verdict == "tight":
        how = "may not fit" if est.total_gib <= est.available_gib else "may run out of memory"
        return (
            f"spec.resources.accelerator: the job {how}: {est.explain()}; the estimate is "
            f"within {BAND:.0%} of XLA's, so the job is admitted (refused above "
            f"{REFUSE_ABOVE * est.available_gib:.1f} GiB)"
        )
    return None


def admission(
    spec: PostTrainJobSpec, placement: Placement, compiler: str | None = None
) -> tuple[str, str | None]:
    """What admission does about the job's memory: ("refuse", the refusal) when the
    estimate is more than BAND above a device's memory, ("warn", the warning) when it is
    within BAND of it or no estimate can be made, else ("admit", None). The webhook, the
    operator and `posttrain validate` apply this (posttrain.checks)."""
    est = estimate(spec, placement, compiler=compiler)
    if est is not None and not est.fits:
        return "refuse", refusal(spec, placement, est)
    found = warning(spec, placement, compiler)
    return ("warn", found) if found else ("admit", None)
