"""Project-level promises: the README's commands, a side-effect-free import, runnable docstrings."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import import_streaming, run_python

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
    assert test_cmd[0] in ci  # then the linters and the type checker, after the tests
    after = ci[ci.index(test_cmd[0]) + 1 :]
    assert after == [
        "python3 -m ruff check .",
        "python3 -m ruff format --check .",
        "python3 -m mypy",
    ]
    assert any("examples/" in c or "benchmarks/" in c for c in commands)


def test_import_has_no_global_side_effects():
    code = (
        "import sys, random, numpy as np, torch; torch.set_num_threads(2); "
        "from torch.utils.data import dataloader as tdl; "
        "methods = (tdl.DataLoader.__iter__, tdl._BaseDataLoaderIter.__next__); "
        "states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()); "
        "import sbloader; "
        "assert 'ffcv' not in sys.modules and 'torchvision' not in sys.modules, 'heavy import'; "
        "assert torch.get_num_threads() == 2, 'threads changed'; "
        "assert random.getstate() == states[0], 'random reseeded'; "
        "assert (np.random.get_state()[1] == states[1]).all(), 'numpy reseeded'; "
        "assert torch.equal(torch.get_rng_state(), states[2]), 'torch reseeded'; "
        "assert (tdl.DataLoader.__iter__, tdl._BaseDataLoaderIter.__next__) == methods, 'patched'; "
        "print('ok')"
    )
    out = run_python(code, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_public_api_is_complete():
    for name in sbloader.__all__:
        assert hasattr(sbloader, name), name


def test_examples_import_only_public_names():
    """The README's Layout: "Public names are in each module's ``__all__``"; what the examples
    import from sbloader's modules, a user copies, so each such name is public."""
    import ast

    for path in sorted((ROOT / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sbloader.")
            ):
                continue
            # read from the source: modules over optional libraries need not import here
            module = ROOT / (node.module.replace(".", "/") + ".py")
            (public,) = (
                ast.literal_eval(n.value)
                for n in ast.parse(module.read_text()).body
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__"
            )
            for alias in node.names:
                assert alias.name in public, f"{path.name}: {node.module}.{alias.name}"


@pytest.mark.parametrize(
    "module",
    sorted(
        m.name
        for m in pkgutil.walk_packages(sbloader.__path__, "sbloader.")
        if not m.ispkg or m.name.count(".") == 1
    ),
)
def test_docstring_examples_run(module):
    """Every module's docstring examples, the integrations' included."""
    # Modules over optional libraries (installed by scripts/setup.sh) are skipped without them.
    if module == "sbloader.streaming":
        import_streaming()
    elif module == "sbloader.stateful":
        pytest.importorskip("torchdata")
    elif module.startswith("sbloader.integrations."):
        # lightning, accelerate (and accelerate_source: accelerate's too)
        pytest.importorskip(module.rsplit(".", 1)[1].split("_")[0])
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_pytest_doctest_modules_uses_the_flags_the_docstrings_are_written_for():
    """``python3 -m pytest --doctest-modules sbloader/selection.py`` failed six modules'
    examples: their expected errors are wrapped over several lines, which only
    NORMALIZE_WHITESPACE (the flag test_docstring_examples_run passes) accepts."""
    import configparser

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    flags = set(config["tool:pytest"]["doctest_optionflags"].split())
    assert {"ELLIPSIS", "NORMALIZE_WHITESPACE"} <= flags


@pytest.mark.realdata
def test_the_wheel_ships_every_module_and_the_typing_marker(tmp_path):
    """A user's type checker reads sbloader's hints only from an installed py.typed (PEP 561)."""
    # NOTE: built from a copy, so that no build/ folder left in the checkout answers for it.
    tree = tmp_path / "tree"
    shutil.copytree(
        ROOT / "sbloader", tree / "sbloader", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    build = ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(tree)]
    subprocess.run(
        [sys.executable, "-m", "pip", *build],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sbloader-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "sbloader/py.typed" in names
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "sbloader").rglob("*.py")}
    assert modules <= names, sorted(modules - names)


