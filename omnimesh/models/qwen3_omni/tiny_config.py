"""The built-in tiny Qwen3-Omni configuration: real `transformers` config classes, tiny sizes.

Role: the single source of the tiny model's sizes and special-token ids. `tiny.py` (the folder builder)
and the tests build from here; nothing else hard-codes these numbers. Sizes follow `shared/MODELS.md`.

Special-token ids (thinker vocab 512): ordinary BPE tokens live below 400, the chat/role/media tokens at
the fixed ids in `SPECIAL_TOKENS`, and every other id below 512 is a reserved special token.
Talker codec vocab 1280: codes 0..255 (the code2wav codebook); `generate` suppresses ids 256..1279 except
the codec EOS, so every codec control id lives up there.
"""

from __future__ import annotations

from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

THINKER_VOCAB = 512
ORDINARY_VOCAB_LIMIT = 400

# token text -> id; the tokenizer builder puts each at exactly this id.
SPECIAL_TOKENS: dict[str, int] = {
    "<|im_start|>": 400,
    "<|im_end|>": 401,
    "<|endoftext|>": 402,
    "<|audio_start|>": 403,
    "<|audio_end|>": 404,
    "<|audio_pad|>": 405,
    "<|vision_start|>": 406,
    "<|vision_end|>": 407,
    "<|image_pad|>": 408,
    "<|video_pad|>": 409,
    "<|tts_pad|>": 410,
    "<|tts_bos|>": 411,
    "<|tts_eos|>": 412,
}
# Role words are ordinary (non-special) tokens in the real vocab; the talker finds user/assistant turns
# by these ids, so the tokenizer must map each word to exactly one token at this id.
ROLE_TOKENS: dict[str, int] = {"user": 413, "assistant": 414, "system": 415}
# the reasoning markers of the thinker-only (Thinking) variant: added tokens that are not special, as in Qwen3's vocab
THINK_TOKENS: dict[str, int] = {"<think>": 416, "</think>": 417}
# the Hermes function-call markers: added tokens that are not special, one token each, as in Qwen's vocab (a spoken
# answer stops its speech at <tool_call>: gateway/spoken_calls.py)
TOOL_TOKENS: dict[str, int] = {"<tool_call>": 418, "</tool_call>": 419}

CODEC_VOCAB = 1280
CODEBOOK_SIZE = 256
NUM_CODE_GROUPS = 4
CODEC_IDS: dict[str, int] = {
    "codec_pad_id": 1000,
    "codec_bos_id": 1001,
    "codec_eos_token_id": 1002,
    "codec_nothink_id": 1003,
    "codec_think_bos_id": 1004,
    "codec_think_eos_id": 1005,
}
SPEAKERS: dict[str, int] = {"ethan": 1010, "chelsie": 1011, "aiden": 1012}


def _rope(head_dim: int, mrope: bool) -> dict:
    params: dict = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if mrope:
        # M-RoPE sections (t, h, w) must sum to head_dim / 2.
        params["mrope_section"] = [2, 3, 3] if head_dim == 16 else [head_dim // 2, 0, 0]
        params["interleaved"] = True
    return params


def tiny_qwen3_omni_config() -> Qwen3OmniMoeConfig:
    """Return the tiny Qwen3-Omni config (hidden 64, 4 thinker layers, vocab 512)."""
    sp = SPECIAL_TOKENS
    text = dict(
        vocab_size=THINKER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        rope_parameters=_rope(16, mrope=True),
    )
    audio = dict(
        num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
        max_source_positions=1500, n_window=50, output_dim=64, n_window_infer=800, conv_chunksize=500,
        downsample_hidden_size=16,
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    thinker = dict(
        audio_config=audio, vision_config=vision, text_config=text,
        audio_start_token_id=sp["<|audio_start|>"], user_token_id=ROLE_TOKENS["user"],
        audio_token_id=sp["<|audio_pad|>"], image_token_id=sp["<|image_pad|>"],
        video_token_id=sp["<|video_pad|>"], vision_start_token_id=sp["<|vision_start|>"],
        vision_end_token_id=sp["<|vision_end|>"], audio_end_token_id=sp["<|audio_end|>"],
        position_id_per_seconds=25, tie_word_embeddings=False,
    )
    talker_text = dict(
        vocab_size=CODEC_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        rope_parameters=_rope(16, mrope=True),
    )
    code_predictor = dict(
        vocab_size=CODEBOOK_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        num_code_groups=NUM_CODE_GROUPS, rope_parameters=_rope(16, mrope=False),
    )
    talker = dict(
        text_config=talker_text, code_predictor_config=code_predictor, num_code_groups=NUM_CODE_GROUPS,
        thinker_hidden_size=64, accept_hidden_layer=2, speaker_id=dict(SPEAKERS),
        audio_token_id=sp["<|audio_pad|>"], image_token_id=sp["<|image_pad|>"],
        video_token_id=sp["<|video_pad|>"], vision_start_token_id=sp["<|vision_start|>"],
        audio_start_token_id=sp["<|audio_start|>"], position_id_per_seconds=25, spatial_merge_size=2,
        **CODEC_IDS,
    )
    code2wav = dict(
        codebook_size=CODEBOOK_SIZE, hidden_size=64, max_position_embeddings=8000,
        rope_parameters=_rope(16, mrope=False), num_attention_heads=4, num_key_value_heads=4,
        sliding_window=72, intermediate_size=128, num_hidden_layers=2, num_quantizers=NUM_CODE_GROUPS,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, enable_audio_output=True,
        im_start_token_id=sp["<|im_start|>"], im_end_token_id=sp["<|im_end|>"],
        tts_pad_token_id=sp["<|tts_pad|>"], tts_bos_token_id=sp["<|tts_bos|>"],
        tts_eos_token_id=sp["<|tts_eos|>"], system_token_id=ROLE_TOKENS["system"],
        user_token_id=ROLE_TOKENS["user"], assistant_token_id=ROLE_TOKENS["assistant"],
    )
