"""Capture: the recorder writes what the kernel saw and the gradient it got, and nothing else changes;
the loader gives back exactly that, and refuses, with one line naming the file, every capture that is
not whole and valid (interrupted, edited, outside the convention, NaN already in it)."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from flamia_verify.capture import CallSite, CaptureWarning, Recorder, load_capture, recording, store
from flamia_verify.errors import CaptureError, ConfigError
from flamia_verify.reference import reference_attention
from flamia_verify.training.model import ModelConfig, TinyLM

SHIPPED = Path(__file__).parent / "data" / "capture_tiny"
README = Path(__file__).resolve().parent.parent / "README.md"
CFG = ModelConfig(layers=2, d_model=32, heads=2)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 5, 5, 17, 24], dtype=torch.int32)
    return torch.randint(256, (24,), generator=g), cu, 12


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(CFG)


def _train(model: TinyLM, kernel, steps: int = 2, after_step=None) -> list[dict[str, torch.Tensor]]:
    """Forward and backward per step; the parameter gradients of each step."""
    grads = []
    for s in range(steps):
        tokens, cu, max_len = _batch(s)
        model.zero_grad(set_to_none=True)
        model(tokens, cu, max_len, kernel).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if after_step is not None:
            after_step()
    return grads


class Spy:
    """The reference kernel, keeping each call's inputs and its output (with the gradient it gets)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal):
        out = reference_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)
        out.retain_grad()
        self.calls.append(((q.detach().clone(), k.detach().clone(), v.detach().clone(), cu_q, max_q), out))
        return out


def _record(out_dir: Path, steps: int = 2, **options) -> Path:
    with recording(reference_attention, out_dir, model="toy", **options) as attn:
        _train(_model(), attn, steps, after_step=attn.next_step)
    return out_dir


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory) -> Path:
    return _record(tmp_path_factory.mktemp("capture") / "cap")


@pytest.fixture
def cap(capture_dir, tmp_path) -> Path:
    """A fresh copy of a valid capture (2 layers x 2 steps), for a test to break."""
    return Path(shutil.copytree(capture_dir, tmp_path / "cap"))


def _manifest(path: Path) -> dict:
    return json.loads((path / store.MANIFEST).read_text())


def _rewrite(path: Path, index: int, tensors=None, entry=None, manifest=None) -> None:
    """Change call ``index`` (its tensors, its manifest entry) or the manifest, then make the hashes
    agree again, so that only the change itself is wrong."""
    m = _manifest(path)
    e = next(c for c in m["calls"] if c["index"] == index)
    file = path / e["file"]
    if tensors is not None:
        ts = load(file.read_bytes())
        tensors(ts)
        data = save(ts, metadata={"format": store.CALL_FORMAT})
        file.write_bytes(data)
        e["sha256"] = store.sha256_hex(data)
        e["tensors"] = {n: {"shape": list(t.shape), "dtype": store.dtype_name(t.dtype)} for n, t in ts.items()}
    if entry is not None:
        entry(e)
    m["sha256"] = store.capture_digest((c["file"], c["sha256"]) for c in m["calls"])
    if manifest is not None:
        manifest(m)
    (path / store.MANIFEST).write_bytes(store.manifest_bytes(m))


def _replace_file(path: Path, entry: dict, data: bytes) -> None:
    (path / entry["file"]).write_bytes(data)
    entry["sha256"] = store.sha256_hex(data)


def _one_line_error(path: Path, *needles: str) -> str:
    with pytest.raises(CaptureError) as info:
        load_capture(path)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    assert info.value.exit_code == 2
    return msg


# -- recording -------------------------------------------------------------------------------------------


def test_recording_round_trips_every_call_of_a_two_layer_model_bitwise(tmp_path):
    spy = Spy()
    with recording(spy, tmp_path / "cap", model="toy") as attn:
        _train(_model(), attn, after_step=attn.next_step)
    cap = load_capture(tmp_path / "cap")
    assert cap.model == "toy" and cap.stopped is None and len(cap) == len(spy.calls) == 4
    assert [(c.index, c.step, c.layer) for c in cap] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for c, ((q, k, v, cu, max_len), out) in zip(cap, spy.calls):
        for got, want in ((c.q, q), (c.k, k), (c.v, v), (c.cu_seqlens_q, cu), (c.cu_seqlens_k, cu)):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert (c.max_seqlen_q, c.max_seqlen_k, c.softmax_scale, c.causal) == (max_len, max_len, 16**-0.5, True)
        assert c.dout is not None and c.dout.dtype == torch.float64 and torch.equal(c.dout, out.grad)
        assert torch.equal(c.run(reference_attention), out.detach())  # the call replays to the same output
    m = _manifest(tmp_path / "cap")
    assert m["complete"] is True and m["calls_seen"] == 4 and m["sha256"] == cap.sha256
    assert m["bytes"] == sum((tmp_path / "cap" / c.file).stat().st_size for c in cap)
    assert sorted(p.name for p in (tmp_path / "cap").iterdir()) == sorted([store.MANIFEST] + [c.file for c in cap])


