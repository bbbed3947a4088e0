"""--tokenizer (vLLM's): a folder whose tokenizer and chat template the gateway's prompt builder and the thinker
use instead of the model folder's. Proved on the tiny model with a copy of its tokenizer under another chat
template: the prompts follow that template (for a request's own processor settings too), the thinker
detokenizes with it; a tokenizer with more tokens than the thinker's vocabulary, a folder without a
tokenizer and a path that is no folder stop the start with the reason; the launcher hands the flag to the
gateway and the thinker only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.events import ChatMessage, ChatRequest, SamplingOverrides, TextPart
from gateway.prompt import PromptBuilder
from omnimesh.config.serve_args import ServeArgs
from omnimesh.launcher import MeshLauncher
from services.llm.thinker_handler import build_handler as thinker_handler

MARK = "<|im_start|>system\nYou are the assistant of the tokenizer folder.<|im_end|>\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tokenizer_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's tokenizer files, its chat template opening every prompt with a system line of its own."""
    folder = tmp_path_factory.mktemp("tokenizer")
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, folder / name)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text("{{- '" + MARK.replace("\n", "\\n") + "' -}}\n" + template)
    return folder


def _chat(**processor: float) -> ChatRequest:
    return ChatRequest(request_id="r", model="m", messages=(ChatMessage("user", (TextPart("hello"),)),),
                       sampling=SamplingOverrides(), processor_kwargs=tuple(processor.items()))


def test_the_prompt_builder_renders_with_the_tokenizer_folders_template(model_dir: Path, tokenizer_dir: Path) -> None:
    own = PromptBuilder(model_dir, max_model_len=512)
    other = PromptBuilder(model_dir, max_model_len=512, tokenizer=tokenizer_dir)
    text, _ = other.render(_chat())
    assert text == MARK + own.render(_chat())[0]
    assert other(_chat()).input_ids.tolist() == own.processor.tokenizer(text)["input_ids"]
    # a request's own processor settings load another processor: with the same tokenizer folder
    assert other.processor_for(_chat(max_pixels=4096.0)).tokenizer.chat_template.startswith("{{- '<|im_start|>system")


def test_the_thinker_takes_the_tokenizer_and_refuses_one_too_big(model_dir: Path, tokenizer_dir: Path,
                                                                  tmp_path: Path) -> None:
    handler = thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB",
                                                   tokenizer=str(tokenizer_dir)))
    assert handler.tokenizer.chat_template.startswith("{{- '<|im_start|>system")
    bigger = tmp_path / "bigger"
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tok.add_tokens(["<|not_in_the_model|>"])
    tok.save_pretrained(bigger)
    with pytest.raises(ValueError, match=rf"the tokenizer in {bigger} has 513 tokens, more than the thinker's "
                                         r"vocabulary of 512: it is not this model's \(--tokenizer\)"):
        thinker_handler(model_dir, ServeArgs(max_model_len=64, kv_cache_memory="1MiB", tokenizer=str(bigger)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"no tokenizer loads from {empty}"):
        PromptBuilder(model_dir, max_model_len=64, tokenizer=empty)
    with pytest.raises(ValueError, match=r"--tokenizer '/no/such/tokenizer': not a folder"):
        ServeArgs(tokenizer="/no/such/tokenizer")


def test_the_launcher_hands_the_tokenizer_to_the_gateway_and_the_thinker(tokenizer_dir: Path, tmp_path: Path) -> None:
    launcher = MeshLauncher(ServeArgs(tokenizer=str(tokenizer_dir)), tmp_path)
    gateway = launcher._gateway_argv({})
    assert gateway[gateway.index("--tokenizer") + 1] == str(tokenizer_dir.resolve())
    assert "--tokenizer" in launcher._stage_argv("thinker", 1)
    assert all("--tokenizer" not in launcher._stage_argv(s, 1) for s in ("encoder", "talker", "vocoder"))
