"""Every *-cpu.yaml example runs offline from the repository root once the quickstart has
converted SmolLM2: it names only the converted model and files the repository ships."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONVERTED = ".cache/models/smollm2-135m-instruct"  # posttrain convert-gguf (make demo)
EXAMPLES = sorted((ROOT / "examples").glob("*-cpu.yaml"))


def sources(spec: dict) -> list[str]:
    found = [spec["model"]["source"], spec["data"]["source"]]
    found += [
        b["source"]
        for b in (spec.get("eval"), (spec.get("distill") or {}).get("teacher"))
        if b and b.get("source")
    ]
    if (spec.get("lora") or {}).get("restoreFrom"):
        found.append(spec["lora"]["restoreFrom"])
    return found


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_cpu_example_names_only_local_sources(path: Path):
    spec = yaml.safe_load(path.read_text())["spec"]
    for source in sources(spec):
        assert "://" not in source, f"{path.name}: {source} needs the network"
        assert source == CONVERTED or (ROOT / source).exists(), f"{path.name}: {source}"


def test_there_are_cpu_examples_of_every_technique():
    techniques = {yaml.safe_load(p.read_text())["spec"].get("technique", "sft") for p in EXAMPLES}
    assert techniques == {"sft", "dpo", "grpo", "distill"}
