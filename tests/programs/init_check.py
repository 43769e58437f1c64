"""Bring up megacp under a launcher and report this rank's mesh (used by the launcher tests).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 tests/programs/init_check.py --deepspeed_config configs/cpu_demo.json
    torchrun --nproc_per_node 2 tests/programs/init_check.py --deepspeed_config configs/cpu_demo.json

megacp must be importable (``pip install -e .`` or ``PYTHONPATH=<repo root>``). Every rank prints
one line ``MEGACP_INIT_CHECK {json}`` with its rank, the CP group size and the global ranks an
all_gather over the CP group actually returned. A bad config exits with status 2 and one line
on stderr. ``--hold-until PATH`` keeps the job running after that all_gather until the file PATH
exists, then creates a process group of all ranks (through the job's store) and gathers again
over it (field ``held_ranks_gathered``): a job that another job disturbed meanwhile fails there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import megacp
from megacp.config import ConfigError
from megacp.launch import add_launcher_args

PREFIX = "MEGACP_INIT_CHECK "


def main(argv: list[str] | None = None) -> int:
    parser = add_launcher_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--hold-until", default=None,
                        help="wait until this file exists, then gather again over a new group (default: no wait)")
    args = parser.parse_args(argv)
    try:
        state = megacp.initialize(args.deepspeed_config)
    except ConfigError as err:
        print(f"init_check: error: {err}", file=sys.stderr)
        return 2
    group = state.group("cp")
    gathered = [torch.zeros(1, dtype=torch.int64, device=state.device) for _ in range(state.size("cp"))]
    dist.all_gather(gathered, torch.tensor([state.rank], device=state.device), group=group)
    report = {
        "rank": state.rank,
        "world_size": state.world_size,
        "local_rank": args.local_rank,
        "backend": state.backend,
        "device": str(state.device),
        "cp_size": state.size("cp"),
        "cp_rank": state.rank_in("cp"),
        "cp_ranks_gathered": [int(t) for t in gathered],
        "layout": str(state.layout),
    }
    if args.hold_until is not None:
        while not os.path.exists(args.hold_until):
            time.sleep(0.1)
        everyone = dist.new_group(list(range(state.world_size)))
        held = [torch.zeros(1, dtype=torch.int64, device=state.device) for _ in range(state.world_size)]
        dist.all_gather(held, torch.tensor([state.rank], device=state.device), group=everyone)
        report["held_ranks_gathered"] = [int(t) for t in held]
    sys.stdout.write(PREFIX + json.dumps(report) + "\n")  # one write: ranks share the launcher's pipe
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
