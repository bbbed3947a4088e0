"""Flag validation: wrong values fail before anything starts, with messages that name the fix."""

import json
import subprocess
import sys

import pytest

from omnimesh.cli import _model_dir, build_parser
from omnimesh.config.serve_args import ServeArgs, from_namespace
from omnimesh.config.stage_config import StageConfig, parse_stage_overrides


def test_defaults_are_valid_and_single_rank() -> None:
    args = ServeArgs()
    cfgs = args.stage_configs()
    assert set(cfgs) == {"encoder", "thinker", "talker", "vocoder"}
    assert all(c.world_size == 1 for c in cfgs.values())
    assert all(c.max_waiting_requests == 256 for c in cfgs.values())  # bounded by default (README)
    assert args.unsupported() == []


@pytest.mark.parametrize("util", [0.0, -0.1, 1.01, 5])
def test_utilization_outside_0_1_is_rejected(util: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        ServeArgs(gpu_memory_utilization=util)


def test_stage_overrides_by_name_and_id() -> None:
    args = ServeArgs(stage_overrides='{"thinker": {"tp": 2, "devices": "0,1"}, "0": {"num_replicas": 2}}')
    cfgs = args.stage_configs()
    assert cfgs["thinker"].tp == 2 and cfgs["thinker"].device_list() == ["0", "1"]
    assert cfgs["encoder"].num_replicas == 2
    assert cfgs["talker"].tp == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"speaker": {"tp": 2}}', "unknown stage 'speaker'"),
        ('{"thinker": {"tpp": 2}}', "unknown key 'tpp'"),
        ('{"thinker": 3}', "must be an object"),
        ('{"thinker": {"tp": 0}}', "tp must be a whole number >= 1"),
        ('{"thinker": {"tp": 2, "devices": "0"}}', "names 1 devices but pp x tp"),
        ('{"thinker": {"pp": 2, "pp_layer_partition": [1, 2, 1]}}', "must list 2 positive layer counts"),
        ('{"talker": {"pp": 2, "pp_layer_partition": 3}}', r"pp_layer_partition must list whole layer counts.*got 3"),
        ('{"talker": {"pp": 2, "pp_layer_partition": "1,x"}}', "pp_layer_partition must list whole layer counts"),
        ('{"talker": {"pp": 2, "pp_layer_partition": [1, true]}}', "pp_layer_partition must list whole layer counts"),
        ('{"talker": {"pp": 2, "pp_layer_partition": [1.5, 1]}}', "pp_layer_partition must list whole layer counts"),
    ],
)
def test_bad_stage_overrides(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeArgs(stage_overrides=text)


def test_a_path_longer_than_a_file_name_is_refused_not_a_crash() -> None:
    """Paths are tested with os.path, which answers False where pathlib raises (ENAMETOOLONG)."""
    name = "n" * 300
    with pytest.raises(ValueError, match="--tokenizer"):
        ServeArgs(tokenizer=name)
    with pytest.raises(ValueError, match="--generation-config 'n+': no such folder"):
        ServeArgs(generation_config=name)
    with pytest.raises(ValueError, match="--uds"):
        ServeArgs(uds=f"{name}/s.sock")
    with pytest.raises(ValueError, match="is not a model folder"):
        _model_dir(name)


def test_the_gateways_ports_and_the_stages_differ() -> None:
    with pytest.raises(ValueError, match="--port and --grpc-port are both 9000: the REST and gRPC APIs need a port"):
        ServeArgs(port=9000, grpc_port=9000)
    assert ServeArgs(port=9000, grpc_port=9000, uds="/tmp/omni.sock").grpc_port == 9000  # REST is on the socket
    with pytest.raises(ValueError, match=r"--grpc-port 50053 is one of the stages' ports \(50051-50054: "
                                         r"--stage-base-port 50051, one per stage replica\)"):
        ServeArgs(grpc_port=50053).check_stage_ports()
    with pytest.raises(ValueError, match=r"--port 8000 is one of the stages' ports \(7999-8003"):
        ServeArgs(stage_base_port=7999, data_parallel_size=1,
                  stage_overrides='{"vocoder": {"num_replicas": 2}}').check_stage_ports()
    ServeArgs(grpc_port=50053, stage_base_port=0).check_stage_ports()  # stages on free ports: no clash
    ServeArgs(grpc_port=50055).check_stage_ports()
    ServeArgs(grpc_port=50053).check_stage_ports(("encoder", "thinker"))  # a thinker-only model's stages: 50051-50052
    with pytest.raises(ValueError, match=r"--grpc-port 50052 is one of the stages' ports \(50051-50052"):
        ServeArgs(grpc_port=50052).check_stage_ports(("encoder", "thinker"))
    assert ServeArgs(grpc_port=50052).grpc_port == 50052  # a gateway alone (its stages elsewhere) may take it


def test_bad_cpu_environment_variables_stop_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read with the flags (exit 2 before any stage starts), not by each stage once it is up."""
    from omnimesh.config.cpu_env import cpu_threads, kernels_mode

    for value in ("x", "-1", "0", "1.5"):
        monkeypatch.setenv("OMNIMESH_CPU_THREADS", value)
        with pytest.raises(ValueError, match=f"OMNIMESH_CPU_THREADS must be a whole number >= 1, got '{value}'"):
            ServeArgs()
    monkeypatch.setenv("OMNIMESH_CPU_THREADS", "3")
    assert cpu_threads() == 3 and ServeArgs().device
    monkeypatch.setenv("OMNIMESH_CPU_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="OMNIMESH_CPU_KERNELS='sometimes': use auto, 0 .* or 1"):
        ServeArgs()
    for value, mode in (("", "auto"), ("Off", "off"), ("1", "on"), ("auto", "auto")):
        monkeypatch.setenv("OMNIMESH_CPU_KERNELS", value)
        assert kernels_mode() == mode


def test_bad_input_limits_stop_the_start() -> None:
    """The gateway's --limit-mm-per-prompt and --input-limits are checked when the flags are read, before any
    stage starts (their parsing: tests/gateway/test_input_limits.py)."""
    with pytest.raises(ValueError, match="--limit-mm-per-prompt: unknown modality 'imagez'"):
        ServeArgs(limit_mm_per_prompt='{"imagez": 1}')
    with pytest.raises(ValueError, match="--input-limits: max_video_seconds must be positive"):
        ServeArgs(input_limits='{"max_video_seconds": -1}')


def test_devices_check_names_the_numbers() -> None:
    args = ServeArgs(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"pp x tp = 2 x 2 = 4 ranks, but only 2 CPU cores"):
        args.check_devices(2, "CPU cores")
    args.check_devices(4, "CUDA devices")  # fits
    with pytest.raises(ValueError, match="device 7 does not exist"):
        ServeArgs(stage_overrides='{"encoder": {"devices": "7"}}').check_devices(4, "CUDA devices")


def test_ray_without_ray_installed_is_listed_with_the_fix(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    args = ServeArgs(stage_overrides='{"thinker": {"pp": 2}, "encoder": {"num_replicas": 2}}',
                     distributed_executor_backend="ray")
    assert args.unsupported() == ["--distributed-executor-backend ray needs Ray in this environment: pip install "
                                  "'omnimesh[ray]' (or use --distributed-executor-backend mp)"]
    assert args.unsupported(only="encoder") == []  # one rank: nothing for Ray to place
    assert ServeArgs(distributed_executor_backend="ray").unsupported() == []


def test_replicas_take_their_own_group_of_devices() -> None:
    cfg = ServeArgs(stage_overrides='{"vocoder": {"tp": 2, "num_replicas": 2, "devices": "0,1,2,3"}}').stage_configs()
    assert [cfg["vocoder"].replica_devices(k) for k in (0, 1)] == [["0", "1"], ["2", "3"]]
    assert cfg["thinker"].replica_devices(0) == []  # none given: the default placement
    with pytest.raises(ValueError, match=r"names 2 devices but pp x tp x num_replicas = 1 x 2 x 2 = 4; give exactly"):
        ServeArgs(stage_overrides='{"vocoder": {"tp": 2, "num_replicas": 2, "devices": "0,1"}}')
    with pytest.raises(ValueError, match=r"num_replicas 0 for one of the talker and vocoder needs it for the other"):
        ServeArgs(stage_overrides='{"vocoder": {"replicas": 0}}')


def test_a_stage_is_either_copied_or_spread_over_hosts() -> None:
    with pytest.raises(ValueError, match=r"num_replicas = 2 with num_nodes = 2: a stage is either copied on one host"):
        ServeArgs(num_nodes=2, master_port=29500, pipeline_parallel_size=2,
                  stage_overrides='{"thinker": {"num_replicas": 2}}')
    cfg = ServeArgs(num_nodes=2, master_port=29500, pipeline_parallel_size=2,
                    stage_overrides='{"thinker": {"num_replicas": 2, "num_nodes": 1}}').stage_configs()
    assert (cfg["thinker"].num_replicas, cfg["thinker"].num_nodes, cfg["talker"].num_nodes) == (2, 1, 2)


def test_stage_base_port_leaves_room_for_every_replica() -> None:
    ServeArgs(stage_base_port=65532)  # four stages: 65532..65535
    with pytest.raises(ValueError, match=r"room for 6 stage ports \(one per stage replica\) below 65536, got 65532"):
        ServeArgs(stage_base_port=65532, stage_overrides='{"vocoder": {"num_replicas": 3}}')


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "fp8"}, "--dtype must be one of"),
        ({"disable_log_requests": True, "enable_log_requests": True}, "contradict each other"),
        ({"enable_log_outputs": True}, "--enable-log-outputs logs each request's output beside its request lines: "
                                       "add --enable-log-requests"),
        ({"root_path": "omni"}, "--root-path must be a URL path that starts with / and does not end with one"),
        ({"root_path": "/omni/"}, "--root-path must be a URL path"),
        ({"uds": "/no/such/folder/gw.sock"}, "--uds '/no/such/folder/gw.sock': its folder '/no/such/folder' does not "
                                             "exist"),
        ({"uds": "/tmp/" + "s" * 120}, "a Unix socket path holds at most 107 bytes"),
        ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype must be one of auto, float32, bfloat16, float16, fp8, fp8_e4m3, "
                                     "fp8_e5m2, got 'int8'"),
        ({"stage_overrides": '{"talker": {"kv_cache_dtype": "fp4"}}'}, r"stage talker: kv_cache_dtype must be one of"),
        ({"port": 0}, "--port must be a port number"),
        ({"distributed_executor_backend": "slurm"}, "must be mp or ray"),
        ({"distributed_executor_backend": "ray", "num_nodes": 2, "master_port": 29500},
         "with ray the Ray cluster places them on its nodes: drop --num-nodes/--node-rank and give --ray-address"),
        ({"ray_address": "10.0.0.1:6379"}, "--ray-address is for --distributed-executor-backend ray"),
        ({"num_nodes": 2, "node_rank": 2}, r"--node-rank must be in \[0, --num-nodes\)"),
        ({"max_waiting_requests": -1}, r"--max-waiting-requests must be >= 0"),
        ({"stage_dns_refresh": 0.0}, r"--stage-dns-refresh must be > 0 seconds, got 0.0"),
        ({"stage_start_timeout": 0.0}, r"--stage-start-timeout must be > 0 seconds, got 0.0"),
        ({"stage_restarts": -1}, r"--stage-restarts must be >= 0 \(0: never restart a stage\), got -1"),
        ({"stream_interval": 0}, r"--stream-interval must be >= 1 token"),
        ({"audio_windows": "5,0"}, r"--audio-windows must be 1 to 32 comma-separated whole numbers of codes >= 1"),
        ({"stage_overrides": '{"talker": {"max_waiting_requests": -2}}'},
         r"stage talker: max_waiting_requests must be a whole number >= 0"),
    ],
)
def test_other_flag_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeArgs(**kwargs)


def test_stage_config_devices_must_be_indices() -> None:
    with pytest.raises(ValueError, match="not a device index"):
        StageConfig(devices="0,gpu1", tp=2).device_list()
    assert parse_stage_overrides(None) == {}


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnimesh.cli", *argv], capture_output=True, text=True, timeout=120)


def test_cli_exits_before_starting_anything() -> None:
    bad = _cli("serve", "--stage-overrides", '{"thinker": {"tp": 2}', "--port", "8123")
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr
    too_many = _cli("serve", "-tp", "64", "--device", "cpu")
    assert too_many.returncode == 2 and "pp x tp = 1 x 64 = 64 ranks" in too_many.stderr and "CPU ranks" in too_many.stderr
    stray = _cli("serve", "--ray-address", "auto", "--device", "cpu")
    assert stray.returncode == 2 and "--ray-address is for --distributed-executor-backend ray" in stray.stderr
    no_model = _cli("stage", "thinker", "--model", "/nonexistent/model")
    assert no_model.returncode == 2 and "no config.json" in no_model.stderr


def test_cli_checks_the_layout_against_the_model(tmp_path) -> None:
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

    model = build_tiny_qwen3_omni(tmp_path / "tiny")
    heads = _cli("stage", "thinker", "--model", str(model), "-tp", "3", "--device", "cpu")
    assert heads.returncode == 2 and "tp=3 does not divide the thinker LM's 4 attention heads" in heads.stderr
    layers = _cli("serve", str(model), "--stage-overrides", '{"talker": {"pp": 2, "pp_layer_partition": [1, 2]}}', "--device", "cpu")
    assert layers.returncode == 2 and "sums to 3, but the talker LM has 2 layers" in layers.stderr


def test_serve_hands_the_gateway_every_gateway_flag(tmp_path) -> None:
    """`omnimesh serve` starts its gateway with each gateway flag as given (`--enable-log-outputs` once went
    missing from a hand-kept list): the gateway's own parser reads the same values back."""
    from omnimesh.launcher import MeshLauncher

    given = dict(enable_log_requests=True, enable_log_outputs=True, max_log_len=40, stage_dns_refresh=7.5,
                 return_tokens_as_token_ids=True, enable_prompt_tokens_details=True, max_logprobs=5,
                 reasoning_parser="qwen3", responses_store_memory="64MiB", allowed_media_domains="media.example.com",
                 chat_template_content_format="string", request_timeout=12.0, served_model_name=("omni", "o2"),
                 trust_request_chat_template=True, max_realtime_sessions=3, allowed_origins='["https://a.example"]',
                 disable_uvicorn_access_log=True, async_chunk=False)
    argv = MeshLauncher(ServeArgs(**given), tmp_path)._gateway_argv({"thinker": ["127.0.0.1:1"]})
    parsed = from_namespace(build_parser().parse_args(argv))
    assert {name: getattr(parsed, name) for name in given} == given
    assert ServeArgs(**given).api_key is None and "--api-key" not in argv  # the key goes by the environment


def test_launcher_passes_each_stage_its_own_layout(tmp_path) -> None:
    from omnimesh.launcher import MeshLauncher

    args = ServeArgs(max_num_seqs=64, kv_cache_memory="1GiB", max_waiting_requests=7, audio_windows="4,8,16",
                     kv_cache_dtype="bfloat16", enable_chunked_prefill=False,
                     stage_overrides='{"thinker": {"pp": 2, "tp": 2, "devices": "0,1,2,3", "pp_layer_partition": [1, 3],'
                                     ' "kv_cache_memory": "256MiB", "max_num_batched_tokens": 512, "transport": "grpc",'
                                     ' "kv_cache_dtype": "fp8", "enable_chunked_prefill": true,'
                                     ' "shm_arena_size": "64MiB", "max_waiting_requests": 3}, "talker": {"pp": 2, '
                                     '"shm_min_tensor_size": "0", "bulk_nice": 5}}')
    launcher = MeshLauncher(args, tmp_path)
    thinker = launcher._stage_argv("thinker", 50052)
    assert thinker[thinker.index("-tp") + 1] == "2" and thinker[thinker.index("-pp") + 1] == "2"
    own = json.loads(thinker[thinker.index("--stage-overrides") + 1])
    assert own == {"thinker": {"pp_layer_partition": [1, 3], "devices": "0,1,2,3", "max_num_seqs": 64,
                               "max_waiting_requests": 3, "gpu_memory_utilization": 0.9, "kv_cache_memory": 256 * 2**20,
                               "max_num_batched_tokens": 512, "transport": "grpc", "shm_arena_size": 64 * 2**20,
                               "shm_min_tensor_size": 16 * 2**10, "nice": 0,
                               "scheduling_policy": "fcfs", "enable_prefix_caching": False, "kv_cache_dtype": "fp8",
                               "enable_chunked_prefill": True}}
    talker = launcher._stage_argv("talker", 50053)
    assert talker[talker.index("-pp") + 1] == "2"
    talker_own = json.loads(talker[talker.index("--stage-overrides") + 1])["talker"]
    assert talker_own["kv_cache_memory"] == 2**30 and talker_own["max_waiting_requests"] == 7
    assert (talker_own["transport"], talker_own["shm_arena_size"], talker_own["shm_min_tensor_size"]) == ("auto", 256 * 2**20, 0)
    assert (talker_own["nice"], talker_own["bulk_nice"], talker_own["kv_cache_dtype"]) == (0, 5, "bfloat16")
    assert talker_own["enable_chunked_prefill"] is False
    encoder = launcher._stage_argv("encoder", 50051)
    assert encoder[encoder.index("-tp") + 1] == "1" and encoder[encoder.index("-pp") + 1] == "1"
    vocoder = launcher._stage_argv("vocoder", 50054)
    assert vocoder[vocoder.index("--audio-windows") + 1] == "4,8,16"
    # what the stage process parses back is the stage's resolved config
    from omnimesh.cli import build_parser
    from omnimesh.config.serve_args import from_namespace

    cfg = from_namespace(build_parser().parse_args(thinker)).stage_configs()["thinker"]
    assert (cfg.pp, cfg.tp, cfg.kv_cache_memory, cfg.max_num_batched_tokens, cfg.max_num_seqs) == (2, 2, 256 * 2**20, 512, 64)
    assert (cfg.max_waiting_requests, cfg.kv_cache_dtype) == (3, "fp8")
    assert (cfg.transport, cfg.shm_arena_size, cfg.shm_min_tensor_size) == ("grpc", 64 * 2**20, 16 * 2**10)
    assert not from_namespace(build_parser().parse_args(thinker)).enforce_eager


def test_launcher_starts_every_replica_on_its_own_port_and_devices(tmp_path) -> None:
    from omnimesh.cli import parse_stage_addresses
    from omnimesh.launcher import MeshLauncher, stage_processes

    args = ServeArgs(stage_overrides='{"vocoder": {"tp": 2, "num_replicas": 2, "devices": "0,1,2,3"}, '
                                     '"talker": {"replicas": 2}}')
    assert stage_processes(args) == [("encoder", 0, "encoder"), ("thinker", 0, "thinker"), ("talker", 0, "talker#0"),
                                     ("talker", 1, "talker#1"), ("vocoder", 0, "vocoder#0"), ("vocoder", 1, "vocoder#1")]
    # a thinker-only checkpoint's stages: the talker's and vocoder's replicas are not started
    assert stage_processes(args, ("encoder", "thinker")) == [("encoder", 0, "encoder"), ("thinker", 0, "thinker")]
    # num_replicas 0 for the talker and vocoder: a text-only mesh (their layouts are not checked against devices)
    text_only = ServeArgs(stage_overrides='{"talker": {"num_replicas": 0, "tp": 8}, "vocoder": {"replicas": 0}}')
    assert stage_processes(text_only) == [("encoder", 0, "encoder"), ("thinker", 0, "thinker")]
    text_only.check_devices(1, "CPUs")
    for bad, needle in (('{"talker": {"num_replicas": 0}}', "needs it for the other too"),
                        ('{"thinker": {"num_replicas": 0}}', "stage thinker: num_replicas 0 leaves out a stage"),
                        ('{"encoder": {"num_replicas": 0}, "talker": {"num_replicas": 0}, "vocoder": {"num_replicas": 0}}',
                         "stage encoder: num_replicas 0"),
                        ('{"vocoder": {"num_replicas": -1}}', "num_replicas must be a whole number >= 0")):
        with pytest.raises(ValueError, match=needle):
            ServeArgs(stage_overrides=bad)
    launcher = MeshLauncher(args, tmp_path)
    for replica, devices in ((0, "0,1"), (1, "2,3")):
        argv = launcher._stage_argv("vocoder", 50055 + replica, replica)
        assert argv[argv.index("--port") + 1] == str(50055 + replica)
        own = json.loads(argv[argv.index("--stage-overrides") + 1])["vocoder"]
        assert own["devices"] == devices and "num_replicas" not in own  # each process is one replica
    gateway = launcher._gateway_argv({"thinker": ["127.0.0.1:1"], "talker": ["127.0.0.1:2", "127.0.0.1:3"]})
    assert parse_stage_addresses(gateway[gateway.index("--stages") + 1]) == {
        "thinker": ["127.0.0.1:1"], "talker": ["127.0.0.1:2", "127.0.0.1:3"]}
    with pytest.raises(ValueError, match=r"--stages names talker=127.0.0.1:2 twice"):
        parse_stage_addresses("thinker=127.0.0.1:1,talker=127.0.0.1:2,talker=127.0.0.1:2")


def test_data_parallel_size_copies_every_stage(tmp_path) -> None:
    """-dp N (vLLM's): N replicas of each stage unless its --stage-overrides entry says otherwise (a text-only mesh
    stays so); on CUDA copy r of a stage without devices of its own takes devices r x pp x tp onwards (one whole
    pipeline per GPU group); too few devices, -dp with --num-nodes and -dp 0 are errors naming the fix;
    `omnimesh stage` does not take it (a stage process is one replica)."""
    from omnimesh.cli import build_parser
    from omnimesh.config.serve_args import from_namespace
    from omnimesh.launcher import MeshLauncher, stage_processes

    args = from_namespace(build_parser().parse_args(["serve", "-dp", "2", "--stage-overrides",
                                                     '{"encoder": {"num_replicas": 1}}']))
    assert stage_processes(args) == [("encoder", 0, "encoder"), ("thinker", 0, "thinker#0"), ("thinker", 1, "thinker#1"),
                                     ("talker", 0, "talker#0"), ("talker", 1, "talker#1"), ("vocoder", 0, "vocoder#0"),
                                     ("vocoder", 1, "vocoder#1")]
    assert {c.devices for c in args.stage_configs().values()} == {None}  # on CPU: no devices to place
    text_only = ServeArgs(data_parallel_size=3, stage_overrides='{"talker": {"num_replicas": 0}, "vocoder": {"num_replicas": 0}}')
    assert [s for s, _, _ in stage_processes(text_only)] == ["encoder"] * 3 + ["thinker"] * 3
    cuda = ServeArgs(data_parallel_size=2, device="cuda", tensor_parallel_size=2,
                     stage_overrides='{"encoder": {"tp": 1}, "talker": {"devices": "2,3,0,1"}}')
    cfgs = cuda.stage_configs(together=True)
    assert {s: c.devices for s, c in cfgs.items()} == {"encoder": "0,1", "thinker": "0,1,2,3", "talker": "2,3,0,1",
                                                       "vocoder": "0,1,2,3"}
    launcher = MeshLauncher(cuda, tmp_path)
    for replica, devices in ((0, "0,1"), (1, "2,3")):
        argv = launcher._stage_argv("thinker", 50052 + replica, replica)
        assert json.loads(argv[argv.index("--stage-overrides") + 1])["thinker"]["devices"] == devices
    cuda.check_devices(4, "CUDA devices")
    with pytest.raises(ValueError, match=r"stage thinker: device 2 does not exist; this host has 2 CUDA devices "
                                         r"\(0-1\) \(-dp 2 puts copy r of a stage on devices r x pp x tp onwards"):
        cuda.check_devices(2, "CUDA devices")
    with pytest.raises(ValueError, match=r"-dp/--data-parallel-size must be >= 1"):
        ServeArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"-dp 2 with --num-nodes 2: a stage is either copied on this host or spread"):
        ServeArgs(data_parallel_size=2, num_nodes=2, master_port=29500, tensor_parallel_size=2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stage", "thinker", "-dp", "2"])


def test_a_stage_process_is_one_replica(tmp_path) -> None:
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

    model = build_tiny_qwen3_omni(tmp_path / "tiny")
    out = _cli("stage", "vocoder", "--model", str(model), "--device", "cpu", "--stage-overrides",
               '{"vocoder": {"num_replicas": 2}}')
    assert out.returncode == 2 and "one `omnimesh stage` process is one replica; start it 2 times" in out.stderr


def test_launcher_passes_enforce_eager_to_every_stage(tmp_path) -> None:
    from omnimesh.cli import build_parser
    from omnimesh.config.serve_args import from_namespace
    from omnimesh.launcher import MeshLauncher

    launcher = MeshLauncher(ServeArgs(enforce_eager=True), tmp_path)
    for port, stage in enumerate(("encoder", "thinker", "talker", "vocoder")):
        assert from_namespace(build_parser().parse_args(launcher._stage_argv(stage, 50051 + port))).enforce_eager


def test_every_stage_labels_its_metrics_with_the_served_model_name(tmp_path) -> None:
    """vLLM's model_name label is the name clients use: the launcher hands --served-model-name to every
    stage (a stage started alone takes the flag itself), and without it every process uses the folder name."""
    from omnimesh.cli import build_parser
    from omnimesh.config.serve_args import from_namespace
    from omnimesh.launcher import MeshLauncher

    named, plain = MeshLauncher(ServeArgs(served_model_name="omni"), tmp_path), MeshLauncher(ServeArgs(), tmp_path)
    for port, stage in enumerate(("encoder", "thinker", "talker", "vocoder")):
        args = from_namespace(build_parser().parse_args(named._stage_argv(stage, 50051 + port)))
        assert args.model_name(tmp_path) == "omni"
        assert from_namespace(build_parser().parse_args(plain._stage_argv(stage, 50051 + port))).model_name(
            tmp_path) == tmp_path.name


def test_several_served_model_names_reach_the_gateway_and_the_first_labels_the_metrics(tmp_path) -> None:
    from omnimesh.cli import build_parser
    from omnimesh.config.serve_args import from_namespace
    from omnimesh.launcher import MeshLauncher

    args = from_namespace(build_parser().parse_args(["serve", str(tmp_path), "--served-model-name", "omni", "omni-alias"]))
    assert args.served_model_name == ("omni", "omni-alias") and args.model_names(tmp_path) == ("omni", "omni-alias")
    launcher = MeshLauncher(args, tmp_path)
    gateway = from_namespace(build_parser().parse_args(launcher._gateway_argv({})))
    assert gateway.model_names(tmp_path) == ("omni", "omni-alias")
    thinker = from_namespace(build_parser().parse_args(launcher._stage_argv("thinker", 50052)))
    assert thinker.model_name(tmp_path) == "omni"
    assert ServeArgs(served_model_name="one").served_model_name == ("one",)
    for bad, message in (([], "one or more non-empty names"), (["a", " b"], "without surrounding spaces"),
                         (["a", "a"], "lists a name twice")):
        with pytest.raises(ValueError, match=message):
            ServeArgs(served_model_name=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("text, size", [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("2G", 2 * 10**9),
                                        ("1000", 1000), (4096, 4096), ("1.5 GiB", int(1.5 * 2**30))])
def test_sizes_parse(text, size) -> None:
    from omnimesh.config.stage_config import parse_bytes

    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["lots", "4XB", "-1", "0"])
def test_bad_sizes_say_how_to_write_one(text) -> None:
    with pytest.raises(ValueError, match="kv-cache-memory"):
        ServeArgs(kv_cache_memory=text)


@pytest.mark.parametrize("text", ["nan", "inf", "1e30", "99999999TiB", float("nan")])
def test_sizes_past_any_machine_are_refused_by_name(text) -> None:
    """They reached the stages: NaN was "cannot convert float NaN to integer", 1e30 overflowed an int64 and
    99999999TiB a tensor's size, each a traceback after the mesh had loaded."""
    with pytest.raises(ValueError, match=r"--kv-cache-memory: .* is not a size this server can hold \(at most 1 EiB\)"):
        ServeArgs(kv_cache_memory=text)


def test_pp_layer_partition_flag() -> None:
    cfgs = ServeArgs(pipeline_parallel_size=2, pp_layer_partition="3,1").stage_configs()
    assert cfgs["thinker"].pp_layer_partition == (3, 1)
    with pytest.raises(ValueError, match="must be comma-separated layer counts"):
        ServeArgs(pp_layer_partition="3;1")
    with pytest.raises(ValueError, match=r"must list 2 positive layer counts"):
        ServeArgs(pipeline_parallel_size=2, pp_layer_partition="4")


@pytest.mark.parametrize("flags, message", [
    (dict(transport="tcp"), "--transport must be one of auto, grpc, shm, cuda-ipc"),
    (dict(shm_arena_size="lots"), "--shm-arena-size"),
    (dict(shm_min_tensor_size="-1"), "--shm-min-tensor-size"),
    (dict(stage_overrides='{"talker": {"shm_min_tensor_size": "tiny"}}'), "shm_min_tensor_size"),
    (dict(stage_overrides='{"talker": {"nice": -5}}'), "nice must be a whole number from 0"),
    (dict(stage_overrides='{"talker": {"nice": 20}}'), "nice must be a whole number from 0"),
    (dict(stage_overrides='{"talker": {"bulk_nice": -1}}'), "bulk_nice must be a whole number from 0"),
    (dict(stage_overrides='{"vocoder": {"bulk_nice": "low"}}'), "bulk_nice must be a whole number from 0"),
    (dict(stage_overrides='{"thinker": {"transport": "rdma"}}'), "transport must be one of"),
])
def test_transport_flags_are_checked(flags, message) -> None:
    with pytest.raises(ValueError, match=message):
        ServeArgs(**flags)


def test_transport_flags_resolve_per_stage() -> None:
    cfgs = ServeArgs(transport="grpc", shm_arena_size="0",
                     stage_overrides='{"talker": {"transport": "shm", "shm_arena_size": "1GiB"}}').stage_configs()
    assert (cfgs["thinker"].transport, cfgs["thinker"].shm_arena_size) == ("grpc", 0)
    assert (cfgs["talker"].transport, cfgs["talker"].shm_arena_size) == ("shm", 2**30)


def test_bulk_steps_run_lower_on_cpu_unless_told() -> None:
    cfgs = ServeArgs(stage_overrides='{"vocoder": {"nice": 5, "bulk_nice": 2}, "thinker": {"bulk_nice": 0}}').stage_configs()
    assert {s: cfgs[s].nice for s in cfgs} == {"encoder": 0, "thinker": 0, "talker": 0, "vocoder": 5}
    assert {s: cfgs[s].effective_bulk_nice(s, "cpu") for s in cfgs} == {"encoder": 0, "thinker": 0, "talker": 19,
                                                                         "vocoder": 2}
    assert {s: cfgs[s].effective_bulk_nice(s, "cuda") for s in cfgs} == {"encoder": 0, "thinker": 0, "talker": 0,
                                                                          "vocoder": 2}


def test_device_auto_is_resolved_before_the_stages_read_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from omnimesh import cli
    from omnimesh.cli import resolve_device

    assert resolve_device(ServeArgs(device="cpu")).device == "cpu"
    monkeypatch.setattr(cli, "gpu_driver_present", lambda: True)  # a GPU host: torch is asked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(ServeArgs()).device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(ServeArgs()).device == "cuda"
    assert resolve_device(ServeArgs(device="cpu")).device == "cpu"
    monkeypatch.setattr(cli, "gpu_driver_present", lambda: False)  # no driver: cpu, whatever torch would say
    assert resolve_device(ServeArgs()).device == "cpu"


def test_device_auto_on_a_host_without_a_gpu_driver_imports_no_torch(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """What a standalone CPU stage does before it re-executes itself on tcmalloc: no torch to resolve auto."""
    import torch

    from omnimesh import cli

    def asked() -> bool:
        raise AssertionError("torch was asked on a host without a GPU driver")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    monkeypatch.setattr(cli, "GPU_DRIVER_NODES", (str(tmp_path / "nvidiactl"),))
    if sys.platform.startswith("linux"):
        assert not cli.gpu_driver_present() and cli.resolve_device(ServeArgs()).device == "cpu"
        (tmp_path / "nvidiactl").touch()
        assert cli.gpu_driver_present()
    code = ("import sys; from omnimesh.cli import resolve_device, gpu_driver_present; "
            "from omnimesh.config.serve_args import ServeArgs; d = resolve_device(ServeArgs()).device; "
            "print(gpu_driver_present(), d, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    present, device, imported = out.stdout.split()
    if present == "False":  # this host has no GPU driver (CI): auto is cpu and torch stayed out
        assert (device, imported) == ("cpu", "False"), out.stdout
    else:  # a GPU host: torch was asked
        assert imported == "True", out.stdout


def test_num_nodes_spreads_every_stage_of_more_than_one_rank() -> None:
    args = ServeArgs(num_nodes=2, master_port=29500, pipeline_parallel_size=2,
                     stage_overrides='{"encoder": {"pp": 1}, "vocoder": {"num_nodes": 1}, "talker": {"tp": 2}}')
    cfgs = args.stage_configs()
    assert {s: c.num_nodes for s, c in cfgs.items()} == {"encoder": 1, "thinker": 2, "talker": 2, "vocoder": 1}
    assert (cfgs["thinker"].ranks_per_node, cfgs["talker"].ranks_per_node, cfgs["vocoder"].ranks_per_node) == (1, 2, 2)
    assert args.unsupported() == []  # multi-node stages run now
    ok = ServeArgs(num_nodes=2, master_port=29500, tensor_parallel_size=2, pipeline_parallel_size=2,
                   stage_overrides='{"thinker": {"devices": "2,3"}}')  # per host: the same ids on every host
    assert ok.stage_configs()["thinker"].device_list() == ["2", "3"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_nodes": 2, "master_port": 29500, "pipeline_parallel_size": 3},
         r"^-pp 3 x -tp 1 = 3 ranks cannot be spread evenly over --num-nodes 2 hosts .* make pp x tp a multiple of 2"),
        ({"num_nodes": 2, "master_port": 29500, "pipeline_parallel_size": 2,
          "stage_overrides": '{"talker": {"pp": 3}}'},
         r"stage talker: pp x tp = 3 x 1 = 3 ranks cannot be spread evenly over num_nodes = 2 hosts"),
        ({"num_nodes": 2, "pipeline_parallel_size": 2}, r"--num-nodes 2 needs --master-port"),
        ({"num_nodes": 2, "master_port": 29500, "pipeline_parallel_size": 2,
          "stage_overrides": '{"thinker": {"num_nodes": 3}}'},
         r"stage thinker: num_nodes 3 in --stage-overrides must be 1 \(node 0 only\) or --num-nodes \(2\)"),
        ({"num_nodes": 2, "master_port": 29500, "pipeline_parallel_size": 2, "tensor_parallel_size": 2,
          "stage_overrides": '{"thinker": {"devices": "0,1,2,3"}}'},
         r"names 4 devices but each of the 2 hosts runs pp x tp / num_nodes = 2 x 2 / 2 = 2 ranks"),
        ({"rendezvous_timeout": 0}, r"--rendezvous-timeout must be > 0 seconds"),
        ({"master_port": 65534}, r"--master-port must be a port number below 65532"),
    ],
)
def test_num_nodes_errors_name_the_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeArgs(**kwargs)


def test_cli_num_nodes_errors_exit_2_before_anything_loads() -> None:
    uneven = _cli("stage", "thinker", "-pp", "3", "--num-nodes", "2", "--node-rank", "1", "--master-port", "29500")
    assert uneven.returncode == 2, uneven.stderr
    assert "-pp 3 x -tp 1 = 3 ranks cannot be spread evenly over --num-nodes 2 hosts" in uneven.stderr
    single = _cli("stage", "thinker", "--num-nodes", "2", "--master-port", "29500", "--device", "cpu")
    assert single.returncode == 2 and "stage thinker: pp x tp = 1 x 1 = 1 rank(s) cannot span --num-nodes 2" in single.stderr
    nothing = _cli("serve", "--num-nodes", "2", "--master-port", "29500", "--device", "cpu")
    assert nothing.returncode == 2 and "no stage has more than one rank to spread" in nothing.stderr


def test_launcher_hands_the_gateways_request_policy_to_the_gateway(tmp_path) -> None:
    """--limit-mm-per-prompt, --input-limits, --max-logprobs and --return-tokens-as-token-ids are the gateway's:
    `omnimesh serve` passes them to it as they were given (and to no stage)."""
    from omnimesh.launcher import MeshLauncher

    args = ServeArgs(limit_mm_per_prompt='{"video": 0}', input_limits='{"max_audio_seconds": 30}', max_logprobs=5,
                     return_tokens_as_token_ids=True)
    launcher = MeshLauncher(args, tmp_path)
    argv = launcher._gateway_argv({"thinker": ["127.0.0.1:1"]})
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"video": 0}'
    assert argv[argv.index("--input-limits") + 1] == '{"max_audio_seconds": 30}'
    assert argv[argv.index("--max-logprobs") + 1] == "5" and "--return-tokens-as-token-ids" in argv
    stage = launcher._stage_argv("thinker", 50052)
    assert not {"--limit-mm-per-prompt", "--input-limits", "--max-logprobs"} & set(stage)


