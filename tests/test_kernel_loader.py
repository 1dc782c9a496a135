"""Loading ``path/to/file.py:function`` kernel specs: sibling modules import, and loading leaves no trace."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flamia_verify.errors import KernelLoadError
from flamia_verify.kernels import load_kernel

KERNEL = """
import {helper}

def attn(q, k, v, cu_q, cu_k, mq, mk, *, softmax_scale, causal):
    return {helper}.run(q, k, v, cu_q, cu_k, mq, mk, softmax_scale=softmax_scale, causal=causal)

TAG = {helper}.TAG
"""

HELPER = """
from flamia_verify.kernels import builtin_kernels
TAG = {tag!r}
_k = builtin_kernels()["bf16"]

def run(*args, **kwargs):
    return _k(*args, **kwargs)
"""


def _kernel_dir(root: Path, tag: str, helper: str = "attn_helper_sibling") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{helper}.py").write_text(HELPER.format(tag=tag))
    (root / "kernel.py").write_text(KERNEL.format(helper=helper))
    return root / "kernel.py"


def test_a_kernel_file_imports_a_module_next_to_it(tmp_path):
    path = _kernel_dir(tmp_path / "v1", "v1")
    kernel = load_kernel(f"{path}:attn")
    assert kernel.source == "file"
    assert sys.modules[kernel.fn.__module__].TAG == "v1"
    import torch

    q = torch.randn(8, 2, 32, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    assert kernel(q, q, q, cu, cu, 8, 8, softmax_scale=0.2, causal=True).shape == q.shape


def test_loading_restores_sys_path_and_forgets_the_siblings(tmp_path):
    path_before = list(sys.path)
    path = _kernel_dir(tmp_path / "v1", "v1")
    load_kernel(f"{path}:attn")
    assert sys.path == path_before
    assert "attn_helper_sibling" not in sys.modules


def test_two_kernel_files_with_same_named_siblings_each_get_their_own(tmp_path):
    """Comparing two versions of a kernel, each directory with its own helper.py."""
    one = load_kernel(f"{_kernel_dir(tmp_path / 'v1', 'v1')}:attn")
    two = load_kernel(f"{_kernel_dir(tmp_path / 'v2', 'v2')}:attn")
    assert sys.modules[one.fn.__module__].TAG == "v1"
    assert sys.modules[two.fn.__module__].TAG == "v2"


def test_a_failed_load_restores_sys_path_too(tmp_path):
    path_before = list(sys.path)
    bad = tmp_path / "bad.py"
    bad.write_text("import attn_helper_missing_here\n")
    with pytest.raises(KernelLoadError, match="attn_helper_missing_here"):
        load_kernel(f"{bad}:attn")
    assert sys.path == path_before


def test_a_relative_path_spec_loads_its_sibling(tmp_path, monkeypatch):
    _kernel_dir(tmp_path / "rel", "rel")
    monkeypatch.chdir(tmp_path)
    kernel = load_kernel("rel/kernel.py:attn")
    assert sys.modules[kernel.fn.__module__].TAG == "rel"


def test_modules_found_deeper_below_the_directory_stay_imported(tmp_path, monkeypatch):
    """A package installed under the kernel's directory (a virtual environment inside the project) is
    imported through its own sys.path entry and stays in sys.modules."""
    lib = tmp_path / "proj" / "venv" / "site"
    lib.mkdir(parents=True)
    (lib / "attn_deep_installed.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(lib))
    path = _kernel_dir(tmp_path / "proj", "proj")
    text = path.read_text()
    path.write_text("import attn_deep_installed\n" + text)
    try:
        load_kernel(f"{path}:attn")
        assert "attn_deep_installed" in sys.modules
        assert "attn_helper_sibling" not in sys.modules
    finally:
        sys.modules.pop("attn_deep_installed", None)


def test_a_sibling_package_and_its_submodules_leave_sys_modules(tmp_path):
    root = tmp_path / "pk"
    (root / "attn_sibling_pkg").mkdir(parents=True)
    (root / "attn_sibling_pkg" / "__init__.py").write_text("")
    (root / "attn_sibling_pkg" / "core.py").write_text("TAG = 'pkg'\n")
    (root / "kernel.py").write_text(
        "from attn_sibling_pkg import core\nTAG = core.TAG\ndef attn(*a, **k):\n    return None\n"
    )
    kernel = load_kernel(f"{root / 'kernel.py'}:attn")
    assert sys.modules[kernel.fn.__module__].TAG == "pkg"
    assert not [n for n in sys.modules if n.startswith("attn_sibling_pkg")]
