"""The planner reads a PEFT model's LoRA settings from the adapters it has, or refuses in one line.

Before, a PEFT model whose settings the planner could not read (``target_modules`` given as a regular
expression, several ranks, ...) was planned silently as full fine-tuning: gradients and AdamW state
budgeted for the frozen base, a slower plan, and the mistake hidden (issue #33).
"""

from __future__ import annotations

import peft
import pytest

from model_zoo import make_model
from tinypipe.errors import UnsupportedModelError
from tinypipe.planner.auto import lora_settings_of


def _peft(**kw) -> peft.PeftModel:
    return peft.get_peft_model(make_model("llama", layers=2), peft.LoraConfig(r=4, lora_alpha=8, **kw))


def test_regex_targets_are_read_from_the_adapters() -> None:
    settings = lora_settings_of(_peft(target_modules=r".*\.(q_proj|v_proj)", lora_dropout=0.1))
    assert settings is not None
    assert list(settings.targets) == ["q_proj", "v_proj"]
    assert (settings.rank, settings.alpha, settings.dropout) == (4, 8.0, 0.1)


def test_list_targets_as_before() -> None:
    settings = lora_settings_of(_peft(target_modules=["v_proj", "q_proj", "down_proj"]))
    assert list(settings.targets) == ["down_proj", "q_proj", "v_proj"]


def test_several_ranks_refused_not_planned_as_full_finetuning() -> None:
    model = _peft(target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 8})
    with pytest.raises(UnsupportedModelError, match="cannot plan for this PEFT model's adapters: adapters of "
                                                    "several ranks") as info:
        lora_settings_of(model)
    assert "\n" not in str(info.value)


def test_plain_model_has_no_lora_settings() -> None:
    assert lora_settings_of(make_model("llama", layers=2)) is None
