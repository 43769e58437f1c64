"""The pass-KV / pass-Q strategy rule and the hardware calibration it reads (the calibration on
real gloo processes)."""

from __future__ import annotations

import pytest
import torch

from megacp.attention import choose_strategy
from megacp.attention.strategy import Hardware


def test_strategy_rule_on_the_papers_numbers() -> None:
    # Llama3-405B: NH=128, NKV=8 => miss-rate threshold 2*8/128 = 12.5% (when transfers are slow)
    hw = Hardware(flops=400e12, bandwidth=50e9)
    kw = dict(num_heads=128, num_kv_heads=8, cp_size=16, elem_bytes=2, hw=hw)
    full = choose_strategy(128_000, 0, **kw)
    assert full.strategy == "pass_kv"
    decode = choose_strategy(1, 128_000, **kw)
    assert decode.strategy == "pass_q"
    low_miss = choose_strategy(1000, 99_000, **kw)  # 1% miss rate, short T: pass-Q
    assert low_miss.strategy == "pass_q" and low_miss.miss_rate == pytest.approx(0.01)
    assert low_miss.miss_threshold == pytest.approx(0.125 - 4 * 1000 * 50e9 / (16 * 400e12 * 2))
    high_miss = choose_strategy(20_000, 80_000, **kw)  # 20% > 12.5%: pass-KV
    assert high_miss.strategy == "pass_kv"
    # transfers hidden: T >= N*C*NKV*e / (2*NH*BW)
    assert full.hide_threshold == pytest.approx(16 * 400e12 * 8 * 2 / (2 * 128 * 50e9))


def _calibrate(rank: int, n: int, cache_dir: str) -> tuple:
    import torch.distributed as dist

    from megacp.attention.strategy import calibrate, hardware_for

    hw = calibrate(None, torch.device("cpu"), cache_dir=cache_dir)
    dist.barrier()  # rank 0 has written the cache
    return hw, hardware_for(torch.device("cpu"), n, cache_dir=cache_dir)


def test_calibration_measures_and_caches(tmp_path) -> None:
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_calibrate, 2, str(tmp_path))
    (hw0, cached0), (hw1, _) = results
    assert hw0 == hw1 and hw0.source == "measured"  # the slowest rank's numbers, agreed by all
    assert 1e6 < hw0.flops < 1e14 and 1e5 < hw0.bandwidth < 1e13
    assert cached0 == hw0 and (tmp_path / "calibration.json").is_file()
    import json

    assert json.loads((tmp_path / "calibration.json").read_text())["cpu|cp2"] == {
        "flops": hw0.flops, "bandwidth": hw0.bandwidth, "source": "measured"}


def _lookup(rank: int, n: int, dirs: list[str]) -> tuple:
    import torch.distributed as dist

    from megacp.attention.strategy import hardware_for

    own = hardware_for(torch.device("cpu"), n, cache_dir=dirs[rank])
    agreed = hardware_for(torch.device("cpu"), n, dist.group.WORLD, cache_dir=dirs[rank])
    return own, agreed, hardware_for(torch.device("cpu"), n, cache_dir=dirs[rank])


def test_a_cp_group_agrees_on_one_calibration(tmp_path) -> None:
    """Ranks whose hosts cache different numbers (or none) would choose differently and hang the ring."""
    import json

    from megacp.attention.strategy import DEFAULTS, Hardware
    from tests.helpers.distributed import run_distributed

    dirs = [tmp_path / "host0", tmp_path / "host1"]
    for d in dirs:
        d.mkdir()
    (dirs[0] / "calibration.json").write_text(json.dumps({"cpu|cp2": {"flops": 1e9, "bandwidth": 5e8, "source": "measured"}}))
    (own0, agreed0, later0), (own1, agreed1, later1) = run_distributed(_lookup, 2, [str(d) for d in dirs])
    rank0 = Hardware(1e9, 5e8, "measured")
    assert own0 == rank0 and own1 == DEFAULTS["cpu"]  # alone, each rank reads its own host
    assert agreed0 == agreed1 == later0 == later1 == rank0  # the group takes rank 0's, and keeps it


def test_a_corrupt_calibration_cache_is_ignored_and_rebuilt(tmp_path, caplog) -> None:
    import json

    from megacp.attention.strategy import DEFAULTS, hardware_for
    from tests.helpers.distributed import run_distributed

    path = tmp_path / "calibration.json"
    path.write_text('{"cpu|cp1": {"flops": 1e9,')  # cut short by a crash mid-write
    with caplog.at_level("WARNING", logger="megacp.strategy"):
        assert hardware_for(torch.device("cpu"), 1, cache_dir=tmp_path) == DEFAULTS["cpu"]
    assert "ignoring the corrupt calibration cache" in caplog.text
    path.write_text('{"cpu|cp1": {"flops": 1e9, "speed": 2}}')  # an entry of the wrong shape
    assert hardware_for(torch.device("cpu"), 1, cache_dir=tmp_path) == DEFAULTS["cpu"]
    path.write_text("[1, 2]")
    ((hw, _),) = run_distributed(_calibrate, 1, str(tmp_path))
    assert json.loads(path.read_text()) == {"cpu|cp1": {"flops": hw.flops, "bandwidth": hw.bandwidth, "source": hw.source}}
