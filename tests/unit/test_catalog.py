"""The accelerator catalog: device names to hosts, chips, labels, machine types and
Pathways types, and the whole TPU/GPU catalog against xpk's system characteristics table
(a copy in tests/unit/data/, from xpk 1.16.0)."""

import csv
import math
from pathlib import Path

import pytest

from posttrain import catalog

XPK_TABLE = Path(__file__).parent / "data" / "xpk-1.16.0-system-characteristics.tsv"

TPU_TABLE = [
    # name, topology, hosts, chips/host, node label, machine type, pathways type
    ("v6e-256", "16x16", 64, 4, "tpu-v6e-slice", "ct6e-standard-4t", "tpuv6e:16x16"),
    ("v6e-8", "2x4", 2, 4, "tpu-v6e-slice", "ct6e-standard-4t", "tpuv6e:2x4"),
    ("v6e-4", "2x2", 1, 4, "tpu-v6e-slice", "ct6e-standard-4t", "tpuv6e:2x2"),
    ("v6e-1", "1x1", 1, 1, "tpu-v6e-slice", "ct6e-standard-1t", "tpuv6e:1x1"),
    ("v5p-128", "4x4x4", 16, 4, "tpu-v5p-slice", "ct5p-hightpu-4t", "tpuv5:4x4x4"),
    ("v5p-8", "2x2x1", 1, 4, "tpu-v5p-slice", "ct5p-hightpu-4t", "tpuv5:2x2x1"),
    ("v5p-384", "4x4x12", 48, 4, "tpu-v5p-slice", "ct5p-hightpu-4t", "tpuv5:4x4x12"),
    ("v5p-768", "4x8x12", 96, 4, "tpu-v5p-slice", "ct5p-hightpu-4t", "tpuv5:4x8x12"),
    ("v5e-8", "2x4", 2, 4, "tpu-v5-lite-podslice", "ct5lp-hightpu-4t", "tpuv5e:2x4"),
    ("v5litepod-16", "4x4", 4, 4, "tpu-v5-lite-podslice", "ct5lp-hightpu-4t", "tpuv5e:4x4"),
    ("v4-32", "2x2x4", 4, 4, "tpu-v4-podslice", "ct4p-hightpu-4t", "tpuv4:2x2x4"),
    ("tpu7x-128", "4x4x4", 16, 4, "tpu7x", "tpu7x-standard-4t", "tpu7x:4x4x4"),
    ("tpu7x-2", "1x1x1", 1, 1, "tpu7x", "tpu7x-standard-1t", "tpu7x:1x1x1"),
]


@pytest.mark.parametrize("name,topology,hosts,per_host,label,machine,pathways", TPU_TABLE)
def test_tpu_slices(name, topology, hosts, per_host, label, machine, pathways):
    p = catalog.resolve(name)
    assert (p.kind, p.topology, p.hosts, p.devices_per_host) == ("tpu", topology, hosts, per_host)
    assert p.node_selector == {
        catalog.TPU_ACCELERATOR_LABEL: label,
        catalog.TPU_TOPOLOGY_LABEL: topology,
        catalog.INSTANCE_TYPE_LABEL: machine,
    }
    assert p.machine_type == machine
    assert p.pathways_instance_type == pathways
    assert p.resource_name == "google.com/tpu"


