"""train-parity: the corpus, the packed batches, the model's document boundaries, and the end-to-end
verdict on a tiny configuration (a correct MXFP8 kernel within BF16's noise, a future-leaking one not)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

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


def _result(kernel: str, seed: int, val: float, exact: float | None = None, diverged: int | None = None):
    from flamia_verify.training.parity import TrainResult

    e = val if exact is None else exact
    return TrainResult(kernel, seed, [0], [val], [1.0], [1], [val], [e], [0.01], 10, 1.0, diverged)


def test_the_gate_is_the_paired_interval():
    """Three seeds, t(0.975, 2) = 4.303: the interval of the paired differences decides, not BF16's spread."""
    from flamia_verify.training.parity import PRESETS, _interval, _paired

    mean, sd, lo, hi = _interval([0.010, 0.012, 0.014], 0.95)
    assert mean == pytest.approx(0.012) and sd == pytest.approx(0.002)
    assert lo == pytest.approx(0.012 - 4.302653 * 0.002 / 3**0.5, rel=1e-5) and hi > lo > 0
    cfg = replace(PRESETS["tiny"], seeds=3)
    base = {s: _result("bf16", s, 2.0 + 0.05 * s) for s in range(3)}  # BF16's seeds spread by 0.05
    # a consistent +0.012 is resolved although it is a quarter of BF16's seed-to-seed spread
    worse = {s: _result("k", s, 2.0 + 0.05 * s + d) for s, d in zip(range(3), (0.010, 0.012, 0.014))}
    row = _paired("k", worse, base, cfg)
    assert row["status"] == "fail" and row["ci"][0] > 0
    assert _paired("k", worse, base, replace(cfg, tolerance=0.02))["status"] == "pass"  # within +-0.02
    noisy = {s: _result("k", s, 2.0 + 0.05 * s + d) for s, d in zip(range(3), (0.01, -0.012, 0.004))}
    assert _paired("k", noisy, base, cfg)["status"] == "pass"  # the interval holds 0
    # a leak: better on its own attention, worse under the exact one; the exact interval fails it
    leak = {s: _result("k", s, 2.0 + 0.05 * s - 0.1, 2.0 + 0.05 * s + d) for s, d in zip(range(3), (0.3, 0.31, 0.29))}
    row = _paired("k", leak, base, cfg)
    assert row["status"] == "fail" and row["ci"][1] < 0 and row["ci_exact"][0] > 0
    diverged = {**worse, 1: _result("k", 1, float("nan"), diverged=3)}
    row = _paired("k", diverged, base, cfg)
    assert row["status"] == "fail" and row["diverged_at"] == {"1": 3}


