"""`flamia-verify survey` (flamia_verify.sweep.survey, flamia_verify.reports.survey): one suite over
many kernels, one report side by side. On the CPU: the rows and their verdicts equal single-process
`check` runs, a kernel that cannot run here gets a row that says why, a crashing kernel gets an error
row and the survey goes on, the speed columns and the error-against-speed plot from timed results, the
command's exit codes and messages."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from flamia_verify.api import check
from flamia_verify.bench import SpeedShape
from flamia_verify.cli import main
from flamia_verify.errors import ConfigError
from flamia_verify.reports.survey import error_speed_svg, render_survey_markdown, survey_rows
from flamia_verify.results import SweepResult
from flamia_verify.sweep.matrix import speed_shape
from flamia_verify.sweep.survey import availability, default_kernels, run_survey, survey_exit_code

pytestmark = pytest.mark.xdist_group("sweep")  # the pool's workers take the machine's cores

ONLY = ("interface.output", "isolation.neighbours", "error.out")


@pytest.fixture(scope="module")
def small_survey(tmp_path_factory):
    root = tmp_path_factory.mktemp("survey")
    crash = root / "crash.py"
    crash.write_text(
        textwrap.dedent(
            """
            import os

            def attn(q, k, v, *args, **kwargs):
                os._exit(7)  # a kernel that takes its process down
            """
        )
    )
    kernels = ["bf16", "mxfp8-naive", "sdpa-cudnn", f"{crash}:attn"]
    # speed asked for, on a CPU: not measured, and the report says so
    outcome = run_survey(
        kernels, root / "out", device="cpu", only=ONLY, workers=2, speed=speed_shape({}, "test"), recipe="bf16"
    )
    return root, outcome


def test_rows_follow_the_kernels_with_unavailable_ones_last(small_survey):
    root, outcome = small_survey
    rows = outcome.rows
    assert [r["kernel"] for r in rows][:2] == ["bf16", "mxfp8-naive"]
    status = {r["kernel"]: r["status"] for r in rows}
    assert status["bf16"] == "pass" and status["mxfp8-naive"] == "fail"
    assert rows[-1]["kernel"] == "sdpa-cudnn" and rows[-1]["status"] == "unavailable"
    assert "needs CUDA" in rows[-1]["reason"]
    crash = next(r for r in rows if r["kernel"].endswith("crash.py:attn"))
    assert crash["status"] == "error" and "7" in crash["reason"]  # its exit code is named
    assert survey_exit_code(outcome) == 1  # a surveyed kernel failed


def test_a_row_is_what_check_finds_for_that_kernel(small_survey):
    """The survey's verdicts are check's: same families, same failing checks, same error metrics."""
    _, outcome = small_survey
    naive = next(r for r in outcome.rows if r["kernel"] == "mxfp8-naive")
    report = check("mxfp8-naive", suite="quick", device="cpu", only=list(ONLY))
    assert naive["families"]["isolation"]["verdict"] == "fail"
    assert naive["families"]["isolation"]["reason"].startswith("isolation.neighbours:")
    assert naive["families"]["interface"]["verdict"] == "pass"
    out = next(c for c in report.checks if c.name == "error.out").metrics
    assert naive["error"]["out"] == {
        "rel_rmse": pytest.approx(out["rel_rmse"], rel=0, abs=0),
        "model": pytest.approx(out["predicted_rel_rmse"], rel=0, abs=0),
        "bf16": pytest.approx(out["bf16_rel_rmse"], rel=0, abs=0),
    }


def test_reports_are_written_and_linked(small_survey):
    root, outcome = small_survey
    out = root / "out"
    document = json.loads((out / "survey.json").read_text())
    assert document["schema"] == "flamia-verify/survey/v1" and len(document["rows"]) == 4
    assert document["settings"]["suite"] == "quick" and document["settings"]["speed"] is None
    bf16 = next(r for r in document["rows"] if r["kernel"] == "bf16")
    assert bf16["report"] == "kernels/bf16/report.html" and (out / bf16["report"]).is_file()
    assert (out / "kernels" / "bf16" / "report.md").is_file() and (out / "kernels" / "bf16" / "junit.xml").is_file()
    markdown = (out / "survey.md").read_text()
    assert "| bf16 | bf16 | **PASS** |" in markdown and "[report](kernels/bf16/report.html)" in markdown
    assert "sdpa-cudnn: not available here: needs CUDA" in markdown
    assert "speed not measured" in markdown  # a CPU survey says why it has no speed columns
    page = (out / "survey.html").read_text()
    assert "<table class='survey'>" in page and "href='kernels/bf16/report.html'" in page and "<script>" in page


def test_the_survey_writes_what_docs_survey_md_lists_and_nothing_else(small_survey):
    """The survey once wrote its sweep's sweep.json, sweep.md and sweep.html beside its own report, which
    repeated it and which docs/survey.md did not mention. It writes its report and its sweeps' stores."""
    root, _ = small_survey
    out = root / "out"
    written = sorted(p.name for p in out.iterdir())
    assert written == ["cases", "kernels", "survey.html", "survey.json", "survey.md"]
    section = (Path(__file__).resolve().parents[1] / "docs" / "survey.md").read_text()
    section = section.split("**What it writes**")[1].split("\n\n")[0]
    for name in [*written, "speed"]:  # speed/: the timing phase's store, on CUDA
        assert f"`{name}" in section, f"docs/survey.md does not say what {name} is"


