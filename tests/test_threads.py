"""torch's CPU threads of a run: one by default (check, fuzz, the API), --threads N otherwise, the count
recorded in the report, torch's own setting restored after the run."""

from __future__ import annotations

import pytest
import torch

from flamia_verify.api import check, fuzz
from flamia_verify.cli import main
from flamia_verify.errors import ConfigError
from flamia_verify.settings import DEFAULT_THREADS, torch_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_api_runs_with_the_default_count_records_it_and_restores_torchs(two_threads):
    report = check("bf16", only=["interface.output"])
    assert report.environment["torch_threads"] == DEFAULT_THREADS == 1
    assert torch.get_num_threads() == 2
    report = check("bf16", only=["interface.output"], threads=None)  # None: torch's own setting
    assert report.environment["torch_threads"] == 2
    fuzz("bf16", examples=1, threads=1)
    assert torch.get_num_threads() == 2


def test_the_cli_takes_threads_and_records_them(two_threads, tmp_path):
    import json

    assert (
        main(["check", "--kernel", "bf16", "--only", "interface.output", "--threads", "2", "--out", str(tmp_path)]) == 0
    )
    assert json.loads((tmp_path / "report.json").read_text())["environment"]["torch_threads"] == 2


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_a_thread_count_below_one_is_a_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--kernel", "bf16", "--threads", bad])
    assert exc.value.code == 2 and "--threads: must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0, True, 1.5])
def test_torch_threads_refuses_what_is_not_a_count(bad):
    with pytest.raises(ConfigError, match="threads must be a positive integer"), torch_threads(bad):
        pass
