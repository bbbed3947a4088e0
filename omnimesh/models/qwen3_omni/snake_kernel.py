"""SnakeBeta's elementwise math, x + inv_beta * sin(x * alpha)^2, as ONE kernel on CPU.

Role: the vocoder's activation (every `SnakeBeta` of code2wav's decoder, called by `streaming_convs`).
Eager PyTorch runs the formula as four passes over the activations; at the decoder's last blocks (n codes x
1920 samples per row) the activations cost about what the convs around them do. Three ways to run it, the
first available wins:
  1. omnimesh's fused CPU kernel (`cpu_kernels`, `torch.ops.omnimesh.snake`: one pass, Sleef's vectorised sine,
     ~2 us fixed cost a call). Measured on this project's CPU machine (one thread, AVX-512): (1, 4, 47499)
     35 us against 54 compiled and 257 eager; (1, 32, 800) 6 us against 22 and 34; (1, 32, 7) 2.1 us
     against 17.5 and 5.1;
  2. a `torch.compile`d kernel (inductor fuses the four ops; ~25 us of guards and wrappers a call, so
     activations under `EAGER_BELOW` elements run eager), when the fused kernels are off
     (OMNIMESH_CPU_KERNELS=0): the vocoder stage compiles it at start-up unless `--enforce-eager`;
  3. the eager formula (CUDA, not measured there; no C++ compiler; `--enforce-eager` without the kernels).
The values differ from the eager formula by float rounding only (max ~1e-6 on activations up to ~10), so the
stream stays within the 1e-5 of one-piece decoding its tests hold it to.

Data flow: `snake(x (B, C, T), alpha (1, C, 1), inv_beta (1, C, 1))` picks the kernel per call; the vocoder
stage calls `compile_snake(device)` once at start-up (dynamic shapes, warmed for one row and several, so no
request waits on a compile) only when the fused kernel is not loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from omnimesh.kernels import cpu_kernels

log = logging.getLogger(__name__)


def snake_eager(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """transformers' SnakeBeta math with its constants made: x + inv_beta * sin(x * alpha)^2."""
    return x + inv_beta * torch.pow(torch.sin(x * alpha), 2)


EAGER_BELOW = 16384  # elements; where the compiled kernel's fixed cost stops paying (see above)
_active: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = snake_eager


def snake(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """x (B, C, T), alpha / inv_beta (1, C, 1) -> (B, C, T) with the kernel this process uses: the fused CPU
    kernel, else the compiled one (eager for small activations), else eager."""
    if cpu_kernels.use(x):
        return cpu_kernels.ops().snake(x, alpha, inv_beta)
    if x.numel() < EAGER_BELOW:
        return snake_eager(x, alpha, inv_beta)
    return _active(x, alpha, inv_beta)


def is_compiled() -> bool:
    return _active is not snake_eager


def compile_snake(device: torch.device | str = "cpu") -> bool:
    """Compile the kernel and warm it up (one row and two, inference and ordinary tensors); returns
    whether the compiled kernel is now in use. CPU only: elsewhere it stays eager and returns False."""
    global _active
    if torch.device(device).type != "cpu":
        return False
    compiled = torch.compile(snake_eager, dynamic=True, fullgraph=True)
    try:  # inference tensors (engine steps) and ordinary ones (no_grad callers) are guarded apart
        for mode in (torch.inference_mode, torch.no_grad):
            with mode():
                for rows in (1, 2):
                    x = torch.randn(rows, 8, 7)
                    alpha, inv_beta = torch.rand(1, 8, 1) + 0.5, torch.rand(1, 8, 1)
                    got, want = compiled(x, alpha, inv_beta), snake_eager(x, alpha, inv_beta)
                    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                        raise RuntimeError(f"it differs from eager by {(got - want).abs().max().item():.2e}")
    except Exception as exc:  # no C++ toolchain, an inductor bug: eager is always right, only slower
        log.warning("vocoder: SnakeBeta kernel not compiled (%s: %s); running eager PyTorch", type(exc).__name__, exc)
        return False
    _active = compiled
    return True


def use_eager() -> None:
    """Back to the eager formula (tests, and `--enforce-eager`)."""
    global _active
    _active = snake_eager
