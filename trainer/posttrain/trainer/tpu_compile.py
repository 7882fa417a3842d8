"""Will it fit? The job's own train step compiled ahead of time by the compiler of the
accelerator it will run on, on this machine: ``posttrain estimate --compile``.

TPU jobs: libtpu (the ``posttrain[tpu-compile]`` extra) gives compile-only TPU devices of
any topology without a TPU (``jax.experimental.topologies.get_topology_desc``: the
job's generation and slice topology, its slices, its hosts' chips); the trainer's step
(``posttrain.trainer.step_memory``: optimizer, clipping, remat, LoRA, accumulation,
reference or teacher) is lowered from abstract arrays on the trainer's mesh over them and
compiled by the TPU compiler. Nothing runs on those devices (any operation that runs
fails there), and no weights are read: spec.model.source must be a local directory with
the model's config.json. ``memory_analysis()`` gives each device's arguments,
temporaries and outputs, ``cost_analysis()`` the compiler's flops, from which the step
time at the chip's peak bf16 rate follows (a floor: no step runs faster). A step over
the chip's HBM does not compile ("... exceeds available HBM"): that is reported as
"does not fit" with the compiler's figures.

CPU jobs compile with XLA:CPU (the host's memory is the limit). GPU jobs: XLA:GPU
needs a GPU to compile for (its compiler queries the device), so the fast estimate
stands in, and the report says so.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain import capacity
from posttrain.api.spec import PostTrainJobSpec
from posttrain.catalog import Placement
from posttrain.trainer.compile_figures import cost_of, is_out_of_memory, libtpu_version

EXTRA = "tpu-compile"
# libtpu's settings for compile-only use: no TPU metadata server to ask, and no claim on
# the one-process-per-TPU lock file (nothing runs, and other processes may hold it).
TPU_ENV = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}
_SIZE = r"([\d.]+)\s*([KMGTP]?)i?B?"
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}


class MissingCompiler(RuntimeError):
    """The TPU compiler (libtpu) is not installed; the message names the extra."""


def missing_libtpu_message() -> str:
    return (
        f"posttrain estimate --compile of a TPU job needs the TPU compiler: "
        f"pip install 'posttrain[{EXTRA}]' (libtpu; no TPU needed)"
    )


def require_libtpu() -> None:
    if importlib.util.find_spec("libtpu") is None:
        raise MissingCompiler(missing_libtpu_message())
    for key, value in TPU_ENV.items():
        os.environ.setdefault(key, value)


def topology_name(placement: Placement) -> str:
    """The name get_topology_desc knows a slice by: v5e:2x4, v6e:16x16, v5p:2x2x1."""
    return f"{placement.generation}:{placement.topology}"


def chips_per_host_bounds(placement: Placement) -> tuple[int, int, int]:
    """The chips of one host as a box: 1 (1x1x1), 4 (2x2x1) or 8 (2x4x1)."""
    return {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}[placement.devices_per_host]


def tpu_devices(placement: Placement, slices: int = 1) -> list[Any]:
    """Compile-only TPU devices of `slices` slices of the placement's topology."""
    require_libtpu()
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="tpu",
        topology_name=topology_name(placement),
        chip_config_name="default",
        chips_per_host_bounds=chips_per_host_bounds(placement),
        num_slices=slices,
    )
    return list(topology.devices)


def trainer_mesh(devices: list[Any], lay: capacity.Layout) -> Any:
    """The trainer's (dp, fsdp, tp) mesh over the devices its layout takes: every slice's
    physical layout (posttrain.trainer.mesh.make_mesh) when it takes them all, else the
    first slices or each slice's first devices (a disaggregated GRPO sampler's are the
    last)."""
    from posttrain.trainer import mesh as mesh_lib

    # One slice's compile-only devices have no slice_index; mesh.slices then groups them
    # by process, in MEGASCALE_NUM_SLICES groups (1) of the job's processes (its hosts).
    hosts = len({d.process_index for d in devices})
    groups = mesh_lib.slices(devices, {}, hosts)
    chosen = [d for g in groups[: lay.slices] for d in g[: lay.per_slice]]
    return mesh_lib.make_mesh(lay.per_slice, 1, chosen, env={}, process_count=hosts)


@dataclass
class Program:
    """One compiled program's figures per device (bytes, flops), or why it did not fit."""

    name: str
    memory: dict[str, int] | None = None
    flops: float | None = None
    seconds: float = 0.0
    error: str | None = None  # the compiler's out-of-memory message
    required: int | None = None  # bytes the compiler said it needed (out of memory)
    available: int | None = None  # bytes of HBM it had
    note: str | None = None  # printed beside the temporaries (a scanned step's count)

    @property
    def peak(self) -> int | None:
        if self.memory is None:
            return self.required
        from posttrain.trainer.step_memory import peak_bytes

        return peak_bytes(self.memory)


