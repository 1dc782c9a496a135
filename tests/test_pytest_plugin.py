"""The pytest plugin (flamia_verify.pytest_plugin, entry point pytest11): the flamia_check fixture
fails a test with the failing checks' reasons, passes a correct kernel, takes its defaults from the
flamia marker, skips where the asked-for device is absent, and writes the metrics into JUnit."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
import torch

from flamia_verify.pytest_plugin import worker_device

pytest_plugins = ["pytester"]


def test_the_plugin_is_registered_as_a_pytest11_entry_point():
    from importlib.metadata import entry_points

    assert any(ep.value == "flamia_verify.pytest_plugin" for ep in entry_points(group="pytest11"))


@pytest.mark.parametrize(
    ("device", "worker", "count", "expected"),
    [
        ("cuda", "gw0", 2, "cuda:0"),
        ("cuda", "gw3", 2, "cuda:1"),
        ("cuda", None, 2, "cuda"),
        ("cpu", "gw1", 2, "cpu"),
        ("cuda:1", "gw0", 2, "cuda:1"),
        ("cuda", "gw1", 0, "cuda"),
    ],
)
def test_each_xdist_worker_gets_its_own_gpu(device, worker, count, expected):
    assert worker_device(device, worker, count) == expected


def test_a_buggy_kernel_fails_the_test_with_reasons_and_a_correct_one_passes(pytester):
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.flamia(suite="quick", only=["isolation.neighbours"])

        def test_correct(flamia_check):
            report = flamia_check("flamia-mxfp8")
            assert report.passed

        @pytest.mark.flamia(only=["interface.output"])
        def test_marker_closest_wins(flamia_check):
            report = flamia_check("bf16")
            assert [c.name for c in report.checks] == ["interface.output"]

        def test_naive(flamia_check):
            flamia_check("mxfp8-naive")

        def test_cuda(flamia_check):
            flamia_check("bf16", device="cuda")
        """
    )
    junit = pytester.path / "junit.xml"
    # -W error: the plugin adds no warning under pytest's default junit_family (xunit2)
    result = pytester.runpytest(
        "-p", "no:randomly", "-W", "error", "--flamia-device", "cpu", f"--junitxml={junit}", "-rs"
    )
    outcomes = result.parseoutcomes()
    cuda = torch.cuda.is_available()
    assert outcomes.get("passed") == (3 if cuda else 2) and outcomes.get("failed") == 1
    result.stdout.fnmatch_lines(
        ["*mxfp8-naive (mxfp8, quick) did not pass: 1 check(s) failed or errored*", "*isolation.neighbours: fail: *"]
    )
    if not cuda:
        assert outcomes.get("skipped") == 1
        result.stdout.fnmatch_lines(["*device cuda was asked for but no CUDA device is present*"])
    assert "PytestWarning" not in result.stdout.str()
    # xunit2: the properties are the suite's (its schema has none per test case), named by test
    root = ET.parse(junit).getroot()
    assert not [p for case in root.iter("testcase") for p in case.iter("property")]
    prefix = "test_a_buggy_kernel_fails_the_test_with_reasons_and_a_correct_one_passes.py::test_naive::"
    props = {
        p.get("name")[len(prefix) :]: p.get("value")
        for suite in root.iter("testsuite")
        for p in suite.iter("property")
        if p.get("name").startswith(prefix)
    }
    assert props["flamia.kernel"] == "mxfp8-naive" and props["flamia.isolation.neighbours.status"] == "fail"
    assert props["flamia.isolation.neighbours.verdict"] == "gating"
    assert any(k.startswith("flamia.isolation.neighbours.") and not k.endswith((".status", ".verdict")) for k in props)
    # xunit1: on the test case
    junit1 = pytester.path / "junit1.xml"
    pytester.runpytest(
        "-p",
        "no:randomly",
        "-W",
        "error",
        "-o",
        "junit_family=xunit1",
        "--flamia-device",
        "cpu",
        f"--junitxml={junit1}",
        "-k",
        "naive",
    )
    props1 = {
        p.get("name"): p.get("value")
        for case in ET.parse(junit1).getroot().iter("testcase")
        if case.get("name") == "test_naive"
        for p in case.iter("property")
    }
    assert props1["flamia.kernel"] == "mxfp8-naive" and props1["flamia.isolation.neighbours.status"] == "fail"