def test_the_type_checked_usage_file_runs():
    """tests/typed_usage.py is what CI's mypy checks as a user's loop; it must also be true."""
    import typed_usage

    assert typed_usage.main() > 0


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


def sbloader_imports(path: Path) -> set[str]:
    """The sbloader modules a module imports (relative imports, at any depth)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_each_module_imports_only_what_the_readme_layout_allows():
    """The README's Layout table is the module map: each row's modules may import only the
    modules its last column names."""
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout") :]
    allowed: dict[str, set[str]] = {}
    for row in re.findall(r"^\| (`[^|]+`) \| [^|]+ \| ([^|]+) \|$", layout, flags=re.M):
        names = re.findall(r"`([a-z0-9_]+)\.py`", row[0])
        deps = set(re.findall(r"`([a-z_]+)`", row[1]))
        for name in names:
            allowed[name] = deps
    allowed["_migrations"] = {"rows"}
    for name in ("_checks", "_state", "_random"):
        allowed[name] = set()
    modules = {p.stem for p in (ROOT / "sbloader").glob("*.py")} - {"__init__"}
    assert modules <= set(allowed), (
        f"modules missing from the README's Layout: {modules - set(allowed)}"
    )
    for name in sorted(modules):
        extra = sbloader_imports(ROOT / "sbloader" / f"{name}.py") - allowed[name]
        assert not extra, (
            f"sbloader/{name}.py imports {sorted(extra)}, which the Layout does not allow"
        )


def test_no_sbloader_modules_import_each_other_in_a_circle():
    """The modules stand in floors: none imports, even for annotations only, a module that
    imports it back through any chain (the epoch iterator declares what it needs of its loader,
    ``EpochHost``, rather than naming the loader's class)."""
    modules = {p.stem for p in (ROOT / "sbloader").glob("*.py")} - {"__init__"}
    edges = {name: sbloader_imports(ROOT / "sbloader" / f"{name}.py") & modules for name in modules}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(edges[name]):
            if state.get(dep) == 1:
                loop = [*path[path.index(dep) :], dep]
                raise AssertionError("sbloader modules import in a circle: " + " -> ".join(loop))
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])


def constructor_stated_defaults() -> dict[str, str]:
    """What SelectiveLoader's docstring states as each argument's default, where it states a
    literal: ``Default X.`` or ``(default X)`` (X a Python literal), or ``X`` ``(default`` in
    its Args entry."""
    import inspect

    doc = inspect.getdoc(sbloader.SelectiveLoader) or ""
    args = doc[doc.index("Args:") : doc.index("Attributes:")]
    entries = re.split(r"^    (\w+(?:, \w+)*): ", args, flags=re.M)[1:]
    stated: dict[str, str] = {}
    for names, text in zip(entries[::2], entries[1::2]):
        text = " ".join(text.split())
        literal = r"(None|True|False|-?\d+|\"[a-z]+\")"
        # (not a default the loader resolves, "Default 2 when the model has BatchNorm")
        found = re.findall(rf"\bDefault:? (?:``)?{literal}(?:``)?(?=[.,:;)])", text)
        found += re.findall(rf"\(default (?:``)?{literal}(?:``)?\)", text)
        found += re.findall(rf"``{literal}`` \(default\b", text)
        for name in names.split(", "):
            if found:
                stated[name] = found[0]
    return stated


def test_the_loader_docstring_states_the_signatures_defaults():
    """Every literal default the constructor's docstring states is the signature's (a default
    changed in one place and not the other fails here)."""
    import ast
    import inspect

    signature = inspect.signature(sbloader.SelectiveLoader.__init__).parameters
    stated = constructor_stated_defaults()
    # (the docstring states these literally; a new one is checked as it is written)
    assert {"remainder", "nonfinite", "autocast", "cdf", "decisions", "keep_logits"} <= set(stated)
    for name, text in stated.items():
        assert name in signature, f"the docstring documents {name}=, which __init__ lacks"
        assert signature[name].default == ast.literal_eval(text), (
            f"the docstring says {name} defaults to {text}, the signature to "
            f"{signature[name].default!r}"
        )
