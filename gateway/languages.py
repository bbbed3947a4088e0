"""The spoken languages a transcription request may name, and the words the thinker is given for them.

Data flow: `/v1/audio/transcriptions` / `/translations` form field `language`, and the Realtime API's
`input_audio_transcription.language` -> `language_name` -> the language's English name for the instruction
(`gateway/transcription_api.instruction`), or a ValueError the caller turns into its 400 / error event.

OpenAI's API takes an ISO-639-1 code ("en", "de"); vLLM refuses codes its model does not list. The table is
Whisper's, from `transformers` (the 99 ISO-639-1 codes Whisper knows, and "yue" for Cantonese, which
Qwen3-Omni also hears), so a misspelt code is a clear 400 instead of a prompt that names a language no one
speaks.
"""

from __future__ import annotations

from transformers.models.whisper.tokenization_whisper import LANGUAGES


def language_name(code: str) -> str:
    """"en" -> "English"; an unknown code -> ValueError saying what is expected."""
    name = LANGUAGES.get(code.strip().lower())
    if name is None:
        raise ValueError(f"{code!r} is not an ISO-639-1 language code this server knows (e.g. 'en', 'zh', 'de', "
                         "'yue' for Cantonese)")
    return name.title()
