"""The shortcuts that make the emulation fast on the CPU give the results of the plain code, bit for bit.

Each fast path is compared with the general code it stands for (scatter/gather block maps, gathered key
blocks, |products| in the E4M3 tensor-core model), and every cache is shown to hand out nothing that a
caller could write into: block layouts, the layouts inside quantized tensors, decode tables, key-block ids.
"""

from __future__ import annotations

import math

import pytest
import torch

from flamia_verify.formats import E4M3, UE4M3, block_layout, decode, e8m0_decode, mx_quantize, nvfp4_quantize
from flamia_verify.formats import blocks as B
from flamia_verify.kernels import emulation as E


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


def _with_specials(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    flat = x.reshape(-1).clone()
    for value in (math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0):
        flat[int(torch.randint(0, flat.numel(), (), generator=g))] = value
    return flat.view(x.shape)


@pytest.mark.parametrize(
    "length, block_size, cu",
    [
        (64, 32, None),
        (96, 32, [0, 32, 96]),
        (80, 16, [0, 16, 16, 80]),
        (33, 33, None),
        (40, None, [0, 40]),
        (7, 1, None),
    ],
)
def test_full_block_paths_match_the_scatter_and_gather_paths(length, block_size, cu):
    """Full blocks reduce and broadcast by a reshape: the same amax (NaN where the scatter gives NaN) and
    the same per-position values, bit for bit, as scatter_reduce and gather over the block index."""
    g = torch.Generator().manual_seed(length)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    index, nblocks = block_layout(length, block_size=block_size, cu_seqlens=cu_t)
    assert B._full_block_size(length, nblocks, block_size) is not None
    for axis, shape in ((1, (3, length, 5)), (2, (2, 4, length))):
        a = _with_specials(torch.randn(*shape, generator=g), g).abs()
        fast = B._block_amax(a, axis, index, nblocks, block_size)
        shape_out = list(a.shape)
        shape_out[axis] = nblocks
        general = torch.zeros(shape_out).scatter_reduce(
            axis, B._index_along(index, axis, a), a, reduce="amax", include_self=True
        )
        assert torch.equal(torch.isnan(fast), torch.isnan(general))
        assert torch.equal(fast.nan_to_num(), general.nan_to_num())
        per_block = _with_specials(torch.randn(*shape_out, generator=g), g)
        view = [1] * a.dim()
        view[axis] = length
        gathered = per_block.gather(axis, index.view(view).expand(a.shape))
        repeated = B._to_positions(per_block, axis, index, block_size)
        assert repeated.is_contiguous() and torch.equal(_bits(repeated), _bits(gathered))


def test_block_layouts_are_cached_but_never_shared_with_callers():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    first, n = block_layout(14, block_size=4, cu_seqlens=cu)
    assert first.tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4] and n == 5
    first.fill_(7)
    again, _ = block_layout(14, block_size=4, cu_seqlens=cu)
    assert again.tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4]
    # the same offsets as another dtype or a strided view are the same layout
    strided = torch.arange(0, 26, dtype=torch.int64)[::12][:2]
    assert block_layout(14, block_size=4, cu_seqlens=torch.tensor([0, 12]))[0].tolist() == (
        block_layout(14, block_size=4, cu_seqlens=strided)[0].tolist()
    )
    x = torch.randn(4, 14)
    q = mx_quantize(x, axis=-1, block_size=4, cu_seqlens=cu)
    q.block_index.zero_()
    assert mx_quantize(x, axis=-1, block_size=4, cu_seqlens=cu).block_index.tolist() == again.tolist()
    t = nvfp4_quantize(x, axis=-1, block_size=4, cu_seqlens=cu)
    t.block_index.zero_()
    assert nvfp4_quantize(x, axis=-1, block_size=4, cu_seqlens=cu).block_index.tolist() == again.tolist()


def test_bad_document_offsets_are_refused_on_every_call():
    cu = torch.tensor([0, 6, 4, 8], dtype=torch.int32)
    for _ in range(2):  # the second call meets the cache: nothing was cached for a bad layout
        with pytest.raises(ValueError, match="non-decreasing: cu_seqlens\\[1\\] = 6 > cu_seqlens\\[2\\] = 4"):
            block_layout(8, block_size=4, cu_seqlens=cu)
        with pytest.raises(ValueError, match="exceeds the length 7"):
            block_layout(7, block_size=4, cu_seqlens=torch.tensor([0, 8]))


def test_decode_tables_are_never_written_through_their_results():
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    for decoded in (e8m0_decode(codes), decode(codes, E4M3), decode(codes, UE4M3)):
        decoded.fill_(3.0)
    assert e8m0_decode(codes)[127].item() == 1.0 and math.isnan(e8m0_decode(codes)[255].item())
    assert decode(codes, E4M3)[0x7E].item() == 448.0 and decode(codes, UE4M3)[0x38].item() == 1.0


@pytest.mark.parametrize("block, n", [(32, 96), (32, 97), (128, 33), (16, 1)])
def test_keys_repeat_their_block_values_as_indexing_would(block, n):
    g = torch.Generator().manual_seed(n)
    per_block = _with_specials(torch.randn(2, 5, -(-n // block), generator=g), g)
    ids = E._block_ids(n, block, per_block.device)
    assert torch.equal(_bits(E._per_key(per_block, block, n)), _bits(per_block[..., ids]))
    assert torch.equal(ids, torch.arange(n) // block)  # the cached ids are what they claim


def test_the_tensor_core_model_finds_the_largest_product_like_abs_amax():
    g = torch.Generator().manual_seed(3)
    prod = _with_specials(torch.randn(4, 7, 32, generator=g, dtype=torch.float64), g)
    prod[0, 0] = -0.0
    prod[1, 1] = torch.where(torch.arange(32) % 2 == 0, 0.0, -0.0).double()
    big = torch.maximum(prod.amax(-1), prod.amin(-1).neg())
    plain = prod.abs().amax(-1)
    assert torch.equal(torch.isnan(big), torch.isnan(plain))
    finite = ~torch.isnan(plain)
    assert torch.equal(big[finite], plain[finite])
    # the group exponent, what the maximum is for, agrees everywhere (zeros of either sign and NaN alike)
    exponent = [torch.floor(torch.log2(torch.where(m > 0, m, torch.ones_like(m)))) for m in (big, plain)]
    assert torch.equal(exponent[0], exponent[1])