def test_sampling_defaults_reach_the_thinker_and_talker(tmp_path) -> None:
    """--override-generation-config is the thinker's (its own default_sampling_params win key by key); the talker
    takes default_sampling_params in --stage-overrides; stages that do not sample refuse them; the launcher hands
    each stage its resolved defaults."""
    from omnimesh.launcher import MeshLauncher

    args = ServeArgs(override_generation_config='{"temperature": 0.5, "max_new_tokens": 64}',
                     stage_overrides='{"thinker": {"default_sampling_params": {"temperature": 0.8}}, '
                                     '"talker": {"default_sampling_params": {"max_tokens": 500}}}')
    cfgs = args.stage_configs()
    assert cfgs["thinker"].default_sampling_params == {"temperature": 0.8, "max_new_tokens": 64}
    assert cfgs["talker"].default_sampling_params == {"max_tokens": 500}
    assert cfgs["vocoder"].default_sampling_params is None
    argv = MeshLauncher(args, tmp_path)._stage_argv("talker", 50053)
    own = json.loads(argv[argv.index("--stage-overrides") + 1])["talker"]
    assert own["default_sampling_params"] == {"max_tokens": 500}
    for bad, message in [({"override_generation_config": '{"temprature": 1}'}, "unknown key 'temprature'"),
                         ({"override_generation_config": "[1]"}, "--override-generation-config must be a JSON object"),
                         ({"stage_overrides": '{"vocoder": {"default_sampling_params": {"top_k": 1}}}'},
                          "the vocoder does not sample"),
                         ({"stage_overrides": '{"talker": {"default_sampling_params": {"top_p": 2}}}'},
                          r"stage talker: default_sampling_params: top_p must be in \(0, 1\]")]:
        with pytest.raises(ValueError, match=message):
            ServeArgs(**bad)  # type: ignore[arg-type]


