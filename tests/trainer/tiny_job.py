"""A tiny PostTrainJob for the trainer tests, running it in this process, and comparing
what two runs wrote.

``tiny_job`` writes the document every trainer test starts from (a local model, a local
data file, batches of 8, float32, LoRA rank 4 unless ``lora=False``); a test adds or
changes what it is about through keyword arguments or by editing ``doc["spec"]``.
``run_job`` validates it as the admission webhook would and trains it in process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from posttrain.api.spec import PostTrainJob
from posttrain.checks import validate


def tiny_job(
    model: Path | str,
    data: Path | str,
    out: Path | str,
    *,
    name: str = "tiny",
    steps: int,
    every: int,
    keep: int = 3,
    lora: bool = True,
    dtype: str = "float32",
    training: dict[str, Any] | None = None,
    **sections: Any,
) -> dict:
    """A PostTrainJob document; ``training`` adds to spec.training, ``sections`` are
    further spec sections (technique, dpo, distill, ...)."""
    spec = {
        **sections,
        "model": {"source": str(model), "dtype": dtype},
        "data": {"source": str(data), "maxLength": 64},
        "training": {"steps": steps, "batchSize": 8, "learningRate": 0.01, **(training or {})},
        "checkpoint": {"everySteps": every, "keep": keep},
        "output": {"uri": str(out)},
    }
    if lora:
        spec["lora"] = {"rank": 4, "alpha": 8}
    return {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": name},
        "spec": spec,
    }


def validated(doc: dict) -> PostTrainJob:
    """The job of ``doc``, which must validate."""
    job, errors = validate(doc)
    assert not errors, errors
    return job


def run_job(job: dict | PostTrainJob):
    """Trains ``job`` (a document, validated first, or a PostTrainJob) in this process as
    the only host; returns what loop.train returns."""
    from posttrain.trainer.distributed import ProcessInfo
    from posttrain.trainer.loop import train

    job = validated(job) if isinstance(job, dict) else job
    return train(job, ProcessInfo(None, 1, 0), show_bar=False)


def assert_bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """The same tensors, bit for bit (an exact resume, a deterministic run)."""
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), f"{key} differs"
