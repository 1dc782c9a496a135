"""train-parity: the corpus, the packed batches, the model's document boundaries, and the end-to-end
verdict on a tiny configuration (a correct MXFP8 kernel within BF16's noise, a future-leaking one not)."""

from __future__ import annotations

import json

import pytest
import torch

from flamia_verify.cli import main
from flamia_verify.commands.common import load_config
from flamia_verify.errors import ConfigError
from flamia_verify.kernels import load_kernel
from flamia_verify.training.corpus import build_corpus, make_batches
from flamia_verify.training.model import ModelConfig, TinyLM


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(max_bytes=400_000)


def test_corpus_is_the_standard_library_split_by_path_hash(corpus):
    again = build_corpus(max_bytes=400_000)
    assert again.fingerprint == corpus.fingerprint and len(again.val) == len(corpus.val)
    assert corpus.val and corpus.train and all(d.dtype == torch.uint8 for d in corpus.train + corpus.val)
    assert corpus.train_bytes >= 400_000 and corpus.val_bytes >= 400_000 // 20
    train = {bytes(d[:200].tolist()) for d in corpus.train}
    assert not any(bytes(d[:200].tolist()) in train for d in corpus.val)  # disjoint files
    assert b"def " in b"".join(bytes(d[:2000].tolist()) for d in corpus.train)


def test_batches_pack_windows_of_the_documents(corpus):
    batches = make_batches(corpus.train, n=5, tokens=1000, max_len=128, min_len=8, seed=3)
    assert [b.tokens.tolist() for b in batches] == [
        b.tokens.tolist() for b in make_batches(corpus.train, n=5, tokens=1000, max_len=128, min_len=8, seed=3)
    ]
    docs = [bytes(d.tolist()) for d in corpus.train]
    for b in batches:
        cu = b.cu_seqlens.tolist()
        lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        assert cu[0] == 0 and cu[-1] == 1000 == b.tokens.numel() == b.targets.numel()
        assert all(8 <= n <= 128 for n in lens) and b.max_seqlen == max(lens)
        for i in range(len(lens)):
            w = bytes(b.tokens[cu[i] : cu[i + 1]].tolist()) + bytes([int(b.targets[cu[i + 1] - 1])])
            assert bytes(b.targets[cu[i] : cu[i + 1] - 1].tolist()) == w[1:-1]  # targets are the next bytes
            assert any(w in d for d in docs)  # each window is a piece of one document


def test_impossible_packings_are_refused_not_looped_on(corpus):
    with pytest.raises(ConfigError, match="window length"):
        make_batches(corpus.train, n=1, tokens=16, max_len=12, min_len=8, seed=0)
    tiny_docs = tuple(d[:10] for d in corpus.train[:5])
    with pytest.raises(ConfigError, match="cannot pack"):
        make_batches(tiny_docs, n=1, tokens=12, max_len=16, min_len=8, seed=0)


def test_a_document_gives_the_same_logits_alone_and_packed_after_another():
    """Positions restart at every document and the causal varlen kernel keeps them apart."""
    torch.manual_seed(0)
    model = TinyLM(ModelConfig(layers=2, d_model=64, heads=2))
    kernel = load_kernel("bf16").fn
    a, b = torch.randint(256, (37,)), torch.randint(256, (21,))
    with torch.no_grad():
        alone = model(b, torch.tensor([0, 21], dtype=torch.int32), 21, kernel)
        packed = model(torch.cat([a, b]), torch.tensor([0, 37, 58], dtype=torch.int32), 37, kernel)
    assert torch.allclose(packed[37:], alone, atol=1e-4, rtol=1e-4)


