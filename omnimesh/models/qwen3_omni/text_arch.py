"""What differs between the decoder LMs that `parallel_text_model.ParallelTextModel` runs, read from a config.

Role: one place that tells a Qwen3-Omni LM (thinker MoE, talker MoE + shared expert) from a Qwen2.5-Omni
LM (dense Qwen2 thinker or talker), so the rank model, the KV pool and the layout checks never test a
model type themselves.

    Qwen3-Omni (`qwen3_omni_moe_text`, `qwen3_omni_moe_talker_text`): per-head q/k RMSNorm, q/k/v/o bias
        = `attention_bias` (false in the released configs), interleaved M-RoPE (t, h, w on alternating
        frequency slots), MoE blocks (`decoder_sparse_step`, `mlp_only_layers`; the talker's every layer
        with a sigmoid-gated shared expert).
    Qwen2.5-Omni (`qwen2_5_omni_text`, `qwen2_5_omni_talker`): no q/k norm, biases on q/k/v but not o,
        M-RoPE in contiguous sections (the first `mrope_section[0]` frequencies t, the next h, then w),
        dense SiLU MLPs, head_dim = hidden / heads unless the config names it.

Data flow: a text config -> `text_arch(config)` -> `TextArch` (frozen; ValueError for a model type or
option this code does not run, naming it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QWEN3_TYPES = ("qwen3_omni_moe_text", "qwen3_omni_moe_talker_text")
QWEN2_TYPES = ("qwen2_5_omni_text", "qwen2_5_omni_talker")


@dataclass(frozen=True)
class TextArch:
    family: str  # "qwen3_omni" | "qwen2_5_omni"
    head_dim: int
    qk_norm: bool  # per-head RMSNorm of q and k before the rotation
    qkv_bias: bool
    o_bias: bool
    interleaved_mrope: bool  # Qwen3's t/h/w slot interleaving; else contiguous sections (Qwen2-VL style)
    num_experts: int  # 0: every layer dense
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def sparse(self, layer_idx: int, is_talker: bool) -> bool:
        """Whether layer `layer_idx` is a MoE block (Qwen3-Omni's talker: every layer)."""
        if self.num_experts == 0:
            return False
        return is_talker or (layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0)


def text_arch(config: Any) -> TextArch:
    """The decoder family and options of a thinker / talker text config (ValueError if this code cannot run it)."""
    model_type = getattr(config, "model_type", "")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if model_type in QWEN3_TYPES:
        bias = bool(getattr(config, "attention_bias", False))
        return TextArch("qwen3_omni", int(head_dim), qk_norm=True, qkv_bias=bias, o_bias=bias, interleaved_mrope=True,
                        num_experts=int(getattr(config, "num_experts", 0)),
                        decoder_sparse_step=int(getattr(config, "decoder_sparse_step", 1)),
                        mlp_only_layers=tuple(getattr(config, "mlp_only_layers", ()) or ()))
    if model_type in QWEN2_TYPES:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(f"{model_type}: use_sliding_window=true is not supported (the released Qwen2.5-Omni "
                             f"configs use full attention in every layer)")
        return TextArch("qwen2_5_omni", int(head_dim), qk_norm=False, qkv_bias=True, o_bias=False,
                        interleaved_mrope=False, num_experts=0, decoder_sparse_step=1, mlp_only_layers=())
    raise ValueError(f"text model type {model_type!r} is not supported; supported: {', '.join(QWEN3_TYPES + QWEN2_TYPES)}")
