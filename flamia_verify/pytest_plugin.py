"""The pytest plugin (entry point ``pytest11``, active wherever flamia-verify is installed): check a
kernel from a test and fail the test with the report's one-line reasons.

    import pytest

    @pytest.mark.flamia(suite="standard", recipe="mxfp8")
    def test_my_kernel_is_causal_and_isolated(flamia_check):
        report = flamia_check("my_attn.py:attn", only=["causal", "isolation"])
        assert report.check("causal.forward").metrics["leaked_elements"] == 0   # optional: more asserts

- ``flamia_check(kernel, **kwargs)`` takes the keyword arguments of :func:`flamia_verify.check`;
  ``@pytest.mark.flamia(...)`` on the test, its class or module sets their defaults (the closest one
  wins), keyword arguments of the call win over both.
- ``--flamia-device auto|cpu|cuda|cuda:N`` (default auto) is the device unless the test names one. A
  test asking for CUDA where none is present is skipped, with the reason. Under pytest-xdist, ``cuda``
  gives worker ``gwK`` the GPU K mod (number of GPUs): one GPU per worker with ``-n <GPUs>``.
- Every check's status, verdict and key metric go into the JUnit XML (``--junitxml``) as properties
  (``flamia.<check>.status``, ``flamia.<check>.verdict``, ``flamia.<check>.<metric>``), with the
  report's kernel, recipe and suite: on the test case under ``junit_family`` xunit1 or legacy; on the
  test suite, each name prefixed with the test's node id (``tests/test_k.py::test_a::flamia.kernel``),
  under xunit2 (pytest's default), whose schema has no test-case properties. No warning either way.
- ``--flamia-out DIR`` also writes each test's reports to ``DIR/<test id>/``.

Nothing heavy is imported until a test uses the fixture: pytest starts as fast as without the plugin.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

__all__ = ["flamia_check", "worker_device"]


def pytest_addoption(parser) -> None:
    group = parser.getgroup("flamia-verify")
    group.addoption(
        "--flamia-device",
        default=None,
        metavar="DEVICE",
        help="device of the flamia_check fixture: auto (default), cpu, cuda or cuda:N; under pytest-xdist "
        "cuda gives worker gwK the GPU K mod count",
    )
    group.addoption(
        "--flamia-out", default=None, metavar="DIR", help="write each flamia_check run's reports to DIR/<test>/"
    )


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "flamia(**kwargs): defaults of the flamia_check fixture (suite, recipe, only, device, dtype, seed, "
        "thresholds, forward_only), the closest marker winning",
    )


def worker_device(device: str, worker_id: str | None, gpu_count: int) -> str:
    """The device a test runs on: ``cuda`` under pytest-xdist worker ``gwK`` is ``cuda:K mod gpu_count``
    (one GPU per worker); any other device, or no worker, is left as it is."""
    if device != "cuda" or not worker_id or gpu_count < 1:
        return device
    match = re.fullmatch(r"gw(\d+)", worker_id)
    return f"cuda:{int(match.group(1)) % gpu_count}" if match else device


def _reasons(report) -> str:
    lines = []
    for c in report.gating_checks:
        if c.status in ("fail", "error"):
            lines.append(f"  {c.name}: {c.status}: {' '.join(str(c.message).split())}")
    if not report.complete:
        lines.append(f"  incomplete: {report.incomplete_reason}")
    return "\n".join(lines)


def _property_recorder(request):
    """How a property reaches the JUnit XML without a schema warning (see the module docstring)."""
    junit = request.config.getoption("xmlpath", None)
    if junit and request.config.getini("junit_family") == "xunit2":
        suite_property = request.getfixturevalue("record_testsuite_property")
        return lambda name, value: suite_property(f"{request.node.nodeid}::{name}", value)
    return lambda name, value: request.node.user_properties.append((name, value))


@pytest.fixture
def flamia_check(request):
    """Run flamia-verify on a kernel; the test fails with the failing checks' reasons (see module doc)."""
    record_property = _property_recorder(request)

    def run(kernel: Any = "flamia-mxfp8", **kwargs: Any):
        import torch

        from flamia_verify.api import check

        options: dict[str, Any] = {}
        for marker in reversed(list(request.node.iter_markers("flamia"))):  # farthest first, closest last
            options.update(marker.kwargs)
        options.update(kwargs)
        device = options.pop("device", None) or request.config.getoption("flamia_device") or "auto"
        worker = getattr(request.config, "workerinput", {}).get("workerid")
        device = worker_device(str(device), worker, torch.cuda.device_count())
        if device.startswith("cuda") and not torch.cuda.is_available():
            pytest.skip(f"flamia_check: device {device} was asked for but no CUDA device is present")
        out_root = request.config.getoption("flamia_out")
        if out_root and "out" not in options:
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid).strip("_")
            options["out"] = Path(out_root) / safe
        report = check(kernel, device=device, **options)
        from flamia_verify.reports.metrics import key_metric

        record_property("flamia.kernel", report.kernel)
        record_property("flamia.recipe", report.recipe)
        record_property("flamia.suite", report.suite)
        for c in report.checks:
            record_property(f"flamia.{c.name}.status", c.status)
            record_property(f"flamia.{c.name}.verdict", c.verdict)
            metric = key_metric(c)
            if metric is not None and metric.metric is not None:
                record_property(f"flamia.{c.name}.{metric.metric}", metric.value)
        if not report.passed:
            failed = [c.name for c in report.gating_checks if c.status in ("fail", "error")]
            pytest.fail(
                f"flamia-verify: {report.kernel} ({report.recipe}, {report.suite}) did not pass: "
                f"{len(failed)} check(s) failed or errored\n{_reasons(report)}",
                pytrace=False,
            )
        return report

    return run
