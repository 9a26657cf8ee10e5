"""Project-level promises: the README's commands, a side-effect-free import, runnable docstrings."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sbloader

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_ci_runs_exactly_the_readme_test_command():
    commands = readme_commands()
    test_cmd = [c for c in commands if "pytest" in c]
    assert len(test_cmd) == 1, commands
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == test_cmd[0]
    assert any("examples/" in c or "benchmarks/" in c for c in commands)


def test_import_has_no_global_side_effects():
    code = (
        "import sys, torch; torch.set_num_threads(2); import sbloader; "
        "assert 'ffcv' not in sys.modules and 'torchvision' not in sys.modules, 'heavy import'; "
        "assert torch.get_num_threads() == 2, 'threads changed'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_public_api_is_complete():
    for name in sbloader.__all__:
        assert hasattr(sbloader, name), name


@pytest.mark.parametrize(
    "module", sorted(m.name for m in pkgutil.iter_modules(sbloader.__path__, "sbloader."))
)
def test_docstring_examples_run(module):
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


@pytest.mark.realdata
def test_fashion_mnist_from_debian_files():
    from sbloader.datasets import FASHION_MNIST_DIR, load_fashion_mnist

    if not FASHION_MNIST_DIR.exists():
        pytest.skip("dataset-fashion-mnist is not installed (scripts/setup.sh installs it)")
    x, y = load_fashion_mnist("train")
    assert x.shape == (60000, 28, 28) and x.dtype == np.uint8
    assert y.shape == (60000,) and set(np.unique(y).tolist()) == set(range(10))
    xt, yt = load_fashion_mnist("test")
    assert xt.shape == (10000, 28, 28) and np.bincount(yt).tolist() == [1000] * 10


def test_missing_fashion_mnist_names_the_fix(tmp_path):
    from sbloader.datasets import load_fashion_mnist

    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("train", root=tmp_path)
