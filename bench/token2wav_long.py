"""Qwen2.5-Omni's token2wav on long utterances: ours against transformers' `Qwen2_5OmniToken2WavModel` (the
baseline), side by side in one run, on the same weights: seconds and peak memory per utterance length.

transformers' DiT masks a full (T, T) attention and its BigVGAN decodes the whole mel at once, so both its
time and its memory grow faster than the utterance; ours (`load_token2wav`: block-local DiT attention,
BigVGAN in windows of 10 s) grow with it, at most. Each (implementation, length) runs in a fresh process
(peak RssAnon above the loaded model, sampled every 5 ms, on the CPU), the same random codes and seed for both;
the last column is the largest |difference| between the two waveforms (float rounding).

    python bench/token2wav_long.py [--model DIR] [--codes 250,500,1000,2000] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import machine_info, model_folder


def _rss_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("RssAnon"))


def run_one(model: Path, impl: str, n: int, out: Path) -> None:
    """In this (fresh) process: load `impl`, decode n codes once, write seconds, peak MiB and the waveform."""
    import torch

    from omnimesh.models.qwen2_5_omni.token2wav import load_speakers, load_token2wav

    codes = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n))
    speaker = load_speakers(model)["chelsie"]
    if impl == "ours":
        ours = load_token2wav(model)
        decode = lambda: ours(codes, "chelsie", seed=0)  # noqa: E731
    else:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        from omnimesh.models.loader import build_submodule

        module = build_submodule(model, config_path="token2wav_config", factory=Qwen2_5OmniToken2WavModel,
                                 prefix="token2wav.", dtype=torch.float32).float().eval()

        def decode() -> torch.Tensor:
            torch.manual_seed(0)  # transformers draws the DiT's noise from the global generator
            with torch.no_grad():
                return module(codes.unsqueeze(0), speaker["cond"].float(), speaker["ref_mel"].float()).reshape(-1)

    peak, base = [0], _rss_mib()
    peak[0] = base

    def watch() -> None:
        while True:
            peak[0] = max(peak[0], _rss_mib())
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.perf_counter()
    wave = decode()
    seconds = time.perf_counter() - t0
    time.sleep(0.02)
    torch.save(wave.float(), out.with_suffix(".pt"))
    out.write_text(json.dumps({"seconds": seconds, "peak_mib": peak[0] - base}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a Qwen2.5-Omni folder (default: the tiny one, built)")
    ap.add_argument("--codes", default="250,500,1000,2000", help="utterance lengths in codes (50 a second)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each measured process")
    ap.add_argument("--one", nargs=3, metavar=("IMPL", "N", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.one:
        run_one(args.model, args.one[0], int(args.one[1]), Path(args.one[2]))
        return
    model = model_folder(args.model, "qwen2.5-omni")
    print(json.dumps(machine_info()))
    print(f"model {model}, torch threads {args.threads}")
    print(f"{'codes':>6} {'audio s':>8} {'hf s':>8} {'ours s':>8} {'hf/ours':>8} {'hf MiB':>8} {'ours MiB':>9} "
          f"{'hf/ours':>8} {'max |diff|':>11}")
    scratch = Path(tempfile.mkdtemp(prefix="token2wav-bench-"))
    for n in (int(c) for c in args.codes.split(",")):
        got = {}
        for impl in ("hf", "ours"):
            out = scratch / f"{impl}-{n}.json"
            subprocess.run([sys.executable, __file__, "--model", str(model), "--threads", str(args.threads),
                            "--one", impl, str(n), str(out)], check=True, stderr=subprocess.DEVNULL)
            got[impl] = {**json.loads(out.read_text()), "wave": torch.load(out.with_suffix(".pt"))}
        hf, ours = got["hf"], got["ours"]
        diff = float((hf["wave"] - ours["wave"]).abs().max())
        print(f"{n:>6} {n / 50:>8.1f} {hf['seconds']:>8.2f} {ours['seconds']:>8.2f} "
              f"{hf['seconds'] / ours['seconds']:>8.2f} {hf['peak_mib']:>8} {ours['peak_mib']:>9} "
              f"{hf['peak_mib'] / max(ours['peak_mib'], 1):>8.2f} {diff:>11.2e}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