def test_a_correct_kernel_is_within_the_noise_and_a_leaking_one_is_not(tmp_path, capsys):
    out = tmp_path / "tp"
    code = main(
        [
            "train-parity",
            "--kernel",
            "flamia-mxfp8",
            "flamia_verify.training.demo_kernels:future_leak",
            "--preset",
            "tiny",
            "--steps",
            "6",
            "--tokens",
            "512",
            "--bf16-seeds",
            "2",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert code == 1, text
    doc = json.loads((out / "train-parity.json").read_text())
    assert doc["schema"] == "flamia-verify/train-parity/v1" and not doc["passed"]
    rows = {r["kernel"]: r for r in doc["kernels"]}
    assert rows["bf16"]["status"] == "pass" and rows["bf16"]["gap_sigmas"] == 0
    assert rows["flamia-mxfp8"]["status"] == "pass", rows["flamia-mxfp8"]
    leak = rows["flamia_verify.training.demo_kernels:future_leak"]
    assert leak["status"] == "fail" and abs(leak["gap_sigmas_exact"]) > 3
    assert leak["attn_rel_rmse_final"] > 3 * rows["flamia-mxfp8"]["attn_rel_rmse_final"]
    assert len(doc["runs"]) == 4 and doc["noise"]["sigma"] > 0
    assert all(len(r["train_loss"]) == 6 and r["tokens_seen"] == 6 * 512 for r in doc["runs"])
    md = (out / "train-parity.md").read_text()
    assert "| `flamia-mxfp8` |" in md and "FAIL" in md
    html = (out / "train-parity.html").read_text()
    assert html.startswith("<!doctype html>") and "data:image/png;base64," in html


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kernel", "bf16", "--bf16-seeds", "1"], "--bf16-seeds must be >= 2"),
        (["--kernel", "bf16", "--preset", "huge"], "unknown preset"),
        (["--kernel", "no_such_kernel"], "unknown kernel"),
        ([], "needs at least one --kernel"),
        (["--kernel", "bf16", "--max-gap", "inf"], "--max-gap must be a positive finite number"),
    ],
)
def test_bad_usage_is_one_line_and_an_exit_code(argv, message, tmp_path, capsys):
    code = main(["train-parity", "--device", "cpu", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert code in (2, 3) and message in err and len(err.strip().splitlines()) == 1, err


def test_config_table_is_validated(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tool.flamia-verify.train_parity]\npreset = "tiny"\nmax_gap = 4.0\nkernels = ["fp8"]\n')
    assert load_config(cfg).train_parity == {"preset": "tiny", "max_gap": 4.0, "kernels": ["fp8"]}
    cfg.write_text("[tool.flamia-verify.train_parity]\nmax_gaps = 4.0\n")
    with pytest.raises(ConfigError, match="unknown key 'max_gaps'"):
        load_config(cfg)
    cfg.write_text("[tool.flamia-verify.train_parity]\nbf16_seeds = 1\n")
    with pytest.raises(ConfigError, match="bf16_seeds must be >= 2"):
        load_config(cfg)


def test_a_kernel_whose_training_diverges_fails_its_row_and_the_others_still_run(corpus):
    from dataclasses import replace

    from flamia_verify.reference import reference_attention
    from flamia_verify.training.parity import PRESETS, run_parity

    bf16 = load_kernel("bf16").fn

    def nan_after_step_one(q, k, v, *args, **kw):
        out = bf16(q, k, v, *args, **kw)
        return out * float("nan") if nan_after_step_one.calls >= 4 else out  # 2 layers: the 4th call is in step 1

    def counting(*a, **kw):
        nan_after_step_one.calls += 1
        return nan_after_step_one(*a, **kw)

    nan_after_step_one.calls = 0
    cfg = replace(PRESETS["tiny"], steps=4, tokens=256, max_len=64, eval_every=2, val_batches=1, bf16_seeds=2)
    doc = run_parity(
        {"bf16": bf16, "nan": counting, "mxfp8": load_kernel("flamia-mxfp8").fn},
        cfg,
        baseline=bf16,
        exact=reference_attention,
        corpus=corpus,
    )
    rows = {r["kernel"]: r for r in doc["kernels"]}
    assert rows["nan"]["status"] == "fail" and rows["nan"]["diverged_at"] == 1 and rows["nan"]["gap_sigmas"] == "inf"
    assert rows["mxfp8"]["diverged_at"] is None and isinstance(rows["mxfp8"]["gap_sigmas"], float)
    json.dumps(doc, allow_nan=False)  # strict JSON: NaN and Inf are strings


def test_next_token_leak_shows_each_query_its_next_position_and_nothing_across_documents():
    from flamia_verify.training.demo_kernels import next_token_leak

    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, 2, 32, generator=g).bfloat16() for _ in range(3))
    base = next_token_leak(q, k, v, cu, cu, 5, 5, softmax_scale=0.2, causal=True)
    for pos, sees in ((1, {0, 1, 2, 3, 4}), (5, set()), (6, {5, 6, 7, 8})):
        v2 = v.clone()
        v2[pos] += 8
        moved = {
            i
            for i in range(9)
            if not torch.equal(next_token_leak(q, k, v2, cu, cu, 5, 5, softmax_scale=0.2, causal=True)[i], base[i])
        }
        assert moved == {i for i in sees if i >= pos - 1}, (pos, moved)
