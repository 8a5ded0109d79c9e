"""The ``finetune`` option table is the one place a flag meets the Config field it sets: each option
names its field (or none), :func:`engine_config` builds the Config from those names alone, and the
settings travel as one typed, frozen object (issue #33, move e)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

import pytest

import tinypipe
from tinypipe import cli
from tinypipe.cli.options import (
    FINETUNE_OPTIONS,
    FinetuneSettings,
    Option,
    config_values,
    engine_config,
    resolve_settings,
)

BASE = ["finetune", "--model", "m", "--data", "d", "--output", "o"]

#: A value for each option that sets a Config field (a new one needs its sample here).
SAMPLES = {"micro_batch": "3", "pack_size": "2,1", "gpu_memory": "1GiB", "cpu_memory": "2GiB",
           "offload_dir": "/tmp/tinypipe-a,/tmp/tinypipe-b", "lr": "0.25", "weight_decay": "0.5",
           "device_optimizer": "embed", "resident_packs": "1", "keep_activations": "on", "turn_packs": "1",
           "mlp_chunk_tokens": "64", "attention_tile_tokens": "512", "optimizer_sharding": "shard", "max_grad_norm": "2.5", "seed": "11",
           "devices": "cpu", "precision": "bf16"}


def table_problems(options: Sequence[Option], config_class: type = tinypipe.Config) -> list[str]:
    """What is wrong with an option table: a target that is no field of the Config, a field two
    options set, a name used twice."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    out = [f"--{o.name}: sets {o.config!r}, which is no field of {config_class.__name__}"
           for o in options if o.config is not None and o.config not in fields]
    setters = Counter(o.config for o in options if o.config is not None)
    out += [f"{field}: set by " + ", ".join(f"--{o.name}" for o in options if o.config == field)
            for field, n in sorted(setters.items()) if n > 1]
    out += [f"--{name}: declared twice" for name, n in Counter(o.name for o in options).items() if n > 1]
    return out


def test_every_target_is_a_config_field_set_by_one_option() -> None:
    assert table_problems(FINETUNE_OPTIONS) == []


def test_a_missing_field_and_a_field_set_twice_are_named() -> None:
    """The check above catches a typo'd target and a second option for one field."""
    broken = (*FINETUNE_OPTIONS,
              Option("micro-batch-size", int, None, "a second flag for the micro-batch",
                     config="micro_batch_size"),
              Option("gpu-mem", int, None, "a typo'd target", config="gpu_memory"))
    assert table_problems(broken) == [
        "--gpu-mem: sets 'gpu_memory', which is no field of Config",
        "micro_batch_size: set by --micro-batch, --micro-batch-size",
    ]


def test_the_table_is_the_settings_class() -> None:
    """One declaration: each FinetuneSettings field is the option of that name, in --help order."""
    assert [o.key for o in FINETUNE_OPTIONS] == [f.name for f in dataclasses.fields(FinetuneSettings)]
    assert FINETUNE_OPTIONS[0].name == "model" and FINETUNE_OPTIONS[-1].name == "quantize"
    by_key = {o.key: o for o in FINETUNE_OPTIONS}
    assert by_key["no_assist"].flag and by_key["global_batch"].default == 8
    assert by_key["model"].default is None  # required: no default
    s = resolve_settings(cli.build_parser().parse_args(BASE + ["--global-batch", "4", "--lora"]))
    assert isinstance(s, FinetuneSettings) and s.global_batch == 4 and s.lora and s.seq_len is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("option", [o for o in FINETUNE_OPTIONS if o.config and not o.workload],
                         ids=lambda o: o.name)
def test_each_option_reaches_its_config_field(option: Option) -> None:
    """Setting the flag sets exactly its field (converted as the table says): nothing hand-mapped."""
    parser = cli.build_parser()
    baseline, _ = engine_config(resolve_settings(parser.parse_args(BASE)))
    argv = [f"--{option.name}"] if option.flag else [f"--{option.name}", SAMPLES[option.key]]
    config, _ = engine_config(resolve_settings(parser.parse_args(BASE + argv)))
    value = True if option.flag else option.parse(SAMPLES[option.key])
    given = value if option.to_config is None else option.to_config(value)
    assert getattr(config, option.config) == getattr(tinypipe.Config(**{option.config: given}), option.config)
    changed = {f.name for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(baseline, f.name)}
    assert changed <= {option.config}
    if option.key != "devices":  # the default device here is cpu already
        assert changed == {option.config}


def test_the_workload_reaches_the_config_once_resolved() -> None:
    """--seq-len and --global-batch are Config.seq_len / global_batch, given after the model is
    loaded (the row length resolved against its positions)."""
    s = resolve_settings(cli.build_parser().parse_args(BASE + ["--global-batch", "4"]))
    assert config_values(s, workload=True, seq_len=64) == {"seq_len": 64, "global_batch": 4}
    config, _ = engine_config(s)
    assert config.seq_len is None and config.global_batch is None
    assert config.replace(**config_values(s, workload=True, seq_len=64)).seq_len == 64


def test_the_cli_modules_import_no_private_names() -> None:
    """cli/ modules import each other's public names only (issue #33: private names across modules)."""
    import ast
    from pathlib import Path

    root = Path(cli.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tinypipe"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []
