"""SKU detection from device properties (fake ones: no GPU needed), the built-in profile per
SKU, and a calibrated profile keyed by the SKU taking over from the built-in one."""
import dataclasses

import pytest

from ficco import config
from ficco.errors import ConfigError
from ficco.heuristics import profiles, sku
from ficco.heuristics.sku import DeviceProps

GIB = 1 << 30

# (properties as torch / NVML / amdsmi report them, expected built-in profile)
PARTS = [
    (DeviceProps("cuda:sm_90", "NVIDIA H100 80GB HBM3", 80 * GIB, 132, 700.0, 1980.0), "h100"),
    (DeviceProps("cuda:sm_90", "NVIDIA H100 80GB HBM2e", 80 * GIB, 132, 700.0), "h100-hbm2e"),
    (DeviceProps("cuda:sm_90", "NVIDIA H100 PCIe", 80 * GIB, 114, 350.0), "h100-pcie"),
    (DeviceProps("cuda:sm_90", "NVIDIA H100", 80 * GIB, 114), "h100-pcie"),       # by SM count
    (DeviceProps("cuda:sm_90", "NVIDIA H800", 80 * GIB, 132, 700.0), "h800"),
    (DeviceProps("cuda:sm_90", "NVIDIA H800 PCIe", 80 * GIB, 114), "h100-pcie"),
    (DeviceProps("cuda:sm_90", "NVIDIA H20", 96 * GIB, 78, 400.0), "h20"),
    (DeviceProps("cuda:sm_90", "NVIDIA H200", 141 * GIB, 132, 700.0), "h200"),
    (DeviceProps("cuda:sm_80", "NVIDIA A100-SXM4-80GB", 80 * GIB, 108), "a100"),
    (DeviceProps("cuda:sm_100", "NVIDIA B200", 180 * GIB, 148), "b200"),
    (DeviceProps("rocm:gfx942", "AMD Instinct MI300X", 192 * GIB, 304, 750.0), "mi300x"),
    (DeviceProps("rocm:gfx942", "AMD Instinct MI325X", 256 * GIB, 304), "mi325x"),
    (DeviceProps("rocm:gfx942", "", 256 * GIB, 304), "mi325x"),                   # by memory
    (DeviceProps("rocm:gfx950", "AMD Instinct MI355X", 288 * GIB, 256, 1400.0), "mi355x"),
    (DeviceProps("cpu"), "cpu"),
]


@pytest.mark.parametrize("props,profile", PARTS, ids=[p.name or p.target for p, _ in PARTS])
def test_sku_picks_the_built_in_profile_of_the_part(props, profile):
    part = sku.sku_of(props)
    assert part.profile == profile
    assert profile in profiles.builtin_names()
    assert profiles.load(profile).name == profile


def test_sku_ids_tell_parts_apart():
    ids = [sku.sku_of(p).id for p, _ in PARTS]
    assert len(set(ids)) == len(ids)
    assert sku.sku_of(PARTS[0][0]).id == "nvidia-h100-80gb-hbm3-132cu-700w"
    # the same part with another power limit is another SKU (its calibration is its own)
    capped = DeviceProps("cuda:sm_90", "NVIDIA H100 80GB HBM3", 80 * GIB, 132, 500.0)
    assert sku.sku_of(capped).id != sku.sku_of(PARTS[0][0]).id
    assert sku.sku_of(capped).profile == "h100"
    assert all("/" not in i and " " not in i for i in ids)


def test_unknown_gpu_falls_back_to_the_vendor_reference_with_a_warning(caplog):
    part = sku.sku_of(DeviceProps("cuda:sm_120", "NVIDIA RTX PRO 6000", 96 * GIB, 188))
    assert part.profile == "h100"
    assert "no built-in profile" in caplog.text
    with pytest.raises(ConfigError, match="no profile for target 'tpu:v5'"):
        sku.sku_of(DeviceProps("tpu:v5"))


def test_the_parts_profiles_differ_where_the_data_sheets_do():
    h100, pcie, h800, h20 = (profiles.load(n) for n in ("h100", "h100-pcie", "h800", "h20"))
    assert pcie.compute_units == 114 and pcie.topology == "pcie"
    assert pcie.flops("bfloat16") < h100.flops("bfloat16")
    assert h800.flops("bfloat16") == h100.flops("bfloat16")
    assert h800.link_bytes_per_s < h100.link_bytes_per_s
    assert h20.compute_units == 78 and h20.flops("bfloat16") < h100.flops("bfloat16") / 5
    for p in (h100, pcie, h800, h20):
        for key in ("peak_flops", "hbm_bytes_per_s", "compute_units", "link_bytes_per_s"):
            assert p.sources.get(key), f"{p.name}: {key} has no source"


def test_no_device_means_the_reference_part():
    # this machine has no GPU: a GPU target alone picks its architecture's reference part
    assert profiles.detect("cuda:sm_90") == "h100"
    assert profiles.detect("rocm:gfx942") == "mi300x"
    assert profiles.detect("cuda:sm_90", "NVIDIA H20") == "h20"


def test_a_calibrated_profile_for_the_sku_is_used_and_FICCO_PROFILE_overrides(tmp_path):
    with config.scope(cache_dir=str(tmp_path)):
        assert profiles.resolve("cpu").name == "cpu"
        assert profiles.identity("cpu") == "cpu"
        calibrated = dataclasses.replace(profiles.load("cpu"), name="cpu-measured",
                                         link_bytes_per_s=7e9)
        calibrated.to_json(profiles.calibrated_path(sku.sku_of(sku.local_props("cpu")).id))
        assert profiles.resolve("cpu").name == "cpu-measured"
        assert profiles.resolve("cpu").link_bytes_per_s == 7e9
        assert profiles.identity("cpu").startswith("cpu-measured@")
        with config.scope(profile="cpu"):
            assert profiles.resolve("cpu").name == "cpu"
            assert profiles.identity("cpu") == "cpu"