def out_of_memory(message: str) -> tuple[int | None, int | None] | None:
    """(required, available) bytes from a TPU compiler's out-of-memory error ("... the
    total memory required for HLO temporaries (42.32G) exceeds available HBM (15.75G)"),
    None when the error is not one."""
    if not is_out_of_memory(message):
        return None
    need = re.search(r"required for [^(]*\(" + _SIZE + r"\)", message)
    have = re.search(r"available (?:HBM|memory)[^(]*\(" + _SIZE + r"\)", message)

    def size(m: re.Match | None) -> int | None:
        return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None

    return size(need), size(have)


def compile_program(
    name: str, spec: PostTrainJobSpec, mesh: Any, compile: Callable[..., Any] | None = None
) -> Program:
    """The job's train step (or what `compile(spec, mesh)` compiles) compiled for `mesh`:
    its figures, or the compiler's out-of-memory figures (any other error is raised)."""
    from posttrain.trainer import step_memory
    from posttrain.trainer.models import scan

    started = time.monotonic()
    scanned = False  # the train step's decoder layers stacked (spec.training.layerLoop)
    try:
        if compile is None:
            step, args = step_memory.build(spec, mesh)
            scanned = scan.is_stacked(args[0])
            compiled = step_memory.compile_built(step, args, mesh)
        else:
            compiled = compile(spec, mesh)
    except Exception as e:  # XlaRuntimeError: only out of memory is an answer
        found = out_of_memory(str(e))
        if found is None:
            raise
        first = " ".join(str(e).split())
        return Program(name, seconds=time.monotonic() - started, error=first[:400],
                       required=found[0], available=found[1])  # fmt: skip
    flops = cost_of(compiled).get("flops")
    memory, note = step_memory.memory_of(compiled), None
    if scanned and list(mesh.devices.flat)[0].platform == "tpu":
        counted, memory = memory["temp"], scanned_memory(memory)
        if memory["temp"] != counted:
            note = (
                f"(the compiler's own count for the scanned layers; memory_analysis() "
                f"counts their loop's buffers more than once: {counted / capacity.GIB:.2f} GiB)"
            )
    return Program(name, memory, float(flops) if flops else None,
                   time.monotonic() - started, note=note)  # fmt: skip


def scanned_memory(memory: dict[str, int]) -> dict[str, int]:
    """A scanned step's figures with its temporaries as the TPU compiler counts them for
    its own peak (``peak_memory_in_bytes``, what it refuses a program over HBM on):
    ``memory_analysis()``'s temporaries count a layer loop's stacked buffers more than once
    (Qwen3-0.6B LoRA r16 at batch 3 on a v5e: 19.4 GiB by them, 14.1 by the compiler's
    own; the chip ran it holding 14.15 GiB in use and reserved; docs/tpu.md). Unchanged
    without that figure, or when it is the larger."""
    held = memory["argument"] + memory["output"] - memory["alias"]
    own = memory.get("peak", 0)
    if not own or own >= held + memory["temp"]:
        return memory
    return {**memory, "temp": own - held}


@dataclass
class Report:
    """What `posttrain estimate --compile` prints, and whether the job fits."""

    lines: list[str] = field(default_factory=list)
    fits: bool | None = None  # None: not compiled here (a GPU job: the estimate stands in)
    program: Program | None = None  # the compiled train step's figures
    limit_bytes: float | None = None  # the memory per device it is held to
    compiler: str | None = None  # e.g. "libtpu 0.0.42.1", "XLA:CPU"
    sampler: Program | None = None  # GRPO's sampler, compiled beside the train step
    sampler_beside: int = 0  # bytes that stay on the sampler's devices (optimizer state)

    def summary(self) -> dict[str, Any]:
        """The answer as JSON-able figures (GiB per device): what the operator's
        preflight reads from its pod's termination message."""
        out: dict[str, Any] = {"fits": self.fits, "compiler": self.compiler}
        program = self.program
        if program is None:
            return out
        gib = capacity.GIB
        if program.peak is not None:
            out["peakGiB"] = round(program.peak / gib, 3)
        if self.limit_bytes:
            out["hbmGiB"] = round(self.limit_bytes / gib, 3)
        if program.memory is not None:
            for key, name in (("argument", "argumentsGiB"), ("temp", "temporariesGiB"),
                              ("output", "outputsGiB")):  # fmt: skip
                out[name] = round(program.memory[key] / gib, 3)
        if program.flops:
            out["flops"] = program.flops
        if program.error:
            out["error"] = program.error
        if self.sampler is not None and self.sampler.peak is not None:
            out["samplerPeakGiB"] = round((self.sampler.peak + self.sampler_beside) / gib, 3)
        return out


