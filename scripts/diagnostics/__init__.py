"""Diagnostics of megacp's prefill on the GPUs: ``profile_prefill`` (GPU timeline of one call per
rank), ``prefill_breakdown`` (where a call's time goes against the zero-communication bound) and
``probe_kernel_shapes`` (cuDNN on one rank's work cut into calls differently)."""
