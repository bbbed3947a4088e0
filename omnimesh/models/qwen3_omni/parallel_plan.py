"""Checks a pp x tp layout against the Qwen3-Omni (or Qwen2.5-Omni) model it will split, before anything loads.

Role: the family adapter's half of the SPEC rules of thumb. For each stage it names the transformer
stacks the stage splits (encoder: audio tower + vision tower; thinker: the LM; talker: the LM + code
predictor; vocoder: code2wav's pre-transformer) and checks:
  errors (ValueError, naming the numbers and the valid values): tp must divide every stack's attention
  heads and KV heads (and the vocabulary where the stack has a vocab-parallel head); pp must not exceed
  any stack's layer count; a custom partition (for the stage's main stack, listed first) must sum to its
  layer count;
  advice (returned, printed on stderr): pp not a power of two; layers not divisible by pp (the remainder
  goes to the middle ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from transformers import Qwen2_5OmniConfig
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

from omnimesh.config.stage_config import StageConfig
from omnimesh.models.qwen3_omni.parallel_audio_tower import check_audio_layout
from omnimesh.models.qwen3_omni.parallel_code2wav_transformer import check_code2wav_layout
from omnimesh.models.qwen3_omni.parallel_code_predictor import check_dense_layout
from omnimesh.models.qwen3_omni.parallel_text_model import check_parallel_layout
from omnimesh.models.qwen3_omni.parallel_vision_tower import check_vision_layout


@dataclass(frozen=True, slots=True)
class Stack:
    name: str
    layers: int
    heads: int
    kv_heads: int
    vocab: int | None = None
    # the parallel implementation's own size checks (intermediate sizes, ...): (config, pp, tp, partition)
    check: Callable[..., None] | None = None
    config: Any = None


def stacks(config: Qwen3OmniMoeConfig | Qwen2_5OmniConfig) -> dict[str, list[Stack]]:
    """The transformer stacks each stage splits over its ranks (Qwen2.5-Omni: the encoder and thinker it serves)."""
    cfg: Any = config  # sub-configs are typed as `dict | PreTrainedConfig | None`; loaded ones are configs
    tc = cfg.thinker_config
    a, v, t = tc.audio_config, tc.vision_config, tc.text_config
    if isinstance(config, Qwen2_5OmniConfig):
        from omnimesh.models.qwen2_5_omni.parallel_dit import check_dit_layout
        from omnimesh.models.qwen2_5_omni.parallel_vision_tower import check_vision_layout_2_5

        tk, dit = cfg.talker_config, cfg.token2wav_config.dit_config
        return {
            "encoder": [Stack("audio tower", a.encoder_layers, a.encoder_attention_heads, a.encoder_attention_heads,
                              check=check_audio_layout, config=a),
                        Stack("vision tower", v.depth, v.num_heads, v.num_heads, check=check_vision_layout_2_5,
                              config=v)],
            "thinker": [Stack("thinker LM", t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads,
                              t.vocab_size, check=check_parallel_layout, config=t)],
            "talker": [Stack("talker LM", tk.num_hidden_layers, tk.num_attention_heads, tk.num_key_value_heads,
                             tk.vocab_size, check=check_parallel_layout, config=tk)],
            "vocoder": [Stack("token2wav DiT", dit.num_hidden_layers, dit.num_attention_heads, dit.num_attention_heads,
                              check=check_dit_layout, config=dit)],
        }
    tk, cp = cfg.talker_config.text_config, cfg.talker_config.code_predictor_config
    w = cfg.code2wav_config
    return {
        "encoder": [
            Stack("audio tower", a.encoder_layers, a.encoder_attention_heads, a.encoder_attention_heads,
                  check=check_audio_layout, config=a),
            Stack("vision tower", v.depth, v.num_heads, v.num_heads, check=check_vision_layout, config=v),
        ],
        "thinker": [Stack("thinker LM", t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.vocab_size,
                          check=check_parallel_layout, config=t)],
        "talker": [
            Stack("talker LM", tk.num_hidden_layers, tk.num_attention_heads, tk.num_key_value_heads, tk.vocab_size,
                  check=check_parallel_layout, config=tk),
            Stack("code predictor", cp.num_hidden_layers, cp.num_attention_heads, cp.num_key_value_heads, cp.vocab_size,
                  check=check_dense_layout, config=cp),
        ],
        "vocoder": [Stack("code2wav transformer", w.num_hidden_layers, w.num_attention_heads, w.num_key_value_heads,
                          check=check_code2wav_layout, config=w)],
    }


def _divisors(*numbers: int) -> list[int]:
    return [d for d in range(1, min(numbers) + 1) if all(n % d == 0 for n in numbers)]


def check_layout(config: Qwen3OmniMoeConfig | Qwen2_5OmniConfig, layouts: dict[str, StageConfig]) -> list[str]:
    """Raise ValueError for a layout the model cannot take; return advice lines for valid but poor ones."""
    advice: list[str] = []
    for stage, cfg in layouts.items():
        for i, s in enumerate(stacks(config)[stage]):
            counts = [s.heads, s.kv_heads] + ([s.vocab] if s.vocab else [])
            if any(n % cfg.tp for n in counts):
                what = f"{s.heads} attention heads, {s.kv_heads} KV heads" + (f", vocab {s.vocab}" if s.vocab else "")
                raise ValueError(
                    f"stage {stage}: tp={cfg.tp} does not divide the {s.name}'s {what}; "
                    f"tp must be one of {_divisors(*counts)}"
                )
            if cfg.pp > s.layers:
                raise ValueError(f"stage {stage}: pp={cfg.pp} exceeds the {s.name}'s {s.layers} layers; use pp <= {s.layers}")
            # a custom partition describes the stage's main stack (listed first); the others split evenly
            if cfg.pp_layer_partition is not None and i == 0 and sum(cfg.pp_layer_partition) != s.layers:
                raise ValueError(
                    f"stage {stage}: pp_layer_partition {list(cfg.pp_layer_partition)} sums to "
                    f"{sum(cfg.pp_layer_partition)}, but the {s.name} has {s.layers} layers"
                )
            if s.check is not None:  # what the parallel implementation itself needs (e.g. intermediate sizes)
                try:
                    s.check(s.config, cfg.pp, cfg.tp,
                            list(cfg.pp_layer_partition) if cfg.pp_layer_partition is not None and i == 0 else None)
                except ValueError as exc:
                    raise ValueError(f"stage {stage} ({s.name}): {exc}") from exc
            if cfg.pp > 1 and s.layers % cfg.pp and (cfg.pp_layer_partition is None or i > 0):
                advice.append(
                    f"stage {stage}: the {s.name}'s {s.layers} layers do not divide evenly over pp={cfg.pp}; "
                    f"the extra layers go to the middle ranks (or give pp_layer_partition)"
                )
        if cfg.pp & (cfg.pp - 1):
            advice.append(f"stage {stage}: pp={cfg.pp} is not a power of two; 2, 4 or 8 split more evenly")
    return advice
