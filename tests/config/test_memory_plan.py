"""The memory plan (omnimesh/memory_plan.py) and `omnimesh plan`: weights and KV cache per rank against the
devices' memory, from the checkpoint's headers only; the shortfall, a layout that fits, and stages that
share a device. On the tiny Qwen3-Omni and Qwen2.5-Omni folders, with --device-memory sized in each test
from the checkpoint itself (no CUDA device needed: `--device cuda` with --device-memory plans for one)."""

from __future__ import annotations

import json
import math
import re
import socket
from pathlib import Path

import pytest
from safetensors import safe_open

from omnimesh.config.serve_args import ServeArgs
from omnimesh.config.stage_config import fmt_bytes
from omnimesh.memory_plan import plan_memory

FAMILIES = ("qwen3-omni", "qwen2.5-omni")
# what each stage loads (stage_loading.py): prefixes its pp x tp ranks split, and what rank 0 keeps whole
SPLIT = {
    "encoder": ("thinker.audio_tower.", "thinker.visual."),
    "thinker": ("thinker.model.layers.", "thinker.model.norm.", "thinker.lm_head."),
    "talker": ("talker.model.layers.", "talker.model.norm.", "talker.codec_head.", "talker.code_predictor."),
    "vocoder": ("code2wav.pre_transformer.", "token2wav.code2wav_dit_model.transformer_blocks."),
}
DRIVER = {
    "encoder": (),
    "thinker": ("thinker.model.embed_tokens.",),
    "talker": ("talker.text_projection.", "talker.hidden_projection.", "talker.model.codec_embedding.",
               "talker.model.norm.", "talker.thinker_to_talker_proj.", "talker.model.embed_tokens."),  # see _driver
    "vocoder": ("code2wav.code_embedding.", "code2wav.decoder.", "code2wav.upsample.", "code2wav.pre_transformer.norm.",
                "token2wav.code2wav_bigvgan_model.", "token2wav.code2wav_dit_model.input_embed.",
                "token2wav.code2wav_dit_model.text_embed.", "token2wav.code2wav_dit_model.time_embed.",
                "token2wav.code2wav_dit_model.norm_out.", "token2wav.code2wav_dit_model.proj_out."),
}
BF16 = 2


def _driver(stage: str, family: str) -> tuple[str, ...]:
    """Qwen3-Omni's talker driver is transformers' talker without its decoder (its final norm included);
    Qwen2.5-Omni's loads only the projection and the codec table."""
    if stage == "talker" and family == "qwen2.5-omni":
        return ("talker.thinker_to_talker_proj.", "talker.model.embed_tokens.")
    return DRIVER[stage]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from omnimesh.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni

    root = tmp_path_factory.mktemp("memory-plan")
    return {"qwen3-omni": build_tiny_qwen3_omni(root / "tiny-qwen3-omni"),
            "qwen2.5-omni": build_tiny_qwen2_5_omni(root / "tiny-qwen2.5-omni")}


def _numels(model: Path) -> dict[str, int]:
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        return {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}


def _bytes(model: Path, prefixes: tuple[str, ...]) -> int:
    """The tensors under `prefixes` in bf16, but Qwen2.5-Omni's token2wav, which stays float32."""
    return sum(n * (4 if k.startswith("token2wav.") else BF16) for k, n in _numels(model).items()
               if k.startswith(prefixes))


