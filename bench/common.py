"""Helpers shared by the benchmarks: the prompts, the model folder, streamed REST requests with per-request
timings, the `transformers` reference run on the same folder, percentiles and the machine description."""

from __future__ import annotations

import base64
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPTS = [f"Tell me a short story about the number {i}." for i in range(64)]


def prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)]


def model_folder(model: Path | None, family: str = "qwen3-omni") -> Path:
    """`--model`, or the built-in tiny model of `family` (Qwen3-Omni's: the folder `omnimesh serve` uses without a
    model), built once."""
    if model is not None:
        return model
    from omnimesh.tiny_cache import tiny_model_dir

    return tiny_model_dir(family)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for no values."""
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def sine_wav(seconds: float = 1.0, rate: int = 16000, freq: float = 440.0) -> bytes:
    from tests.e2e.reference import sine_wav as _sine_wav

    return _sine_wav(seconds, rate, freq)


# ------------------------------------------------------------------------------------------- omnimesh REST


def chat_body(text: str, *, max_tokens: int, talker_max: int, stream: bool, wav: bytes | None = None,
              audio_format: str | None = None) -> dict[str, Any]:
    """A greedy text + audio chat request; `wav` adds an audio input part before the text."""
    content: Any = text
    if wav is not None:
        content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                   {"type": "text", "text": text}]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "modalities": ["text", "audio"],
                            "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                            "stage_params": {"talker": {"max_tokens": talker_max}}}
    if audio_format is not None:
        body["audio"] = {"voice": "ethan", "format": audio_format}
    return body


@dataclass
class StreamResult:
    """One streamed request, times in seconds from sending it (nan when that event never came)."""

    latency: float = float("nan")
    ttft: float = float("nan")  # first non-empty text delta
    ttfp: float = float("nan")  # first audio delta
    audio_samples: int = 0  # pcm16 samples over all audio deltas
    audio_at: list[tuple[float, int]] = field(default_factory=list)  # (arrival s, pcm16 samples) per audio delta
    text: str = ""
    error: str = ""
    finish_reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def stream_chat(url: str, body: dict[str, Any], timeout_s: float = 600.0,
                client: httpx.Client | None = None) -> StreamResult:
    """POST a `stream: true` chat completion and time its first text delta, first audio delta and end."""
    res = StreamResult()
    parts: list[str] = []
    t0 = time.perf_counter()
    try:
        cm = (client or httpx).stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout_s)
        with cm as r:
            if r.status_code != 200:
                r.read()
                res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return res
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    break
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        if res.ttft != res.ttft:
                            res.ttft = time.perf_counter() - t0
                        parts.append(delta["content"])
                    audio = delta.get("audio") or {}
                    if audio.get("data"):
                        if res.ttfp != res.ttfp:
                            res.ttfp = time.perf_counter() - t0
                        n = len(base64.b64decode(audio["data"])) // 2
                        res.audio_samples += n
                        res.audio_at.append((time.perf_counter() - t0, n))
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - t0
    res.text = "".join(parts)
    if not res.error and res.finish_reason is None:
        res.error = "the stream ended without a finish_reason"
    return res


def playback_stall(audio_at: list[tuple[float, int]], rate: int) -> float:
    """Seconds a player that starts at the first audio delta sits silent waiting for the next one (buffer
    underrun), summed over the stream: the stall a listener hears, 0 when audio always came ahead of playback."""
    stall = played_until = 0.0
    for at, samples in audio_at:
        if at > played_until and played_until:  # the buffer ran dry before this delta came
            stall += at - played_until
        played_until = max(played_until, at) + samples / rate
    return stall


def served_sample_rate(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> int:
    """The sample rate the mesh serves audio at: one non-streaming request answered as WAV (header read)."""
    body = {**body, "stream": False, "audio": {"voice": "ethan", "format": "wav"}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s)
    r.raise_for_status()
    data = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate()


# --------------------------------------------------------------------------------- transformers reference


def hf_dtype(device: str) -> Any:
    """What `omnimesh serve --dtype auto` picks: bfloat16 on CUDA, float32 on CPU."""
    import torch

    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class HFGenerate:
    """`Qwen3OmniMoeForConditionalGeneration.generate` (or `Qwen2_5OmniForConditionalGeneration.generate` for a
    Qwen2.5-Omni folder) on the folder, as a user runs it: the same chat template and processor as the gateway
    (`PromptBuilder`), greedy thinker and talker, speaker Ethan (the mesh side's voice; both families have it).
    `end_ids`: where its thinker stops (Qwen3-Omni's `im_end_token_id`; Qwen2.5-Omni's generation config's EOS)."""

    def __init__(self, model_dir: Path, device: str = "cpu"):
        from transformers import AutoConfig, AutoTokenizer, Qwen2_5OmniForConditionalGeneration, Qwen3OmniMoeForConditionalGeneration

        from gateway.prompt import PromptBuilder

        self.device = device
        self.qwen2_5 = AutoConfig.from_pretrained(model_dir).model_type == "qwen2_5_omni"
        self.speaker = "Ethan"
        cls = Qwen2_5OmniForConditionalGeneration if self.qwen2_5 else Qwen3OmniMoeForConditionalGeneration
        self.model = cls.from_pretrained(model_dir, dtype=hf_dtype(device)).to(device).eval()  # type: ignore[attr-defined]
        if self.qwen2_5:
            eos = self.model.generation_config.eos_token_id
            self.end_ids = list(eos) if isinstance(eos, list) else [eos]
            tk = self.model.config.talker_config
            self.extra = {"talker_eos_token_id": [tk.tts_codec_pad_token_id, tk.tts_codec_end_token_id]}
        else:
            self.end_ids = [self.model.config.im_end_token_id]
            self.extra = {"return_audio": True}
            # transformers bug (MODELS.md): with audio AND an image the talker needs the thinker's audio config
            self.model.talker.config.audio_config = self.model.thinker.config.audio_config
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.prompts = PromptBuilder(model_dir, max_model_len=4096)

    def inputs(self, text: str, wav: bytes | None, *, max_tokens: int, talker_max: int) -> Any:
        from tests.e2e.reference import chat_request

        return self.prompts(chat_request(text, wav, None, max_tokens=max_tokens, talker_max=talker_max))

    def generate(self, batch: list[Any], *, max_tokens: int, talker_max: int) -> list[tuple[list[int], int]]:
        """One `generate` call over `batch` (PromptInputs; more than one = left-padded batch). Returns each
        row's generated token ids and its number of audio samples."""
        import torch

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        longest = max(p.input_ids.numel() for p in batch)
        ids = torch.full((len(batch), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, p in enumerate(batch):
            n = p.input_ids.numel()
            ids[row, longest - n:] = p.input_ids
            mask[row, longest - n:] = 1
        kwargs: dict[str, Any] = {}
        with_audio = [p for p in batch if p.input_features is not None]
        if with_audio:
            frames = max(p.input_features.shape[-1] for p in with_audio)
            kwargs["input_features"] = torch.cat(
                [torch.nn.functional.pad(p.input_features, (0, frames - p.input_features.shape[-1])) for p in with_audio]
            ).to(self.device, hf_dtype(self.device))
            kwargs["feature_attention_mask"] = torch.cat(
                [torch.nn.functional.pad(p.feature_attention_mask, (0, frames - p.feature_attention_mask.shape[-1]))
                 for p in with_audio]
            ).to(self.device)
        with torch.no_grad():
            seq, wavs = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), speaker=self.speaker,
                thinker_max_new_tokens=max_tokens, thinker_eos_token_id=self.end_ids, thinker_do_sample=False,
                talker_do_sample=False, talker_max_new_tokens=talker_max, **self.extra, **kwargs,
            )
        if isinstance(wavs, torch.Tensor):  # a batch of one: a (1, 1, samples) tensor
            wavs = [wavs.reshape(-1)]
        return [(seq[row, longest:].tolist(), int(wavs[row].numel())) for row in range(len(batch))]


# ------------------------------------------------------------------------------------------------ machine


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads_bench": torch.get_num_threads(),
        "torch_interop_threads_bench": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OMNIMESH_CPU_THREADS": os.environ.get("OMNIMESH_CPU_THREADS"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        from omnimesh.server.stage_server import cpu_threads

        info["mesh_stage_cpu_threads"] = cpu_threads()
    except Exception as e:  # noqa: BLE001 - informative only
        info["mesh_stage_cpu_threads"] = f"unknown ({type(e).__name__})"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["commit"] = rev + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info




def measure_streams(url: str, bodies: list[dict], concurrency: int) -> dict[str, list[float]]:
    """`bodies` streamed with `concurrency` in flight -> TTFT, TTFP and latency per request and the turn's
    requests per second (`SideBySide.run`'s measure); a failed request raises."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda b: stream_chat(url, b), bodies))
    wall = time.perf_counter() - t0
    for r in results:
        if r.error:
            raise RuntimeError(r.error)
    return {"ttft": [r.ttft for r in results], "ttfp": [r.ttfp for r in results],
            "latency": [r.latency for r in results], "rps": [len(bodies) / wall]}


def headline(model_dir: Path, workload: str) -> str:
    """A bench's first line: the model, what was sent, and this machine's CPUs and commit."""
    info = machine_info()
    return f"model: {model_dir.name}; {workload}; {info['cpus_usable']} CPUs, commit {info.get('commit', '?')}"

class SideBySide:
    """Two (or more) meshes measured in one run, alternating: in each round and at each concurrency the same
    requests go to every mesh in turn (the baseline first), so drift of the host's speed hits all alike.
    `samples[(mesh, c)][metric]` collects what `measure` returned for each turn."""

    def __init__(self, meshes: list[tuple[str, str]], levels: list[int]) -> None:
        self.meshes = meshes  # (name, url), the baseline first
        self.levels = levels
        self.samples: dict[tuple[str, int], dict[str, list[float]]] = {}

    def run(self, rounds: int, requests: int, bodies: Callable[[int, int], list[dict]],
            measure: Callable[[str, list[dict], int], dict[str, list[float]]]) -> None:
        """`bodies(first_index, n)` -> n request bodies; `measure(url, bodies, c)` -> {metric: values}."""
        seq = 0
        for _ in range(rounds):
            for c in self.levels:
                batch = bodies(seq, requests)
                seq += requests
                for name, url in self.meshes:
                    got = self.samples.setdefault((name, c), {})
                    for metric, values in measure(url, batch, c).items():
                        got.setdefault(metric, []).extend(values)

    def print(self, spec: list[tuple[str, str, float | None]]) -> None:
        """Per concurrency, each (label, metric, quantile; None: the median of per-turn values) for the
        baseline and the second mesh, with the ratio second / baseline."""
        (base, _), (other, _) = self.meshes[0], self.meshes[1]

        def value(name: str, c: int, metric: str, q: float | None) -> float:
            got = self.samples[(name, c)][metric]
            return statistics.median(got) if q is None else percentile(got, q)

        ratio = f"{other}/{base}"
        width = max(10, len(ratio) + 2)
        print(f"{'c':>3} {'metric':<16}{base:>12}{other:>12}{ratio:>{width}}")
        for c in self.levels:
            for label, metric, q in spec:
                a, b = value(base, c, metric, q), value(other, c, metric, q)
                print(f"{c:>3} {label:<16}{a:>12.4f}{b:>12.4f}{b / a:>{width}.3f}")
