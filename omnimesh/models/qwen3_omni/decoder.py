"""Run the layers of a Qwen3-Omni decoder stack: the one place that executes transformer layers.

Role: the swap point for parallelism. The step logic (`thinker.py`, `talker.py`) decides WHAT to feed
(inputs_embeds, explicit positions, a per-request KV cache) and what to emit; the functions here only run
the transformers sub-modules on it. A tensor/pipeline-parallel runner replaces these functions, nothing else.

Data flow:
    inputs_embeds (1, T, H) + position_ids (4, 1, T) + DynamicCache
        -> causal mask -> M-RoPE cos/sin -> layers (+ deepstack adds after the first layers) -> final norm
        -> DecoderOutput(last_hidden (1, T, H), captured (1, T, H) | None)
    code predictor: inputs_embeds (1, T, H) + position_ids (1, T) + DynamicCache -> last_hidden (1, T, H)

It mirrors `Qwen3OmniMoeThinkerTextModel.forward` / `Qwen3OmniMoeTalkerModel.forward` line for line (so the
numbers equal `generate`'s), minus output recording: the one hidden state the talker needs is captured here
with the same convention as `output_hidden_states` (index 0 = layer input, i = output of layer i-1 BEFORE
its deepstack add, num_layers = after the final norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask


@dataclass
class DecoderOutput:
    last_hidden: torch.Tensor  # (1, T, H), after the final norm
    captured: torch.Tensor | None  # (1, T, H) hidden state at `capture_layer`, when asked for


def run_decoder(
    text_model: Any,
    inputs_embeds: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    visual_pos_mask: torch.Tensor | None = None,
    deepstack: list[torch.Tensor] | None = None,
    capture_layer: int | None = None,
) -> DecoderOutput:
    """Run a thinker or talker text model (`.layers`, `.norm`, `.rotary_emb`) on one request's tokens.

    `position_ids` is (4, 1, T): row 0 the text positions (mask only), rows 1..3 the M-RoPE t/h/w positions.
    `deepstack[i]` (n_visual, H) is added at `visual_pos_mask` (1, T) after layer i.
    """
    text_positions, mrope_positions = position_ids[0], position_ids[1:]  # (1, T), (3, 1, T)
    mask = create_causal_mask(
        config=text_model.config, inputs_embeds=inputs_embeds, attention_mask=None,
        past_key_values=cache, position_ids=text_positions,
    )
    position_embeddings = text_model.rotary_emb(inputs_embeds, mrope_positions)  # 2 x (1, T, head_dim)
    num_layers = len(text_model.layers)
    hidden = inputs_embeds  # (1, T, H)
    captured = hidden if capture_layer == 0 else None
    for idx, layer in enumerate(text_model.layers):
        hidden = layer(
            hidden, attention_mask=mask, position_ids=text_positions, past_key_values=cache,
            position_embeddings=position_embeddings,
        )  # (1, T, H)
        if capture_layer == idx + 1 and capture_layer < num_layers:
            captured = hidden
        if deepstack is not None and idx < len(deepstack):
            hidden = text_model._deepstack_process(hidden, visual_pos_mask, deepstack[idx])  # (1, T, H)
    hidden = text_model.norm(hidden)  # (1, T, H)
    if capture_layer == num_layers:
        captured = hidden
    return DecoderOutput(last_hidden=hidden, captured=captured)


def run_code_predictor(
    predictor_model: Any, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache
) -> torch.Tensor:
    """Run the code predictor's small dense decoder: (1, T, H) at positions (1, T) -> last hidden (1, T, H)."""
    config = predictor_model.config
    masks: dict[str, Any] = {
        "full_attention": create_causal_mask(
            config=config, inputs_embeds=inputs_embeds, attention_mask=None, past_key_values=cache,
            position_ids=position_ids,
        )
    }
    if "sliding_attention" in config.layer_types:
        masks["sliding_attention"] = create_sliding_window_causal_mask(
            config=config, inputs_embeds=inputs_embeds, attention_mask=None, past_key_values=cache,
            position_ids=position_ids,
        )
    position_embeddings = predictor_model.rotary_emb(inputs_embeds, position_ids)
    hidden = inputs_embeds  # (1, T, H)
    for idx, layer in enumerate(predictor_model.layers[: config.num_hidden_layers]):
        hidden = layer(
            hidden, attention_mask=masks[config.layer_types[idx]], position_ids=position_ids, past_key_values=cache,
            use_cache=True, position_embeddings=position_embeddings,
        )  # (1, T, H)
    return predictor_model.norm(hidden)  # (1, T, H)
