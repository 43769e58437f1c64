"""The kernel floor of CP attention: attention of one block of queries over one block of keys.

Partial attention returning ``(out, lse)`` and its backward (:mod:`.partial`, :mod:`.partial_backward`),
the fused kernels behind them (:mod:`.cudnn`, :mod:`.flash`; sliding-window bands in :mod:`.band` and
:mod:`.cudnn_band`), runs of packed tiles in one call (:mod:`.varlen`), planned tiles folded into a
running state (:mod:`.tile_attention`), the exact merges (:mod:`.merge`, Triton in :mod:`.merge_kernel`),
cuDNN plan lengths and their warm-up (:mod:`.plans`, :mod:`.warmup`) and the FP8 decode kernel
(:mod:`.fp8_decode_kernel`). :mod:`.registry` is the one list of the backends. Nothing here knows of the
CP ring: the ring algorithms of :mod:`megacp.attention` sit above.

This package's ``__init__`` imports nothing, so that :mod:`megacp.config` reads the registry
without loading torch.
"""