def test_mm_processor_kwargs_are_the_gateways(tmp_path) -> None:
    from omnimesh.launcher import MeshLauncher

    launcher = MeshLauncher(ServeArgs(mm_processor_kwargs='{"fps": 1}'), tmp_path)
    argv = launcher._gateway_argv({"thinker": ["127.0.0.1:1"]})
    assert argv[argv.index("--mm-processor-kwargs") + 1] == '{"fps": 1}'
    assert "--mm-processor-kwargs" not in launcher._stage_argv("encoder", 50051)
    with pytest.raises(ValueError, match="--mm-processor-kwargs: unknown setting 'fsp'"):
        ServeArgs(mm_processor_kwargs='{"fsp": 1}')


def test_scheduling_policy_reaches_the_llm_stages(tmp_path) -> None:
    from omnimesh.launcher import MeshLauncher

    args = ServeArgs(scheduling_policy="priority", stage_overrides='{"talker": {"scheduling_policy": "fcfs"}}')
    assert (args.stage_configs()["thinker"].scheduling_policy, args.stage_configs()["talker"].scheduling_policy) == (
        "priority", "fcfs")
    argv = MeshLauncher(args, tmp_path)._stage_argv("thinker", 50052)
    assert json.loads(argv[argv.index("--stage-overrides") + 1])["thinker"]["scheduling_policy"] == "priority"
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority, got 'lifo'"):
        ServeArgs(scheduling_policy="lifo")