def test_machine_type_tells_one_8_chip_host_from_two_4_chip_hosts():
    """A 2x4 slice is two ct6e-standard-4t VMs or one ct6e-standard-8t VM; the node
    selector names the machine type, so neither job lands on the other kind of pool."""
    two = catalog.resolve("v6e-8")
    one = catalog.resolve("v6e-8", machine_type="ct6e-standard-8t")
    assert (two.hosts, two.devices_per_host) == (2, 4)
    assert (one.hosts, one.devices_per_host, one.topology) == (1, 8, "2x4")
    assert one.node_selector[catalog.INSTANCE_TYPE_LABEL] == "ct6e-standard-8t"
    assert two.node_selector[catalog.INSTANCE_TYPE_LABEL] == "ct6e-standard-4t"
    assert catalog.resolve("v5e-8", machine_type="ct5lp-hightpu-8t").hosts == 1
    with pytest.raises(catalog.CatalogError, match="do not form v6e-16 slices of topology 4x4"):
        catalog.resolve("v6e-16", machine_type="ct6e-standard-8t")
    with pytest.raises(catalog.CatalogError, match="valid: ct6e-standard-1t, ct6e-standard-4t"):
        catalog.resolve("v6e-8", machine_type="ct5lp-hightpu-4t")
    with pytest.raises(catalog.CatalogError, match="machineType applies to TPU slices only"):
        catalog.resolve("nvidia-h100-80gb", machine_type="a3-highgpu-8g")


def test_alias_is_canonicalised():
    assert catalog.resolve("v5litepod-8").accelerator == "v5e-8"


def test_explicit_topology_must_match_chip_count():
    assert catalog.resolve("v6e-32", "4x8").hosts == 8
    with pytest.raises(catalog.CatalogError, match="has 16 chips but 'v6e-32' has 32"):
        catalog.resolve("v6e-32", "4x4")


@pytest.mark.parametrize(
    "name,topology,fragment",
    [
        ("v6e-300", None, "no v6e slice has 300 chips"),
        ("v6e-64", "4x4x4", "does not exist for v6e"),
        ("v5p-7", None, "multiple of 2"),
        ("v9-8", None, "unknown accelerator"),
        ("nvidia-k80", None, "unknown accelerator"),
        ("cpu", "2x2", "TPU slices only"),
    ],
)
def test_impossible_requests_list_choices(name, topology, fragment):
    with pytest.raises(catalog.CatalogError) as e:
        catalog.resolve(name, topology)
    assert fragment in str(e.value)
    if "unknown" in fragment or "no v6e" in fragment:
        assert "v6e-256" in str(e.value)  # valid choices are listed


def test_gpus():
    p = catalog.resolve("nvidia-h100-80gb")
    assert (p.kind, p.devices_per_host, p.resource_name) == ("gpu", 8, "nvidia.com/gpu")
    assert p.node_selector == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert catalog.resolve("nvidia-l4", gpus_per_node=2).devices_per_host == 2
    for name in (
        "nvidia-a100-80gb",
        "nvidia-h200-141gb",
        "nvidia-b200",
        "nvidia-gb200",
        "nvidia-l4",
    ):
        assert catalog.resolve(name).kind == "gpu"
    with pytest.raises(catalog.CatalogError, match="at most 8 GPUs"):
        catalog.resolve("nvidia-h100-80gb", gpus_per_node=9)


def test_cpu():
    p = catalog.resolve("cpu")
    assert (p.kind, p.devices_per_host, p.resource_name, p.node_selector) == ("cpu", 0, None, {})


def test_device_names_cover_every_generation():
    names = catalog.tpu_device_names()
    for expected in ("v4-8", "v5e-256", "v5p-8", "v5p-384", "v6e-256", "tpu7x-2", "tpu7x-8"):
        assert expected in names
    assert all(catalog.is_tpu_name(n) for n in names)
    assert not catalog.is_tpu_name("nvidia-h100-80gb")


# -- the whole catalog against xpk's table ----------------------------------------------

XPK_PREFIXES = {"v5litepod": "v5e"}  # xpk's name -> posttrain's canonical generation
# Not in posttrain: tpu7 (GKE machine types tpu7-standard-*) has no published HBM and
# throughput figures for the capacity check yet.
XPK_ONLY = {"tpu7"}
# Shapes GKE documents that xpk does not list: single-host v5e slices (1x1 on
# ct5lp-hightpu-1t, 2x2 on -4t) and the single-host 2x4 (8-chip) v5e and v6e VMs.
GKE_ONLY = {
    ("v5e", "ct5lp-hightpu-1t", "1x1"),
    ("v5e", "ct5lp-hightpu-4t", "2x2"),
    ("v5e", "ct5lp-hightpu-8t", "2x4"),
    ("v6e", "ct6e-standard-8t", "2x4"),
}


