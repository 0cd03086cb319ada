"""tools/gpu: the offline GPU host's wheelhouse and device-check script,
checked on CPU as far as CPU goes."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "gpu"


def test_the_device_check_dry_run_collects_the_device_tests_without_ray(tmp_path):
    """The script's --dry-run on CPU, with ray made unimportable as on the
    GPU host: the device tests collect, each benchmark asked for CUDA
    stops with its one-line error, and the sim step calibrates and replays
    a trace on the tiny engine in process."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(TOOLS / "run_device_checks.sh"), str(out), "--dry-run",
                          "--steps", "import,tests,bench-llm,bench-transfer,sim,capture-fi"],
                         env=env, capture_output=True, text=True, timeout=300)
    log = (out / "log.txt").read_text()
    assert run.returncode == 0, log[-3000:]
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [(name, rc) for name, rc, _ in steps] == [     # the script's order: most wanted first
        ("import", "0"), ("capture-fi", "0"), ("bench-transfer", "0"), ("sim", "0"),
        ("tests", "0"), ("bench-llm", "0")]
    assert "ray: ray is not installed on the GPU host" in log
    collected = [int(n) for n in re.findall(r"(\d+)/\d+ tests collected", log)]
    assert collected[0] == 2 and collected[1] >= 24, log[-3000:]   # capture-fi's, then tests
    for what in ("transfer", "capture"):
        assert (out / f"bench_{what}.txt").read_text().startswith(
            "pdserve: error: device 'cuda': no CUDA GPU is usable here")
    subprocess.run(["tar", "-xJf", str(out / "sim.tar.xz"), "-C", str(tmp_path)], check=True)
    runs = json.loads((tmp_path / "sim_accuracy.json").read_text())[0]["runs"]
    assert [r["level"] for r in runs] == ["c1", "0.5x", "0.9x", "1.1x"]
    assert all(r["ok"] == r["requests"] == r["sim"]["ok"] for r in runs)
    assert "round:" in (tmp_path / "profile.yaml").read_text()


def test_the_wheelhouse_pins_the_flashinfer_the_gpu_extra_pins():
    script = (TOOLS / "build_wheelhouse.sh").read_text()
    pinned = re.search(r'flashinfer-python==([\w.]+)', (ROOT / "pyproject.toml").read_text())
    assert pinned and f"FLASHINFER={pinned.group(1)}\n" in script
    assert "LIMIT_MIB=60" in script
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()
