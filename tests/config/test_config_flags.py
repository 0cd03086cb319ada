"""The command line over a config file (config/flags.py): a flag given
replaces the file's setting, one not given leaves it; the engine counts
given name every engine; the mapping `pdserve up` prints is, saved
anywhere, the config it ran. Pure: no model is loaded, no process started."""

from __future__ import annotations

import pytest
import yaml

from pdserve.cli.main import build_parser
from pdserve.benchmarks.common.options import flags_from
from pdserve.config import (
    UP_CONFIG, ConfigError, Flags, ServeConfig, load_config, load_with_flags, model_source,
    with_flags)

FILE = {"model": {"preset": "smollm2-135m", "name": "smol", "dtype": "bfloat16"},
        "engine": {"page_size": 16, "total_pages": 1024},
        "cluster": {"prefill": 1, "decode": 1}}


def test_flags_not_given_leave_the_file_as_it_is():
    assert with_flags(FILE, Flags()) == FILE


def test_a_model_flag_replaces_the_files_model_and_the_name_it_was_served_by():
    out = with_flags(FILE, Flags(model_path="/ckpt/llama"))
    assert out["model"] == {"dtype": "bfloat16", "path": "/ckpt/llama"}
    assert ServeConfig.from_dict(out).model.served_name == "llama"
    named = with_flags(FILE, Flags(model_preset="tiny", served_model_name="t", dtype="float32"))
    assert named["model"] == {"dtype": "float32", "preset": "tiny", "name": "t"}
    assert FILE["model"]["preset"] == "smollm2-135m"      # the file's mapping is not changed


def test_the_limits_and_the_tensor_parallel_size_set_their_engine_keys():
    cfg = ServeConfig.from_dict(with_flags(FILE, Flags(
        tensor_parallel_size=2, max_model_len=4096, max_num_seqs=8,
        max_num_batched_tokens=64)))
    e = cfg.engine
    assert (e.tensor_parallel_size, e.max_context_tokens, e.max_batch_size,
            e.max_scheduled_tokens, e.total_pages) == (2, 4096, 8, 64, 1024)
    # the model's context no longer bounds it by default: the flag set it
    assert "max_context_tokens" in cfg.engine_overrides


def test_the_counts_given_name_every_engine_as_a_cluster_mapping_does():
    fused = ServeConfig.from_dict(with_flags(FILE, Flags(fused=2))).cluster
    assert (fused.prefill, fused.decode, fused.fused) == (0, 0, 2)
    with pytest.raises(ConfigError, match="prefill=2, decode=0, fused=0: nothing could serve"):
        ServeConfig.from_dict(with_flags(FILE, Flags(prefill=2)))


def test_a_roles_own_size_stays_with_its_new_count_and_tp_replaces_every_size():
    file = {"cluster": {"fused": {"count": 1, "tensor_parallel_size": 2}}}
    kept = ServeConfig.from_dict(with_flags(file, Flags(fused=3))).cluster
    assert (kept.fused, kept.tp_size("fused")) == (3, 2)
    tp = ServeConfig.from_dict(with_flags(file, Flags(tensor_parallel_size=4)))
    assert (tp.cluster.fused, tp.cluster.tp_size("fused", tp.engine.tensor_parallel_size)) == (1, 4)


def test_insecure_control_plane_drops_the_files_certificates():
    file = {"control_plane": {"ca_cert": "/ca.pem", "ca_key": "/ca.key",
                              "server_name": "x"}}
    out = with_flags(file, Flags(insecure_control_plane=True))
    assert out["control_plane"] == {"server_name": "x", "insecure": True}


def test_flags_over_a_file_are_the_config_of_the_equivalent_file(tmp_path):
    """`pdserve up --config up.yaml --model M --prefill 1 --decode 1 -tp 1`
    runs what a file saying so runs."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    equivalent = tmp_path / "equivalent.yaml"
    equivalent.write_text(yaml.safe_dump({
        **FILE, "model": {"path": str(ckpt), "dtype": "bfloat16"},
        "engine": {**FILE["engine"], "tensor_parallel_size": 1}}))
    base = tmp_path / "up.yaml"
    base.write_text(yaml.safe_dump(FILE))
    cfg, _ = load_with_flags(base, Flags(model_path=str(ckpt), prefill=1, decode=1,
                                         tensor_parallel_size=1))
    assert cfg == load_config(equivalent)


def test_the_printed_mapping_saved_elsewhere_is_the_config_that_ran(tmp_path):
    """Paths the file reads beside itself come out absolute."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "c.yaml").write_text(yaml.safe_dump(
        {"lora": {"adapters": {"a": "adapters/a", "b": {"path": "b", "pinned": True}},
                  "max_loras": 2},
         "simulate": {"profile": "profile.yaml"}, "cluster": {"fused": 1}}))
    cfg, merged = load_with_flags(here / "c.yaml", Flags(max_num_seqs=4))
    elsewhere = tmp_path / "elsewhere" / "saved.yaml"
    elsewhere.parent.mkdir()
    elsewhere.write_text(yaml.safe_dump(merged))
    again = load_config(elsewhere)
    assert again == cfg
    assert dict(again.lora.adapters)["a"] == str(here / "adapters" / "a")
    assert again.simulate.profile == str(here / "profile.yaml")


def test_the_defaults_with_flags_say_where_a_bad_flag_went():
    with pytest.raises(ConfigError, match="the default config with the command line's flags: "
                                          "cluster has prefill=0, decode=1"):
        load_with_flags(None, Flags(decode=1))


def test_a_model_names_a_preset_only_where_no_such_path_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_source("tiny", ["tiny"]) == {"model_preset": "tiny"}
    assert model_source("mine", ["tiny"]) == {"model_path": str(tmp_path / "mine")}
    (tmp_path / "tiny").mkdir()                 # a folder of that name is the model
    assert model_source("tiny", ["tiny"]) == {"model_path": str(tmp_path / "tiny")}


def test_up_takes_vllm_and_sglang_spellings_and_keeps_its_config_flag(tmp_path):
    ckpt = tmp_path / "m"
    ckpt.mkdir()
    ap = build_parser()
    vllm = ap.parse_args(["up", str(ckpt), "--tensor-parallel-size", "2", "--max-model-len",
                          "512", "--max-num-seqs", "4", "--prefill", "1", "--decode", "1"])
    sglang = ap.parse_args(["up", "--model-path", str(ckpt), "--tp", "2", "--context-length",
                            "512", "--max-running-requests", "4", "--prefill", "1",
                            "--decode", "1"])
    short = ap.parse_args(["up", "--model", str(ckpt), "-tp", "2", "--max-model-len", "512",
                           "--max-num-seqs", "4", "--prefill", "1", "--decode", "1"])
    want = Flags(model_path=str(ckpt), tensor_parallel_size=2, max_model_len=512,
                 max_num_seqs=4, prefill=1, decode=1)
    assert flags_from(vllm) == flags_from(sglang) == flags_from(short) == want
    # the DESIGN contract: up --config FILE --port P --http-port H --api-key K, as before
    plain = ap.parse_args(["up", "--config", "x.yaml", "--port", "1", "--http-port", "2",
                           "--api-key", "k"])
    assert (plain.config, plain.port, plain.http_port, plain.api_key) == ("x.yaml", 1, 2, "k")
    assert flags_from(plain) == Flags()
    assert ap.parse_args(["up"]).config == UP_CONFIG


def test_two_different_models_are_refused():
    args = build_parser().parse_args(["up", "/a", "--model", "/b"])
    with pytest.raises(ValueError, match="two models: MODEL '/a' and --model '/b'; give one"):
        flags_from(args)
