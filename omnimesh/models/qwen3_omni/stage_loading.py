"""Which weights each Qwen3-Omni stage loads, and from where in the checkpoint (and Qwen2.5-Omni's encoder and
thinker: the same thinker keys; its towers are `qwen2_5_omni/parallel_{audio,vision}_tower.py`, split like
Qwen3-Omni's).

Role: the family adapter's loading half. Each stage process calls exactly one of these and so holds
only its own part of the model (the encoder never loads the LLMs, the vocoder never loads the talker).
Every load goes through `omnimesh.models.loader`, which fails on any missing key (a sub-model
`from_pretrained` would silently keep random weights). Works the same for the tiny built-in folder
and a real Qwen3-Omni checkpoint (the prefixes are the real checkpoint's key layout).

    load_encoder(dir)  -> Qwen3OmniEncoder       thinker.audio_tower.*, thinker.visual.*
    load_thinker(dir, layout) -> Qwen3OmniThinker   thinker.model.embed_tokens here; its layers + lm_head
                                                    split over the layout's pp x tp ranks (LMShard)
    load_talker(dir, layout)  -> Qwen3OmniTalker    talker projections + code predictor here; its layers +
                                                    codec head split over the ranks
    load_code2wav(dir) -> Qwen3OmniMoeCode2Wav   code2wav.*
    rank_factory(stage, dir) -> the program each of the stage's ranks builds: what a headless node (a host
                                 other than node 0 of a multi-node stage) runs, without the driver's parts
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeTalkerForConditionalGeneration,
    _get_feat_extract_output_lengths,
)

from omnimesh.models.loader import build_submodule
from omnimesh.models.model_config import is_qwen2_5, load_config
from omnimesh.models.qwen3_omni.code2wav_shard import C2WShardSpec, Code2WavTransformerBackend, build_code2wav_shard
from omnimesh.models.qwen3_omni.encoder import Qwen3OmniEncoder
from omnimesh.models.qwen3_omni.encoder_shard import (
    EncoderShardSpec,
    ShardedAudioTower,
    ShardedVisionTower,
    build_encoder_shard,
    encoder_runner,
)
from omnimesh.models.qwen3_omni.lm_backend import ShardedBackend
from omnimesh.models.qwen3_omni.lm_shard import LMShardSpec, build_shard
from omnimesh.models.qwen3_omni.talker import Qwen3OmniTalker
from omnimesh.models.qwen3_omni.thinker import Qwen3OmniThinker
from omnimesh.parallel.mp_executor import ProgramFactory
from omnimesh.parallel.node_rendezvous import NodeSpec

log = logging.getLogger(__name__)


def _timed(what: str, model_dir: Path, fn):  # noqa: ANN001, ANN202
    t0 = time.monotonic()
    log.info("loading %s from %s", what, model_dir)
    module = fn()
    if isinstance(module, nn.Module):
        n = sum(p.numel() for p in module.parameters())
        log.info("loaded %s: %.2f M parameters in %.1fs", what, n / 1e6, time.monotonic() - t0)
    else:  # parts spread over ranks (each rank logs its own bytes) or wrapped towers: no one count here
        log.info("loaded %s in %.1fs", what, time.monotonic() - t0)
    return module


@dataclass(frozen=True)
class LMLayout:
    """How a thinker / talker stage spreads its decoder: pp x tp ranks (rank 0 is this process)."""

    pp: int = 1
    tp: int = 1
    partition: tuple[int, ...] | None = None
    backend: str = "gloo"  # "nccl" when the stage runs on CUDA devices
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port, so stages on one host never collide
    on_failure: Callable[[str], None] | None = None
    devices: tuple[str, ...] = ()  # per rank of a host, e.g. ("cuda:2", "cuda:3"); () = rank r on cuda:r (or CPU)
    timeout_s: float = 120.0  # rendezvous, start-up and every collective
    nodes: NodeSpec | None = None  # the stage spans several hosts: this host's part (node 0 runs the driver)
    executor: str = "mp"  # how ranks 1..N-1 start: "mp" (local processes) or "ray" (actors on a Ray cluster)
    ray_address: str | None = None  # with "ray": the cluster (None: a Ray instance of the stage's own)
    load_format: str = "auto"  # --load-format: "dummy" fills every rank's weights with random values

    @property
    def driver_device(self) -> str:
        """Where this process's own modules run when the stage keeps them here (Qwen2.5-Omni's towers and
        token2wav): rank 0's device."""
        if self.devices:
            return self.devices[0]
        return "cuda:0" if self.backend == "nccl" else "cpu"

    @property
    def in_process_cpu(self) -> bool:
        """One rank, this process, on CPU: the stage's steps may share it (EngineLoop `preempt`, lanes)."""
        return self.pp * self.tp == 1 and self.backend != "nccl"

    def executor_args(self) -> dict[str, Any]:
        """What `start_program` takes from this layout (used only when pp x tp > 1)."""
        return {"backend": self.backend, "master_addr": self.master_addr, "master_port": self.master_port,
                "on_failure": self.on_failure, "devices": self.devices, "timeout_s": self.timeout_s,
                "nodes": self.nodes, "executor": self.executor, "ray_address": self.ray_address,
                "load_format": self.load_format}


def load_thinker(model_dir: Path, dtype: torch.dtype = torch.float32, layout: LMLayout = LMLayout()) -> Qwen3OmniThinker:
    """This process keeps the embedding table (inputs are embedded and media merged here); the decoder
    layers + lm_head are split over the layout's ranks, each loading only its own shard."""
    config = load_config(model_dir)
    embed = build_submodule(
        model_dir, config_path="thinker_config.text_config",
        factory=lambda c: nn.Embedding(c.vocab_size, c.hidden_size), prefix="thinker.model.embed_tokens.", dtype=dtype)
    backend = _timed("thinker decoder", model_dir, lambda: ShardedBackend.start(
        LMShardSpec(model_dir, "thinker", layout.partition, dtype), layout.pp, layout.tp, **layout.executor_args()))
    return Qwen3OmniThinker(embed, backend, config)


