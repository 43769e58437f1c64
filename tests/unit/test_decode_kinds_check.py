"""The first-greedy-token check of ``scripts.bench.decode_kinds``: a differing token passes only as a
near tie by the reference's own logits (within ``TIE`` × its largest absolute logit)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from scripts.bench.decode_kinds import TIE, first_token_check


class LastLogits(torch.nn.Module):
    """A stand-in for transformers' model: the same last-position logits for every prompt."""

    def __init__(self, last: list[float]) -> None:
        super().__init__()
        self.last = torch.tensor(last)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.last.expand(ids.shape[0], ids.shape[1], -1))


def test_differences_pass_only_as_near_ties() -> None:
    hf = LastLogits([10.0, 10.0 - TIE * 10 / 2, 0.0, -10.0])  # token 1 trails token 0 by half the tie bound
    prompts = [[1, 2, 3]] * 3
    assert first_token_check(hf, prompts, [0, 0, 0], [0, 0, 0]) == {
        "first_greedy_token_equal": True, "differing": 0, "near_ties": 0, "ok": True}
    assert first_token_check(hf, prompts, [0, 1, 0], [0, 0, 0]) == {
        "first_greedy_token_equal": False, "differing": 1, "near_ties": 1, "ok": True}
    assert first_token_check(hf, prompts, [2, 1, 0], [0, 0, 0]) == {
        "first_greedy_token_equal": False, "differing": 2, "near_ties": 1, "ok": False}
