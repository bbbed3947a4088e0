"""pp x tp layouts checked against the tiny Qwen3-Omni before anything loads."""

import pytest

from omnimesh.config.stage_config import StageConfig
from omnimesh.models.qwen3_omni.parallel_plan import check_layout, stacks
from omnimesh.models.qwen3_omni.tiny_config import tiny_qwen3_omni_config

CONFIG = tiny_qwen3_omni_config()


def test_every_stage_names_its_stacks() -> None:
    names = {stage: [s.name for s in ss] for stage, ss in stacks(CONFIG).items()}
    assert names == {"encoder": ["audio tower", "vision tower"], "thinker": ["thinker LM"],
                     "talker": ["talker LM", "code predictor"], "vocoder": ["code2wav transformer"]}


def test_valid_layouts_pass() -> None:
    assert check_layout(CONFIG, {"thinker": StageConfig(pp=2, tp=2), "talker": StageConfig(pp=2)}) == []


def test_tp_must_divide_heads_and_vocab() -> None:
    with pytest.raises(ValueError, match=r"stage thinker: tp=3 does not divide the thinker LM's 4 attention heads, "
                                         r"2 KV heads, vocab 512; tp must be one of \[1, 2\]"):
        check_layout(CONFIG, {"thinker": StageConfig(tp=3)})


def test_pp_cannot_exceed_layers() -> None:
    with pytest.raises(ValueError, match="stage talker: pp=3 exceeds the talker LM's 2 layers"):
        check_layout(CONFIG, {"talker": StageConfig(pp=3)})


def test_partition_must_cover_the_layers() -> None:
    with pytest.raises(ValueError, match=r"pp_layer_partition \[1, 2\] sums to 3, but the thinker LM has 4 layers"):
        check_layout(CONFIG, {"thinker": StageConfig(pp=2, pp_layer_partition=(1, 2))})


def test_uneven_and_non_power_of_two_pp_is_advice() -> None:
    advice = check_layout(CONFIG, {"thinker": StageConfig(pp=3)})
    assert any("4 layers do not divide evenly over pp=3" in a for a in advice)
    assert any("pp=3 is not a power of two" in a for a in advice)


def test_the_parallel_layers_own_checks_run_too() -> None:
    """Sizes only the implementation knows about (here the MoE experts' intermediate size) fail up front."""
    config = tiny_qwen3_omni_config()
    config.thinker_config.text_config.moe_intermediate_size = 31  # the experts' 31 columns do not split over tp=2
    with pytest.raises(ValueError, match=r"stage thinker \(thinker LM\): .*moe_intermediate_size"):
        check_layout(config, {"thinker": StageConfig(tp=2)})
