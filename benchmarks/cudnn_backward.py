"""cudnn-fp8 with cuDNN's non-deterministic (faster) backward, for `check` and `bench` on a GPU:

    flamia-verify check --kernel benchmarks/cudnn_backward.py:fast_backward --suite quick --device cuda
    flamia-verify bench --kernel cudnn-fp8 benchmarks/cudnn_backward.py:fast_backward --seqlens 8192

The built-in `cudnn-fp8` runs cuDNN's deterministic backward algorithm; this is the same kernel (delayed
scaling, history 16, margin 1, one state per instance) with ``deterministic=False``. Importing it builds
the cuDNN engine, so it needs a GPU with nvidia-cudnn-frontend.
"""

from flamia_verify.kernels.cudnn_fp8.kernel import make_kernel

fast_backward = make_kernel(deterministic=False)