def test_request_timeout_is_checked_and_reaches_the_gateway(tmp_path) -> None:
    from omnimesh.launcher import MeshLauncher

    with pytest.raises(ValueError, match="--request-timeout must be >= 0 seconds"):
        ServeArgs(request_timeout=-1)
    argv = MeshLauncher(ServeArgs(request_timeout=30), tmp_path)._gateway_argv({})
    assert argv[argv.index("--request-timeout") + 1] == "30"
    assert "--request-timeout" not in MeshLauncher(ServeArgs(), tmp_path)._stage_argv("thinker", 1)


def test_a_vllm_command_line_parses() -> None:
    from omnimesh.cli import build_parser
    from omnimesh.config.serve_args import from_namespace

    argv = ["serve", "/models/qwen3-omni", "--disable-log-requests", "--enable-chunked-prefill", "--kv-cache-dtype",
            "fp8", "--root-path", "/omni", "--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.85"]
    args = from_namespace(build_parser().parse_args(argv))
    assert args.disable_log_requests and not args.enable_log_requests and args.root_path == "/omni"
    thinker = args.stage_configs()["thinker"]
    assert (thinker.enable_chunked_prefill, thinker.kv_cache_dtype, thinker.max_num_batched_tokens) == (True, "fp8", 8192)
    off = from_namespace(build_parser().parse_args(["serve", "--no-enable-chunked-prefill"]))
    assert off.stage_configs()["talker"].enable_chunked_prefill is False
    gateway = build_parser().parse_args(["gateway", "--model", "m", "--stages", "thinker=h:1", "--disable-log-requests",
                                         "--uds", "/tmp/gw.sock", "--root-path", "/omni"])
    assert gateway.disable_log_requests and gateway.uds == "/tmp/gw.sock"


def test_token_counts_take_vllms_human_readable_forms(capsys) -> None:
    from omnimesh.cli import build_parser
    from omnimesh.config.serve_args import from_namespace, human_readable_int

    args = from_namespace(build_parser().parse_args(["serve", "--max-model-len", "2k", "--max-num-batched-tokens", "1K"]))
    assert (args.max_model_len, args.max_num_batched_tokens) == (2000, 1024)
    assert [human_readable_int(t) for t in ("4096", "25.6k", "1M", "1m")] == [4096, 25600, 2**20, 10**6]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model-len", "1.5"])
    assert "'1.5' is not a token count (e.g. 4096, 4k or 4K)" in capsys.readouterr().err
