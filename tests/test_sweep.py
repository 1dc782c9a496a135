"""Sweeps (flamia_verify.sweep): the matrix file, case keys and shards, the local worker pool (one
process per case: crashes and hangs become error rows, the sweep goes on), resuming from the store,
merging shards, Ray, and the `sweep` command. Results of a sweep equal a single-process `check` of the
same case bit for bit (apart from times and host names), on the emulated kernels."""

from __future__ import annotations

import html
import json
import re
import textwrap

import pytest

from flamia_verify.api import check
from flamia_verify.cli import main
from flamia_verify.errors import ConfigError
from flamia_verify.reports.survey import case_label
from flamia_verify.results import SweepResult
from flamia_verify.sweep import comparable, exit_code, load_sweep, merge_sweeps, run_sweep
from flamia_verify.sweep.matrix import case_key, shard_of
from flamia_verify.sweep.worker import run_case

pytestmark = pytest.mark.xdist_group("sweep")  # the pool's workers take the machine's cores

# cheap checks of each kind of verdict: a passing one, and one the naive MXFP8 kernel fails
ONLY = '[["interface.output", "isolation.neighbours"]]'


def _write(tmp_path, body: str, name: str = "sweep.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_the_matrix_is_the_product_in_file_order(tmp_path):
    path = _write(
        tmp_path,
        """
        [sweep]
        kernels = ["bf16", {spec = "fp8", recipe = "fp8"}]
        suites = ["quick", "standard"]
        only = [["causal"], []]
        dtypes = ["bf16", "fp16"]
        seeds = [0, 3]
        settings = [{}, {causal_len = 128}]
        device = "cpu"
        """,
    )
    cases = load_sweep(path).cases
    assert len(cases) == 2 * 2 * 2 * 2 * 2 * 2
    assert cases[0].label() == "bf16 quick bf16 seed=0 only=causal"
    assert cases[1].seed == 3 and cases[2].settings == {"causal_len": 128}
    assert cases[-1].kernel == "fp8" and cases[-1].recipe == "fp8" and cases[-1].only == ()
    assert cases[-1].check_kwargs()["thresholds"] == {"suite": {"causal_len": 128}}
    assert len({case_key(c) for c in cases}) == len(cases)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('kernels = ["bf16"]\nworkers = 3', "unknown key sweep.workers"),
        ("kernels = []", "non-empty list"),
        ('kernels = ["bf16"]\nsuites = ["huge"]', "unknown suite 'huge'"),
        ('kernels = ["bf16"]\nonly = [["causal.nope"]]', "unknown check or family 'causal.nope'"),
        ('kernels = ["bf16"]\ndtypes = ["fp32x"]', "unknown dtype"),
        ('kernels = ["bf16"]\nseeds = [-1]', "non-negative"),
        ('kernels = ["bf16"]\nsettings = [{nope = 1}]', "nope"),
        ('kernels = ["bf16"]\ndevice = "cuda:1"', "each worker gets its own GPU"),
        ('kernels = ["bf16", "bf16"]', r"same case twice: bf16 .*quick bf16 seed=0 \(cases 1 and 2 of 2"),
        ('kernels = ["bf16"]\nseeds = [0, 1, 0]', r"same case twice: .*seed=0 \(cases 1 and 3 of 3"),
        ('kernels = [{spec = "bf16", recipe = 3}]', "spec and recipe"),
        ('kernels = ["bf16", "sdpa-flsh"]', r"unknown kernel 'sdpa-flsh' \(did you mean 'sdpa-flash'\?\)"),
    ],
)
def test_a_bad_sweep_file_is_a_config_error_naming_it(tmp_path, body, message):
    path = _write(tmp_path, "[sweep]\n" + body + "\n")
    with pytest.raises(ConfigError, match=message):
        load_sweep(path)


