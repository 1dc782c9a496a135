"""Bad inputs to the reference raise InputError with a message that names the problem."""

from __future__ import annotations

import math

import pytest
import torch

from flamia_verify.errors import InputError
from flamia_verify.reference import attention_backward, attention_forward, reference_attention, visible_mask


def _good():
    q = torch.randn(5, 4, 8, dtype=torch.float64)
    k = torch.randn(6, 2, 8, dtype=torch.float64)
    v = torch.randn(6, 2, 8, dtype=torch.float64)
    cq = torch.tensor([0, 2, 5], dtype=torch.int32)
    ck = torch.tensor([0, 3, 6], dtype=torch.int32)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck)


def _call(**changes):
    args = {
        **_good(),
        **{k: v for k, v in changes.items() if k not in ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal")},
    }
    return reference_attention(
        args["q"],
        args["k"],
        args["v"],
        args["cu_seqlens_q"],
        args["cu_seqlens_k"],
        changes.get("max_seqlen_q", 3),
        changes.get("max_seqlen_k", 3),
        softmax_scale=changes.get("softmax_scale", 0.35),
        causal=changes.get("causal", True),
    )


BAD = [
    ("cu_float", dict(cu_seqlens_q=torch.tensor([0.0, 2.0, 5.0])), r"cu_seqlens_q must have dtype torch.int32"),
    ("cu_int64", dict(cu_seqlens_k=torch.tensor([0, 3, 6])), r"cu_seqlens_k must have dtype torch.int32"),
    ("cu_list", dict(cu_seqlens_q=[0, 2, 5]), r"cu_seqlens_q must be a torch.Tensor"),
    ("cu_not_zero", dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)), r"cu_seqlens_q\[0\] must be 0"),
    ("cu_decreasing", dict(cu_seqlens_k=torch.tensor([0, 4, 3, 6], dtype=torch.int32)), r"non-decreasing"),
    (
        "cu_total",
        dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)),
        r"must equal the number of tokens \(5\)",
    ),
    ("cu_2d", dict(cu_seqlens_q=torch.tensor([[0, 2, 5]], dtype=torch.int32)), r"must be 1-D"),
    (
        "batch_mismatch",
        dict(cu_seqlens_k=torch.tensor([0, 1, 3, 6], dtype=torch.int32)),
        r"same number of documents, got 2 and 3",
    ),
    ("q_2d", dict(q=torch.randn(5, 32, dtype=torch.float64)), r"q must have shape \(tokens, heads, headdim\)"),
    ("q_int", dict(q=torch.ones(5, 4, 8, dtype=torch.int64)), r"q must be a floating-point tensor"),
    ("kv_shapes", dict(v=torch.randn(6, 2, 4, dtype=torch.float64)), r"k and v must have the same shape"),
    ("headdim", dict(q=torch.randn(5, 4, 4, dtype=torch.float64)), r"same headdim"),
    ("heads", dict(q=torch.randn(5, 3, 8, dtype=torch.float64)), r"nheads \(3\) must be a multiple of nheads_k \(2\)"),
    ("mixed_dtype", dict(q=torch.randn(5, 4, 8, dtype=torch.float32)), r"must share one dtype"),
    ("max_seqlen_q", dict(max_seqlen_q=2), r"max_seqlen_q = 2 is smaller than the longest query document \(3\)"),
    ("max_seqlen_k", dict(max_seqlen_k=1), r"max_seqlen_k = 1 is smaller than the longest key document \(3\)"),
    ("scale_nan", dict(softmax_scale=math.nan), r"softmax_scale must be finite"),
    ("scale_str", dict(softmax_scale="0.3"), r"softmax_scale must be a real number"),
    ("scale_tensor", dict(softmax_scale=torch.tensor(0.3)), r"softmax_scale must be a real number"),
    ("causal_int", dict(causal=1), r"causal must be True or False"),
]


@pytest.mark.parametrize("changes,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_reference_attention_rejects(changes, message) -> None:
    with pytest.raises(InputError, match=message):
        _call(**changes)


def test_input_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        _call(causal="yes")


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True], ids=str)
def test_forward_rejects_bad_chunk_size(chunk) -> None:
    with pytest.raises(InputError, match=r"chunk_size must be a positive int or None"):
        attention_forward(**_good(), softmax_scale=0.3, causal=False, chunk_size=chunk)


def test_forward_validates_convention() -> None:
    args = _good()
    args["cu_seqlens_q"] = torch.tensor([0, 6, 5], dtype=torch.int32)
    with pytest.raises(InputError, match=r"non-decreasing: cu_seqlens_q\[2\] = 5 < cu_seqlens_q\[1\] = 6"):
        attention_forward(**args, softmax_scale=0.3, causal=False)


@pytest.mark.parametrize(
    "which,shape,message",
    [
        ("dout", (5, 4, 7), r"dout must have shape \(5, 4, 8\)"),
        ("out", (4, 4, 8), r"out must have shape \(5, 4, 8\)"),
        ("lse", (5, 4, 1), r"lse must have shape \(5, 4\)"),
    ],
)
def test_backward_checks_its_extra_tensors(which, shape, message) -> None:
    args = _good()
    out, lse = attention_forward(**args, softmax_scale=0.3, causal=True)
    extra = {"dout": torch.randn_like(out), "out": out, "lse": lse}
    extra[which] = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(InputError, match=message):
        attention_backward(
            extra["dout"],
            args["q"],
            args["k"],
            args["v"],
            extra["out"],
            extra["lse"],
            args["cu_seqlens_q"],
            args["cu_seqlens_k"],
            softmax_scale=0.3,
            causal=True,
        )


def test_visible_mask_rejects_negative_lengths() -> None:
    with pytest.raises(InputError, match=r"non-negative lengths, got lq=-1"):
        visible_mask(-1, 3, True)
