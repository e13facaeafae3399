"""DeviceProfile's rate curves: interpolation, validation and the JSON round trip."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from remat.ir import DeviceProfile, Graph
from remat.ir.device_profile import interpolate
from remat.ir.devices import roofline_time_s


def _profile() -> DeviceProfile:
    return DeviceProfile(
        name="curved",
        peak_flops_per_s={"float32": 1e11},
        memory_bandwidth_bytes_per_s=2e10,
        host_bandwidth_bytes_per_s=2e10,
        op_overhead_s=1e-6,
        op_bandwidth_bytes_per_s={"softmax": 8e9},
        op_bandwidth_curves={"_safe_softmax": ((32.0, 1e9), (128.0, 2e9), (2048.0, 4e9))},
        op_efficiency_curves={"bmm": ((1e5, 0.2), (1e6, 0.6), (1e7, 1.0))},
    )


def test_interpolation_is_linear_in_log_size_and_flat_beyond_the_ends() -> None:
    points = ((32.0, 1e9), (128.0, 2e9), (2048.0, 4e9))
    assert interpolate(points, 32) == 1e9
    assert interpolate(points, 128) == 2e9
    assert interpolate(points, 64) == pytest.approx(1.5e9)  # halfway on log2: 5 of 5..7
    assert interpolate(points, 512) == pytest.approx(3e9)  # log2 9 of 7..11
    assert interpolate(points, 8) == 1e9 and interpolate(points, 0) == 1e9
    assert interpolate(points, 1e6) == 4e9
    assert interpolate(((10.0, 5.0),), 3.0) == interpolate(((10.0, 5.0),), 30.0) == 5.0


def test_rates_come_from_the_curve_where_the_size_is_known() -> None:
    p = _profile()
    assert p.bandwidth_bytes_per_s("_safe_softmax", 128) == 2e9
    # no size: the key's figure, else the memory bandwidth
    assert p.bandwidth_bytes_per_s("_safe_softmax") == 2e10
    assert p.bandwidth_bytes_per_s("softmax", 128) == 8e9
    eff = 0.2 + 0.4 * math.log(3e5 / 1e5) / math.log(10)
    assert p.flops_per_s("float32", "bmm", 3e5) == pytest.approx(eff * 1e11)
    assert p.flops_per_s("float32", "bmm") == 1e11
    assert p.flops_per_s("float32", "bmm", 1e9) == 1e11  # the large end: the matmul's rate
    # a small batched product: compute at 20% of the peak
    t = roofline_time_s(p, 2e6, 1e3, "float32", "bmm", 1e4)
    assert t == pytest.approx(1e-6 + 2e6 / (0.2 * 1e11))
    # a softmax over rows of 64: 1.5 GB/s
    t = roofline_time_s(p, 0, 3e6, "float32", "_safe_softmax", 64)
    assert t == pytest.approx(1e-6 + 3e6 / 1.5e9)
    assert p.knows("bmm") and p.knows("_safe_softmax") and p.knows("softmax")
    assert not p.knows("gelu")


def test_curves_survive_the_json_round_trip_of_a_graph() -> None:
    p = _profile()
    assert DeviceProfile.model_validate_json(p.model_dump_json()) == p
    g = Graph(name="g", nodes=[], values=[], device=p)
    back = Graph.model_validate_json(g.to_json())
    assert back.device == p
    assert back.device is not None
    assert back.device.op_efficiency_curves["bmm"][1] == (1e6, 0.6)


def test_points_in_any_order_are_kept_by_size() -> None:
    base = _profile().model_dump()
    unsorted = ((2048.0, 4e9), (32.0, 1e9), (128.0, 2e9))
    p = DeviceProfile.model_validate({**base, "op_bandwidth_curves": {"_softmax": unsorted}})
    assert p.op_bandwidth_curves["_softmax"] == ((32.0, 1e9), (128.0, 2e9), (2048.0, 4e9))
    assert p.bandwidth_bytes_per_s("_softmax", 64) == pytest.approx(1.5e9)
    # a size given twice: between its neighbours as usual, the first of the two at the size
    twice = ((32.0, 1e9), (64.0, 3e9), (64.0, 2e9), (128.0, 2e9))
    p = DeviceProfile.model_validate({**base, "op_bandwidth_curves": {"_softmax": twice}})
    assert p.bandwidth_bytes_per_s("_softmax", 64) == 3e9
    assert p.bandwidth_bytes_per_s("_softmax", 45.254833995939045) == pytest.approx(2e9)
    assert p.bandwidth_bytes_per_s("_softmax", 90.50966799187809) == pytest.approx(2e9)


@pytest.mark.parametrize(
    ("curve", "match"),
    [
        ((), "at least 1 item"),
        (((32.0, 0.0),), "greater than 0"),
        (((-1.0, 1e9),), "greater than 0"),
        (((32.0, math.inf),), "finite"),
    ],
)
def test_a_bad_curve_is_refused_naming_it(curve, match) -> None:
    base = _profile().model_dump()
    with pytest.raises(ValidationError, match=match):
        DeviceProfile.model_validate({**base, "op_bandwidth_curves": {"_softmax": curve}})
