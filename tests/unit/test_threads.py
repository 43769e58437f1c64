"""CPU thread count of the generation and serving processes: the idle cores shared among the local
ranks, one line when the machine's load takes cores away, nothing when OMP_NUM_THREADS is set."""

from __future__ import annotations

import os

import pytest
import torch

from megacp.generate.cli import _set_threads


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.skipif(torch.cuda.is_available(), reason="threads are set on CPU-only machines")
def test_the_idle_cores_are_shared(monkeypatch, capsys, restore_threads) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    _set_threads("megacp.generate")
    assert torch.get_num_threads() == 8 and capsys.readouterr().out == ""
    monkeypatch.setattr(os, "getloadavg", lambda: (9.6, 0.0, 0.0))  # 10 cores busy: 6 idle for 2 ranks
    _set_threads("megacp.generate")
    assert torch.get_num_threads() == 3
    assert capsys.readouterr().out == "megacp.generate: 10 of 16 cores are busy: 3 thread(s) per rank (OMP_NUM_THREADS sets it)\n"
    _set_threads("megacp.generate", quiet=True)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    torch.set_num_threads(7)
    _set_threads("megacp.generate")
    assert torch.get_num_threads() == 7  # OMP_NUM_THREADS is the user's
