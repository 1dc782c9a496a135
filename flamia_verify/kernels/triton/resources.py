"""What the fused kernels take on the GPU, and the launch that adapts to it: the pipeline depth that
fits shared memory (a kernel that does not fit is relaunched with one stage fewer, remembered per
kernel specialization and tile), and the registers, spills and shared memory of every compiled
kernel (``kernel_resources``; benchmarks/kernel_resources.py prints them).
"""

from __future__ import annotations

from triton.runtime.errors import OutOfResources

from flamia_verify.kernels.triton.config import TileConfig

__all__ = ["kernel_resources"]


#: the pipeline depth that fit, per (kernel, constexprs, tile): a GPU with less shared memory than
#: the H200 (or a large head_dim) gets fewer stages once, not an error at every call
_STAGES_THAT_FIT: dict = {}

#: what each compiled kernel took on the GPU, per the same key: registers per thread, spilled
#: registers, shared memory bytes, pipeline stages (``kernel_resources``; empty under the interpreter)
_RESOURCES: dict = {}


def kernel_resources() -> list[dict]:
    """The registers, spills and shared memory of every fused kernel launched so far in this process
    (one dict per kernel specialization and tile; benchmarks/kernel_resources.py prints them)."""
    rows = []
    for (name, constexprs, tile), res in _RESOURCES.items():
        rows.append({"kernel": name, "constexprs": dict(constexprs), "tile": tile, **res})
    return rows


def _launch(kernel, grid, tile: TileConfig, *args, **constexprs):
    """Launch ``kernel`` with ``tile``'s warps and stages; when the compiled kernel does not fit the
    GPU's shared memory, retry with one pipeline stage fewer (results do not depend on the depth:
    the stages only prefetch the same tiles) down to one."""
    key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), tile)
    stages = _STAGES_THAT_FIT.get(key, tile.num_stages)
    while True:
        try:
            compiled = kernel[grid](*args, **constexprs, num_warps=tile.num_warps, num_stages=stages)
        except OutOfResources as exc:
            if stages <= 1:
                raise RuntimeError(
                    f"the fused {kernel.fn.__name__} kernel does not fit this GPU even with one pipeline stage "
                    f"(tile {tile.block_m} x {tile.block_n}, head_dim {constexprs.get('HEAD_DIM')}): {exc}; "
                    "the emulation (CPU tensors) computes the same design"
                ) from exc
            stages -= 1
            continue
        _STAGES_THAT_FIT[key] = stages
        if key not in _RESOURCES and getattr(compiled, "n_regs", None) is not None:  # diagnostics only:
            _RESOURCES[key] = {
                "stages": stages,
                "n_regs": compiled.n_regs,  # never fail a launch over them
                "n_spills": getattr(compiled, "n_spills", None),
                "shared": getattr(getattr(compiled, "metadata", None), "shared", None),
            }
        return stages