def test_recording_leaves_outputs_and_gradients_bitwise_unchanged(tmp_path):
    plain = _train(_model(), reference_attention)
    with recording(reference_attention, tmp_path / "cap") as attn:
        recorded = _train(_model(), attn, after_step=attn.next_step)
    for a, b in zip(plain, recorded):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_layers_per_step_derives_the_steps_and_for_layer_names_the_layers(tmp_path):
    with recording(reference_attention, tmp_path / "a", layers_per_step=2) as attn:
        _train(_model(), attn, steps=3)  # never calls next_step
    assert [(c.step, c.layer) for c in load_capture(tmp_path / "a")] == [(s, l) for s in range(3) for l in range(2)]
    rec = Recorder(reference_attention, tmp_path / "b")
    for name in ("blocks.0.attn", "blocks.1.attn"):
        tokens, cu, n = _batch(0)
        q = torch.randn(24, 2, 16, dtype=torch.bfloat16)
        rec.for_layer(name)(q, q, q, cu, cu, n, n, softmax_scale=0.25, causal=False)
    rec.next_step()
    rec.for_layer(7)(q, q, q, cu, cu, n, n, softmax_scale=0.25, causal=False)
    rec.close()
    got = [(c.step, c.layer, c.causal, c.dout) for c in load_capture(tmp_path / "b")]
    assert got == [(0, "blocks.0.attn", False, None), (0, "blocks.1.attn", False, None), (1, 7, False, None)]
    with pytest.raises(CaptureError, match="layer must be"):
        rec.for_layer(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "indices"),
    [
        ({"every": 2}, [0, 2, 4]),
        ({"calls": 2}, [0, 1]),
        ({"every": 2, "calls": 2}, [0, 2]),
        ({"select": [1, 4, 99]}, [1, 4]),
        ({"select": lambda site: site.layer == 1}, [1, 3, 5]),
        ({"select": lambda site: site.step == 2, "calls": 1}, [4]),
        ({"calls": 0}, []),
    ],
)
def test_every_calls_and_select_choose_the_calls(tmp_path, options, indices):
    rec = _record(tmp_path / "cap", steps=3, **options)
    m = _manifest(rec)
    assert [c["index"] for c in m["calls"]] == indices and m["calls_seen"] == 6
    if indices:
        assert [c.index for c in load_capture(rec)] == indices
    else:
        _one_line_error(rec, "holds no calls")


def test_the_selection_sees_the_call_site(tmp_path):
    sites: list[CallSite] = []
    _record(tmp_path / "cap", steps=2, select=lambda site: sites.append(site) or False)
    assert sites == [CallSite(i, i // 2, i % 2, True) for i in range(4)]
    with torch.no_grad(), recording(reference_attention, tmp_path / "b", select=sites.append) as attn:
        _model()(*_batch(0), attn)
    assert sites[-1] == CallSite(1, 0, 1, False)


def test_calls_without_autograd_are_written_at_once_without_dout(tmp_path):
    rec = Recorder(reference_attention, tmp_path / "cap")
    with torch.no_grad():
        _model()(*_batch(0), rec)
    assert rec.recorded == 2 and _manifest(tmp_path / "cap")["complete"] is False  # written, not yet closed
    rec.close()
    assert rec.close() == tmp_path / "cap"  # closing twice is harmless
    assert [c.dout for c in load_capture(tmp_path / "cap")] == [None, None]
    _model()(*_batch(0), rec)  # after close the kernel still runs, unrecorded
    assert rec.recorded == 2


def test_other_keyword_arguments_are_kept_and_positional_ones_are_not_recorded(tmp_path):
    tokens, cu, n = _batch(0)
    q = torch.randn(24, 2, 16, dtype=torch.bfloat16)

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *args, softmax_scale=None, causal=False, window_size=(-1, -1)):
        return reference_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale, causal=causal)

    with recording(kernel, tmp_path / "cap") as rec:
        rec(q, q, q, cu, cu, n, n, causal=True, window_size=(-1, -1))
        with pytest.warns(CaptureWarning, match="positional argument"):
            rec(q, q, q, cu, cu, n, n, 0.0)
    (call,) = load_capture(tmp_path / "cap")
    assert call.softmax_scale is None and call.causal and dict(call.extra_kwargs) == {"window_size": [-1, -1]}
    assert torch.equal(call.run(kernel), kernel(q, q, q, cu, cu, n, n, causal=True))


