"""The TPU compiler's figures of bench/tpu_memory_table.json (bench/tpu_calibration.py) beside
posttrain's fast estimate and admission verdict for each case: pure, no JAX."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from posttrain import capacity, catalog
from posttrain.api.spec import PostTrainJobSpec

TABLE = Path(__file__).resolve().parents[2] / "bench" / "tpu_memory_table.json"
NO_WARNING_BELOW = 0.9  # the compiler's total under this share of HBM: admitted, no warning


@dataclass(frozen=True)
class Row:
    name: str
    spec: PostTrainJobSpec
    compiler: float  # GiB per device, the TPU compiler's (its temporaries alone if over_hbm)
    over_hbm: bool
    estimate: float  # GiB per device, posttrain.capacity.estimate
    terms: dict
    hbm: float
    verdict: str  # posttrain.capacity.admission: admit, warn or refuse
    message: str | None
    peak: str = ""  # the phase of the step whose temporaries the estimate counts

    @property
    def ratio(self) -> float:
        return self.estimate / self.compiler


def load(path: Path = TABLE) -> dict:
    return json.loads(path.read_text())


def rows(table: dict | None = None) -> list[Row]:
    """Every case of the table with the estimate and admission for its spec, the models'
    shapes read from the table's config.json copies (as a job with a local checkpoint)."""
    table = table or load()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for model, config in table["configs"].items():
            (root / model).mkdir()
            (root / model / "config.json").write_text(json.dumps(config))
        for name, case in table["cases"].items():
            doc = json.loads(json.dumps(case["spec"]))
            doc["model"]["source"] = str(root / doc["model"]["source"])
            if "distill" in doc:
                teacher = doc["distill"]["teacher"]
                teacher["source"] = str(root / teacher["source"])
            spec = PostTrainJobSpec.model_validate(doc)
            placement = catalog.resolve(spec.resources.accelerator)
            est = capacity.estimate(spec, placement)
            verdict, message = capacity.admission(spec, placement)
            m = case["memory"]
            peak = m["argument"] + m["temp"] + m["output"] - m["alias"]
            out.append(Row(name, spec, peak / capacity.GIB, case["over_hbm"], est.total_gib,
                           dict(est.terms), est.available_gib, verdict, message,
                           est.peak))  # fmt: skip
    return out


def admission_check(row: Row) -> str:
    """'right' or 'WRONG': a case the compiler fits within NO_WARNING_BELOW of HBM must be
    admitted without a warning, one over HBM refused; '-' in between (either is right)."""
    if row.over_hbm or row.compiler > row.hbm:
        return "right" if row.verdict == "refuse" else "WRONG"
    if row.compiler < NO_WARNING_BELOW * row.hbm:
        return "right" if row.verdict == "admit" else "WRONG"
    return "-"
