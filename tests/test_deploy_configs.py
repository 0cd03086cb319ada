"""Every config in deploy/ loads and validates; the ray up YAML starts the
router with a config that exists; the generated gRPC code is what
`make proto` produces."""

from pathlib import Path

import pytest
import yaml

from pdserve.cluster.cli import build_parser
from pdserve.cluster.config import load_config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
CONFIGS = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "ray-cluster.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_deploy_config_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.cluster.fused or (cfg.cluster.prefill and cfg.cluster.decode)


def test_the_ray_up_yaml_starts_pdserve_on_the_head_with_gpu_engines():
    spec = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type",
                "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in spec, key
    workers = spec["available_node_types"]["gpu_worker"]["resources"]
    assert workers["GPU"] >= 1
    cmd = next(c for c in spec["head_start_ray_commands"] if "pdserve up" in c).split()
    args = build_parser().parse_args(cmd[cmd.index("pdserve") + 1:cmd.index(">")])
    assert args.address == "auto" and args.device == "cuda" and args.gpus_per_engine == 1
    cfg = load_config(DEPLOY / Path(args.config).name)
    assert cfg.cluster.prefill >= 1 and cfg.cluster.decode >= 1


def test_generated_grpc_code_is_reproducible(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1] / "proto"
    # in its own process: protoc's bundled libraries must not share one with NIXL's
    out = subprocess.run([sys.executable, str(root / "generate.py"), str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 4
    for path in map(Path, out):
        assert path.read_text() == (root / path.name).read_text(), \
            f"{path.name} differs from a fresh `make proto`"
