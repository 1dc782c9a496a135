"""head_dim 256 through the fused kernels on a GPU: the largest head_dim they take, where the pipeline
depth falls back to what fits in shared memory (``resources._launch``) and ``config.head_dim_limit``
sends the fp8 design to the emulation. Each design's kernel lies closer to its emulation than the
emulation lies to the float64 reference (the random-input criterion of test_triton_attention.py).

CUDA only (``-m gpu``; benchmarks/gpu_run.sh runs it with ``-s``, which prints the figures and the
pipeline stages that fit). Under the interpreter head_dim 256 says nothing about shared memory.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from test_kernels_emulation import make_case, reference, rel_rmse, run

from flamia_verify.kernels import builtin_kernels
from flamia_verify.kernels.designs import DESIGNS
from flamia_verify.kernels.triton.compat import interpreting
from flamia_verify.kernels.triton.config import config_for, head_dim_supported

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        interpreting() or not torch.cuda.is_available(), reason="needs CUDA with TRITON_INTERPRET unset"
    ),
]


@pytest.mark.parametrize("name", ["bf16", "fp8", "flamia-mxfp8", "flamia-nvfp4"])
def test_head_dim_256_stays_within_the_emulations_error(name):
    from flamia_verify.kernels.triton.attention import fused_attention
    from flamia_verify.kernels.triton.resources import _STAGES_THAT_FIT

    if not head_dim_supported(256, config_for(DESIGNS[name])):
        pytest.skip(f"{name}: head_dim 256 runs the emulation (config.head_dim_limit)")
    case = [t.cuda() for t in make_case([300, 77], heads=2, dim=256, seed=5)]
    got = run(functools.partial(fused_attention, DESIGNS[name]), *case, causal=True)
    cpu = [t.cpu() for t in case]
    spec = run(builtin_kernels()[name].fn.emulated, *cpu, causal=True)
    ref = reference(*cpu, causal=True)
    for what, g, s, r in zip(("out", "dq", "dk", "dv"), got, spec, ref):
        noise, err = rel_rmse(g.cpu(), s), rel_rmse(s, r)
        print(f"{name} {what}: kernel vs emulation {noise:.3g}, emulation vs float64 {err:.3g}")
        assert noise <= err, (name, what, noise, err)
    print("stages that fit:", {key[0]: stages for key, stages in _STAGES_THAT_FIT.items()})
