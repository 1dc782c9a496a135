"""report.json and the other report files on disk: round trip, schema validation, atomic replacement."""

from __future__ import annotations

import copy
import json
import os
import stat

import pytest
from reports_examples import example_report, passing_report

from flamia_verify.errors import ReportSchemaError
from flamia_verify.reports import SCHEMA, CheckResult, load_report, write_reports
from flamia_verify.reports.store import REPORT_FILES, atomic_write_text, report_json

EXPECTED_FILES = sorted(REPORT_FILES.values())


def _without_nan(report):
    report = copy.deepcopy(report)
    report.check("error.backward").metrics["max_abs_err_dV"] = 0.25
    return report


# ------------------------------------------------------------------------------------------ round trip


def test_round_trip_is_equal(tmp_path):
    report = _without_nan(example_report())
    paths = write_reports(report, tmp_path / "out")
    assert set(paths) == {"json", "markdown", "html", "junit"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == EXPECTED_FILES
    loaded = load_report(paths["json"])
    assert loaded == report, "write_reports then load_report must give back an equal Report"


def test_round_trip_keeps_key_order_and_summary(tmp_path):
    report = _without_nan(example_report())
    data = json.loads(write_reports(report, tmp_path)["json"].read_text())
    assert list(data) == [
        "schema",
        "kernel",
        "recipe",
        "suite",
        "seed",
        "threshold_overrides",
        "require",
        "environment",
        "checks",
        "summary",
    ]
    assert data["threshold_overrides"] == []
    assert data["schema"] == SCHEMA
    check = data["checks"][1]
    assert list(check["thresholds"]) == ["rel_err_vs_bf16_dQ", "rel_err_vs_bf16_dK", "rel_err_vs_bf16_dV"]
    assert data["summary"] == {
        "total": 11,
        "pass": 7,
        "fail": 2,
        "error": 1,
        "skip": 1,
        "passed": False,
        "failed_checks": ["error.backward", "causal.forward"],
        "errored_checks": ["causal.backward"],
        "complete": True,
        "status": "fail",
        "require": [],
        "verdicts": {
            "gating": {
                "status": "fail",
                "gates": True,
                "checks": 11,
                "failed": ["error.backward", "causal.forward"],
                "errored": ["causal.backward"],
            }
        },
        "gradients_checked": True,
        "forward_only": False,
    }


def test_nonfinite_values_are_strict_json_strings(tmp_path):
    report = example_report()  # error.backward has a NaN metric
    report.check("error.forward").metrics["worst_ratio"] = float("inf")
    path = write_reports(report, tmp_path)["json"]
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"report.json holds the non-JSON constant {c}"))
    loaded = load_report(path)
    assert loaded.check("error.backward").metrics["max_abs_err_dV"] == "nan"
    assert loaded.check("error.forward").metrics["worst_ratio"] == "inf"
    assert loaded.to_dict() == report.to_dict()


def test_bare_nan_literals_written_by_other_tools_are_read(tmp_path):
    data = passing_report().to_dict()
    text = json.dumps(data).replace('"rel_err_vs_bf16_O": 1.3', '"rel_err_vs_bf16_O": NaN')
    path = tmp_path / "report.json"
    path.write_text(text)
    value = load_report(path).check("error.forward").metrics["rel_err_vs_bf16_O"]
    assert value != value  # NaN


def test_undecodable_file_names_in_messages_round_trip(tmp_path):
    report = passing_report()
    report.kernel = "kernels/k\udcff.py:attn"  # a file name with a byte that is not UTF-8
    report.check("error.forward").message = "loaded kernels/k\udcff.py"
    paths = write_reports(report, tmp_path)
    assert load_report(paths["json"]).to_dict() == report.to_dict()
    assert "k\\\\udcff.py" in paths["markdown"].read_text()  # visible escape, its backslash escaped for Markdown


# ------------------------------------------------------------------------------------- schema problems


def _mutate(fn):
    data = passing_report().to_dict()
    fn(data)
    return data


