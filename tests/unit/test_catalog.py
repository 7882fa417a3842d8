"""The accelerator catalog: device names to hosts, chips, labels and Pathways types."""

import pytest

from posttrain import catalog

TPU_TABLE = [
    # name, topology, hosts, chips/host, node label, pathways type
    ("v6e-256", "16x16", 64, 4, "tpu-v6e-slice", "tpuv6e:16x16"),
    ("v6e-8", "2x4", 2, 4, "tpu-v6e-slice", "tpuv6e:2x4"),
    ("v6e-1", "1x1", 1, 1, "tpu-v6e-slice", "tpuv6e:1x1"),
    ("v5p-128", "4x4x4", 16, 4, "tpu-v5p-slice", "tpuv5:4x4x4"),
    ("v5p-8", "2x2x1", 1, 4, "tpu-v5p-slice", "tpuv5:2x2x1"),
    ("v5e-8", "2x4", 2, 4, "tpu-v5-lite-podslice", "tpuv5e:2x4"),
    ("v5litepod-16", "4x4", 4, 4, "tpu-v5-lite-podslice", "tpuv5e:4x4"),
    ("v4-32", "2x2x4", 4, 4, "tpu-v4-podslice", "tpuv4:2x2x4"),
    ("tpu7x-128", "4x4x4", 16, 4, "tpu7x", "tpu7x:4x4x4"),
]


@pytest.mark.parametrize("name,topology,hosts,per_host,label,pathways", TPU_TABLE)
def test_tpu_slices(name, topology, hosts, per_host, label, pathways):
    p = catalog.resolve(name)
    assert (p.kind, p.topology, p.hosts, p.devices_per_host) == ("tpu", topology, hosts, per_host)
    assert p.node_selector == {
        catalog.TPU_ACCELERATOR_LABEL: label,
        catalog.TPU_TOPOLOGY_LABEL: topology,
    }
    assert p.pathways_instance_type == pathways
    assert p.resource_name == "google.com/tpu"


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
    for name in ("nvidia-a100-80gb", "nvidia-h200-141gb", "nvidia-b200", "nvidia-l4"):
        assert catalog.resolve(name).kind == "gpu"
    with pytest.raises(catalog.CatalogError, match="at most 8 GPUs"):
        catalog.resolve("nvidia-h100-80gb", gpus_per_node=9)


def test_cpu():
    p = catalog.resolve("cpu")
    assert (p.kind, p.devices_per_host, p.resource_name, p.node_selector) == ("cpu", 0, None, {})


def test_device_names_cover_every_generation():
    names = catalog.tpu_device_names()
    for expected in ("v4-8", "v5e-256", "v5p-8", "v6e-256", "tpu7x-8"):
        assert expected in names
    assert all(catalog.is_tpu_name(n) for n in names)
    assert not catalog.is_tpu_name("nvidia-h100-80gb")