@pytest.mark.parametrize("dtype", [d for d in store.DTYPES.values() if d.is_floating_point])
def test_every_floating_dtype_of_a_capture_round_trips_bitwise(tmp_path, dtype):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = (torch.randn(8, 2, 8) * 4).to(dtype)
    with recording(lambda *a, **kw: q.float(), tmp_path / "cap") as rec:
        rec(q, q[:, :1], q[:, 1:], cu, cu, 5, 5, softmax_scale=0.5, causal=True)
    (call,) = load_capture(tmp_path / "cap")
    assert call.q.dtype == dtype and torch.equal(call.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(call.k.float(), q[:, :1].float()) and call.k.is_contiguous()  # a strided view, stored whole


# -- bounded and atomic -------------------------------------------------------------------------------------


def test_the_size_cap_stops_recording_with_a_warning_and_keeps_a_whole_capture(tmp_path, capture_dir):
    sizes = [c["bytes"] for c in _manifest(capture_dir)["calls"]]
    cap = sum(sizes[:2]) + 2048 + sizes[2] // 2  # room for two calls and their headers, not three
    plain = _train(_model(), reference_attention)
    with pytest.warns(CaptureWarning, match=f"size cap max_bytes={cap} is reached at call 2 .step 1, layer 0."):
        rec = _record(tmp_path / "cap", max_bytes=cap)
    m = _manifest(rec)
    assert m["complete"] is True and m["bytes"] <= cap and "size cap" in m["stopped"]
    loaded = load_capture(rec)
    assert [c.index for c in loaded] == [0, 1] and "raise max_bytes" in (loaded.stopped or "")
    with recording(reference_attention, tmp_path / "again", max_bytes=cap) as attn, warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        recorded = _train(_model(), attn, after_step=attn.next_step)
    assert all(torch.equal(a[n], b[n]) for a, b in zip(plain, recorded) for n in a)  # the run itself goes on


def test_a_failed_write_stops_recording_without_breaking_the_run(tmp_path, monkeypatch):
    real = store.atomic_write

    def full_disk(directory, name, data):
        if name.startswith("call-000002"):
            raise OSError(28, "No space left on device")
        real(directory, name, data)

    monkeypatch.setattr("flamia_verify.capture.recorder.atomic_write", full_disk)
    with pytest.warns(CaptureWarning, match="could not write .*call-000002.safetensors: OSError"):
        rec = _record(tmp_path / "cap", steps=3)
    loaded = load_capture(rec)
    # call 3 (layer 1 of step 1) got its gradient, and was written, before call 2 (layer 0) failed;
    # after the failure no call is taken
    assert [c.index for c in loaded] == [0, 1, 3] and "No space left" in (loaded.stopped or "")


def test_atomic_write_leaves_no_temporary_file_when_it_fails(tmp_path, monkeypatch):
    store.atomic_write(tmp_path, "x", b"old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.atomic_write(tmp_path, "x", b"new")
    assert [p.name for p in tmp_path.iterdir()] == ["x"] and (tmp_path / "x").read_bytes() == b"old"


def test_an_unclosed_recording_is_not_read_as_complete(tmp_path):
    rec = Recorder(reference_attention, tmp_path / "cap")
    _one_line_error(tmp_path / "cap", "incomplete")  # from the start
    _train(_model(), rec, after_step=rec.next_step)
    assert rec.recorded == 4  # every call is written, the manifest lists them, and still:
    _one_line_error(tmp_path / "cap", "manifest.json", "incomplete", "complete is not true")
    rec.close()
    assert len(load_capture(tmp_path / "cap")) == 4


def test_a_leftover_temporary_file_is_rejected(cap):
    (cap / (store.TMP_PREFIX + "call-000004.safetensors.abc123")).write_bytes(b"partial")
    _one_line_error(cap, ".tmp-call-000004", "interrupted write")


def test_an_exception_in_the_recorded_code_leaves_out_calls_waiting_for_their_backward(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), recording(reference_attention, tmp_path / "cap") as attn:
        _train(_model(), attn, steps=1, after_step=attn.next_step)
        _model()(*_batch(5), attn)  # forward of the next step; its backward never runs
        raise RuntimeError("boom")
    loaded = load_capture(tmp_path / "cap")
    assert [c.index for c in loaded] == [0, 1] and all(c.dout is not None for c in loaded)
    assert (
        loaded.stopped
        == "interrupted: the recorded code raised RuntimeError; 2 call(s) waiting for their backward were left out"
    )


def test_a_kernel_that_raises_records_nothing_and_raises_as_before(tmp_path):
    def broken(*args, **kwargs):
        raise ValueError("kernel bug")

    with recording(broken, tmp_path / "cap") as attn, pytest.raises(ValueError, match="kernel bug"):
        _model()(*_batch(0), attn)
    assert _manifest(tmp_path / "cap")["calls"] == [] and _manifest(tmp_path / "cap")["calls_seen"] == 1


# -- paths -------------------------------------------------------------------------------------------------------


def test_out_dir_must_be_new_or_empty_and_nothing_is_written_outside_it(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    with pytest.raises(CaptureError, match="used: not empty"):
        Recorder(reference_attention, tmp_path / "used")
    with pytest.raises(CaptureError, match="file: exists and is not a directory"):
        Recorder(reference_attention, tmp_path / "file")
    (tmp_path / "empty").mkdir()
    before = {p for p in tmp_path.rglob("*")}
    _record(tmp_path / "empty")
    _record(tmp_path / "new" / "deeper")
    new = {p for p in tmp_path.rglob("*")} - before
    assert {p for p in new if p.is_dir()} == {tmp_path / "new", tmp_path / "new" / "deeper"}
    assert {p.parent for p in new if not p.is_dir()} == {tmp_path / "empty", tmp_path / "new" / "deeper"}


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("every", 0),
        ("calls", -1),
        ("max_bytes", 0),
        ("layers_per_step", True),
        ("meta", {"x": object()}),
        ("select", "0,1"),
        ("select", [0.5]),
        ("model", 3),
    ],
)
def test_bad_options_are_refused_before_anything_is_written(tmp_path, option, value):
    with pytest.raises(CaptureError, match=option if option != "meta" else "JSON"):
        Recorder(reference_attention, tmp_path / "cap", **{option: value})
    assert not (tmp_path / "cap").exists()


# -- bad captures: one line each ---------------------------------------------------------------------------------

BAD = {
    "missing manifest": (lambda p: (p / store.MANIFEST).unlink(), ["manifest.json: missing"]),
    "manifest not JSON": (lambda p: (p / store.MANIFEST).write_text("{"), ["manifest.json: not JSON"]),
    "other schema": (
        lambda p: _rewrite(p, 0, manifest=lambda m: m.update(schema="flamia-verify/capture/v9")),
        ["schema is 'flamia-verify/capture/v9'"],
    ),
    "missing file": (lambda p: (p / "call-000002.safetensors").unlink(), ["call-000002.safetensors: missing"]),
    "hash mismatch": (
        lambda p: (p / "call-000001.safetensors").write_bytes(
            (p / "call-000001.safetensors").read_bytes()[:-1] + b"\x01"
        ),
        ["call-000001.safetensors: sha256", "differs from the manifest's", "changed after recording"],
    ),
    "capture hash mismatch": (
        lambda p: _rewrite(p, 0, manifest=lambda m: m.update(sha256="0" * 64)),
        ["manifest.json: sha256 000000000000... does not match"],
    ),
    "truncated file": (
        lambda p: _rewrite(p, 3, entry=lambda e: _replace_file(p, e, b"\x10\x00\x00\x00\x00\x00\x00\x00{}")),
        ["call-000003.safetensors: not a safetensors file (a header of 16 bytes in a file of 10)"],
    ),
    "not a call file": (
        lambda p: _rewrite(p, 2, entry=lambda e: _replace_file(p, e, save({"q": torch.zeros(1)}))),
        ["call-000002.safetensors: not a call file of a capture"],
    ),
    "file outside the capture": (
        lambda p: _rewrite(p, 1, entry=lambda e: e.update(file="../call-000001.safetensors")),
        ["file '../call-000001.safetensors' is not the file name of call 1"],
    ),
    "file of another call": (
        lambda p: _rewrite(p, 1, entry=lambda e: e.update(file="call-000000.safetensors")),
        ["file 'call-000000.safetensors' is not the file name of call 1"],
    ),
    "cu_seqlens break the convention": (
        lambda p: _rewrite(p, 2, tensors=lambda t: t["cu_seqlens_q"].copy_(torch.tensor([0, 5, 4, 17, 24]))),
        ["call-000002.safetensors: breaks the calling convention", "non-decreasing"],
    ),
    "heads break the convention": (
        lambda p: _rewrite(
            p,
            0,
            tensors=lambda t: t.update(
                k=t["k"][:, :1].repeat(1, 3, 1).contiguous(), v=t["v"][:, :1].repeat(1, 3, 1).contiguous()
            ),
        ),
        ["call-000000.safetensors: breaks the calling convention", "multiple of nheads_k"],
    ),
    "max_seqlen below the longest document": (
        lambda p: _rewrite(p, 1, entry=lambda e: e.update(max_seqlen_k=3)),
        ["call-000001.safetensors: breaks the calling convention", "max_seqlen_k = 3"],
    ),
    "dout shaped unlike q": (
        lambda p: _rewrite(p, 3, tensors=lambda t: t.update(dout=t["dout"][:-1].contiguous())),
        ["call-000003.safetensors: dout is float64 [23, 2, 16]; it must be", "shaped like q [24, 2, 16]"],
    ),
    "shape differs from the manifest": (
        lambda p: _rewrite(p, 0, entry=lambda e: e["tensors"]["q"].update(shape=[24, 2, 8])),
        ["call-000000.safetensors: q is bfloat16 [24, 2, 16], the manifest says bfloat16 [24, 2, 8]"],
    ),
    "a tensor missing": (
        lambda p: _rewrite(p, 0, tensors=lambda t: t.pop("v")),
        ["call-000000.safetensors: holds tensors", "a call holds q, k, v"],
    ),
    "NaN already in q": (
        lambda p: _rewrite(p, 1, tensors=lambda t: t["q"].view(-1)[5:8].fill_(float("nan"))),
        ["call-000001.safetensors: q already holds 3 NaN and 0 Inf value(s) of 768"],
    ),
    "Inf already in dout": (
        lambda p: _rewrite(p, 2, tensors=lambda t: t["dout"].view(-1)[0].fill_(float("-inf"))),
        ["call-000002.safetensors: dout already holds 0 NaN and 1 Inf"],
    ),
    "NaN softmax_scale": (
        lambda p: _rewrite(p, 0, entry=lambda e: e.update(softmax_scale="nan")),
        ["call-000000.safetensors: softmax_scale is 'nan'"],
    ),
    "causal not a boolean": (
        lambda p: _rewrite(p, 0, entry=lambda e: e.update(causal=1)),
        ["calls[0]: 'causal' must be bool, got int"],
    ),
    "step missing": (lambda p: _rewrite(p, 3, entry=lambda e: e.pop("step")), ["calls[3]: 'step' is missing"]),
    "listed twice": (
        lambda p: _rewrite(p, 0, manifest=lambda m: m["calls"].append(m["calls"][0])),
        ["call 0 is listed twice"],
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_captures_raise_one_line_capture_errors(cap, case):
    breaker, needles = BAD[case]
    breaker(cap)
    _one_line_error(cap, *needles)


def test_a_linked_call_file_is_refused(cap, tmp_path):
    (tmp_path / "elsewhere.safetensors").write_bytes((cap / "call-000001.safetensors").read_bytes())
    (cap / "call-000001.safetensors").unlink()
    (cap / "call-000001.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    _one_line_error(cap, "call-000001.safetensors: a link")


def test_no_capture_at_all(tmp_path):
    _one_line_error(tmp_path / "nothing", "nothing: no capture here")


def test_a_non_finite_softmax_scale_is_recorded_as_it_was_and_refused_on_load(tmp_path):
    tokens, cu, n = _batch(0)
    q = torch.randn(24, 2, 16, dtype=torch.bfloat16)
    with recording(lambda *a, **kw: q.clone(), tmp_path / "cap") as rec:
        rec(q, q, q, cu, cu, n, n, softmax_scale=float("inf"), causal=True)
    assert _manifest(tmp_path / "cap")["calls"][0]["softmax_scale"] == "inf"
    _one_line_error(tmp_path / "cap", "softmax_scale is 'inf'")


# -- the shipped capture ------------------------------------------------------------------------------------------


def test_the_shipped_capture_loads_and_its_manifest_matches_its_files():
    from make_capture import MAX_BYTES, SETTINGS

    cap = load_capture(SHIPPED)
    m = _manifest(SHIPPED)
    assert cap.model == "train-parity tiny" and cap.stopped is None
    assert {k: m["meta"][k] for k in SETTINGS} == SETTINGS
    assert sorted(p.name for p in SHIPPED.iterdir()) == sorted([store.MANIFEST] + [c.file for c in cap])
    assert [(c.step, c.layer) for c in cap] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    total = 0
    for c, e in zip(cap, m["calls"]):
        size = (SHIPPED / c.file).stat().st_size
        total += size
        assert size == e["bytes"] and c.sha256 == store.sha256_hex((SHIPPED / c.file).read_bytes())
        assert c.q.shape == (512, 2, 32) and c.k.shape == c.v.shape == c.q.shape and c.q.dtype == torch.bfloat16
        assert c.dout is not None and c.dout.shape == c.q.shape and c.causal and c.softmax_scale == 32**-0.5
        assert int(c.cu_seqlens_q[-1]) == 512 and c.max_seqlen_q <= 128
    assert total == m["bytes"] <= MAX_BYTES


def test_the_shipped_capture_regenerates_to_the_same_hashes(tmp_path):
    """tests/make_capture.py on this machine: the same files, unless this Python's standard library
    (the corpus) or torch differ from those that made the shipped one."""
    from make_capture import make_capture

    threads = torch.get_num_threads()
    try:
        make_capture(tmp_path / "cap")
    finally:
        torch.set_num_threads(threads)
    new, old = _manifest(tmp_path / "cap"), _manifest(SHIPPED)
    if new["meta"]["corpus_fingerprint"] != old["meta"]["corpus_fingerprint"] or new["torch"] != old["torch"]:
        pytest.skip("another standard library or torch than the shipped capture's: other tensors, other hashes")
    assert new == old
    assert all((tmp_path / "cap" / c["file"]).read_bytes() == (SHIPPED / c["file"]).read_bytes() for c in old["calls"])


def test_the_readme_lines_capture_the_tiny_model_as_shipped(tmp_path, monkeypatch, capsys):
    """README's "Capturing a model's attention calls" runs as written and records what tests/data holds."""
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S) if "record_training_steps(" in b
    ]
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(block, "README.md", "exec"), {})
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.splitlines() == [f"{s} {l} (512, 2, 32) True" for s in range(2) for l in range(2)]
    new, old = load_capture(tmp_path / "captures" / "tiny"), load_capture(SHIPPED)
    same_machine = _manifest(new.path)["meta"]["corpus_fingerprint"] == _manifest(SHIPPED)["meta"]["corpus_fingerprint"]
    if same_machine and _manifest(new.path)["torch"] == _manifest(SHIPPED)["torch"]:
        assert new.sha256 == old.sha256 and [c.sha256 for c in new] == [c.sha256 for c in old]


def test_recording_after_warmup_steps_records_the_trained_model(tmp_path):
    """``warmup_steps`` train unrecorded before the recorded steps: the capture says so, holds only the
    recorded steps (numbered from 0), and its tensors are those of the trained model, not of its
    initialization; a count that is not a non-negative int is refused."""
    from flamia_verify.training.corpus import build_corpus
    from flamia_verify.training.record import record_training_steps

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        corpus = build_corpus(max_bytes=200_000)
        kw = dict(preset="tiny", steps=1, tokens=128, kernel="bf16", seed=0, corpus=corpus)
        fresh = load_capture(record_training_steps(tmp_path / "fresh", **kw))
        trained = load_capture(record_training_steps(tmp_path / "trained", warmup_steps=3, **kw))
    finally:
        torch.set_num_threads(threads)
    assert _manifest(trained.path)["meta"]["warmup_steps"] == 3 and "warmup_steps" not in _manifest(fresh.path)["meta"]
    assert [(c.step, c.layer) for c in trained] == [(0, 0), (0, 1)] == [(c.step, c.layer) for c in fresh]
    assert all(c.dout is not None for c in trained)
    # other batches and other weights: the recorded step is the fourth of the run
    assert not torch.equal(trained.calls[0].q, fresh.calls[0].q)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="warmup_steps"):
            record_training_steps(tmp_path / f"bad{bad}", warmup_steps=bad, **kw)  # type: ignore[arg-type]