def test_a_hung_kernel_row_names_its_recipe(tmp_path):
    """A kernel that hangs past --timeout gets an error row with the recipe it declared, like every other
    row: its worker names the recipe once the kernel has loaded, before the call that hangs."""
    hung = tmp_path / "hung.py"
    hung.write_text(
        textwrap.dedent(
            """
            import time

            def attn(q, k, v, *args, **kwargs):
                time.sleep(600)

            attn.recipe = "mxfp8"
            """
        )
    )
    outcome = run_survey([f"{hung}:attn"], tmp_path / "out", device="cpu", only=ONLY, workers=1, timeout_s=10)
    (row,) = outcome.rows
    assert row["status"] == "error" and "timed out after 10 s" in row["reason"]
    assert row["recipe"] == "mxfp8"
    assert f"| {hung}:attn | mxfp8 | **ERROR** |" in (tmp_path / "out" / "survey.md").read_text()
    assert "<td class='v'>mxfp8</td>" in (tmp_path / "out" / "survey.html").read_text()


def test_a_rerun_reuses_every_stored_result(small_survey):
    root, outcome = small_survey
    again = run_survey(
        ["bf16", "mxfp8-naive", "sdpa-cudnn"],
        root / "out",
        device="cpu",
        only=ONLY,
        workers=2,
        speed=speed_shape({}, "test"),
    )
    assert again.ran == 0 and again.reused == 2


def _timed(rows_speed: dict[str, dict]) -> list[SweepResult]:
    """Sweep results with a stored report's error metrics and the given speed rows."""
    results = []
    for name, speed in rows_speed.items():
        checks = [
            {
                "name": "error.out",
                "family": "error",
                "status": "pass",
                "metrics": {"rel_rmse": 0.05, "predicted_rel_rmse": 0.1, "bf16_rel_rmse": 0.002},
            }
        ]
        report = {"recipe": "bf16", "checks": checks, "summary": {"forward_only": False}}
        results.append(SweepResult(key=name, case={"kernel": name}, status="pass", report=report, speed=speed))
    return results


def test_speed_columns_ratio_to_the_fastest_bf16_baseline_and_the_plot():
    shape = SpeedShape().describe()
    results = _timed(
        {
            "sdpa-cudnn": {"fwd_tflops": 430.0, "bwd_tflops": 366.0, "fwdbwd_tflops": 400.0, "shape": shape},
            "sdpa-flash": {"fwd_tflops": 230.0, "bwd_tflops": 130.0, "fwdbwd_tflops": 150.0, "shape": shape},
            "mine": {"fwd_tflops": 300.0, "bwd_tflops": 100.0, "fwdbwd_tflops": 200.0, "shape": shape},
            "fwd-only": {"fwd_tflops": 333.0, "bwd_tflops": None, "fwdbwd_tflops": None, "shape": shape},
        }
    )
    rows = survey_rows(results, label=lambda case: case["kernel"])
    ratio = {r["kernel"]: r["speed"]["ratio"] for r in rows}
    assert ratio["sdpa-cudnn"] == 1.0 and ratio["mine"] == 0.5 and ratio["fwd-only"] is None
    assert rows[2]["speed"]["reference"] == "sdpa-cudnn"
    markdown = render_survey_markdown(rows, "t")
    assert "| 300 | 100 | 200 | 0.50 |" in markdown
    svg = error_speed_svg(rows)
    assert svg is not None and svg.startswith("<svg") and "mine" in svg and "fwd-only (fwd)" in svg
    assert error_speed_svg(survey_rows(_timed({"x": None}))) is None  # nothing timed: no plot


def test_default_kernels_and_availability():
    names = default_kernels()
    assert names[:2] == ["bf16", "fp8"] and "sdpa-math" in names and "flex-packed" in names
    assert len(set(names)) == len(names)
    assert availability("flamia-mxfp8", "cpu") == (None, "mxfp8")
    reason, recipe = availability("sdpa-cudnn", "cpu")
    assert reason and recipe == "bf16"
    assert availability("my_kernel.py:attn", "cpu") == (None, "")


def test_bad_input_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="listed twice: bf16"):
        run_survey(["bf16", "bf16"], tmp_path, device="cpu")
    with pytest.raises(ConfigError, match=r"unknown kernel 'sdpa-flsh' \(did you mean 'sdpa-flash'\?\)"):
        run_survey(["bf16", "sdpa-flsh"], tmp_path, device="cpu")
    assert not (tmp_path / "cases").exists()  # nothing ran
    with pytest.raises(ConfigError, match="positive integer"):
        speed_shape({"seqlen": 0}, "test")


def test_the_command(tmp_path, capsys):
    code = main(["survey", "--kernel", "bf16", "--device", "cpu", "--only", "interface.output", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0 and "survey: 1 kernel(s): 1 pass" in captured.out
    assert (tmp_path / "survey.html").is_file()
    assert main(["survey", "--kernel", "bf16", "--device", "cpu", "--only", "nonsense", "--out", str(tmp_path)]) == 2
    assert main(["survey", "--address", "x", "--out", str(tmp_path)]) == 2
    assert main(["survey", "--kernel", "bf16", "sdpa-flsh", "--device", "cpu", "--out", str(tmp_path / "typo")]) == 2
    assert "did you mean 'sdpa-flash'" in capsys.readouterr().err
