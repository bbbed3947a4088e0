"""`--enable-log-requests` / `--max-log-len` / `--enable-log-outputs` in a real `omnimesh gateway` on the shared
mesh's stages: a request that completes logs a `Received` line (id, model, prompt cut to --max-log-len, token
count, sampling, stage_params), a `Generated response` line with the text the client got (cut the same way)
and a `Finished` line with its finish reason and tokens; a spoken answer's line gives its seconds of audio; one
refused after arriving logs its status and error; a stream the client drops logs what it had and `cancelled`;
a completion's prompt is logged as its token ids. The shared mesh (flags off) logs no such line."""

from __future__ import annotations

import re

import httpx
from mesh_harness import start_gateway

BODY = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Tell me about the sea, please."}],
        "max_tokens": 8, "temperature": 0, "stage_params": {"talker": {"top_k": 10}}}


def test_requests_are_logged_when_asked(mesh, tiny_model_dir) -> None:
    proc, url = start_gateway(tiny_model_dir, mesh.stages, "--enable-log-requests", "--max-log-len", "12",
                              "--enable-log-outputs")
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=BODY, headers={"X-Request-Id": "log-1"}, timeout=60)
        assert r.status_code == 200, r.text
        n = r.json()["usage"]["prompt_tokens"]
        got = proc.wait_for_line(r"Received request chatcmpl-log-1: (.*)$", timeout_s=10).group(1)
        assert got == (f"model=tiny-qwen3-omni, modalities=text, voice=None, prompt='user: Tell m... (24 more "
                       f"characters)' ({n} tokens, 0 audio, 0 images), sampling=temperature=0.0 max_tokens=8, "
                       f"stage_params=talker: top_k=10"), got
        proc.wait_for_line(rf"Finished request chatcmpl-log-1: length, {n} prompt \+ 8 completion tokens in "
                           r"[\d.]+ s", timeout_s=10)
        text = r.json()["choices"][0]["message"]["content"]
        said = [line for line in proc.lines if "Generated response chatcmpl-log-1:" in line]
        cut = text if len(text) <= 12 else text[:12] + f"... ({len(text) - 12} more characters)"
        assert len(said) == 1 and said[0].endswith(f"Generated response chatcmpl-log-1: output={cut!r}"), said
        long = {**BODY, "max_tokens": 10**6}
        assert httpx.post(f"{url}/v1/chat/completions", json=long, headers={"X-Request-Id": "log-2"},
                          timeout=60).status_code == 400
        proc.wait_for_line(r"Finished request chatcmpl-log-2: failed \(400\): the prompt is \d+ tokens", timeout_s=10)
        stream = {**BODY, "stream": True, "max_tokens": 2000, "min_tokens": 2000}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=stream, headers={"X-Request-Id": "log-3"},
                          timeout=60) as s:
            assert s.status_code == 200
            next(s.iter_lines())
        proc.wait_for_line(r"Finished request chatcmpl-log-3: cancelled \(the client stopped reading\)", timeout_s=20)
        assert any("Generated response chatcmpl-log-3: output='" in line for line in proc.lines)
        spoken = {**BODY, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"},
                  "stage_params": {"talker": {"max_tokens": 12}}}
        assert httpx.post(f"{url}/v1/chat/completions", json=spoken, headers={"X-Request-Id": "log-5"},
                          timeout=60).status_code == 200
        proc.wait_for_line(r"Generated response chatcmpl-log-5: output='.*', \d+\.\d\d s of audio$", timeout_s=10)
        # a completion's prompt is logged as its token ids (cut to --max-log-len ids), as vLLM logs them
        ids = list(range(20, 40))
        assert httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 2},
                          headers={"X-Request-Id": "log-4"}, timeout=60).status_code == 200
        got = proc.wait_for_line(r"Received request cmpl-log-4: .*prompt='(.*)' \(20 tokens", timeout_s=10).group(1)
        assert got == f"token ids {ids[:12]}... (8 more)", got
    finally:
        assert proc.stop() == 0, proc.output()
    assert not any(re.search(r"(Received|Finished) request|Generated response", line) for line in mesh.proc.lines)
