"""The encoder cache (--encoder-cache-memory) against the same encoder stage without it (the baseline), side
by side in one run: a conversation whose every turn adds one picture, so turn k sends the encoder k pictures
(the history's and its own), as a chat client does.

Three encoder stages are built from the same model folder and run the same turns one after another, in
this process on the CPU: the stage's own step (`EncoderBatcher.step_batch`), without the network. "cache"
keys items by the gateway's digests (what `omnimesh serve` does; the gateway's time to digest the decoded
pictures, `media_digests`, is counted in), "cache, own keys" hashes the patches in the stage (a client that
sends no digests), "no cache" (--encoder-cache-memory 0) is the baseline. Prints per turn the milliseconds
of each and the baseline's over each, and the totals.

    python bench/encoder_cache.py [--model DIR] [--turns 8] [--size 448] [--rounds 3] [--max-pixels N]
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import numpy as np
from PIL import Image

from common import machine_info, model_folder


def turn_media(processor, pictures: list) -> dict:
    """The encoder's input for one turn: every picture so far, as the gateway's processor makes them."""
    import torch

    text = "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in pictures)
    batch = processor(text=[text], images=pictures, return_tensors="pt")
    return {"pixel_values": torch.as_tensor(batch["pixel_values"]),
            "image_grid_thw": torch.as_tensor(batch["image_grid_thw"])}


def digested(media: dict, pictures: list) -> tuple[dict, float]:
    """`media` with the gateway's digests of its pictures, and the seconds they took."""
    from gateway.media_digest import media_digests

    t0 = time.perf_counter()
    hashes = media_digests([], pictures, [], {})
    return {**media, **hashes}, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in tiny Qwen3-Omni)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--size", type=int, default=448, help="each picture's width and height in pixels")
    ap.add_argument("--rounds", type=int, default=3, help="conversations per mode (the first one warms up)")
    ap.add_argument("--max-pixels", type=int, default=12845056,
                    help="the processor's max_pixels (default Qwen3-Omni's own, so a picture keeps its size as with "
                         "the real checkpoint; the tiny folder's 65536 would shrink it)")
    args = ap.parse_args()

    from omnimesh.config.serve_args import ServeArgs
    from omnimesh.models.qwen3_omni.processor import load_processor
    from omnimesh.transport.frames import StageChunk
    from omnimesh.v1 import stage_pb2
    from services.encoder.handler import build_handler

    folder = model_folder(args.model)
    processor = load_processor(folder, {"max_pixels": args.max_pixels})
    rng = np.random.default_rng(0)
    pictures = []
    for _ in range(args.turns):
        png = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (args.size, args.size, 3), dtype=np.uint8)).save(png, format="PNG")
        pictures.append(Image.open(io.BytesIO(png.getvalue())).convert("RGB"))
    turns = [turn_media(processor, pictures[:k + 1]) for k in range(args.turns)]
    modes = {"cache": build_handler(folder, ServeArgs()), "cache, own keys": build_handler(folder, ServeArgs()),
             "no cache": build_handler(folder, ServeArgs(encoder_cache_memory="0"))}
    ms: dict[str, list[list[float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for handler in modes.values():
            if handler.batcher.cache is not None:
                handler.batcher.cache = type(handler.batcher.cache)(handler.batcher.cache.capacity)  # a new chat
        per_turn: dict[str, list[float]] = {m: [] for m in modes}
        for k, media in enumerate(turns):
            for mode, handler in modes.items():
                sent, extra = digested(media, pictures[:k + 1]) if mode == "cache" else (media, 0.0)
                task = handler.open(stage_pb2.Open(request_id=f"{mode}-{r}-{k}"))
                task.feed(StageChunk(tensors=sent, final=True))
                t0 = time.perf_counter()
                out = handler.batcher.step_batch([task])
                per_turn[mode].append((time.perf_counter() - t0 + extra) * 1e3)
                assert isinstance(out[task.request_id], list), out
        for mode in modes:
            ms[mode].append(per_turn[mode])
    kept = {m: np.median(np.array(v[1:] if len(v) > 1 else v), axis=0) for m, v in ms.items()}  # median over rounds
    info = machine_info()
    print(f"encoder stage, {folder.name}, {args.turns} turns of {args.size}x{args.size} pictures, median of "
          f"{max(args.rounds - 1, 1)} conversations; {info['date']}, {info['cpus_usable']} usable CPUs, "
          f"{info['torch_threads_bench']} torch threads, torch {info['torch']}")
    print(" turn  pictures  cache ms  own keys ms  no cache ms  no cache / cache  no cache / own keys")
    for k in range(args.turns):
        c, o, n = kept["cache"][k], kept["cache, own keys"][k], kept["no cache"][k]
        print(f"{k + 1:5d}  {k + 1:8d}  {c:8.2f}  {o:11.2f}  {n:11.2f}  {n / c:15.2f}  {n / o:18.2f}")
    c, o, n = (float(kept[m].sum()) for m in ("cache", "cache, own keys", "no cache"))
    print(f"total            {c:8.2f}  {o:11.2f}  {n:11.2f}  {n / c:15.2f}  {n / o:18.2f}")


if __name__ == "__main__":
    main()