def _gib(n: float) -> str:
    return f"{n / capacity.GIB:8.2f} GiB"


def describe(program: Program, limit_bytes: float, limit_name: str, peak_tflops: float,
             chip: str) -> tuple[list[str], bool]:  # fmt: skip
    """A program's lines, per device, and whether it fits in `limit_bytes`."""
    lines = [f"{program.name}, per device (compiled in {program.seconds:.0f} s):"]
    if program.memory is None:
        need = f"{program.required / capacity.GIB:.2f} GiB" if program.required else "more"
        have = program.available or limit_bytes
        lines += [
            f"  does not fit: the compiler needs {need} for its temporaries alone, more than "
            f"the {have / capacity.GIB:.2f} GiB of {limit_name} it has",
            f"  the compiler: {program.error}",
        ]
        return lines, False
    m = program.memory
    peak = program.peak or 0
    lines += [
        f"  {'arguments':<13}{_gib(m['argument'])}",
        f"  {'temporaries':<13}{_gib(m['temp'])}" + (f"  {program.note}" if program.note else ""),
        f"  {'outputs':<13}{_gib(m['output'])}"
        + (
            f"  ({m['alias'] / capacity.GIB:.2f} GiB of them in donated arguments' buffers)"
            if m["alias"]
            else ""
        ),  # fmt: skip
        f"  {'total':<13}{_gib(peak)} of {limit_bytes / capacity.GIB:.2f} GiB {limit_name} "
        f"({peak / limit_bytes:.0%})",
    ]
    fits = peak <= limit_bytes
    lines.append("  fits" if fits else "  does not fit")
    if program.flops and peak_tflops:
        seconds = program.flops / (peak_tflops * 1e12)
        lines.append(
            f"  {'flops':<13}{program.flops:.3g}: at least {_duration(seconds)} a step at "
            f"{chip}'s peak {peak_tflops:g} TFLOP/s bf16"
        )
    elif program.flops:
        lines.append(f"  {'flops':<13}{program.flops:.3g}")
    return lines, fits


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _for_cpu(spec: PostTrainJobSpec) -> PostTrainJobSpec:
    """spec.training.remat as the trainer applies it on CPU (auto: none)."""
    t = spec.training
    if str(t.remat) != "auto":
        return spec
    return spec.model_copy(update={"training": t.model_copy(update={"remat": "none"})})


def _remote_config(source: str, field: str) -> bytes:
    """config.json of a gs:// prefix or an hf://org/name[@rev] repository (nothing else of
    it: the compile reads no weights). ValueError naming `field` when it cannot be read."""
    try:
        if source.startswith("hf://"):
            from huggingface_hub import hf_hub_download

            from posttrain.trainer.sources import HF_CACHE

            repo, _, revision = source.removeprefix("hf://").partition("@")
            path = hf_hub_download(
                repo, "config.json", revision=revision or None, cache_dir=str(HF_CACHE)
            )
            with open(path, "rb") as f:
                return f.read(1024 * 1024)
        from posttrain.trainer import storage

        return storage.read_bytes(storage.join(source, "config.json"))
    except Exception as e:  # noqa: BLE001 - storage and Hub errors come in many types
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise ValueError(f"{field}: cannot read config.json of {source}: {reason}") from None


def local_configs(spec: PostTrainJobSpec, scratch: Any) -> PostTrainJobSpec:
    """`spec` with a gs:// or hf:// spec.model.source (and distillation teacher) replaced
    by a directory under `scratch` holding its config.json alone: what the compile reads
    (`posttrain estimate --compile --fetch-configs`, the operator's preflight pod)."""
    from pathlib import Path

    def local(source: str, field: str, name: str) -> str:
        if "://" not in source:
            return source
        target = Path(scratch) / name
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_bytes(_remote_config(source, field))
        return str(target)

    model = spec.model.model_copy(
        update={"source": local(spec.model.source, "spec.model.source", "model")}
    )
    update: dict[str, Any] = {"model": model}
    if spec.technique == "distill" and spec.distill is not None:
        teacher = spec.distill.teacher
        source = local(teacher.source, "spec.distill.teacher.source", "teacher")
        update["distill"] = spec.distill.model_copy(
            update={"teacher": teacher.model_copy(update={"source": source})}
        )
    return spec.model_copy(update=update)