def test_a_run_reports_paired_gaps_floors_resolution_and_the_ladder(corpus, tmp_path):
    """Schema v2 end to end on a minimal CPU run: every field the gate and its resolution need."""
    from flamia_verify.known_bad.demos import ladder
    from flamia_verify.reference import reference_attention
    from flamia_verify.training.parity import PRESETS, run_parity
    from flamia_verify.training.report import write_parity_reports

    bf16 = load_kernel("bf16").fn
    cfg = replace(PRESETS["tiny"], steps=2, tokens=256, max_len=64, eval_every=2, val_batches=1, seeds=2)
    rungs = dict(list(ladder(bf16).items())[-2:])  # noise 0.1 and the temperature error
    doc = run_parity(
        {"bf16": bf16, "flamia-mxfp8": load_kernel("flamia-mxfp8").fn},
        cfg,
        baseline=bf16,
        exact=reference_attention,
        corpus=corpus,
        floor_kernel=load_kernel("sdpa-math").fn,
        ladder=rungs,
    )
    json.dumps(doc, allow_nan=False)
    assert doc["schema"] == "flamia-verify/train-parity/v2"
    rows = {r["kernel"]: r for r in doc["kernels"]}
    assert rows["bf16"]["deltas"] == [0.0, 0.0] and rows["bf16"]["status"] == "pass"
    mx = rows["flamia-mxfp8"]
    assert len(mx["deltas"]) == 2 and mx["ci"][0] <= mx["mean"] <= mx["ci"][1]
    assert set(doc["floors"]) == {"bf16_vs_itself", "bf16_vs_other_rounding"}
    assert doc["floors"]["bf16_vs_itself"]["deltas"] == [0.0, 0.0]  # the CPU repeats itself bitwise
    res = doc["resolution"]
    assert res["null_from"] == "bf16_vs_other_rounding" and res["minimum_detectable_gap"] >= 0
    assert res["t_quantile"] == pytest.approx(12.7062, rel=1e-4)  # two seeds: one degree of freedom
    assert [r["kernel"] for r in doc["ladder"]] == list(rungs)
    for r in doc["ladder"]:
        assert r["should_be_flagged"] == (abs(r["mean"]) >= res["minimum_detectable_gap"])
        assert r["consistent"] == (r["flagged"] or not r["should_be_flagged"])
    assert doc["passed"] == (all(r["status"] == "pass" for r in doc["kernels"]) and doc["ladder_consistent"])
    assert doc["evaluation"]["val_tokens"] == 256 and doc["evaluation"]["standard_error"] > 0
    assert len(doc["runs"]) == 2 * (2 + 2 + 2)  # seeds x (bf16, mxfp8, two floors, two rungs)
    paths = write_parity_reports(doc, tmp_path)
    md = paths["train-parity.md"].read_text()
    assert "Minimum detectable gap" in md and "| `floor: bf16_vs_other_rounding (sdpa-math)` |" in md
    assert "| `ladder: noise 0.1` |" in md
    assert "data:image/png;base64," in paths["train-parity.html"].read_text()