SCHEMA_PROBLEMS = [
    ("missing kernel", lambda d: d.pop("kernel"), "field 'kernel' is missing"),
    ("missing summary", lambda d: d.pop("summary"), "field 'summary' is missing"),
    ("missing schema", lambda d: d.pop("schema"), "field 'schema' is missing"),
    (
        "other schema",
        lambda d: d.update(schema="flamia-verify/report/v2"),
        "field 'schema': unsupported report schema 'flamia-verify/report/v2'",
    ),
    (
        "bad status",
        lambda d: d["checks"][1].update(status="passed"),
        "field 'checks[1].status' (check 'error.backward'): expected one of pass, fail, error, skip, got 'passed'",
    ),
    ("seed as text", lambda d: d.update(seed="1234"), "field 'seed': expected an integer, got a string"),
    ("seed as bool", lambda d: d.update(seed=True), "field 'seed': expected an integer, got a boolean"),
    ("checks not a list", lambda d: d.update(checks={}), "field 'checks': expected a list, got an object"),
    ("check not an object", lambda d: d["checks"].append(3), "field 'checks[4]': expected an object, got a number"),
    (
        "missing worst_case",
        lambda d: d["checks"][0].pop("worst_case"),
        "field 'checks[0].worst_case' (check 'error.forward') is missing",
    ),
    (
        "metrics as list",
        lambda d: d["checks"][2].update(metrics=[1]),
        "field 'checks[2].metrics' (check 'causal.forward'): expected an object, got a list",
    ),
    (
        "nested metric",
        lambda d: d["checks"][0]["metrics"].update(per_head=[1, 2]),
        "field 'checks[0].metrics.per_head' (check 'error.forward'): expected a number, string, boolean or null",
    ),
    (
        "unknown family",
        lambda d: d["checks"][0].update(family="speed"),
        "field 'checks[0].family' (check 'error.forward'): unknown family 'speed'",
    ),
    (
        "name outside family",
        lambda d: d["checks"][0].update(name="bias.forward"),
        "field 'checks[0].name' (check 'bias.forward'): a check name must start with its family 'error.'",
    ),
    (
        "duplicate name",
        lambda d: d["checks"][1].update(name="error.forward"),
        "field 'checks[1].name' (check 'error.forward'): duplicate of checks[0]",
    ),
    (
        "duration as text",
        lambda d: d["checks"][0].update(duration_s="1s"),
        "field 'checks[0].duration_s' (check 'error.forward'): expected a number, got a string",
    ),
]


@pytest.mark.parametrize("mutate, expected", [p[1:] for p in SCHEMA_PROBLEMS], ids=[p[0] for p in SCHEMA_PROBLEMS])
def test_schema_problems_name_file_and_field(tmp_path, mutate, expected):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_mutate(mutate)))
    with pytest.raises(ReportSchemaError) as info:
        load_report(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert expected in message, f"expected {expected!r} in {message!r}"


def test_every_problem_is_collected_and_counted(tmp_path):
    path = tmp_path / "report.json"
    data = _mutate(lambda d: (d.pop("kernel"), d.update(seed="x"), d["checks"][0].update(status="ok")))
    path.write_text(json.dumps(data))
    with pytest.raises(ReportSchemaError) as info:
        load_report(path)
    assert len(info.value.problems) == 3
    assert "(and 2 more problem(s))" in str(info.value)


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"", "not valid JSON: Expecting value at line 1 column 1"),
        (b'{"schema": ', "not valid JSON"),
        (b"[1, 2]", "expected a JSON object at the top level, got a list"),
        (b"\xff\xfe", "not UTF-8 text"),
    ],
    ids=["empty", "truncated", "list", "binary"],
)
def test_unreadable_content_is_a_schema_error(tmp_path, content, expected):
    path = tmp_path / "report.json"
    path.write_bytes(content)
    with pytest.raises(ReportSchemaError, match="report.json: ") as info:
        load_report(path)
    assert expected in str(info.value)


def test_missing_file_is_a_schema_error(tmp_path):
    with pytest.raises(ReportSchemaError, match=r"nope\.json: cannot read report: No such file"):
        load_report(tmp_path / "nope.json")


def test_report_schema_error_exits_2():
    assert ReportSchemaError.exit_code == 2


# ---------------------------------------------------------------------------------------- atomic writes


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_write_creates_directory_and_rewrites_as_checks_finish(tmp_path):
    out = tmp_path / "deep" / "flamia-report"
    report = passing_report()
    full = list(report.checks)
    report.checks = full[:1]
    write_reports(report, out)
    assert len(load_report(out / "report.json").checks) == 1
    report.checks = full
    write_reports(report, out)
    assert [c.name for c in load_report(out / "report.json").checks] == [c.name for c in full]
    assert sorted(p.name for p in out.iterdir()) == EXPECTED_FILES


def test_renderer_failure_leaves_previous_files_untouched(tmp_path, monkeypatch):
    write_reports(passing_report(), tmp_path)
    before = _snapshot(tmp_path)

    def broken(report):
        raise RuntimeError("renderer bug")

    monkeypatch.setattr("flamia_verify.reports.store.render_html", broken)
    with pytest.raises(RuntimeError, match="renderer bug"):
        write_reports(example_report(), tmp_path)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_failed_replacement_keeps_old_file_and_removes_temp(tmp_path, monkeypatch, failing):
    target = tmp_path / "report.json"
    atomic_write_text(target, "old complete content\n")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_text(target, "new content that never lands\n")
    monkeypatch.undo()
    assert target.read_text() == "old complete content\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"], "a temporary file was left behind"


def test_interrupt_mid_write_leaves_no_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "report.html"
    atomic_write_text(target, "<p>old</p>")
    real_write = os.fdopen

    class Interrupting:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            raise KeyboardInterrupt

        def __getattr__(self, name):
            return getattr(self.handle, name)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Interrupting(real_write(fd, mode)))
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(target, "<p>" + "new " * 1000 + "</p>")
    monkeypatch.undo()
    assert target.read_text() == "<p>old</p>"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_written_files_get_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "junit.xml", "<x/>")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_report_json_is_what_write_reports_writes(tmp_path):
    report = example_report()
    assert write_reports(report, tmp_path)["json"].read_text() == report_json(report)


def test_check_results_built_in_code_validate_like_loaded_ones():
    with pytest.raises(ValueError, match="status must be one of"):
        CheckResult("error.x", "error", "passed")