def load_encoder(model_dir: Path, dtype: torch.dtype = torch.float32, layout: LMLayout = LMLayout()) -> Qwen3OmniEncoder:
    """Both towers split over the layout's pp x tp ranks (in-process for pp = tp = 1); each rank loads only
    its own blocks of each tower."""
    config = load_config(model_dir)
    tc: Any = config.thinker_config
    if is_qwen2_5(config):
        from omnimesh.models.qwen2_5_omni.parallel_audio_tower import audio_output_lengths_2_5 as lengths
    else:
        lengths = partial(_get_feat_extract_output_lengths, n_window=tc.audio_config.n_window)
    run, executor = _timed("audio + vision towers", model_dir, lambda: encoder_runner(
        EncoderShardSpec(model_dir, dtype, layout.partition), layout.pp, layout.tp, **layout.executor_args()))
    return Qwen3OmniEncoder(ShardedAudioTower(tc.audio_config, run, lengths),
                            ShardedVisionTower(tc.vision_config, run, dtype))


def _talker_without_decoder(config: Any) -> nn.Module:
    """The talker's per-step parts only (projections, codec embedding): its decoder layers, codec head and
    code predictor live in the LM shards, so they are dropped before loading."""
    talker = Qwen3OmniMoeTalkerForConditionalGeneration(config)
    talker.model.layers = nn.ModuleList()
    talker.codec_head = None  # type: ignore[assignment]
    talker.code_predictor = None  # type: ignore[assignment]
    return talker


def load_talker(model_dir: Path, dtype: torch.dtype = torch.float32, layout: LMLayout = LMLayout()) -> Any:
    """`Qwen3OmniTalker`, or for a Qwen2.5-Omni checkpoint `Qwen2_5OmniTalker` (no code predictor); the decoder
    layers + codec head split over the layout's ranks either way."""
    config = load_config(model_dir)
    if is_qwen2_5(config):
        from omnimesh.models.qwen2_5_omni.talker import load_qwen2_5_talker

        decoder = _timed("talker decoder", model_dir, lambda: ShardedBackend.start(
            LMShardSpec(model_dir, "talker", layout.partition, dtype), layout.pp, layout.tp, **layout.executor_args()))
        return _timed("talker projection, codec table and speakers", model_dir,
                      lambda: load_qwen2_5_talker(model_dir, dtype, decoder))
    talker = _timed("talker projections + code predictor", model_dir, lambda: build_submodule(
        model_dir, config_path="talker_config", factory=_talker_without_decoder, prefix="talker.", dtype=dtype))
    backend = _timed("talker decoder", model_dir, lambda: ShardedBackend.start(
        LMShardSpec(model_dir, "talker", layout.partition, dtype), layout.pp, layout.tp, **layout.executor_args()))
    return Qwen3OmniTalker(talker, config, backend, predictor=backend.predict)


def _code2wav_without_transformer_layers(config: Any) -> nn.Module:
    """code2wav's embedding and conv stack; its pre-transformer layers live in the Code2WavShards."""
    c2w = Qwen3OmniMoeCode2Wav(config)
    c2w.pre_transformer.layers = nn.ModuleList()
    return c2w


def load_code2wav(model_dir: Path, dtype: torch.dtype = torch.float32,
                  layout: LMLayout = LMLayout()) -> tuple[Qwen3OmniMoeCode2Wav, Code2WavTransformerBackend]:
    """This process keeps the code embedding and the conv stack, on rank 0's device (a CUDA stage's GPU: the
    conv stack is most of code2wav's compute); the pre-transformer's layers are split over the layout's
    pp x tp ranks (in-process for pp = tp = 1), each loading only its own shard."""
    c2w = _timed("code2wav embedding + convs", model_dir, lambda: build_submodule(
        model_dir, config_path="code2wav_config", factory=_code2wav_without_transformer_layers, prefix="code2wav.",
        dtype=dtype).to(layout.driver_device))
    spec = C2WShardSpec(model_dir, layout.partition, dtype)
    backend = _timed("code2wav pre-transformer", model_dir, lambda: Code2WavTransformerBackend.build(
        spec, layout.pp, layout.tp, **layout.executor_args()))
    return c2w, backend


def rank_factory(stage: str, model_dir: Path, dtype: torch.dtype = torch.float32,
                 partition: tuple[int, ...] | None = None) -> ProgramFactory:
    """The program factory the stage's ranks run, as the load_* functions above hand it to their executor:
    a headless node builds its ranks from this, so it needs only the stage's name and the flags."""
    if stage in ("thinker", "talker"):
        return partial(build_shard, LMShardSpec(model_dir, stage, partition, dtype))
    if stage == "encoder":
        return partial(build_encoder_shard, EncoderShardSpec(model_dir, dtype, partition))
    if stage == "vocoder" and is_qwen2_5(load_config(model_dir)):  # token2wav's DiT layers (always float32)
        from omnimesh.models.qwen2_5_omni.dit_shard import DiTShardSpec, build_dit_shard

        return partial(build_dit_shard, DiTShardSpec(model_dir, torch.float32, partition))
    if stage == "vocoder":
        return partial(build_code2wav_shard, C2WShardSpec(model_dir, partition, dtype))
    raise ValueError(f"stage {stage!r} has no ranks to run; stages: encoder, thinker, talker, vocoder")
