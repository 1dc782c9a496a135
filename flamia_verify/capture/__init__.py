"""Capture: record the attention calls of a real training or inference step, and read them back.

    from flamia_verify.capture import load_capture, recording

    with recording(kernel, "captures/run1", model="my-lm", calls=8) as attn:
        loss = model(batch, attention=attn)   # every attention layer calls attn in the varlen convention
        loss.backward()
        attn.next_step()
    capture = load_capture("captures/run1")   # validated: complete, hashes, the convention, finite

The recorder (:mod:`.recorder`) wraps a kernel in FlashAttention's varlen convention and writes the
selected calls (q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal and, when a backward runs,
dout) as one safetensors file each plus a JSON manifest (:mod:`.store`); the loader (:mod:`.loader`)
refuses any capture that is not whole and valid with one :class:`~flamia_verify.errors.CaptureError`.
"""

from flamia_verify.capture.loader import Capture, CapturedCall, load_capture
from flamia_verify.capture.recorder import DEFAULT_MAX_BYTES, CallSite, CaptureWarning, Recorder, recording

__all__ = [
    "recording",
    "Recorder",
    "CallSite",
    "CaptureWarning",
    "DEFAULT_MAX_BYTES",
    "load_capture",
    "Capture",
    "CapturedCall",
]
