"""`omnimesh run-batch`: an OpenAI batch file (JSONL) through a mesh, as vLLM's `vllm run-batch`.

Data flow: the input file (or stdin) -> every line checked before anything starts (`read_batch`: a JSON object
with a unique `custom_id`, `method` POST, a `url` of BATCH_URLS and a `body` object that does not stream; the
first bad line stops the run, exit 2, naming the line) -> a mesh started for the run (`omnimesh serve` with the
command's flags, on loopback and free ports, its output on stderr, until its /health answers) or the server at
--url -> the requests sent --max-concurrency at a time; a 429 (a stage's queue is full) or 503 is sent again
after its Retry-After, so backpressure never fails a line -> one output line per input line, in the input's
order, OpenAI's batch output format: {"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"} -> the output file, written whole at the end (a temporary file renamed), or stdout. A request the
server answers with an error status is its line's response with that status, as OpenAI's batch output has
it; one that gets no answer (connection lost, timeout) is its line's `error`. Progress goes to the log.
Exit 0 when every line got a 2xx answer, 1 when some did not (the output is complete either way).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from omnimesh import json_text
from omnimesh.config.serve_args import HTTP_FRONT_FIELDS, ServeArgs, to_argv
from omnimesh.proc_utils import die_with_parent, free_port

log = logging.getLogger(__name__)

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
RETRY_STATUSES = (429, 503)  # a full queue, a stage restarting: sent again after Retry-After
RETRY_FOR_S = 600.0  # how long a line keeps being sent again before its last answer stands
START_MARGIN_S = 60.0
PROGRESS_EVERY_S = 10.0
# the mesh a run starts: plain http on loopback ports of its own (no TLS, socket or CORS), its key in its environment
MESH_SKIP = HTTP_FRONT_FIELDS | {"api_key"}


@dataclass(frozen=True)
class BatchLine:
    number: int  # in the input file, from 1
    custom_id: str
    url: str
    body: dict[str, Any]


def read_batch(stream: IO[bytes], where: str) -> list[BatchLine]:
    """Every request of a batch file (bytes, UTF-8); ValueError naming the first bad line."""
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(stream, 1):
        what = f"{where} line {number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{what}: not UTF-8 (byte {exc.start})") from None
        if not text.strip():
            continue
        try:
            item = json_text.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{what}: must be a JSON object with custom_id, method, url and body")
        custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            raise ValueError(f"{what}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise ValueError(f"{what}: custom_id {custom_id!r} is already the id of line {seen[custom_id]}; each "
                             f"request needs its own")
        if method != "POST":
            raise ValueError(f"{what}: method must be \"POST\", got {method!r}")
        if url not in BATCH_URLS:
            raise ValueError(f"{what}: url must be one of {', '.join(BATCH_URLS)}, got {url!r}")
        if not isinstance(body, dict):
            raise ValueError(f"{what}: body must be a JSON object (the request {url} takes)")
        if body.get("stream"):
            raise ValueError(f"{what}: body.stream: a batch request is answered whole; drop stream")
        seen[custom_id] = number
        lines.append(BatchLine(number, custom_id, url, body))
    if not lines:
        raise ValueError(f"{where} holds no requests")
    return lines


def output_line(line: BatchLine, response: dict[str, Any] | None, error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": response, "error": error}


async def send_all(lines: list[BatchLine], base_url: str, api_key: str | None, max_concurrency: int,
                   timeout_s: float | None) -> list[dict[str, Any]]:
    """Every line's output, in order; 429 / 503 answers are sent again after their Retry-After."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency)
    done: Counter[str] = Counter()

    async def one(client: httpx.AsyncClient, line: BatchLine) -> dict[str, Any]:
        async with gate:
            deadline = time.monotonic() + RETRY_FOR_S
            while True:
                try:
                    r = await client.post(line.url, json=line.body, headers=headers)
                except httpx.HTTPError as exc:
                    done["no answer"] += 1
                    return output_line(line, None, {"code": "request_failed",
                                                    "message": f"{type(exc).__name__}: {exc}"})
                if r.status_code in RETRY_STATUSES and time.monotonic() < deadline:
                    await asyncio.sleep(_retry_after(r.headers.get("retry-after")))
                    continue
                try:
                    body = r.json()
                except ValueError:
                    body = {"text": r.text}
                done[str(r.status_code)] += 1
                request_id = r.headers.get("x-request-id") or (body.get("id") if isinstance(body, dict) else None)
                return output_line(line, {"status_code": r.status_code, "request_id": request_id, "body": body}, None)

    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            log.info("run-batch: %d of %d requests answered (%s)", sum(done.values()), len(lines), _tally(done))

    timeout = httpx.Timeout(timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        reporter = asyncio.create_task(progress())
        try:
            return list(await asyncio.gather(*(one(client, line) for line in lines)))
        finally:
            reporter.cancel()


def _retry_after(value: str | None) -> float:
    try:
        return min(max(float(value or 1), 0.1), 30.0)
    except ValueError:
        return 1.0


def _tally(done: Counter[str]) -> str:
    return ", ".join(f"{n} x {status}" for status, n in sorted(done.items())) or "none yet"


def write_outputs(outputs: list[dict[str, Any]], target: str) -> None:
    """The output lines to `target` ("-": stdout), a file written whole: a temporary file renamed."""
    text = "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs)
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(target)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class BatchMesh:
    """`omnimesh serve` with the run's flags on loopback and free ports, for the length of the run."""

    def __init__(self, args: ServeArgs) -> None:
        self.port = free_port()
        mesh = replace(args, host="127.0.0.1", port=self.port, grpc_port=free_port(), stage_base_port=0)
        argv = ["serve", *to_argv(mesh, skip=MESH_SKIP)]
        env = {**os.environ, **({"OMNIMESH_API_KEY": args.api_key} if args.api_key else {})}
        # its output on our stderr: stdout may be the batch output (-o -)
        self.proc = subprocess.Popen([sys.executable, "-m", "omnimesh.cli", *argv], stdout=sys.stderr,
                                     preexec_fn=die_with_parent, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        # the mesh fails itself past --stage-start-timeout (its exit is noticed here); the margin: its checks
        self.start_timeout_s = args.stage_start_timeout + START_MARGIN_S

    def wait_ready(self) -> None:
        import httpx

        timeout_s = self.start_timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (code := self.proc.poll()) is not None:
                raise RuntimeError(f"the mesh exited with code {code} while starting (its log is above)")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the mesh did not answer {self.url}/health within {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def check_url(url: str, timeout_s: float = 10.0) -> None:
    """--url: an http(s) address where a server answers (its /health, or anything HTTP): ValueError otherwise,
    before any request is sent (each line was sent and failed as "no answer", the reason only in the output)."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"--url {url!r}: not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--url {url!r}: give the server's http(s) address, e.g. http://127.0.0.1:8000")
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ValueError(f"--url {url}: nothing answers there ({type(exc).__name__}: {exc}); start the server "
                         "first (omnimesh serve), or leave --url out to run a mesh for the batch") from None


def run_batch(args: ServeArgs, input_file: str, output_file: str, url: str | None, max_concurrency: int) -> int:
    """The whole command: 0 when every line got a 2xx answer, 1 when some did not; ValueError for bad input."""
    if max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if output_file != "-" and not Path(output_file).parent.is_dir():
        raise ValueError(f"--output-file {output_file}: its folder does not exist")
    if url is not None:
        check_url(url)
    if input_file == "-":
        lines = read_batch(sys.stdin.buffer, "stdin")
    else:
        try:
            with open(input_file, "rb") as f:
                lines = read_batch(f, input_file)
        except OSError as exc:
            raise ValueError(f"--input-file {input_file}: cannot read it ({exc.strerror})") from None
    log.info("run-batch: %d requests from %s", len(lines), "stdin" if input_file == "-" else input_file)
    mesh = None if url is not None else BatchMesh(args)
    started = time.monotonic()
    try:
        if mesh is not None:
            mesh.wait_ready()
        base = (mesh.url if mesh is not None else str(url)).rstrip("/")
        timeout = args.request_timeout + 30.0 if args.request_timeout else None
        outputs = asyncio.run(send_all(lines, base, args.api_key or os.environ.get("OMNIMESH_API_KEY"),
                                       max_concurrency, timeout))
    finally:
        if mesh is not None:
            mesh.stop()
    write_outputs(outputs, output_file)
    statuses = Counter(str(o["response"]["status_code"]) if o["response"] else "no answer" for o in outputs)
    failed = sum(n for status, n in statuses.items() if not status.startswith("2"))
    log.info("run-batch: %d requests in %.1f s: %d answered 2xx, %d not (%s); output in %s", len(lines),
             time.monotonic() - started, len(lines) - failed, failed, _tally(statuses),
             "stdout" if output_file == "-" else output_file)
    return 1 if failed else 0
