"""Which thread autograd runs a backward on."""

from __future__ import annotations

import threading

import torch


def backward_thread(device: str) -> str:
    """The name of the thread that runs the backward of a one-op graph on ``device`` (a CUDA
    device: autograd's device thread; CPU: the caller's)."""
    names: list[str] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x * 2

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            names.append(threading.current_thread().name)
            return g * 2

    x = torch.ones(2, device=device, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [2.0, 2.0]
    return names[0]