@pytest.mark.parametrize("doc", ["README.md", "docs/sweep.md"])
def test_the_documented_sweep_files_load(doc, tmp_path):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / doc).read_text()
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", text, flags=re.S) if "[sweep]" in b]
    assert blocks, f"{doc} shows no sweep file"
    for block in blocks:
        path = tmp_path / "sweep.toml"
        path.write_text(block)
        assert load_sweep(path).cases


def test_a_key_changes_with_the_kernel_source_and_nothing_else(tmp_path):
    kernel = tmp_path / "attn.py"
    kernel.write_text("from flamia_verify.reference import reference_attention as attn\n")
    path = _write(tmp_path, f'[sweep]\nkernels = ["{kernel}:attn"]\ndevice = "cpu"\n')
    (case,) = load_sweep(path).cases
    first = case_key(case)
    assert case_key(load_sweep(path).cases[0]) == first
    kernel.write_text("from flamia_verify.reference import reference_attention as attn  # edited\n")
    assert case_key(case) != first


def test_an_adapters_key_changes_with_the_version_of_the_library_it_wraps(tmp_path, monkeypatch):
    import importlib.metadata

    path = _write(tmp_path, '[sweep]\nkernels = ["flash-attn", "sdpa-math"]\ndevice = "cpu"\n')
    flash, sdpa = load_sweep(path).cases
    keys = case_key(flash), case_key(sdpa)
    real = importlib.metadata.version

    def newer(dist):
        if dist == "flash-attn":
            return "9.9.9"
        return real(dist)

    monkeypatch.setattr(importlib.metadata, "version", newer)
    assert case_key(flash) != keys[0]
    assert case_key(sdpa) == keys[1]


def test_shards_partition_the_matrix():
    keys = [f"{i:032x}" for i in range(0, 10_000, 37)]
    for n in (1, 2, 3, 7):
        shards = [[k for k in keys if shard_of(k, n) == i] for i in range(1, n + 1)]
        assert sorted(sum(shards, [])) == sorted(keys)
        assert all(shards)


@pytest.fixture(scope="session")  # the survey tests share its group: a module scope would build it twice
def small_sweep(tmp_path_factory):
    """Two kernels x two seeds of two cheap checks, run once on a pool of two CPU workers."""
    root = tmp_path_factory.mktemp("sweep")
    path = _write(
        root,
        f"""
        [sweep]
        kernels = ["flamia-mxfp8", "mxfp8-naive"]
        only = {ONLY}
        seeds = [0, 1]
        device = "cpu"
        """,
    )
    seen = []
    outcome = run_sweep(path, root / "out", workers=2, on_result=lambda r, done, total: seen.append(done))
    return path, root, outcome, seen


def test_a_local_sweep_equals_single_process_checks_bit_for_bit(small_sweep):
    path, _, outcome, seen = small_sweep
    assert outcome.ran == 4 and outcome.workers == 2 and seen == [1, 2, 3, 4]
    cases = load_sweep(path).cases
    assert [r.case for r in outcome.results] == [c.to_dict() for c in cases]
    for case, result in zip(cases, outcome.results):
        alone = run_case(case.to_dict())
        assert comparable(result) == comparable(alone), case.label()
        direct = check(case.kernel, **case.check_kwargs()).to_dict()
        alone_direct = SweepResult(key=result.key, case=result.case, status=direct["summary"]["status"], report=direct)
        assert comparable(alone_direct)["report"]["checks"] == comparable(result)["report"]["checks"]
    assert {r.kernel: r.status for r in outcome.results} == {
        "flamia-mxfp8": "pass",
        "mxfp8-naive": "fail",
    }


