"""The planner's one frozen request (issue #33, house move a): every input of a search in one
validated value, each refusal written once (in ``PlanRequest.__post_init__``), the engine's request
built in one place (``auto.request_for``) with the adapters as the loader attached them -- unreadable
adapters are an error, never a full fine-tuning plan -- and ``plan_for``'s keywords a thin wrapper
that answers exactly as ``plan(PlanRequest(...))``.
"""

from __future__ import annotations

import dataclasses

import peft
import pytest

import tinypipe
from model_zoo import make_model
from tinypipe.errors import ConfigError, UnsupportedModelError
from tinypipe.lora.settings import LoraSettings
from tinypipe.planner import PlanRequest, plan, plan_for
from tinypipe.planner.auto import hardware_for, request_for
from tinypipe.planner.ssd import SsdSpec

GIB = 2**30
BASE = dict(model_config="llama-3.2-1b", gpus=1, cpu_memory_bytes=64 * GIB, seq=512, global_batch=4)


@pytest.mark.parametrize("change, match", [
    (dict(gpus=0), "--gpus must be >= 1"),
    (dict(seq=1), "sequence length must be >= 2"),
    (dict(global_batch=0), "global batch must be >= 1"),
    (dict(precision="fp16"), "precision must be one of"),
    (dict(keep_activations=[True]), "keep_activations must be true, false or unset"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be > 0"),
    (dict(turn_packs=2), "turn_packs must be 0 .no turn. or unset"),
    (dict(cpu_memory_bytes=0), "host memory budget must be positive"),
    (dict(gpu_memory_bytes=-1), "GPU memory budget must be positive"),
    (dict(host_shards=0), "host_shards must be >= 1"),
    (dict(host_shards=2, ssd=SsdSpec(1.6, 2.4, source="stated")), "SSD tier is not combined"),
    (dict(seq=1 << 20), "exceeds the model's max_position_embeddings"),
])
def test_each_refusal_is_raised_by_the_request(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PlanRequest(**{**BASE, **change})


def test_request_is_frozen_and_resolves_a_preset_once() -> None:
    r = PlanRequest(**BASE)
    assert r.model_name == "llama-3.2-1b" and r.config.num_hidden_layers == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.seq = 1024  # type: ignore[misc]
    again = dataclasses.replace(r, global_batch=8)  # a re-plan at another batch: still validated
    assert again.config is r.config and again.global_batch == 8
    with pytest.raises(ConfigError, match="global batch must be >= 1"):
        dataclasses.replace(r, global_batch=0)


def test_plan_for_keywords_answer_as_the_request() -> None:
    kw = dict(gpus=1, gpu_memory_bytes=6 * GIB, cpu_memory_bytes=64 * GIB, seq=512, global_batch=4,
              max_grad_norm=1.0, lora=LoraSettings(rank=8))
    a = plan_for("llama-3.2-1b", "rtx4090-pcie4", **kw)
    b = plan(PlanRequest(model_config="llama-3.2-1b", **kw), "rtx4090-pcie4")
    assert (a.best.plan, a.best.time, a.considered, a.fitting) == (b.best.plan, b.best.time, b.considered,
                                                                   b.fitting)
    assert a.model_name == b.model_name == "llama-3.2-1b"


def _config(**kw) -> tinypipe.Config:
    return tinypipe.Config(devices=["cpu"], seq_len=64, global_batch=4, cpu_memory_bytes=16 * GIB,
                           gpu_memory_bytes=2 * GIB, **kw)


def test_request_for_takes_the_config_and_the_loaders_adapters() -> None:
    config = _config(max_grad_norm=1.0, resident_packs=0)
    model = peft.get_peft_model(make_model("llama", layers=2),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    r = request_for(config, model, hardware_for(config))
    assert (r.seq, r.global_batch, r.gpus, r.max_grad_norm, r.resident_packs) == (64, 4, 1, 1.0, 0)
    assert (r.gpu_memory_bytes, r.cpu_memory_bytes, r.precision) == (2 * GIB, 16 * GIB, config.precision)
    assert r.lora is not None and (r.lora.rank, list(r.lora.targets)) == (4, ["q_proj", "v_proj"])
    assert request_for(config, make_model("llama", layers=2), hardware_for(config)).lora is None


def test_request_for_refuses_unreadable_adapters_not_full_finetuning() -> None:
    config = _config()
    model = peft.get_peft_model(make_model("llama", layers=2),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                rank_pattern={"v_proj": 8}))
    with pytest.raises(UnsupportedModelError, match="cannot plan for this PEFT model's adapters"):
        request_for(config, model, hardware_for(config))
