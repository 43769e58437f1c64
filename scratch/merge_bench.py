import torch, triton
from megacp.attention import merge_kernel as mk
H, D = 32, 128
dev = "cuda"
for rows in (8192, 32768, 65536):
    acc = torch.randn(H, rows, D, device=dev, dtype=torch.bfloat16).transpose(0, 1)
    accl = torch.randn(H, rows, device=dev).transpose(0, 1)
    o = torch.randn(H, rows, D, device=dev, dtype=torch.bfloat16).transpose(0, 1)
    ol = torch.randn(H, rows, device=dev).transpose(0, 1)
    total = rows * H
    for hm in (False, True):
        for bm in (16, 32, 64, 128):
            for nw in (4, 8):
                def f():
                    mk._merge_into_kernel[(triton.cdiv(total, bm),)](acc, accl, o, ol, total, rows, H,
                        acc.stride(0), acc.stride(1), accl.stride(0), accl.stride(1), o.stride(0), o.stride(1), ol.stride(0), ol.stride(1),
                        D=D, BLOCK_M=bm, HEAD_MAJOR=hm, num_warps=nw)
                for _ in range(3): f()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(); a.record()
                for _ in range(50): f()
                b.record(); b.synchronize()
                us = a.elapsed_time(b) / 50 * 1000
                gb = 3 * rows * H * D * 2 / us / 1e3
                print(f"rows {rows:6d} head_major {int(hm)} BLOCK_M {bm:3d} warps {nw}: {us:8.1f} us  {gb:6.0f} GB/s", flush=True)
