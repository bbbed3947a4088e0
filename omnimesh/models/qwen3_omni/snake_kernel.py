"""SnakeBeta's elementwise math, x + inv_beta * sin(x * alpha)^2, as ONE compiled kernel on CPU.

Role: the vocoder's activation (every `SnakeBeta` of code2wav's decoder, called by `streaming_convs`).
Eager PyTorch runs the formula as four passes over the activations, and on CPU aten's `sin` is not
vectorised: at the decoder's last blocks (n codes x 1920 samples per row) the activations cost more than
the convs around them. Measured on this project's CPU machine (one thread, AVX512), a (2, 16, 96000)
activation: eager 19 ms, of which `sin` 16 ms; compiled 1.4 ms. Inductor fuses the four ops into one
vectorised loop; the values differ from the eager formula by float rounding only (max 4.8e-7 measured on
activations up to ~5), so the stream stays within the 1e-5 of one-piece decoding its tests hold it to.
A compiled call has a fixed cost (its guards and wrappers, ~25 us here) that eager does not: activations
under `EAGER_BELOW` elements run eager (measured: (4, 32, 50) eager 17 us, compiled 30 us; (4, 32, 400)
eager 90 us, compiled 50 us).

Data flow: the vocoder stage calls `compile_snake(device)` once at start-up (before it serves; dynamic
shapes, warmed for one row and several, so no request waits on a compile) unless `--enforce-eager`;
`snake(x (B, C, T), alpha (1, C, 1), inv_beta (1, C, 1))` then runs the compiled kernel. Without that call,
on CUDA (not measured there) or when compiling fails (no C++ compiler: logged once), it is the eager formula.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def snake_eager(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """transformers' SnakeBeta math with its constants made: x + inv_beta * sin(x * alpha)^2."""
    return x + inv_beta * torch.pow(torch.sin(x * alpha), 2)


EAGER_BELOW = 16384  # elements; where the compiled kernel's fixed cost stops paying (see above)
_active: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = snake_eager


def snake(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """x (B, C, T), alpha / inv_beta (1, C, 1) -> (B, C, T) with the kernel this process uses (eager for
    small activations)."""
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
