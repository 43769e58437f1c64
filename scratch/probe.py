"""Scratch GPU probe (not part of the library): pass-Q NaN hunt + which ops overlap a running attention kernel."""
import os, sys, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import bench_common as bc
import torch, torch.distributed as dist
from megacp.attention import ShardPlan, build_kv_block, cp_prefill, partial_attention
from megacp.attention.merge import merge_stack, pack_states, unpack_states
from megacp.attention.tiles import run_tiles
from megacp.parallel.ring import Ring
from megacp.parallel.peer import peer_window

ctx = bc.init_dist("cuda", None)
n, r, dev = ctx.world, ctx.rank, ctx.device
H, HKV, D = 32, 8, 128
def P(*a):
    for rk in range(n):
        if rk == r: print(f"[r{r}]", *a, flush=True)
        dist.barrier()

def nan(t): return int(torch.isnan(t.float()).sum())

# ---- Part A: pass-Q at 64K
S = int(os.environ.get("PROBE_S", 65536))
q = bc.shared_randn((S, H, D), ctx, 1); k = bc.shared_randn((S, HKV, D), ctx, 2); v = bc.shared_randn((S, HKV, D), ctx, 3)
ref, _ = partial_attention(q, k, v, causal=True, backend="cudnn")
plan = ShardPlan([0], [S], n, r); idx = plan.local_index().to(dev)
ql, block = q[idx], build_kv_block(plan, k[idx], v[idx])
refl = ref[idx].float()
for tr in ("nccl", "copy_engine"):
    ring = Ring(ctx.group, transport=tr)
    cp_prefill(ql, block, plan, ring, strategy="pass_kv")  # window made by pass-KV first as in verify
    o = cp_prefill(ql, block, plan, ring, strategy="pass_q")
    P(tr, "cp_prefill pass_q nan", nan(o), "maxerr", (o.float() - refl).abs().nan_to_num(1e9).max().item())
    # manual
    hq, d = H, D
    padded = ql.new_zeros((plan.max_local, hq, d)); padded[: ql.shape[0]] = ql
    parts = [None] * n
    for step, qb in ring.rotate(padded):
        origin = (r - step) % n; rows = plan.num_local(origin)
        torch.cuda.synchronize()
        qerr = (qb[:rows].float() - q[plan.local_index(origin).to(dev)].float()).abs().max().item()
        out, lse = run_tiles(qb[:rows], block[0], block[1], plan.tiles(origin, r), None)
        torch.cuda.synchronize()
        P(tr, f"step {step} origin {origin}: q_block err {qerr}, out nan {nan(out)} lse nan {nan(lse)} lse -inf {int(torch.isneginf(lse).sum())}")
        parts[origin] = torch.nn.functional.pad(pack_states(out, lse), (0, 0, 0, plan.max_local - rows))
    recv = ring.all_to_all(torch.stack(parts))
    outs, lses = unpack_states(recv[:, : ql.shape[0]], hq, d, ql.dtype)
    torch.cuda.synchronize()
    P(tr, f"received: outs nan {nan(outs)} lses nan {nan(lses)}; strides {outs.stride()} {lses.stride()}")
    for fused in (True, False):
        mo, ml = merge_stack(outs, lses, fused=fused)
        torch.cuda.synchronize()
        P(tr, f"merge fused={fused}: nan {nan(mo)} lse nan {nan(ml)} maxerr {(mo.float() - refl).abs().nan_to_num(1e9).max().item():.3e}")
    del padded, parts, recv
del q, k, v, ref
torch.cuda.empty_cache()

# ---- Part B: which ops on a side stream run beside a long attention kernel
L = 32768
qa = torch.randn(L, H, D, device=dev, dtype=torch.bfloat16); ka = torch.randn(L, HKV, D, device=dev, dtype=torch.bfloat16)
nbytes = 128 << 20
src = torch.empty(nbytes, dtype=torch.uint8, device=dev); dst = torch.empty_like(src)
win = peer_window(ctx.group, nbytes, dev)
mine = win.view(r, (nbytes,), torch.uint8); peer = win.view((r + 1) % n, (nbytes,), torch.uint8)
small = torch.zeros(1 << 18, device=dev)
import ctypes
cudart = None
ops = {
    "dtod copy (plain->plain)": lambda: dst.copy_(src),
    "dtod copy (plain->own window)": lambda: mine.copy_(src),
    "ptop pull (peer window->plain)": lambda: dst.copy_(peer),
    "ptop push (plain->peer window)": lambda: peer.copy_(src),
    "small kernel (add_)": lambda: small.add_(1),
    "symm barrier": lambda: win.barrier(),
}
for prio in (-1, 0):
    side = torch.cuda.Stream(priority=prio)
    for name, op in ops.items():
        res = []
        for rep in range(4):
            torch.cuda.synchronize(); dist.barrier()
            e0, e1, s0, s1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            e0.record()
            partial_attention(qa, ka, ka, causal=True, backend="cudnn")
            e1.record()
            with torch.cuda.stream(side):
                s0.record(); op(); s1.record()
            torch.cuda.synchronize()
            res.append((e0.elapsed_time(s0), e0.elapsed_time(s1), e0.elapsed_time(e1)))
        a, b, c = (statistics.median(x[i] for x in res) for i in range(3))
        P(f"prio {prio:2d} {name:32s}: op start {a:7.3f} end {b:7.3f} ms; attention ends {c:7.3f} ms")
dist.barrier()
dist.destroy_process_group()