def test_a_rerun_reads_every_case_back_and_writes_the_reports(small_sweep):
    path, root, outcome, _ = small_sweep
    again = run_sweep(path, root / "out", workers=2)
    assert again.ran == 0 and again.reused == 4
    assert [comparable(r) for r in again.results] == [comparable(r) for r in outcome.results]
    document = json.loads((root / "out" / "sweep.json").read_text())
    assert document["schema"] == "flamia-verify/sweep/v1" and len(document["matrix"]) == 4
    markdown = (root / "out" / "sweep.md").read_text()
    assert "| mxfp8-naive quick bf16 seed=0 only=interface.output,isolation.neighbours | mxfp8 | **FAIL** |" in markdown
    assert "isolation.neighbours:" in markdown  # the failing check's one-line reason
    assert "<table class='survey'>" in (root / "out" / "sweep.html").read_text()


def test_every_row_of_the_sweep_pages_links_its_own_case_report(small_sweep):
    """Each case's full report is written under reports/<key>/ and linked, by a relative path, from its row of
    sweep.html and sweep.md (the report column was empty on every row)."""
    _, root, outcome, _ = small_sweep
    out = root / "out"
    page, markdown = (out / "sweep.html").read_text(), (out / "sweep.md").read_text()
    for result in outcome.results:
        link = f"reports/{result.key}/report.html"
        assert (out / link).is_file() and f"href='{link}'" in page and f"[report]({link})" in markdown, link
        own = json.loads((out / "reports" / result.key / "report.json").read_text())
        assert own == result.report
        for name in ("report.md", "junit.xml"):
            assert (out / "reports" / result.key / name).is_file(), name
    assert page.count("<a href=") == len(outcome.results)


def test_shards_merge_to_the_whole_sweep(small_sweep, tmp_path):
    path, _, outcome, _ = small_sweep
    # a case's shard hashes its key, which digests the tool's source: the fewest shards that split
    # these four cases (two shards leave one empty for one source in eight)
    keys = [r.key for r in outcome.results]
    count = next(n for n in range(2, 9) if len({shard_of(k, n) for k in keys}) > 1)
    shard_dirs = [tmp_path / f"shard{i}" for i in range(1, count + 1)]
    for i, d in enumerate(shard_dirs, 1):
        run_sweep(path, d, workers=2, shard=f"{i}/{count}")
    partial = merge_sweeps(shard_dirs[:1], tmp_path / "partial")
    merged = merge_sweeps(shard_dirs, tmp_path / "merged")
    assert partial.missing and not merged.missing
    assert [comparable(r) for r in merged.results] == [comparable(r) for r in outcome.results]
    # an incomplete merge says so in every artifact, names what is missing, and exits 2 whatever the
    # present cases say (a failing case included)
    labels = {r.key: case_label(r.case) for r in outcome.results}
    absent = [labels[k] for k in partial.missing]
    document = json.loads((tmp_path / "partial" / "sweep.json").read_text())
    assert document["complete"] is False and [m["label"] for m in document["missing"]] == absent
    for name in ("sweep.md", "sweep.html"):
        text = (tmp_path / "partial" / name).read_text()
        assert f"INCOMPLETE: {len(absent)} of 4 case(s) missing" in text, name
        assert all(html.escape(a) in text for a in absent), name
    assert exit_code(partial) == 2 and exit_code(merged) == 1  # mxfp8-naive fails
    whole = json.loads((tmp_path / "merged" / "sweep.json").read_text())
    assert whole["complete"] is True and whole["missing"] == []
    # each case's report, as its shard's worker wrote it, is linked from the merged pages
    for key in keys:
        merged_page = tmp_path / "merged" / "reports" / key / "report.html"
        shard_page = next(
            d / "reports" / key / "report.html" for d in shard_dirs if (d / "cases" / f"{key}.json").is_file()
        )
        assert merged_page.read_text() == shard_page.read_text()
        assert f"href='reports/{key}/report.html'" in (tmp_path / "merged" / "sweep.html").read_text()
    assert "INCOMPLETE" not in (tmp_path / "merged" / "sweep.md").read_text()


