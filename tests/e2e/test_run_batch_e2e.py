"""`omnimesh run-batch` (omnimesh/run_batch.py), vLLM's offline batch command, in real processes.

- Against the shared mesh (`--url`): chat, completion and Responses lines come back in the input's order in
  OpenAI's batch output format, each body what the same request gets sent alone; a line the server refuses
  keeps its 400 and its error body, and the exit code is 1.
- With a mesh of its own (`--max-num-seqs 1 --max-waiting-requests 0`: every request beyond the one running
  is a 429): requests sent 4 at a time are sent again after Retry-After until each is answered, so the batch
  ends 0 with every line a 200; stdin in, stdout out, nothing but the output lines on stdout.
- A bad file stops the run before anything starts (exit 2, the line named); the flags a run hands the mesh
  parse back to the same settings.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from omnimesh.cli import build_parser
from omnimesh.config.serve_args import ServeArgs, from_namespace, to_argv
from omnimesh.run_batch import read_batch

REPO = Path(__file__).resolve().parents[2]
CHAT = {"model": "tiny-qwen3-omni", "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 8, "temperature": 0}


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def _run(*argv: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnimesh.cli", "run-batch", *argv], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_a_batch_against_a_running_server(mesh, tmp_path: Path) -> None:
    completion = {"model": "tiny-qwen3-omni", "prompt": "The sea is", "max_tokens": 5, "temperature": 0}
    responses = {"model": "tiny-qwen3-omni", "input": "Say hi.", "max_output_tokens": 6, "temperature": 0}
    bad = {**CHAT, "max_tokens": -1}
    src = tmp_path / "in.jsonl"
    src.write_text(_line("c1", "/v1/chat/completions", CHAT) + "\n" + _line("p1", "/v1/completions", completion)
                   + _line("r1", "/v1/responses", responses) + _line("bad", "/v1/chat/completions", bad))
    out = tmp_path / "out.jsonl"
    done = _run("-i", str(src), "-o", str(out), "--url", mesh.rest)
    assert done.returncode == 1, done.stderr  # one line was refused
    assert "3 answered 2xx, 1 not (3 x 200, 1 x 400)" in done.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["c1", "p1", "r1", "bad"]
    assert all(r["id"].startswith("batch_req_") for r in rows) and len({r["id"] for r in rows}) == 4
    alone = {"c1": httpx.post(f"{mesh.rest}/v1/chat/completions", json=CHAT, timeout=60).json(),
             "p1": httpx.post(f"{mesh.rest}/v1/completions", json=completion, timeout=60).json()}
    c1, p1, r1, refused = rows
    assert c1["response"]["status_code"] == 200 and c1["error"] is None
    assert c1["response"]["body"]["choices"][0]["message"]["content"] == alone["c1"]["choices"][0]["message"]["content"]
    assert c1["response"]["request_id"] == c1["response"]["body"]["id"]
    assert p1["response"]["body"]["choices"][0]["text"] == alone["p1"]["choices"][0]["text"]
    assert r1["response"]["status_code"] == 200 and r1["response"]["body"]["object"] == "response"
    assert refused["response"]["status_code"] == 400 and "max_tokens" in refused["response"]["body"]["error"]["message"]


def test_a_batch_on_a_mesh_of_its_own_rides_out_backpressure(tiny_model_dir: Path) -> None:
    lines = "".join(_line(f"q{i}", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": f"Question {i}?"}]}) for i in range(4))
    done = _run(str(tiny_model_dir), "-i", "-", "-o", "-", "--max-num-seqs", "1", "--max-waiting-requests", "0",
                "--max-concurrency", "4", "--stage-overrides", '{"talker": {"num_replicas": 0}, "vocoder": '
                '{"num_replicas": 0}}', stdin=lines)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(x) for x in done.stdout.splitlines()]  # stdout: the output lines only
    assert [r["custom_id"] for r in rows] == ["q0", "q1", "q2", "q3"]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in rows)
    assert '"POST /v1/chat/completions HTTP/1.1" 429' in done.stderr  # it was refused, and sent again


@pytest.mark.parametrize("text, message", [
    ("", "holds no requests"),
    ("{nope\n", "line 1: not JSON"),
    ("[1]\n", "line 1: must be a JSON object"),
    (_line("a", "/v1/chat/completions", CHAT) + _line("a", "/v1/completions", {}), "line 2: custom_id 'a' is already "
                                                                                   "the id of line 1"),
    (_line("", "/v1/chat/completions", CHAT), "custom_id must be a non-empty string"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/models", "body": {}}), 'method must be "POST"'),
    (_line("a", "/v1/embeddings", {}), "url must be one of /v1/chat/completions, /v1/completions, /v1/responses"),
    (_line("a", "/v1/chat/completions", {**CHAT, "stream": True}), "body.stream: a batch request is answered whole"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}), "body must be a JSON"),
])
def test_bad_batch_files(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_batch(io.BytesIO(text.encode()), "in.jsonl")


def test_a_line_that_is_not_utf8() -> None:
    with pytest.raises(ValueError, match=r"in.jsonl line 2: not UTF-8 \(byte 15\)"):
        read_batch(io.BytesIO(_line("a", "/v1/completions", {}).encode() + b'{"custom_id": "\xff"}\n'), "in.jsonl")


def test_a_url_where_nothing_answers_or_no_url_stops_the_run_before_any_line(tmp_path: Path) -> None:
    """Each line was sent and failed as "no answer" (exit 1, the reason only in the output file); a --url that
    is no http(s) address, or where nothing answers, is now the run's error at once (exit 2). A line that gets
    no answer from a server that was up stays that line's error (`send_all`)."""
    from omnimesh.proc_utils import free_port

    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", "/v1/chat/completions", CHAT) + _line("b", "/v1/completions", {"prompt": "x"}))
    port = free_port()
    done = _run("-i", str(src), "-o", "-", "--url", f"http://127.0.0.1:{port}", timeout=120)
    assert done.returncode == 2 and f"--url http://127.0.0.1:{port}: nothing answers there (ConnectError" in done.stderr
    assert done.stdout == ""
    done = _run("-i", str(src), "-o", "-", "--url", "notaurl", timeout=120)
    assert done.returncode == 2 and "--url 'notaurl': give the server's http(s) address" in done.stderr
    # a server gone once the run has started: each line still gets its row, its error saying why
    import asyncio

    from omnimesh.run_batch import read_batch, send_all

    with open(src, "rb") as f:
        lines = read_batch(f, str(src))
    rows = asyncio.run(send_all(lines, f"http://127.0.0.1:{port}", None, 2, 10.0))
    assert [r["custom_id"] for r in rows] == ["a", "b"] and all(r["response"] is None for r in rows)
    assert all(r["error"]["code"] == "request_failed" and "ConnectError" in r["error"]["message"] for r in rows)


