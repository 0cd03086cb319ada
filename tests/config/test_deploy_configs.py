"""Every config in deploy/ loads and validates; the ray up YAML starts the
router with a config that exists; the generated gRPC code is what
`make proto` produces."""

import re
from pathlib import Path

import pytest
import yaml

from pdserve.cli.main import build_parser
from pdserve.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "src" / "pdserve" / "deploy"
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
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands")
              for c in spec[key] if "ray start" in c]
    assert len(starts) == 2 and all(c.startswith("RAY_worker_niceness=0 ") for c in starts)
    cmd = next(c for c in spec["head_start_ray_commands"] if "pdserve up" in c).split()
    args = build_parser().parse_args(cmd[cmd.index("pdserve") + 1:cmd.index(">")])
    assert args.address == "auto" and args.device == "cuda" and args.gpus_per_engine == 1
    cfg = load_config(DEPLOY / Path(args.config).name)
    assert cfg.cluster.prefill >= 1 and cfg.cluster.decode >= 1


_STAMPS = [  # where the compiler writes its own version: a newer grpcio-tools changes only these
    (re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.M), "grpcio"),
    (re.compile(r"^# Protobuf Python Version: ([0-9.]+)$", re.M), "protobuf"),
    (re.compile(r"Domain\.PUBLIC,\n\s*(\d+),\n\s*(\d+),\n\s*(\d+),", re.M), "protobuf"),
]


def _unstamped(text: str) -> str:
    for pattern, _ in _STAMPS:
        text = pattern.sub("<version>", text)
    return text


