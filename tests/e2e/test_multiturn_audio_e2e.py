"""OpenAI's multi-turn audio through the shared mesh: a spoken answer's `audio.id`, sent back as the assistant's
turn of the next chat, is read as that answer's transcript — the next answer equals the one given when the
transcript itself is the turn's content (greedy)."""

from __future__ import annotations

import httpx

MODEL = "tiny-qwen3-omni"


def _chat(mesh, messages: list[dict], **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 8, **extra}
    r = httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


def test_a_spoken_answer_named_by_its_id_is_its_transcript(mesh):
    ask = {"role": "user", "content": "Tell me about the sea."}
    first = _chat(mesh, [ask], modalities=["text", "audio"], stage_params={"talker": {"max_tokens": 20}})
    audio = first["audio"]
    assert audio["transcript"] == first["content"] and audio["id"].startswith("audio_")
    follow = {"role": "user", "content": "And the moon?"}
    by_id = _chat(mesh, [ask, {"role": "assistant", "audio": {"id": audio["id"]}}, follow])
    by_text = _chat(mesh, [ask, {"role": "assistant", "content": audio["transcript"]}, follow])
    assert by_id["content"] == by_text["content"]
    def tokens(assistant: dict) -> list[int]:
        return httpx.post(f"{mesh.rest}/tokenize", timeout=60, json={
            "model": MODEL, "messages": [ask, {"role": "assistant", **assistant}, follow]}).json()["tokens"]

    assert tokens({"audio": {"id": audio["id"]}}) == tokens({"content": audio["transcript"]})
    missing = httpx.post(f"{mesh.rest}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [ask, {"role": "assistant", "audio": {"id": "audio_0"}}, follow]})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages[1].audio.id"