def _xpk_rows(kind: str) -> list[dict[str, str]]:
    lines = [line for line in XPK_TABLE.read_text().splitlines() if not line.startswith("#")]
    return [r for r in csv.DictReader(lines, delimiter="\t") if r["kind"] == kind]


def _split(name: str) -> tuple[str, str]:
    prefix, suffix = name.rsplit("-", 1)
    return XPK_PREFIXES.get(prefix, prefix), suffix


def _xpk_tpu_rows() -> list[dict[str, str]]:
    return [r for r in _xpk_rows("tpu") if _split(r["name"])[0] not in XPK_ONLY]


def _chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def _same_facts(row: dict[str, str], p: catalog.Placement) -> None:
    gen = catalog.TPU_GENERATIONS[p.generation]
    assert (p.topology, p.hosts, p.devices_per_host, p.machine_type) == (
        row["topology"],
        int(row["vms_per_slice"]),
        int(row["chips_per_vm"]),
        row["machine_type"],
    ), row["name"]
    assert gen.node_label == row["gke_accelerator"], row["name"]
    assert p.pathways_instance_type == f"{row['pathways_type']}:{row['topology']}", row["name"]


def test_every_xpk_tpu_shape_is_in_the_catalog_with_the_same_facts():
    rows = [r for r in _xpk_tpu_rows() if "x" in _split(r["name"])[1]]
    assert len(rows) > 1400
    for row in rows:
        gen = catalog.TPU_GENERATIONS[_split(row["name"])[0]]
        name = f"{gen.name}-{_chips(row['topology']) * gen.cores_per_chip}"
        _same_facts(row, catalog.resolve(name, row["topology"], machine_type=row["machine_type"]))


def test_device_names_default_to_xpks_shape_or_a_more_compact_one():
    """Where xpk names a preferred shape for a chip count, posttrain takes the same one.
    Where it has none, xpk falls back to the first shape it generated (4x8x196 for
    tpu7x-12544); posttrain takes the most compact (shortest longest edge) instead."""
    shapes = [r for r in _xpk_tpu_rows() if "x" in _split(r["name"])[1]]
    devices = [r for r in _xpk_tpu_rows() if "x" not in _split(r["name"])[1]]
    first_generated = {}
    for r in shapes:
        first_generated.setdefault((_split(r["name"])[0], _chips(r["topology"])), r["topology"])
    compact = 0
    for row in devices:
        prefix, cores = _split(row["name"])
        p = catalog.resolve(f"{prefix}-{cores}")
        if p.topology == row["topology"]:
            _same_facts(row, p)
            continue
        assert row["topology"] == first_generated[(prefix, _chips(row["topology"]))], row
        longest = max(int(d) for d in p.topology.split("x"))
        assert longest < max(int(d) for d in row["topology"].split("x")), (row, p.topology)
        compact += 1
    assert len(devices) > 300 and compact < len(devices) // 3


def test_every_catalog_shape_is_in_xpks_table_or_documented_by_gke():
    xpk = {
        (_split(r["name"])[0], r["machine_type"], r["topology"])
        for r in _xpk_tpu_rows()
        if "x" in _split(r["name"])[1]
    }
    ours = {
        (gen.name, m.name, t)
        for gen in catalog.TPU_GENERATIONS.values()
        for m in gen.machines
        for t in m.topologies
    }
    assert ours - xpk == GKE_ONLY
    assert xpk <= ours


def test_gpu_types_cover_xpks():
    rows = _xpk_rows("gpu")
    assert {r["gke_accelerator"] for r in rows} <= set(catalog.GPU_TYPES)
    for r in rows:
        gpu = catalog.GPU_TYPES[r["gke_accelerator"]]
        assert int(r["chips_per_vm"]) <= gpu.max_per_node, r["name"]
    assert catalog.GPU_TYPES["nvidia-gb200"].max_per_node == 4  # a4x-highgpu-4g