def test_a_result_without_a_report_names_the_recipe_it_knows():
    """A case that gave no verdict keeps its recipe: the one its worker announced, else the case's own,
    else the one its built-in kernel or adapter claims (a file's kernel: unknown until it loads)."""
    from flamia_verify.sweep.matrix import SweepCase
    from flamia_verify.sweep.worker import error_result

    assert error_result(SweepCase(kernel="flamia-nvfp4"), "timed out").recipe == "nvfp4"
    assert error_result(SweepCase(kernel="sdpa-cudnn"), "timed out").recipe == "bf16"
    assert error_result(SweepCase(kernel="k.py:attn", recipe="fp8"), "timed out").recipe == "fp8"
    assert error_result(SweepCase(kernel="k.py:attn"), "timed out").recipe is None
    assert error_result(SweepCase(kernel="k.py:attn"), "crashed", recipe="mxfp8").recipe == "mxfp8"


def test_a_crashing_and_a_hanging_kernel_become_error_rows_and_the_sweep_goes_on(tmp_path):
    (tmp_path / "bad.py").write_text(
        textwrap.dedent(
            """
            import os, time
            def crash(*args, **kwargs):
                os._exit(7)
            def hang(*args, **kwargs):
                time.sleep(600)
            """
        )
    )
    bad = tmp_path / "bad.py"
    path = _write(
        tmp_path,
        f"""
        [sweep]
        kernels = [{{spec = "{bad}:crash", recipe = "bf16"}}, {{spec = "{bad}:hang", recipe = "bf16"}}, "bf16"]
        only = [["interface.output"]]
        device = "cpu"
        timeout_s = 10
        """,
    )
    outcome = run_sweep(path, tmp_path / "out", workers=2)
    status = {r.kernel.rpartition(":")[2]: (r.status, r.error) for r in outcome.results}
    assert status["crash"][0] == "error" and "worker crashed (exit code 7)" in status["crash"][1]
    assert status["hang"][0] == "error" and "timed out after 10 s" in status["hang"][1]
    assert status["bf16"] == ("pass", None)
    assert (
        main(["sweep", str(path), "--out", str(tmp_path / "out"), "--timeout", "11"]) == 3
    )  # errors rerun, no verdict


def test_the_sweep_command_exit_codes(small_sweep, tmp_path, capsys):
    path, root, _, _ = small_sweep
    assert main(["sweep", str(path), "--out", str(root / "out")]) == 1  # read back: mxfp8-naive fails
    assert "4 case(s), 4 already in the store, 0 to run" in capsys.readouterr().err
    assert main(["sweep", "merge", str(root / "out"), "--out", str(tmp_path / "m")]) == 1
    assert main(["sweep", "merge", str(tmp_path / "nowhere"), "--out", str(tmp_path / "m2")]) == 2
    assert "the --out of a sweep?" in capsys.readouterr().err
    assert main(["sweep", str(path), "--shard", "3/2"]) == 2
    assert main(["sweep", str(path), "--address", "auto"]) == 2


def test_a_full_disk_names_the_file_and_says_incomplete(small_sweep, tmp_path, capsys, monkeypatch):
    """It said "cannot access: No space left on device" (no file) and exited 2, a usage error; check
    names the file and exits 1 (the run is incomplete)."""
    import errno
    import os

    path, root, _, _ = small_sweep

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "full"
    assert main(["sweep", str(path), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"flamia-verify: cannot write {out}"), err
    assert "No space left on device; the run is incomplete" in err
    assert not list(out.rglob(".*.tmp")), "no partial file is left behind"
    assert not list((out / "cases").glob("*.json")), "no case is stored as if it had been written"


def test_a_ray_sweep_on_a_local_cluster_of_two_workers_equals_the_local_one(small_sweep, tmp_path):
    pytest.importorskip("ray")
    path, _, outcome, _ = small_sweep
    on_ray = run_sweep(path, tmp_path / "ray", backend="ray", workers=2)
    assert on_ray.ran == 4 and on_ray.workers == 2
    assert [comparable(r) for r in on_ray.results] == [comparable(r) for r in outcome.results]