def test_generated_grpc_code_is_reproducible(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    root = repo / "src" / "pdserve" / "proto"
    # in its own process: protoc's bundled libraries must not share one with NIXL's
    out = subprocess.run([sys.executable, str(repo / "tools" / "generate_proto.py"),
                          str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 4
    for path in map(Path, out):
        assert _unstamped(path.read_text()) == _unstamped((root / path.name).read_text()), \
            f"{path.name} differs from a fresh `make proto`"


def test_dependency_floors_are_the_versions_the_checked_in_grpc_code_needs():
    """The generated modules refuse a grpcio or protobuf runtime older than the
    compiler that wrote them, so pyproject's floors must be those versions."""
    repo = Path(__file__).resolve().parents[2]
    deps = (repo / "pyproject.toml").read_text()
    found = set()
    for path in sorted((repo / "src" / "pdserve" / "proto").glob("*_pb2*.py")):
        text = path.read_text()
        for pattern, package in _STAMPS:
            for match in pattern.finditer(text):
                version = ".".join(match.groups())
                found.add(pattern.pattern)
                assert f'"{package}>={version}"' in deps, \
                    f"{path.name} needs {package}>={version}; pyproject.toml says otherwise"
    assert found == {pattern.pattern for pattern, _ in _STAMPS}, "a stamp's format changed"


def test_a_given_cluster_mapping_names_every_engine_and_no_section_means_1p1d():
    from pdserve.config import ServeConfig

    assert ServeConfig.from_dict({"cluster": {"fused": 2}}).cluster.__dict__ == \
        {"prefill": 0, "decode": 0, "fused": 2, "tensor_parallel": ()}
    assert ServeConfig.from_dict({}).cluster.__dict__ == \
        {"prefill": 1, "decode": 1, "fused": 0, "tensor_parallel": ()}
    with pytest.raises(Exception, match="nothing could serve"):
        ServeConfig.from_dict({"cluster": {"prefill": 1}})


def test_local_configs_serve_the_real_default_model():
    for name in ("local-pd.yaml", "local-fused.yaml", "local-cpu-fused.yaml"):
        cfg = load_config(DEPLOY / name)
        assert cfg.model.preset == "smollm2-135m" and cfg.model.served_name == "smollm2-135m"


def test_the_grafana_dashboard_plots_only_series_the_router_exports():
    import json
    import re

    from pdserve.router.metrics import _COUNTERS, _GAUGES, RouterMetrics

    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"]
            for m in re.findall(r"pdserve:[a-z_]+", t["expr"])}
    names = {f"pdserve:{n}" for n, _, _ in _GAUGES} | {"pdserve:kv_cache_usage_perc"}
    names |= {f"pdserve:{n}_total" for n, _, _ in _COUNTERS}
    names |= {"pdserve:kv_transfer_failures_total", "pdserve:kv_transfer_seconds_bucket"}
    for metric in RouterMetrics().registry.collect():
        names.add(metric.name + {"counter": "_total", "histogram": "_bucket"}.get(metric.type, ""))
    assert used and used <= names, used - names
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["metrics_path"] == "/metrics"


def test_the_gpu_cluster_runs_its_engines_on_cuda_a_gpu_each_in_bfloat16():
    from pdserve.config import engine_gpus

    m = load_config(DEPLOY / "gpu-cluster.yaml").model
    assert m.device == "cuda" and m.device_for(None) == "cuda" and m.dtype == "bfloat16"
    assert engine_gpus(m.device_for(None), None) == 1


def test_model_device_auto_means_cpu_and_the_command_line_wins():
    from pdserve.config import ServeConfig
    from pdserve.scheduler.config import ConfigError

    assert ServeConfig.from_dict({}).model.device_for(None) == "cpu"
    cuda = ServeConfig.from_dict({"model": {"preset": "tiny", "device": "cuda"}}).model
    assert cuda.device_for(None) == "cuda" and cuda.device_for("cpu") == "cpu"
    with pytest.raises(ConfigError, match="model.device is 'gpu'; use one of auto, cpu, cuda"):
        ServeConfig.from_dict({"model": {"device": "gpu"}})


@pytest.mark.parametrize("device,flag,want", [
    ("cuda", None, 1), ("cuda", "0.5", 0.5), ("cpu", None, 0), ("auto", None, 0)])
def test_up_gives_each_cuda_engine_its_own_gpu(tmp_path, monkeypatch, device, flag, want):
    import pdserve.cluster.deploy as deploy
    from pdserve.cli.main import main

    seen = {}

    class Stop(Exception):
        pass

    def fake(cfg, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(deploy, "Deployment", fake)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{preset: tiny, device: {device}}}\ncluster: {{fused: 1}}\n")
    with pytest.raises(Stop):
        # --port 0: not checked, whatever else on the host holds the default 50051
        main(["up", "--config", str(cfg), "--port", "0"] +
             (["--gpus-per-engine", flag] if flag else []))
    assert seen["device"] == ("cpu" if device == "auto" else device)
    assert seen["gpus_per_engine"] == want


def test_up_on_cuda_refuses_zero_gpus_per_engine_before_starting_anything(tmp_path, capsys):
    from pdserve.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {preset: tiny}\ncluster: {fused: 2}\n")
    assert main(["up", "--config", str(cfg), "--device", "cuda", "--gpus-per-engine", "0"]) == 2
    assert "--gpus-per-engine 0 with device cuda would put every engine on the same GPU " \
           "(cuda:0)" in capsys.readouterr().err


def test_up_refuses_an_unknown_preset_before_starting_ray(tmp_path, capsys, monkeypatch):
    from pdserve.cluster import deploy
    from pdserve.cli.main import main

    monkeypatch.setattr(deploy, "Deployment", None)      # never reached
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {preset: smollm-135m}\ncluster: {fused: 1}\n")
    assert main(["up", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "unknown model preset 'smollm-135m'; use preset: tiny or smollm2-135m" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_llm_and_offline_generate_read_model_device(tmp_path, capsys):
    from pdserve import LLM
    from pdserve.cli.main import main
    from pdserve.kernels.models.model_config import ModelError

    conf = {"model": {"preset": "tiny", "device": "cuda"}}
    with pytest.raises(ModelError, match="device 'cuda': no CUDA GPU is usable here"):
        LLM(conf)
    assert LLM(conf, device="cpu").model.device.type == "cpu"
    cfg = tmp_path / "cuda.yaml"
    cfg.write_text("model: {preset: tiny, device: cuda}\n")
    assert main(["generate", "--config", str(cfg), "--max-tokens", "2", "hi"]) == 2
    assert "device 'cuda': no CUDA GPU is usable here" in capsys.readouterr().err
    assert main(["generate", "--config", str(cfg), "--device", "cpu", "--max-tokens", "2",
                 "hi"]) == 0


@pytest.mark.parametrize("what", ["llm", "transfer"])
def test_a_cuda_benchmark_on_a_machine_without_one_is_a_one_line_error(what, capsys):
    import torch

    from pdserve.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", what, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pdserve: error: device 'cuda': no CUDA GPU" in err


def test_a_context_beyond_the_models_is_refused_at_load_not_in_every_round():
    from pdserve import LLM
    from pdserve.scheduler.config import ConfigError

    with pytest.raises(ConfigError, match="exceeds the model's context of 4,096 tokens"):
        LLM({"engine": {"max_context_tokens": 5000}})
    assert LLM({"engine": {"max_context_tokens": 1000}}).engine_config.max_context_tokens == 1000


def test_up_refuses_a_model_path_or_a_port_it_cannot_use_before_starting_ray(
        tmp_path, capsys, monkeypatch):
    import socket

    from pdserve.cluster import deploy
    from pdserve.cli.main import main

    monkeypatch.setattr(deploy, "Deployment", None)      # never reached
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tmp_path / 'nothing'}}}\ncluster: {{fused: 1}}\n")
    assert main(["up", "--config", str(cfg)]) == 2
    assert "does not exist; set model.path" in capsys.readouterr().err
    cfg.write_text("model: {preset: tiny}\ncluster: {fused: 1}\n")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for flag in ("--port", "--http-port"):
            other = [] if flag == "--port" else ["--port", "0"]   # 50051 may be anyone's
            assert main(["up", "--config", str(cfg), flag, str(port)] + other) == 2
            assert f"port {port} ({flag}) on 127.0.0.1 is in use" in capsys.readouterr().err


def test_up_says_when_a_config_names_no_model(tmp_path, capsys, monkeypatch):
    from pdserve.cluster import deploy
    from pdserve.cli.main import main

    class Stop(Exception):
        pass

    def fake(cfg, **kw):
        raise Stop
    monkeypatch.setattr(deploy, "Deployment", fake)
    cfg = tmp_path / "c.yaml"
    for text, warned in (("engine: {page_size: 16}\n", True),
                         ("model: {preset: tiny}\n", False)):
        cfg.write_text(text)
        with pytest.raises(Stop):
            main(["up", "--config", str(cfg), "--port", "0"])
        err = capsys.readouterr().err
        assert ("names no model: serving the tiny preset (random weights" in err) == warned


def test_engines_that_need_gpus_ray_lacks_are_refused_on_our_ray_and_said_on_a_joined_one(
        monkeypatch, caplog):
    import ray

    from pdserve.config import ServeConfig
    from pdserve.cluster.deploy import Deployment

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    cfg = ServeConfig.from_dict({"cluster": {"prefill": 1, "decode": 1}})
    ours = Deployment(cfg, device="cuda", gpus_per_engine=1)
    ours._started_ray = True
    monkeypatch.setattr(ours, "stop", lambda: None)
    with pytest.raises(ValueError, match="2 engines at 1 GPU each need 2 GPUs and Ray has 0 "
                                         "on this machine"):
        ours._check_gpus()
    joined = Deployment(cfg, address="ray://head:10001", device="cuda", gpus_per_engine=1)
    with caplog.at_level("WARNING"):
        joined._check_gpus()
    assert "the engines wait until Ray's autoscaler adds GPU nodes" in caplog.text
    Deployment(cfg, device="cpu", gpus_per_engine=0)._check_gpus()      # none needed


def test_a_ray_address_nothing_answers_at_is_an_error_at_once(capsys):
    import socket

    from pdserve.cli.main import main

    with socket.socket() as s:                  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = DEPLOY / "local-tiny.yaml"
    assert main(["up", "--config", str(cfg), "--port", "0",
                 "--address", f"127.0.0.1:{port}"]) == 2
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_missing_config_says_where_a_relative_path_was_read_and_which_configs_ship(
        tmp_path, monkeypatch):
    from pdserve.scheduler.config import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"does not exist \\(a relative path is read from "
                                          f"{tmp_path}\\).* ships: .*local-fused.yaml"):
        load_config("deploy/no-such.yaml")
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        load_config(tmp_path)


def test_a_shipped_config_loads_by_name_from_anywhere(tmp_path, monkeypatch):
    """`deploy/NAME.yaml` or `NAME.yaml` with no such file here is the config
    pdserve ships under that name, read from the installed package."""
    monkeypatch.chdir(tmp_path)
    shipped = load_config(DEPLOY / "local-fused.yaml")
    assert load_config("deploy/local-fused.yaml") == shipped == load_config("local-fused.yaml")
    (tmp_path / "local-fused.yaml").write_text("cluster: {fused: 3}\n")
    assert load_config("local-fused.yaml").cluster.fused == 3       # a file here comes first