def _thinker_need(model: Path, tp: int, block_size: int = 16) -> int:
    """Rank 0 of a pp=1 thinker in bf16: its 1/tp of the split weights, the embedding table, and the KV cache
    of one max_position_embeddings sequence (2 x layers x kv_heads/tp x head_dim x 2 bytes per token)."""
    config = json.loads((model / "config.json").read_text())["thinker_config"]["text_config"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] // tp * head_dim * BF16
    seq = -(-config["max_position_embeddings"] // block_size) * block_size
    return -(-_bytes(model, SPLIT["thinker"]) // tp) + _bytes(model, DRIVER["thinker"]) + per_token * seq


@pytest.mark.parametrize("family", FAMILIES)
def test_each_stage_counts_the_checkpoint_tensors_it_loads_in_the_serving_dtype(models, family) -> None:
    model = models[family]
    plan = plan_memory(model, ServeArgs(device="cuda"), device_memory=2**40)
    assert not any(s.missing for s in plan.stages) and plan.dtype == "bfloat16" and [s.stage for s in plan.stages] == list(SPLIT)
    for s in plan.stages:
        assert (s.weights_per_rank, s.driver) == (_bytes(model, SPLIT[s.stage]), _bytes(model, _driver(s.stage, family))), s.stage
    # every tensor belongs to some stage (only the final norms are loaded twice: by rank 0 and by the last rank)
    counted = {k for k in _numels(model) if any(k.startswith(SPLIT[s] + DRIVER[s]) for s in SPLIT)}
    assert counted == set(_numels(model))
    thinker = next(s for s in plan.stages if s.stage == "thinker")
    assert thinker.need == _thinker_need(model, 1) and thinker.kv_max_len == 4096
    # on CPU: float32, twice the floats' bytes
    cpu = plan_memory(model, ServeArgs(device="cpu"))
    assert next(s for s in cpu.stages if s.stage == "thinker").weights_per_rank == 2 * thinker.weights_per_rank


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stage_too_big_for_its_device_says_what_is_missing_and_which_layout_fits(models, family) -> None:
    model = models[family]
    one, two = _thinker_need(model, 1), _thinker_need(model, 2)
    share = ServeArgs(device="cuda").stage_configs()["thinker"].gpu_memory_utilization
    assert share == 0.9  # the stage alone (`omnimesh stage`, `only`): its whole fraction
    assert abs(ServeArgs(device="cuda").stage_configs(together=True)["thinker"].gpu_memory_utilization - 0.6) < 1e-9
    memory = int((one + two) / 2 / share)  # tp 1 does not fit its share, tp 2 does
    plan = plan_memory(model, ServeArgs(device="cuda"), only="thinker", device_memory=memory, num_devices=8)
    assert not plan.ok
    [thinker] = plan.stages
    missing = one - int(memory * share)
    assert (thinker.need, thinker.missing, thinker.fits_with) == (one, missing, (1, 2))
    [error] = plan.errors
    assert error.startswith("stage thinker (pp 1 x tp 1 on cuda:0)") and f"{fmt_bytes(missing)} missing per rank" in error
    assert "--stage-overrides '{\"thinker\": {\"pp\": 1, \"tp\": 2}}'" in plan.error_text()
    fixed = ServeArgs(device="cuda", stage_overrides=json.dumps({"thinker": {"pp": 1, "tp": 2}}))
    again = plan_memory(model, fixed, only="thinker", device_memory=memory, num_devices=8)
    assert again.ok and again.stages[0].need == two
    # a device too small for any layout says so
    tiny = plan_memory(model, ServeArgs(device="cuda"), only="thinker", device_memory=2**10, num_devices=8)
    assert tiny.stages[0].fits_with is None and "no pp x tp up to the 8 CUDA devices" in tiny.error_text()


def test_the_table_names_each_copys_devices(models) -> None:
    """-dp 2 -tp 2 on four GPUs: every stage's copies on cuda:0,1 and cuda:2,3 (one whole pipeline per pair), each
    device shared by one copy of each stage, so it fits where the same stages all on cuda:0,1 would share more."""
    args = ServeArgs(device="cuda", data_parallel_size=2, tensor_parallel_size=2, encoder_cache_memory="0")
    plan = plan_memory(models["qwen3-omni"], args, device_memory=2 * 2**30, num_devices=4)
    rows = {line.split()[0]: line for line in plan.table().splitlines()[1:]}
    assert all("cuda:0,cuda:1 | cuda:2,cuda:3" in rows[s] for s in ("encoder", "thinker", "talker", "vocoder")), rows
    assert plan.ok, plan.report()
    one = plan_memory(models["qwen3-omni"], ServeArgs(device="cuda", encoder_cache_memory="0"), device_memory=2 * 2**30,
                      num_devices=4)
    assert all(line.split()[4] == "cuda:0" for line in one.table().splitlines()[1:])  # one copy: its devices alone


def test_stages_sharing_a_device_must_not_claim_more_than_all_of_it(models) -> None:
    model = models["qwen3-omni"]
    shared = {"thinker": {"devices": "1", "gpu_memory_utilization": 0.6},
              "talker": {"devices": "1", "gpu_memory_utilization": 0.5}}
    plan = plan_memory(model, ServeArgs(device="cuda", stage_overrides=json.dumps(shared)), device_memory=2**30)
    assert all(not s.missing for s in plan.stages)  # each fits its own fraction ...
    [error] = plan.errors  # ... but not together
    assert error.startswith("cuda:1 is shared by thinker (0.6), talker (0.5): their gpu_memory_utilization adds "
                            "up to 1.1 of the device")
    shared["talker"]["gpu_memory_utilization"] = 0.3
    ok = plan_memory(model, ServeArgs(device="cuda", stage_overrides=json.dumps(shared)), device_memory=2**30)
    assert ok.ok
    # a fixed kv_cache_memory takes what it needs, not a fraction: the encoder and vocoder never count theirs
    fixed = ServeArgs(device="cuda", kv_cache_memory="8MiB", gpu_memory_utilization=0.9)
    assert plan_memory(model, fixed, device_memory=2**30).ok
    # the default mesh, all four on cuda:0: the thinker and talker take 2/3 and 2/9 of 0.9, so it fits one GPU
    # (on a 4 GiB GPU: what the thinker's and talker's fractions leave holds the encoder's 512 MiB cache too)
    default = plan_memory(model, ServeArgs(device="cuda"), device_memory=2**32)
    assert default.ok, default.errors
    assert [round(s.cfg.gpu_memory_utilization, 6) for s in default.stages] == [0.9, 0.6, 0.2, 0.9]
    alone = ServeArgs(device="cuda", stage_overrides=json.dumps({"thinker": {"devices": "1"}}))
    assert alone.stage_configs(together=True)["thinker"].gpu_memory_utilization == 0.9  # a GPU of its own


def test_omnimesh_plan_prints_the_table_and_exits_0_or_2(models, capsys) -> None:
    from omnimesh.cli import main

    model = models["qwen3-omni"]
    memory = int((_thinker_need(model, 1) + _thinker_need(model, 2)) / 2 / 0.6)  # the thinker's share on GPU 0
    base = ["plan", str(model), "--device", "cuda", "--device-memory", str(memory), "--num-devices", "8",
            "--encoder-cache-memory", "0"]  # GPUs of a few MiB: no room for the encoder's cache
    assert main(base) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[1].split()[:3] == ["stage", "pp", "x"] and "NO:" in out
    assert "does not fit: stage thinker (pp 1 x tp 1 on cuda:0)" in out and "fits with: stage thinker: pp 1 x tp 2" in out
    assert "omnimesh: error: the model does not fit its devices" in err
    first = plan_memory(model, ServeArgs(device="cuda", encoder_cache_memory="0"), device_memory=memory, num_devices=8)
    overrides, device = {}, 0
    for s in first.stages:  # each stage on devices of its own, in the layout the plan recommends
        pp, tp = s.fits_with or (s.cfg.pp, s.cfg.tp)
        overrides[s.stage] = {"pp": pp, "tp": tp, "devices": ",".join(str(device + i) for i in range(pp * tp))}
        device += pp * tp
    assert main(base + ["--stage-overrides", json.dumps(overrides)]) == 0
    out, _ = capsys.readouterr()
    assert "everything fits" in out and "thinker  1 x 2" in out
    assert main(["plan", str(model), "--device", "cpu"]) == 0  # the host's RAM holds the tiny model
    assert "host RAM" in capsys.readouterr().out


def test_serve_and_stage_refuse_on_cuda_and_only_advise_on_cpu(models, monkeypatch, capsys) -> None:
    """The same plan before anything starts: on CUDA a shortfall exits 2; on CPU it is advice and the mesh starts."""
    from omnimesh import cli, launcher, memory_plan

    model = models["qwen3-omni"]
    started: list[str] = []

    class FakeLauncher:
        def __init__(self, args, model_dir) -> None:
            started.append(args.device)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(launcher, "MeshLauncher", FakeLauncher)
    monkeypatch.setattr(cli, "_devices", lambda device: (8, "CUDA devices"))
    memory = int(_thinker_need(model, 1) / 2)
    monkeypatch.setattr(memory_plan, "_cuda_memory", lambda *_: (8, lambda i: memory, "test"))
    assert cli.main(["serve", str(model), "--device", "cuda"]) == 2
    assert "stage thinker (pp 1 x tp 1 on cuda:0)" in capsys.readouterr().err and not started
    assert cli.main(["stage", "thinker", "--model", str(model), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "stage thinker" in err and "stage talker" not in err  # its own stage only
    monkeypatch.setattr(memory_plan, "host_memory", lambda: 4 * 2**30)  # the processes fit, full KV pools do not
    free = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            free.append(str(sock.getsockname()[1]))
    ports = ["--port", free[0], "--grpc-port", free[1], "--stage-base-port", "0"]  # a server on the defaults: no matter
    assert cli.main(["serve", str(model), "--device", "cpu", *ports]) == 0 and started == ["cpu"]
    assert "omnimesh: advice: the stages may take up to" in capsys.readouterr().err


def test_serve_hands_each_stage_its_share_of_a_shared_gpu(models) -> None:
    """The launcher passes each stage process its resolved fraction: the default mesh's thinker and talker their
    shares of GPU 0, a stage on a GPU of its own the whole fraction (a stage process never re-splits)."""
    from omnimesh.launcher import MeshLauncher

    def fraction(launcher: MeshLauncher, stage: str) -> float:
        argv = launcher._stage_argv(stage, 50000)
        return json.loads(argv[argv.index("--stage-overrides") + 1])[stage]["gpu_memory_utilization"]

    model = models["qwen3-omni"]
    shared = MeshLauncher(ServeArgs(device="cuda"), model)
    assert [round(fraction(shared, s), 6) for s in ("encoder", "thinker", "talker", "vocoder")] == [0.9, 0.6, 0.2, 0.9]
    apart = MeshLauncher(ServeArgs(device="cuda", stage_overrides=json.dumps({"thinker": {"devices": "1"}})), model)
    assert fraction(apart, "thinker") == 0.9 and round(fraction(apart, "talker"), 6) == 0.2


def test_the_encoder_cache_is_counted_on_the_encoders_rank_0(models) -> None:
    """--encoder-cache-memory at its capacity on the encoder's first rank (its outputs are kept there), none
    with 0; too big for the device is the encoder's shortfall, naming the flag."""
    model = models["qwen3-omni"]
    args = {"device": "cuda", "stage_overrides": json.dumps({"encoder": {"pp": 2, "devices": "0,1"}})}
    on = plan_memory(model, ServeArgs(encoder_cache_memory="64MiB", **args), device_memory=2**40)
    off = plan_memory(model, ServeArgs(encoder_cache_memory="0", **args), device_memory=2**40)
    enc_on, enc_off = (next(s for s in p.stages if s.stage == "encoder") for p in (on, off))
    assert (enc_on.cache, enc_off.cache) == (64 * 2**20, 0) and enc_on.need == enc_off.need + 64 * 2**20
    assert next(s for s in on.stages if s.stage == "thinker").cache == 0
    encoder_row = next(line for line in on.table().splitlines() if line.startswith("encoder"))
    assert re.split(r"\s{2,}", encoder_row)[4] == "64 MiB"  # the "+ on rank 0" column
    small = int((enc_off.need + 32 * 2**20) / 0.9)  # the encoder without its cache fits, with it not
    tight = plan_memory(model, ServeArgs(encoder_cache_memory="64MiB", **args), only="encoder", device_memory=small)
    assert not tight.ok and "encoder cache 64 MiB on rank 0 (--encoder-cache-memory; 0 = off)" in tight.error_text()
    assert plan_memory(model, ServeArgs(encoder_cache_memory="0", **args), only="encoder", device_memory=small).ok
    shared = plan_memory(model, ServeArgs(device="cuda"), device_memory=2**31)  # the default mesh on one 2 GiB GPU
    assert "the encoder's part includes its cache, 512 MiB (--encoder-cache-memory; 0 = off)" in shared.error_text()
    assert plan_memory(model, ServeArgs(device="cuda", encoder_cache_memory="0"), device_memory=2**31).ok
    cpu = plan_memory(model, ServeArgs(device="cpu", encoder_cache_memory="64MiB"))
    cpu_off = plan_memory(model, ServeArgs(device="cpu", encoder_cache_memory="0"))
    assert cpu.total_cpu == cpu_off.total_cpu + 64 * 2**20


def test_a_narrower_kv_cache_dtype_counts_fewer_bytes_per_token(models) -> None:
    model = models["qwen3-omni"]
    plans = {name: {s.stage: s for s in plan_memory(model, ServeArgs(device="cuda", kv_cache_dtype=name,
                                                                      stage_overrides=overrides),
                                                    device_memory=2**40).stages}
             for name, overrides in (("auto", None), ("fp8", '{"talker": {"kv_cache_dtype": "float32"}}'))}
    auto, fp8 = plans["auto"], plans["fp8"]
    assert fp8["thinker"].kv_per_token * 2 == auto["thinker"].kv_per_token  # bf16 -> fp8
    assert fp8["talker"].kv_per_token == 2 * auto["talker"].kv_per_token  # its own override: float32
    assert fp8["thinker"].need < auto["thinker"].need


def test_what_a_stage_would_refuse_stops_any_start_before_loading(models, monkeypatch, capsys) -> None:
    """A KV cache given a size that holds less than one max-length sequence, and a --max-model-len beyond the
    thinker's max_position_embeddings: the engine / handler would refuse them after loading, so `serve`,
    `stage` and `plan` refuse them first, on CPU as on CUDA. The boundary is the engine's own block arithmetic:
    exactly one sequence of whole blocks starts, one byte less does not."""
    from omnimesh import cli, launcher

    model = models["qwen3-omni"]
    text = json.loads((model / "config.json").read_text())["thinker_config"]["text_config"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_block = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 4 * 16  # fp32, 16 tokens
    one_sequence = -(-text["max_position_embeddings"] // 16) * per_block

    def refusals(thinker_kv: int, **kw: object) -> list[str]:
        overrides = json.dumps({"thinker": {"kv_cache_memory": thinker_kv}})
        return plan_memory(model, ServeArgs(device="cpu", stage_overrides=overrides, **kw)).refusals

    assert refusals(one_sequence) == []
    (refused,) = refusals(one_sequence - 1)
    assert refused.startswith(f"stage thinker: its KV cache of {fmt_bytes(one_sequence - 1)} per rank") and \
        refused.endswith("or lower --max-model-len")
    assert refusals(per_block * 4, max_model_len=64) == []  # 4 blocks hold 64 tokens
    too_long = refusals(one_sequence, max_model_len=10**5)
    assert too_long[0] == (f"stage thinker: --max-model-len 100000 exceeds the model's max_position_embeddings "
                           f"{text['max_position_embeddings']}") and "holds fewer than the 100000 tokens" in too_long[1]

    started: list[str] = []
    monkeypatch.setattr(launcher, "MeshLauncher", lambda *a: started.append("serve"))
    for argv in (["serve", str(model), "--kv-cache-memory", "256KiB"], ["serve", str(model), "--max-model-len", "99999"],
                 ["stage", "talker", "--model", str(model), "--kv-cache-memory", "256KiB"]):
        assert cli.main(argv) == 2, argv
        assert "omnimesh: error: stage t" in capsys.readouterr().err
    assert not started
    assert cli.main(["plan", str(model), "--kv-cache-memory", "256KiB"]) == 2
    out, err = capsys.readouterr()
    assert "cannot start: stage thinker" in out and "cannot start: stage talker" in out
    assert "the mesh would not start (2 reason(s))" in err


def test_a_cpu_start_of_more_processes_than_the_host_can_hold_is_refused(models, monkeypatch, capsys) -> None:
    """Each process takes ~250 MiB before any weight, and each stage its shared-memory arena: a thousand vocoder
    replicas on a 24 GiB host swamped it (the ~200 spawned had taken all its memory; the kernel's OOM killer then
    took other processes) and the launcher could not even be stopped. The floor (weights + processes x the
    runtime + the arenas) is refused before anything starts; an ordinary mesh is not, nor 30 vocoders."""
    from omnimesh import cli, launcher, memory_plan

    model = models["qwen3-omni"]
    monkeypatch.setattr(memory_plan, "host_memory", lambda: 24 * 2**30)
    assert plan_memory(model, ServeArgs(device="cpu")).refusals == []
    some = json.dumps({"vocoder": {"num_replicas": 30}})  # 34 x 250 MiB + 33 x 256 MiB of arenas: 16.3 GiB
    assert plan_memory(model, ServeArgs(device="cpu", stage_overrides=some)).refusals == []
    more = json.dumps({"vocoder": {"num_replicas": 45}})  # 49 x 250 MiB + 48 x 256 MiB: 24 GiB
    assert plan_memory(model, ServeArgs(device="cpu", stage_overrides=more)).refusals != []
    monkeypatch.setattr(memory_plan, "host_memory", lambda: 3 * 2**30)  # a small VM: the default 4 GiB pools,
    assert plan_memory(model, ServeArgs(device="cpu")).refusals == []  # touched only as they fill, still start
    monkeypatch.setattr(memory_plan, "host_memory", lambda: 24 * 2**30)
    huge = plan_memory(model, ServeArgs(device="cpu", kv_cache_memory="100TiB")).refusals  # asked for: never fills
    assert [r.split(":")[0] for r in huge] == ["stage thinker", "stage talker"]
    assert "its KV cache of 100 TiB per rank (kv_cache_memory) is more than this host's 24 GiB of RAM" in huge[0]
    many = json.dumps({"vocoder": {"num_replicas": 1000}})
    (refused,) = plan_memory(model, ServeArgs(device="cpu", stage_overrides=many)).refusals
    assert refused.startswith("1004 processes (the stage ranks and the gateway: encoder 1 x 1, thinker 1 x 1, talker "
                              "1 x 1, vocoder 1000 x 1) need at least ") and "but this host has 24 GiB" in refused
    started: list[str] = []
    monkeypatch.setattr(launcher, "MeshLauncher", lambda *a: started.append("serve"))
    assert cli.main(["serve", str(model), "--stage-overrides", many]) == 2 and not started
    assert "omnimesh: error: 1004 processes" in capsys.readouterr().err
