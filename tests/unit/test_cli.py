"""The posttrain CLI: validate, render, crd."""

import subprocess
import sys
from pathlib import Path

import yaml
from invalid_jobs import CASES

ROOT = Path(__file__).parent.parent.parent


def posttrain(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *args], cwd=cwd, capture_output=True, text=True
    )


def test_validate_examples_ok():
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.yaml"))
    assert examples
    r = posttrain("validate", *examples)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": valid") == len(examples)


def test_validate_reports_every_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    doc = next(c for c in CASES if c.id == "steps-zero").doc()
    doc["spec"]["lora"] = {"rank": 0}
    bad.write_text(yaml.safe_dump(doc))
    r = posttrain("validate", str(bad))
    assert r.returncode == 1
    assert str(bad) in r.stderr
    assert "spec.training.steps" in r.stderr and "spec.lora.rank" in r.stderr


def test_validate_yaml_syntax_error(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("spec: [unclosed\n")
    r = posttrain("validate", str(bad))
    assert r.returncode == 1 and "(yaml)" in r.stderr


def test_render_prints_objects():
    r = posttrain("render", "tests/golden/jobs/v5e-8.yaml", "-n", "other")
    assert r.returncode == 0, r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout)]
    assert kinds == ["JobSet"]
    assert all(d["metadata"]["namespace"] == "other" for d in yaml.safe_load_all(r.stdout))


def test_render_prints_the_preflight_job_first_when_the_job_compiles_first(tmp_path):
    """A TPU job's preflight Job (the operator makes it before the JobSet) is printed with
    --preflight (an installation that compiles TPU jobs first) or spec.preflight.compile;
    spec.preflight.compile: false wins over --preflight; a CPU job has none."""
    doc = yaml.safe_load((ROOT / "tests/golden/jobs/v5e-8.yaml").read_text())

    def kinds(doc: dict, *flags: str) -> list[str]:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(doc))
        r = posttrain("render", str(path), *flags)
        assert r.returncode == 0, r.stderr
        return [d["kind"] for d in yaml.safe_load_all(r.stdout)]

    assert kinds(doc) == ["JobSet"]
    assert kinds(doc, "--preflight") == ["Job", "JobSet"]
    r = posttrain("render", "tests/golden/jobs/v5e-8.yaml", "--preflight")
    pf = next(yaml.safe_load_all(r.stdout))
    container = pf["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:3] == ["posttrain", "estimate", "--compile"]
    assert pf["metadata"]["name"].startswith(doc["metadata"]["name"] + "-pf-")
    assert kinds({**doc, "spec": {**doc["spec"], "preflight": {"compile": True}}}) == [
        "Job",
        "JobSet",
    ]
    off = {**doc, "spec": {**doc["spec"], "preflight": {"compile": False}}}
    assert kinds(off, "--preflight") == ["JobSet"]
    cpu = {**doc, "spec": {**doc["spec"], "resources": {"accelerator": "cpu"}}}
    assert kinds(cpu, "--preflight") == ["JobSet"]


def test_crd_matches_file():
    r = posttrain("crd")
    assert r.returncode == 0
    assert r.stdout == (ROOT / "crds" / "posttrain.dev_posttrainjobs.yaml").read_text()


def _job_yaml(**spec_extra) -> str:
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "cli-job"},
        "spec": {
            "model": {"source": "/models/tiny"},
            "data": {"source": "/data/train.jsonl"},
            "output": {"uri": "/outputs/run"},
            **spec_extra,
        },
    }
    return yaml.safe_dump(doc)


def test_validate_never_tracebacks_and_keeps_going(tmp_path):
    files = {
        "list.yaml": b"- a\n- b\n",
        "scalar.yaml": b"just text\n",
        "list-first.yaml": b"- a\n---\n" + _job_yaml().encode(),
        "latin1.yaml": "metadata: {name: caf\xe9}\n".encode("latin-1"),
        "utf16.yaml": _job_yaml().encode("utf-16-le"),  # no byte order mark
        "deep.yaml": b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
        "escape.yaml": _job_yaml(**{"x\x1b[32m\nspec.model: valid": 1}).encode(),
        "regex.yaml": _job_yaml(lora={"targetModules": "a{4294967296}"}).encode(),
        "good.yaml": _job_yaml().encode(),
    }
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    r = posttrain("validate", *paths, str(tmp_path / "missing.yaml"))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == f"{tmp_path / 'good.yaml'}: valid\n"
    lines = r.stderr.splitlines()
    for name in [*files, "missing.yaml"]:
        if name != "good.yaml":
            assert any(line.startswith(str(tmp_path / name) + ": ") for line in lines), name
    assert all(line.startswith(str(tmp_path)) for line in lines), lines  # no forged lines
    assert "spec.x\\x1b[32m\\nspec.model: valid: unknown field" in r.stderr
    assert "spec.lora.targetModules" in r.stderr


def test_job_files_in_the_encodings_and_sizes_kubectl_reads(tmp_path):
    """kubectl reads UTF-16 with a byte order mark (LE or BE) and UTF-8 with or without
    one, and refuses UTF-16 without one; a file over the size posttrain reads is one line
    naming the file, its size and the limit."""
    text = _job_yaml()
    files = {
        "utf16le-bom.yaml": b"\xff\xfe" + text.encode("utf-16-le"),
        "utf16be-bom.yaml": b"\xfe\xff" + text.encode("utf-16-be"),
        "utf8-bom.yaml": b"\xef\xbb\xbf" + text.encode(),
        "utf16be.yaml": text.encode("utf-16-be"),
        "huge.yaml": text.encode() + b"#" * (1536 * 1024),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    r = posttrain("validate", *(str(tmp_path / n) for n in files))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    valid = [
        f"{tmp_path / n}: valid" for n in ("utf16le-bom.yaml", "utf16be-bom.yaml", "utf8-bom.yaml")
    ]
    assert r.stdout.splitlines() == valid, r.stdout
    errors = [line for line in r.stderr.splitlines() if ": warning: " not in line]
    assert errors == [
        f"{tmp_path / 'utf16be.yaml'}: (encoding): UTF-16 text without a byte order mark, "
        "which kubectl refuses too: save the file as UTF-8 (or as UTF-16 with a BOM)",
        f"{tmp_path / 'huge.yaml'}: (file size): the file is 1.50 MiB "
        f"({len(files['huge.yaml'])} bytes), over the 1048576 bytes (1 MiB) posttrain reads of "
        "a job file: a job's whole spec must fit in the 240 KiB of its JobSet's config annotation",
    ], r.stderr


def test_bad_flags_get_one_line(tmp_path):
    r = posttrain("validate")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr


def test_run_validates_overrides(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(_job_yaml())
    for flags, field in [
        (["--steps", "-5"], "spec.training.steps"),
        (["--steps", "many"], "spec.training.steps"),
        (["--output", ""], "spec.output.uri"),
        (["--output", "/"], "spec.output.uri"),
        (["--output", "s3://bucket/run"], "spec.output.uri"),
    ]:
        r = posttrain("run", str(job), *flags)
        assert r.returncode == 65, (flags, r.stderr)
        assert field in r.stderr and "Traceback" not in r.stderr, r.stderr
