"""Admission through a real `omnimesh serve` of this module's own.

--max-num-seqs 1 --max-waiting-requests 1 (the flags travel launcher -> stage): request A streams and
holds the thinker's only seat, B is admitted to wait, and C is answered HTTP 429 with `Retry-After` and a
message naming the flag, streaming or not, before any event. Nothing admitted is lost: A runs to its
`min_tokens` and B finishes with exactly the text it gets alone; once they are done C is served.
--limit-mm-per-prompt '{"video": 0}' --input-limits '{"max_audio_seconds": 0.5}' (launcher -> gateway):
a video is refused on REST and gRPC, and 1 s of audio is a 413 naming the limit.
--override-generation-config '{"max_new_tokens": 3}' and the talker's default_sampling_params
{"max_tokens": 5} (launcher -> thinker / talker): a request that sets neither runs to them, exactly as one
that asks for them. --mm-processor-kwargs '{"max_pixels": 4096}' (launcher -> gateway): an image costs the
prompt tokens the processor with that setting gives, fewer than the folder's own. --kv-cache-dtype fp8
(launcher -> talker) with the thinker's own "auto" in --stage-overrides: the talker keeps its KV cache in fp8,
4x the tokens of the float32 default in the same memory, the thinker in float32 (its fused CPU decode kernel
takes float32 pools only: A's 4000 tokens took 16 s on fp8 against 6 s). --no-enable-chunked-prefill
(launcher -> thinker / talker): both prefill prompts whole, their step budget max_model_len. --log-config-file
(vLLM's; through the environment to every process): the stages' and the gateway's records, uvicorn's access
lines among them, come out in its format. Every wait is bounded.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from mesh_harness import start_mesh
from reference import chat_request, mp4_bytes, openai_content, png_bytes, sine_wav

from omnimesh.v1 import omni_pb2, omni_pb2_grpc, stage_pb2, stage_pb2_grpc

MODEL = "tiny-qwen3-omni"
TIMEOUT_S = 120.0
LONG = 4000  # A's tokens (min_tokens = max_tokens: no early stop): it holds the seat 4-10 s (max_model_len 4096)


LOG_CONFIG = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"tagged": {"format": "LOGCFG %(levelname)s %(name)s: %(message)s"}},
              "handlers": {"err": {"class": "logging.StreamHandler", "formatter": "tagged", "stream": "ext://sys.stderr"}},
              "root": {"level": "INFO", "handlers": ["err"]}}


@pytest.fixture(scope="module")
def capped(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_config = tmp_path_factory.mktemp("logging") / "logging.json"
    log_config.write_text(json.dumps(LOG_CONFIG))
    m = start_mesh(tiny_model_dir, "--log-config-file", str(log_config), "--max-num-seqs", "1", "--max-waiting-requests", "1",
                   "--limit-mm-per-prompt", '{"video": 0}', "--input-limits", '{"max_audio_seconds": 0.5}',
                   "--override-generation-config", '{"max_new_tokens": 3}',
                   "--stage-overrides", '{"talker": {"default_sampling_params": {"max_tokens": 5}}, '
                                        '"thinker": {"kv_cache_dtype": "auto"}}',
                   "--mm-processor-kwargs", '{"max_pixels": 4096}', "--kv-cache-dtype", "fp8",
                   "--no-enable-chunked-prefill")
    try:
        yield m
    finally:
        code = m.proc.stop()
        assert code == 0, f"omnimesh serve exited with {code} on SIGTERM:\n{m.proc.output()}"


def _body(prompt: str, **over: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "modalities": ["text"],
            "max_tokens": 8, "temperature": 0, **over}


def _post(mesh, body: dict) -> httpx.Response:
    return httpx.post(f"{mesh.rest}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


def _thinker_waiting(mesh) -> float:
    """The thinker's `num_requests_waiting` gauge, from its own Metrics RPC (the gateway's /metrics scrapes
    every stage and leaves out one slower than 2 s: under load that read 0 while B waited)."""
    with grpc.insecure_channel(mesh.stages["thinker"]) as ch:
        text = stage_pb2_grpc.StageStub(ch).Metrics(stage_pb2.MetricsRequest(), timeout=TIMEOUT_S).text
    for line in text.splitlines():
        if line.startswith("omnimesh:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _assert_429(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded", err
    assert err["message"] == ("1 requests already waiting in thinker (--max-waiting-requests 1); "
                              "retry later or raise it"), err


def test_third_request_is_429_and_the_admitted_ones_finish(capped):
    alone = _post(capped, _body("B"))
    assert alone.status_code == 200, alone.text
    results: dict[str, httpx.Response] = {}
    waiter = threading.Thread(target=lambda: results.update(b=_post(capped, _body("B"))), daemon=True)
    usage = None
    a_body = _body("A", stream=True, max_tokens=LONG, min_tokens=LONG, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{capped.rest}/v1/chat/completions", json=a_body, timeout=TIMEOUT_S) as a:
        assert a.status_code == 200
        lines = a.iter_lines()
        while not next(lines).startswith('data: {"id"'):  # A's first chunk: it runs, holding the seat
            pass
        waiter.start()
        deadline = time.monotonic() + 30.0
        while _thinker_waiting(capped) < 1:  # B reached the thinker's engine and waits there
            assert time.monotonic() < deadline and "b" not in results, "B never waited in the thinker"
            time.sleep(0.02)
        _assert_429(_post(capped, _body("C")))
        with httpx.stream("POST", f"{capped.rest}/v1/chat/completions", json=_body("C", stream=True),
                          timeout=TIMEOUT_S) as c:
            c.read()
        _assert_429(c)
        assert "b" not in results, "B finished before A: A did not hold the seat long enough for the test"
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                usage = chunk.get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == LONG
    waiter.join(TIMEOUT_S)
    b = results["b"]
    assert b.status_code == 200, b.text
    assert b.json()["choices"][0]["message"]["content"] == alone.json()["choices"][0]["message"]["content"]
    assert _post(capped, _body("C")).status_code == 200  # served once the queue drained


def test_the_gateways_input_limits_come_from_the_flags(capped):
    assert "gateway: input limits max_audio_seconds=0.5 (default 600), video refused" in capped.proc.output()
    no_video = "this server takes no video input (--limit-mm-per-prompt video=0)"
    r = _post(capped, {**_body("x"), "messages": [{"role": "user", "content": openai_content("x", None, None, mp4_bytes())}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == no_video, r.text
    r = _post(capped, {**_body("x"), "messages": [{"role": "user", "content": openai_content("x", sine_wav(1.0), None)}]})
    assert r.status_code == 413 and "audio is 1.0 s long; the limit is 0.5 s" in r.json()["error"]["message"], r.text
    request = omni_pb2.GenerateRequest(messages=[omni_pb2.ChatMessage(role="user", content=[
        omni_pb2.ContentPart(text="x"), omni_pb2.ContentPart(video=mp4_bytes())])], modalities=["text"])
    with grpc.insecure_channel(capped.grpc) as ch:
        (answer,) = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=TIMEOUT_S))
    assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and answer.error.message == no_video


def test_the_operators_sampling_defaults_apply(capped):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Sing."}], "modalities": ["text", "audio"],
            "audio": {"format": "pcm16"}, "temperature": 0}
    default = _post(capped, body)
    assert default.status_code == 200, default.text
    assert default.json()["usage"]["completion_tokens"] == 3 and default.json()["choices"][0]["finish_reason"] == "length"
    asked = _post(capped, {**body, "max_tokens": 3, "stage_params": {"talker": {"max_tokens": 5}}})
    assert asked.json()["choices"][0]["message"] == default.json()["choices"][0]["message"] | {
        "audio": asked.json()["choices"][0]["message"]["audio"]}
    pcm = [base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"]) for r in (default, asked)]
    assert pcm[0] == pcm[1] and 0 < len(pcm[0]) // 2 <= 5 * 1920  # at most 5 codes of 80 ms at 24 kHz
    assert "thinker: default sampling max_tokens=3" in capped.proc.output()
    assert "talker: default sampling max_tokens=5" in capped.proc.output()


def test_the_processor_settings_apply(capped, tiny_model_dir):
    from gateway.prompt import PromptBuilder

    png = png_bytes(128)
    body = {**_body("x"), "messages": [{"role": "user", "content": openai_content("What is it?", None, png)}]}
    r = _post(capped, body)
    assert r.status_code == 200, r.text
    req = chat_request("What is it?", None, png, max_tokens=1, talker_max=1, modalities=("text",))
    small = PromptBuilder(tiny_model_dir, max_model_len=4096, processor_kwargs={"max_pixels": 4096})(req)
    default = PromptBuilder(tiny_model_dir, max_model_len=4096)(req)
    assert r.json()["usage"]["prompt_tokens"] == small.input_ids.numel() < default.input_ids.numel()
    assert "gateway: processor settings max_pixels=4096" in capped.proc.output()


def test_the_kv_cache_dtypes_and_whole_prefills_reach_the_llm_stages(capped, tiny_model_dir: Path):
    import torch

    from omnimesh.models.qwen3_omni import paged_kv
    from omnimesh.models.qwen3_omni.paged_kv import CPU_KV_CACHE_BYTES
    from omnimesh.models.model_config import load_config

    config = load_config(tiny_model_dir)
    for stage, text, dtype in (("thinker", config.thinker_config.text_config, "auto"),
                               ("talker", config.talker_config.text_config, "fp8")):
        kind = paged_kv.kv_cache_dtype(dtype, torch.float32)
        per_block = paged_kv.block_bytes(text, text.num_hidden_layers, 1, 16, kind)
        line = capped.proc.wait_for_line(rf"{stage} KV cache: (\d+) blocks x 16 tokens = \d+ tokens "
                                         rf"\(kv-cache-dtype {dtype}\); batches of up to 1 sequences / "
                                         rf"{text.max_position_embeddings} tokens; chunked prefill off", timeout_s=5)
        assert int(line.group(1)) == CPU_KV_CACHE_BYTES // per_block  # fp8: 4x the float32 pool's blocks


def test_every_process_logs_in_the_log_config_files_format(capped):
    capped.proc.wait_for_line(r"^LOGCFG INFO omnimesh\.models\.qwen3_omni\.lm_engine: talker KV cache", timeout_s=5)
    capped.proc.wait_for_line(r"^LOGCFG INFO omnimesh\.models\.qwen3_omni\.lm_engine: thinker KV cache", timeout_s=5)
    assert _post(capped, _body("logged")).status_code == 200
    capped.proc.wait_for_line(r'^LOGCFG INFO uvicorn\.access: .*"POST /v1/chat/completions HTTP/1\.1" 200',
                              timeout_s=10)
