"""The vocoder's SnakeBeta kernels: the fused CPU kernel and the compiled one both equal transformers'
SnakeBeta to float rounding; the vocoder stage uses the fused kernel when it is loaded, else compiles once
before serving, and stays eager when compiling fails, on a non-CPU device, or with --enforce-eager.

Run: python -m pytest tests/models/test_snake_kernel.py -q
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from qwen3_omni_fixtures import torch_threads
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeSnakeBeta

from omnimesh.config.serve_args import ServeArgs
from omnimesh.kernels import cpu_kernels
from omnimesh.models.qwen3_omni import snake_kernel
from omnimesh.models.qwen3_omni.streaming_convs import _snake


@pytest.fixture(autouse=True)
def restore_kernel() -> Iterator[None]:
    """Each test starts eager and leaves the process as it found it."""
    before = snake_kernel._active
    snake_kernel.use_eager()
    with torch_threads(1):
        yield
    snake_kernel._active = before


@pytest.fixture
def no_fused() -> Iterator[None]:
    """The fused CPU kernels out of the way: the compiled kernel's tests."""
    with cpu_kernels.disabled():
        yield


def snake_module(channels: int) -> Qwen3OmniMoeSnakeBeta:
    m = Qwen3OmniMoeSnakeBeta(channels)
    with torch.no_grad():
        m.alpha.normal_(generator=torch.Generator().manual_seed(1))
        m.beta.normal_(generator=torch.Generator().manual_seed(2))
    return m


@pytest.mark.usefixtures("no_fused")
@pytest.mark.parametrize("rows,length", [(1, 333), (3, 1920), (2, 1)])
def test_compiled_kernel_equals_transformers_snake(rows: int, length: int) -> None:
    m = snake_module(16)
    x = 3 * torch.randn(rows, 16, length, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        want = m(x)
    assert torch.equal(_snake(m, x), want)  # eager: the same ops, bit for bit
    assert snake_kernel.compile_snake("cpu") and snake_kernel.is_compiled()
    with torch.inference_mode():
        got = _snake(m, x.clone())
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("rows,length", [(1, 333), (3, 1920), (2, 1), (1, 47499)])
def test_fused_kernel_equals_transformers_snake(rows: int, length: int) -> None:
    assert cpu_kernels.load()
    m = snake_module(16)
    x = 3 * torch.randn(rows, 16, length, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        want = m(x)
    calls: list[int] = []
    snake_kernel._active = lambda x, *_: calls.append(x.numel())  # type: ignore[assignment,misc,return-value]
    with torch.inference_mode():
        got = _snake(m, x.clone())
    assert not calls  # the fused kernel took it, at any size
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))


@pytest.mark.usefixtures("no_fused")
def test_small_activations_skip_the_compiled_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under EAGER_BELOW elements the compiled call's fixed cost is larger than the math: eager runs."""
    calls: list[int] = []

    def compiled(x: torch.Tensor, alpha: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
        calls.append(x.numel())
        return snake_kernel.snake_eager(x, alpha, inv_beta)

    monkeypatch.setattr(snake_kernel, "_active", compiled)
    alpha, inv_beta = torch.ones(1, 8, 1), torch.ones(1, 8, 1)
    small = torch.randn(1, 8, snake_kernel.EAGER_BELOW // 8 - 1)
    large = torch.randn(1, 8, snake_kernel.EAGER_BELOW // 8)
    assert torch.equal(snake_kernel.snake(small, alpha, inv_beta), snake_kernel.snake_eager(small, alpha, inv_beta))
    snake_kernel.snake(large, alpha, inv_beta)
    assert calls == [large.numel()]


@pytest.mark.usefixtures("no_fused")
def test_a_failed_compile_leaves_eager_math(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_: object, **__: object) -> object:
        def run(*_: object) -> None:
            raise RuntimeError("no C++ compiler found")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING):
        assert not snake_kernel.compile_snake("cpu")
    assert not snake_kernel.is_compiled()
    assert "not compiled (RuntimeError: no C++ compiler found); running eager PyTorch" in caplog.text
    m, x = snake_module(4), torch.randn(1, 4, 9)
    with torch.no_grad():
        assert torch.equal(_snake(m, x), m(x))


@pytest.mark.usefixtures("no_fused")
def test_off_cpu_it_stays_eager_without_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*_: object, **__: object) -> None:
        raise AssertionError("torch.compile must not run for a CUDA vocoder")

    monkeypatch.setattr(torch, "compile", never)
    assert not snake_kernel.compile_snake("cuda")
    assert not snake_kernel.is_compiled()


@pytest.mark.usefixtures("no_fused")
def test_the_vocoder_stage_compiles_unless_enforce_eager(tmp_path_factory: pytest.TempPathFactory) -> None:
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
    from services.vocoder.handler import build_handler

    model_dir: Path = build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m")
    build_handler(model_dir, ServeArgs())  # the fused kernels are off here (no_fused)
    assert snake_kernel.is_compiled()
    build_handler(model_dir, ServeArgs(enforce_eager=True))
    assert not snake_kernel.is_compiled()


def test_the_vocoder_stage_uses_the_fused_kernel_without_compiling(tmp_path_factory: pytest.TempPathFactory,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from omnimesh.models.qwen3_omni.tiny import build_tiny_qwen3_omni
    from services.vocoder.handler import build_handler

    def never(*_: object, **__: object) -> None:
        raise AssertionError("nothing to compile: the fused kernel runs SnakeBeta")

    model_dir: Path = build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny") / "m")
    assert cpu_kernels.load()
    monkeypatch.setattr(torch, "compile", never)
    build_handler(model_dir, ServeArgs())
    assert not snake_kernel.is_compiled() and cpu_kernels.use(torch.zeros(1, 4, 9))
