"""The package as users install it: a wheel, not the checkout.

The wheel is built non-editably from a copy of the checkout's sources and
installed with --no-deps into a fresh virtual environment. The project's
dependencies come from the environment running this test through a `.pth`
line naming its site-packages: a directory added that way does not have its
own `.pth` files processed, so the editable install's finder (which would
put the checkout's `src/` first) stays out. Everything then runs with the
working directory outside the checkout and without PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC_PKG = REPO / "src" / "pdserve"


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{' '.join(map(str, cmd))} exited {done.returncode}\n"
                                  f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}")
    return done.stdout


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, pdserve script, installed package folder, a cwd outside the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    env = _clean_env()
    # --no-build-isolation builds with this environment's setuptools (the test
    # extra pins it): no index is needed, and what CI installed is what builds
    import setuptools
    assert int(setuptools.__version__.split(".")[0]) >= 77, \
        f"setuptools {setuptools.__version__} cannot build pdserve; pip install -e '.[test]'"

    # build from a copy, so no build/ or egg-info lands in the checkout and
    # nothing stale from an earlier in-tree build reaches the wheel
    tree = root / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, tree / name)
    shutil.copytree(REPO / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist), str(tree)], cwd=root, env=env)
    wheels = list(dist.glob("pdserve-*.whl"))
    assert len(wheels) == 1, wheels

    target = root / "venv"
    venv.EnvBuilder(with_pip=False).create(target)
    py = target / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
          "--no-index", "-q", str(wheels[0])], cwd=root, env=env)

    # the dependencies: this environment's site-packages, one .pth line each
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=root, env=env).strip())
    ours = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "zz_pdserve_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))

    where = json.loads(_run([str(py), "-c", textwrap.dedent("""
        import json, pdserve, yaml
        from pathlib import Path
        print(json.dumps([str(Path(pdserve.__file__).parent), yaml.__file__]))
        """)], cwd=root, env=env))
    pkg = Path(where[0])
    assert pkg.is_relative_to(target), f"pdserve imported from {pkg}, not the wheel's install"
    assert not Path(where[1]).is_relative_to(target)      # the deps do come from outside
    cwd = root / "elsewhere"
    cwd.mkdir()
    return py, target / "bin" / "pdserve", pkg, cwd, env


def test_every_module_imports(installed):
    py, _, pkg, cwd, env = installed
    out = _run([str(py), "-c", textwrap.dedent("""
        import importlib, pkgutil, pdserve
        names = ["pdserve"]
        for m in pkgutil.walk_packages(pdserve.__path__, "pdserve."):
            importlib.import_module(m.name)
            names.append(m.name)
        print("\\n".join(names))
        """)], cwd=cwd, env=env)
    imported = set(out.split())
    expected = {"pdserve." + ".".join(p.relative_to(SRC_PKG).with_suffix("").parts)
                for p in SRC_PKG.rglob("*.py")}
    expected = {m.removesuffix(".__init__") for m in expected} | {"pdserve"}
    assert expected <= imported, f"not in the wheel: {sorted(expected - imported)}"


def test_shipped_files_are_installed(installed):
    _, _, pkg, _, _ = installed
    deploy = SRC_PKG / "deploy"
    shipped = {str(p.relative_to(SRC_PKG)) for p in deploy.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    shipped |= {str(p.relative_to(SRC_PKG)) for p in (SRC_PKG / "proto").glob("*.proto")}
    # the kinds the issue found missing, named so an empty glob cannot pass
    for must in ("deploy/prometheus.yml", "deploy/grafana-dashboard.json",
                 "deploy/demo-trace.jsonl", "deploy/sim-demo.yaml",
                 "proto/router.proto", "proto/control.proto"):
        assert must in shipped
    assert any(s.startswith("deploy/profiles/") and s.endswith(".yaml") for s in shipped)
    missing = sorted(s for s in shipped if not (pkg / s).is_file())
    assert not missing, f"in the checkout but not the installed package: {missing}"
    for s in shipped:
        assert (pkg / s).read_bytes() == (SRC_PKG / s).read_bytes(), s
    assert (pkg / "py.typed").is_file()


def test_help(installed):
    _, pdserve, _, cwd, env = installed
    out = _run([str(pdserve), "--help"], cwd=cwd, env=env)
    for cmd in ("sim", "bench"):
        assert cmd in out


def test_sim_on_a_shipped_config(installed):
    _, pdserve, pkg, cwd, env = installed
    assert not (cwd / "deploy").exists()      # the config name resolves to the shipped file
    out = _run([str(pdserve), "sim", "--config", "deploy/sim-demo.yaml",
                "--trace", str(pkg / "deploy" / "demo-trace.jsonl"), "--out", "out.json",
                "--no-progress"], cwd=cwd, env=env)
    assert "pdserve sim:" in out
    result = json.loads((cwd / "out.json").read_text())
    assert result


def test_bench_planner(installed):
    _, pdserve, _, cwd, env = installed
    out = _run([str(pdserve), "bench", "planner", "--sizes", "8", "--rounds", "3"], cwd=cwd, env=env)
    assert "planner decode round" in out
