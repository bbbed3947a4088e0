"""The built-in tiny Qwen2.5-Omni configuration: real `transformers` config classes, tiny sizes.

Role: the single source of the tiny Qwen2.5-Omni's sizes and special-token ids (sizes follow
`shared/MODELS.md`: hidden 64, 4 thinker layers, vocab 512). The tests build from here.

Qwen2.5-Omni differs from Qwen3-Omni where omnimesh feels it: a dense Qwen2 thinker LM (q/k/v biases, no
q/k norm, M-RoPE in contiguous t/h/w sections rather than interleaved), a Whisper-style audio tower, a
Qwen2.5-VL vision tower with window attention, a dense talker over one codec stream, and a DiT + BigVGAN
token2wav. Special-token ids sit where the tiny Qwen3-Omni's do (ordinary BPE tokens below 400), under
Qwen2.5-Omni's own names (`<|AUDIO|>`, `<|IMAGE|>`, `<|vision_bos|>`, ...).
"""

from __future__ import annotations

from transformers import Qwen2_5OmniConfig

from omnimesh.models.qwen3_omni import tiny_config as qwen3
from omnimesh.models.qwen3_omni.tiny_config import ORDINARY_VOCAB_LIMIT, ROLE_TOKENS, THINKER_VOCAB

__all__ = ["ORDINARY_VOCAB_LIMIT", "ROLE_TOKENS", "THINKER_VOCAB"]  # the tiny Qwen3-Omni's, shared

# Qwen3-Omni's token names -> Qwen2.5-Omni's; every id stays where the tiny Qwen3-Omni has it
RENAMED: dict[str, str] = {
    "<|vision_start|>": "<|vision_bos|>", "<|vision_end|>": "<|vision_eos|>", "<|image_pad|>": "<|IMAGE|>",
    "<|video_pad|>": "<|VIDEO|>", "<|audio_start|>": "<|audio_bos|>", "<|audio_end|>": "<|audio_eos|>",
    "<|audio_pad|>": "<|AUDIO|>", "<|tts_pad|>": "<|tts_text_pad|>", "<|tts_bos|>": "<|tts_text_bos|>",
    "<|tts_eos|>": "<|tts_text_eos|>",
}
# token text -> id (Qwen2.5-Omni's names)
SPECIAL_TOKENS: dict[str, int] = {RENAMED.get(name, name): i for name, i in qwen3.SPECIAL_TOKENS.items()}

CODEC_VOCAB = 512  # codes 0..499, the talker's control ids from 500
CODEC_IDS: dict[str, int] = {
    "tts_codec_pad_token_id": 500,
    "tts_codec_start_token_id": 501,
    "tts_codec_end_token_id": 502,
    "tts_codec_mask_token_id": 503,
}
HEAD_DIM = 16
MROPE_SECTION = [2, 3, 3]  # t, h, w: sums to HEAD_DIM / 2


def _rope() -> dict:
    return {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": list(MROPE_SECTION)}


def tiny_qwen2_5_omni_config(audio_output: bool = True) -> Qwen2_5OmniConfig:
    """Return the tiny Qwen2.5-Omni config (hidden 64, 4 thinker layers, vocab 512)."""
    sp = SPECIAL_TOKENS
    text = dict(
        vocab_size=THINKER_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_parameters=_rope(),
        tie_word_embeddings=False,
    )
    audio = dict(
        num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
        max_source_positions=1500, n_window=100, output_dim=64,
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=64,
        fullatt_block_indexes=[1],
    )
    thinker = dict(
        audio_config=audio, vision_config=vision, text_config=text,
        audio_token_index=sp["<|AUDIO|>"], image_token_index=sp["<|IMAGE|>"], video_token_index=sp["<|VIDEO|>"],
        audio_start_token_id=sp["<|audio_bos|>"], audio_end_token_id=sp["<|audio_eos|>"],
        vision_start_token_id=sp["<|vision_bos|>"], vision_end_token_id=sp["<|vision_eos|>"],
        user_token_id=ROLE_TOKENS["user"], position_id_per_seconds=25, seconds_per_chunk=2,
        pad_token_id=sp["<|endoftext|>"], tie_word_embeddings=False,
    )
    talker = dict(
        vocab_size=CODEC_VOCAB, embedding_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=4096,
        rope_parameters=_rope(), audio_token_index=sp["<|AUDIO|>"], image_token_index=sp["<|IMAGE|>"],
        video_token_index=sp["<|VIDEO|>"], vision_start_token_id=sp["<|vision_bos|>"],
        vision_end_token_id=sp["<|vision_eos|>"], audio_start_token_id=sp["<|audio_bos|>"],
        audio_end_token_id=sp["<|audio_eos|>"], tts_text_start_token_id=sp["<|tts_text_bos|>"],
        tts_text_end_token_id=sp["<|tts_text_eos|>"], tts_text_pad_token_id=sp["<|tts_text_pad|>"],
        position_id_per_seconds=25, seconds_per_chunk=2, spatial_merge_size=2, **CODEC_IDS,
    )
    token2wav = dict(
        dit_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16, ff_mult=2,
                        emb_dim=32, mel_dim=80, num_embeds=CODEC_VOCAB, repeats=2, block_size=24,
                        look_ahead_layers=[1], look_backward_layers=[0], enc_emb_dim=16, enc_dim=32,
                        enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16, enc_se_channels=16),
        bigvgan_config=dict(mel_dim=80, upsample_initial_channel=64, upsample_rates=[5, 3, 2, 2, 2, 2],
                            upsample_kernel_sizes=[11, 7, 4, 4, 4, 4]),
    )
    return Qwen2_5OmniConfig(thinker_config=thinker, talker_config=talker, token2wav_config=token2wav,
                             enable_audio_output=audio_output)