def test_the_ladder_flags_what_the_run_resolves_and_a_missed_rung_fails_the_run():
    from flamia_verify.training.parity import PRESETS, _paired, judge_rung

    cfg = replace(PRESETS["tiny"], seeds=3)
    base = {s: _result("bf16", s, 2.0) for s in range(3)}
    seen = _paired("r", {s: _result("r", s, 2.0 + d) for s, d in zip(range(3), (0.05, 0.051, 0.049))}, base, cfg)
    assert judge_rung(seen, 0.01) == dict(seen, should_be_flagged=True, flagged=True, consistent=True)
    # a rung of 0.02 in the mean that spreads so much that the gate cannot call it: missed
    missed = _paired("r", {s: _result("r", s, 2.0 + d) for s, d in zip(range(3), (0.09, -0.05, 0.02))}, base, cfg)
    assert missed["status"] == "pass" and not judge_rung(missed, 0.01)["consistent"]
    small = _paired("r", {s: _result("r", s, 2.0 + d) for s, d in zip(range(3), (0.002, -0.001, 0.0))}, base, cfg)
    assert judge_rung(small, 0.01)["consistent"]  # below the resolution: not expected to be seen


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kernel", "bf16", "--seeds", "1"], "--seeds must be >= 2"),
        (["--kernel", "bf16", "--level", "1.5"], "--level must be a confidence level"),
        (["--kernel", "bf16", "--tolerance", "-1"], "--tolerance must be a finite number of nats >= 0"),
        (["--kernel", "bf16", "--preset", "huge"], "unknown preset"),
        (["--kernel", "no_such_kernel"], "unknown kernel"),
        ([], "needs at least one --kernel"),
    ],
)
def test_bad_usage_is_one_line_and_an_exit_code(argv, message, tmp_path, capsys):
    code = main(["train-parity", "--device", "cpu", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert code in (2, 3) and message in err and len(err.strip().splitlines()) == 1, err


def test_config_table_is_validated(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tool.flamia-verify.train_parity]\npreset = "tiny"\ntolerance = 0.01\nkernels = ["fp8"]\n')
    assert load_config(cfg).train_parity == {"preset": "tiny", "tolerance": 0.01, "kernels": ["fp8"]}
    cfg.write_text("[tool.flamia-verify.train_parity]\ntolerances = 4.0\n")
    with pytest.raises(ConfigError, match="unknown key 'tolerances'"):
        load_config(cfg)
    cfg.write_text("[tool.flamia-verify.train_parity]\nseeds = 1\n")
    with pytest.raises(ConfigError, match="seeds must be >= 2"):
        load_config(cfg)
    cfg.write_text("[tool.flamia-verify.train_parity]\nmax_gap = 3.0\n")  # schema v1's gate
    with pytest.raises(ConfigError, match="'max_gap' was replaced by tolerance"):
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
    cfg = replace(PRESETS["tiny"], steps=4, tokens=256, max_len=64, eval_every=2, val_batches=1, seeds=2, floors=False)
    doc = run_parity(
        {"bf16": bf16, "nan": counting, "mxfp8": load_kernel("flamia-mxfp8").fn},
        cfg,
        baseline=bf16,
        exact=reference_attention,
        corpus=corpus,
    )
    rows = {r["kernel"]: r for r in doc["kernels"]}
    assert rows["nan"]["status"] == "fail" and rows["nan"]["diverged_at"]["0"] == 1 and rows["nan"]["mean"] == "inf"
    assert rows["mxfp8"]["diverged_at"] is None and isinstance(rows["mxfp8"]["mean"], float)
    json.dumps(doc, allow_nan=False)  # strict JSON: NaN and Inf are strings


def test_next_token_leak_shows_each_query_its_next_position_and_nothing_across_documents():
    from flamia_verify.known_bad.demos import next_token_leak

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


def test_the_preset_help_names_every_preset(capsys):
    from flamia_verify.cli import main
    from flamia_verify.training.parity import PRESETS

    with pytest.raises(SystemExit):
        main(["train-parity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text.rsplit("--preset PRESET", 1)[1].split("--steps")[0] for name in PRESETS), text


def test_a_run_continues_from_the_trainings_an_earlier_one_finished(corpus):
    """run_parity(finished=...): a record of the same fingerprint, name and seed stands for its training
    (marked resumed); the document equals the uninterrupted run's; another configuration reuses nothing."""
    from flamia_verify.reference import reference_attention
    from flamia_verify.training.parity import PRESETS, run_parity

    bf16, other = load_kernel("bf16").fn, load_kernel("sdpa-math").fn
    cfg = replace(PRESETS["tiny"], steps=2, tokens=256, max_len=64, eval_every=2, val_batches=1, seeds=2, floors=False)

    def go(config, finished=()):
        seen = []
        doc = run_parity(
            {"sdpa-math": other},
            config,
            baseline=bf16,
            exact=reference_attention,
            corpus=corpus,
            on_run=seen.append,
            finished=finished,
        )
        return doc, seen

    whole, runs = go(cfg)
    assert len(runs) == 4 and len({r.fingerprint for r in runs}) == 1 and runs[0].fingerprint
    journal = [dataclasses.asdict(r) for r in runs[:3]]  # the run stopped during its fourth training
    again, seen = go(cfg, journal)
    assert [r.resumed for r in seen] == [True, True, True, False]

    def strip(rows):  # what a resumed run must reproduce: everything but the time it took
        return [{k: v for k, v in r.items() if k not in ("seconds", "resumed")} for r in rows]

    assert strip(again["runs"]) == strip(whole["runs"]) and strip(again["kernels"]) == strip(whole["kernels"])
    _, fresh = go(replace(cfg, lr=cfg.lr / 2), journal)  # another configuration: nothing of the journal fits
    assert not any(r.resumed for r in fresh)


def test_the_journal_skips_a_line_cut_short(tmp_path):
    from flamia_verify.commands.train_parity import read_journal

    path = tmp_path / "train-parity-runs.jsonl"
    assert read_journal(path) == []
    path.write_text('{"kernel": "bf16", "seed": 0}\n[1, 2]\n{"kernel": "bf16", "se')
    assert read_journal(path) == [{"kernel": "bf16", "seed": 0}]