def _add_sampler(report: Report, spec: PostTrainJobSpec, devices: list[Any], mesh: Any,
                 limit: float, placement: Placement) -> bool:  # fmt: skip
    """GRPO's sampler (sampler_memory) compiled where it runs: on the trainer's devices
    beside the optimizer's state (colocated), or on the devices the trainer leaves it
    (disaggregated). Its lines go into `report`; returns whether it fits."""
    from posttrain.trainer import models, sampler_memory

    trainer_devices = set(mesh.devices.flat)
    rest = [d for d in devices if d not in trainer_devices]
    sampler_mesh = models.make_mesh(devices=rest) if rest else mesh
    held = [0]

    def compile(spec: PostTrainJobSpec, mesh: Any) -> Any:
        compiled, held[0] = sampler_memory.compile_sampler(spec, mesh)
        return compiled

    where = f"its {len(rest)} devices" if rest else "the trainer's devices"
    program = compile_program(f"GRPO's sampler on {where}", spec, sampler_mesh, compile)
    room, room_name = limit, "HBM"
    if not rest:  # colocated: the optimizer's state stays on the devices while it samples
        room -= held[0]
        room_name = f"HBM left beside the optimizer's state ({held[0] / capacity.GIB:.2f} GiB)"
    lines, fits = describe(program, room, room_name, 0.0, placement.generation or "the chip")
    report.lines += lines
    report.sampler, report.sampler_beside = program, (0 if rest else held[0])
    return fits


def compile_report(spec: PostTrainJobSpec, placement: Placement) -> Report:
    """Compile the job's train step for its accelerator and say whether it fits."""
    from posttrain.api import model_shapes

    report = Report()
    source = spec.model.source
    if model_shapes.read_config(source) is None:
        raise ValueError(
            f"spec.model.source: {source!r}: --compile needs a local directory with the "
            "model's config.json (no weights are read)"
        )
    if (
        spec.technique == "distill"
        and model_shapes.read_config(spec.distill.teacher.source) is None
    ):
        raise ValueError(
            f"spec.distill.teacher.source: {spec.distill.teacher.source!r}: --compile needs "
            "a local directory with the teacher's config.json"
        )
    if placement.kind == "gpu":
        report.lines.append(
            f"{placement.accelerator}: XLA:GPU cannot compile without a GPU on this machine "
            "(its compiler reads the device); the fast estimate instead:"
        )
        return report
    if placement.kind == "cpu":
        from posttrain import host_memory
        from posttrain.trainer import cpu_flags

        cpu_flags.apply()  # the trainer's CPU scheduler (before JAX starts its backend)
        import jax

        from posttrain.trainer import step_memory

        spec = _for_cpu(spec)
        host = host_memory.estimate(spec, placement)
        limit = (host.available_gib if host else 0) * capacity.GIB
        where = host.available_from if host else "host memory"
        mesh = step_memory.mesh_of(1, 1, jax.devices("cpu"))
        report.lines.append("cpu: compiled with XLA:CPU on this machine, 1 device")
        program = compile_program("train step", spec, mesh)
        lines, fits = describe(program, limit, f"memory ({where})", 0.0, "cpu")
        report.lines += lines
        report.fits = fits
        report.program, report.limit_bytes, report.compiler = program, limit, "XLA:CPU"
        return report
    require_libtpu()
    lay = capacity.layout(spec, placement)
    slices = spec.resources.slices
    devices = tpu_devices(placement, slices)
    mesh = trainer_mesh(devices, lay)
    report.lines.append(
        f"{placement.accelerator} ({topology_name(placement)}, {slices} slice"
        f"{'s' if slices > 1 else ''}, {len(devices)} chips): the train step on "
        f"{lay.slices} x {lay.per_slice} (dp x fsdp) of them, compiled by the TPU compiler "
        f"(libtpu {libtpu_version()}, compile-only: no TPU used)"
    )
    limit = placement.memory_gib_per_device * capacity.GIB
    program = compile_program("train step", spec, mesh)
    if program.available:  # the compiler's own figure for the chip's usable HBM
        limit = program.available
    lines, fits = describe(program, limit, "HBM", placement.bf16_tflops_per_device,
                           placement.generation or "the chip")  # fmt: skip
    report.lines += lines
    report.fits = fits
    report.program, report.limit_bytes = program, limit
    report.compiler = f"libtpu {libtpu_version()}"
    if str(spec.technique) == "grpo":
        sampler_fits = _add_sampler(report, spec, devices, mesh, limit, placement)
        report.fits = fits and sampler_fits
    est = capacity.estimate(spec, placement)
    if est is not None:
        report.lines.append(
            f"the fast estimate (posttrain estimate without --compile): {est.total_gib:.2f} GiB"
        )
    return report