def test_a_bad_file_stops_the_run_before_anything_starts(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", "/v1/chat/completions", CHAT) + "{nope\n")
    done = _run("-i", str(src), "-o", str(tmp_path / "out.jsonl"), timeout=60)
    assert done.returncode == 2 and f"{src} line 2: not JSON" in done.stderr
    assert not (tmp_path / "out.jsonl").exists() and "omnimesh serving" not in done.stderr
    missing = _run("-i", str(tmp_path / "none.jsonl"), "-o", "-", timeout=60)
    assert missing.returncode == 2 and "cannot read it" in missing.stderr


def test_the_flags_a_run_hands_its_mesh_parse_back_to_the_same_settings(tmp_path: Path) -> None:
    args = ServeArgs(model=str(tmp_path), served_model_name=("a", "b"), tensor_parallel_size=2, kv_cache_dtype="fp8",
                     enable_chunked_prefill=False, enable_prefix_caching=True, enable_log_requests=True,
                     gpu_memory_utilization=0.5, stage_overrides='{"talker": {"max_num_seqs": 4}}', seed=7)
    argv = to_argv(args)
    assert argv[0] == str(tmp_path) and "--no-enable-chunked-prefill" in argv
    assert from_namespace(build_parser().parse_args(["serve", *argv])) == args
