"""The memory estimate against a real accelerator's compiler: run on a machine with a TPU or
GPU (no simulated devices), it compiles bench/memory.py's cases with the accelerator's own
XLA (its memory-aware scheduler, its fusions; see docs/user-guide.md, "Will it fit?") and
prints, per case, the estimate, ``memory_analysis()`` of one device, and the ratio, next to
the device's memory. Nothing runs and no weights are read: abstract arrays only, so a
case over the device's memory still compiles.

A case needs as many devices as its mesh (8 for most of bench/memory.py's cases); on a
machine with fewer, each case is compiled on the devices there are, the batch scaled to
keep the rows per device (--devices N to choose), and the estimate made for that layout.

    python bench/device_memory.py                   # every case that fits the devices
    python bench/device_memory.py --case sft-4k-remat --devices 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import memory  # noqa: E402  (bench/memory.py: the cases and their configs)


def main() -> int:
    import jax

    from posttrain import capacity, catalog
    from posttrain.api.spec import PostTrainJobSpec
    from posttrain.trainer import step_memory

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(memory.CASES))
    parser.add_argument("--devices", type=int, default=len(jax.devices()))
    args = parser.parse_args()
    devices = jax.devices()[: args.devices]
    stats = devices[0].memory_stats() or {}
    limit = stats.get("bytes_limit", 0) / capacity.GIB
    print(f"{len(devices)} x {devices[0].device_kind} ({limit:.1f} GiB each)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = Path(tmp)
        memory.write_configs(models_dir)
        for name in args.case or list(memory.CASES):
            doc = memory.spec_doc(name, models_dir)
            spec = PostTrainJobSpec.model_validate(doc)
            lay = capacity.layout(spec, catalog.resolve(spec.resources.accelerator))
            if lay.devices > len(devices):  # the same rows per device on fewer devices
                per_slice = max(1, len(devices) // lay.slices)
                slices = min(lay.slices, len(devices))
                scale = lay.devices // (slices * per_slice)
                t = spec.training
                batch = max(t.gradient_accumulation, t.batch_size // scale)
                spec = spec.model_copy(
                    update={"training": t.model_copy(update={"batch_size": batch})}
                )
                lay = capacity.Layout(slices, per_slice)
            est = capacity.estimate(spec, catalog.resolve(spec.resources.accelerator), lay)
            mesh = step_memory.mesh_of(lay.slices, lay.per_slice, devices)
            try:
                xla = step_memory.peak_bytes(step_memory.compiled_memory(spec, mesh))
            except Exception as e:  # a case this machine cannot compile: said, not fatal
                print(f"{name:<26} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            ratio = est.total_gib * capacity.GIB / xla
            results.append(ratio)
            print(
                f"{name:<26} {lay.slices}x{lay.per_slice} devices  estimate "
                f"{est.total_gib:6.1f} GiB  XLA {xla / capacity.GIB:6.1f} GiB  ratio {ratio:.2f}",
                flush=True,
            )
    inside = sum(0.8 <= r <= 1.25 for r in results)
    print(f"{inside} of {len(results)} compiled cases within 0.8-1.25")
    return 0


if __name__ == "__main__":
    sys.exit(main())
