"""The SSD engine with its state striped over 2 and 3 offload directories: losses, gradient norms,
weights and moments equal the DRAM-only engine's and the one-directory engine's bit for bit; a
directory too small is refused before training, naming it; a write failing on one directory stops
the run with one line naming it; every directory is cleaned at exit, and a killed striped run's
scratch is swept and reported in each.

The stripe unit is shrunk to 8 KiB here (the engine uses :data:`DEFAULT_CHUNK_BYTES`, 16 MiB) so
that the tiny model's regions (12-40 KB) are each spread over every directory, as a real model's
hundreds of MiB are at 16 MiB."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import transformers

import tinypipe
from model_zoo import make_batch, make_model
from test_cli import assert_one_line_error, data_file, run_cli, tiny_model_dir  # noqa: F401 - fixtures
from test_ssd_exact import ALL, LR, _assert_same, _every, _run
from test_ssd_kill import _args, _plan_file, _scratch
from test_storage_faults import mounted, root_only
from tinypipe.errors import StorageError, WorkerError
from tinypipe.planner.auto import manual_plan
from tinypipe.storage import scratch, store as store_module
from tinypipe.train.loop import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 8 << 10


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "DEFAULT_CHUNK_BYTES", CHUNK)


def _dirs(tmp_path: Path, n: int, name: str = "drive") -> list[Path]:
    out = [tmp_path / f"{name}{i}" for i in range(n)]
    for d in out:
        d.mkdir()
    return out


def _empty(dirs: list[Path]) -> bool:
    return all(not list(d.iterdir()) for d in dirs)


def _spread(engine: tinypipe.Engine, n: int) -> None:
    """Every directory holds a share, and the largest region has chunks on all of them."""
    store = engine.store.offload.ssd
    assert len(store.paths) == n and all(s > 0 for s in store.shares), store.shares
    big = max(store.regions(), key=store.region_bytes)
    assert {drive for _, _, drive, _ in store._core.layout[big].chunks(CHUNK)} == set(range(n))


@pytest.mark.parametrize(("n", "precision", "devices"), [(2, "fp32", 1), (3, "bf16", 2)])
def test_striped_engine_is_bit_identical_to_dram_and_one_directory(
        tmp_path: Path, small_chunks: None, n: int, precision: str, devices: int) -> None:
    dram = tinypipe.Config(lr=LR, devices=["cpu"] * devices, pack_size=2, micro_batch_size=2,
                           precision=precision, max_grad_norm=1.6)
    (one,) = _dirs(tmp_path, 1, "one")
    dirs = _dirs(tmp_path, n)
    a, ra = _run(make_model("llama"), dram, [], 5)
    b, rb = _run(make_model("llama"), dram.replace(offload_dir=str(one)), _every(4, ALL), 5)
    c, rc = _run(make_model("llama"), dram.replace(offload_dir=[str(d) for d in dirs]), _every(4, ALL), 5)
    try:
        _spread(c, n)
        _assert_same(a, b, ra, rb)
        _assert_same(a, c, ra, rc)
        clipped = [r.clipped for r in ra]
        assert any(clipped) and not all(clipped), clipped  # speculated, rolled back and deferred steps
        for e in (b, c):
            e.synchronize()
        tb, tc = b.store.offload.ssd.stats.totals(), c.store.offload.ssd.stats.totals()
        assert (tc.read_bytes, tc.write_bytes) == (tb.read_bytes, tb.write_bytes) and tb.read_bytes > 0
    finally:
        for e in (a, b, c):
            e.close()
    assert _empty([one, *dirs]), "scratch left behind after close"


def test_lora_with_its_frozen_base_striped(tmp_path: Path, small_chunks: None) -> None:
    from tinypipe.lora import LoraSettings, apply_lora

    settings = LoraSettings(rank=4, alpha=8)
    dram = tinypipe.Config(lr=LR, pack_size=2, micro_batch_size=2, precision="bf16", max_grad_norm=0.05)
    dirs = _dirs(tmp_path, 2)
    a, ra = _run(apply_lora(make_model("llama"), settings), dram, [], 4)
    b, rb = _run(apply_lora(make_model("llama"), settings), dram.replace(offload_dir=tuple(map(str, dirs))),
                 _every(4, ("frozen", "moments")), 4)
    try:
        assert b.store.frozen_bytes == 0 and a.store.frozen_bytes > 0
        _spread(b, 2)
        _assert_same(a, b, ra, rb)
    finally:
        a.close()
        b.close()
    assert _empty(dirs)


def _engine(dirs: list[Path], model: torch.nn.Module | None = None) -> tinypipe.Engine:
    config = tinypipe.Config(pack_size=2, micro_batch_size=2, lr=1e-3, offload_dir=[str(d) for d in dirs])
    plan = manual_plan(config, num_blocks=4, tied=False)
    offload = tuple((layer, k) for layer in range(6) for k in ("master", "moments"))
    plan = dataclasses.replace(plan, offload=offload)
    return tinypipe.Engine(model or make_model("llama"), config, plan=plan)


def test_a_directory_without_room_for_its_share_is_refused_before_training(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dirs = _dirs(tmp_path, 3)
    real = scratch.free_bytes
    monkeypatch.setattr(scratch, "free_bytes", lambda p: 1 << 10 if Path(p) == dirs[2] else real(p))
    model = make_model("llama")
    with pytest.raises(StorageError, match=rf"offload directory {dirs[2]} has 1\.0 KiB free; the SSD tier "
                                           "needs .* choose another") as e:
        _engine(dirs, model)
    assert "\n" not in str(e.value)
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model was not touched
    assert _empty(dirs)


@root_only
def test_a_small_filesystem_among_the_directories_is_named(tmp_path: Path) -> None:
    (disk,) = _dirs(tmp_path, 1)
    with mounted(tmp_path / "small", "tmpfs", "size=64k") as small, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "on tmpfs: occupies RAM"
        with pytest.raises(StorageError, match=rf"offload directory {small} has 64\.0 KiB free; the SSD "
                                               "tier needs"):
            _engine([disk, small])
        assert _empty([disk, small])


def test_a_write_failing_on_one_directory_stops_the_run_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path, small_chunks: None) -> None:
    dirs = _dirs(tmp_path, 2)
    engine = _engine(dirs)
    engine.step(make_batch(4, 12))
    real = store_module.write_from

    def write_from(f, address, nbytes, offset):
        if Path(f.path).parent.parent == dirs[1]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(f, address, nbytes, offset)

    monkeypatch.setattr(store_module, "write_from", write_from)
    # step 0's write-backs may still be in flight when the patch lands: then the failure is already
    # recorded when step 1 starts staging and surfaces as the StorageError itself (seen on CI);
    # otherwise a lane hits it mid-step and the step raises WorkerError -- one line either way
    with pytest.raises((WorkerError, StorageError)) as info:
        engine.step(make_batch(4, 12, seed=1))
    text = str(info.value)
    assert "\n" not in text and "Input/output error (EIO)" in text, text
    assert f"offload directory {dirs[1]}" in text, text  # the failed write, or the read of what it left
    with pytest.raises(WorkerError, match="engine unusable: the SSD tier failed"):
        engine.step(make_batch(4, 12, seed=2))
    engine.close()
    assert _empty(dirs)


_CHILD = textwrap.dedent(
    """
    import dataclasses, os, signal, sys
    sys.path.insert(0, {tests!r})
    import tinypipe
    from model_zoo import make_batch, make_model
    from tinypipe.planner.auto import manual_plan
    cfg = tinypipe.Config(pack_size=2, micro_batch_size=2, offload_dir={dirs!r})
    plan = dataclasses.replace(manual_plan(cfg, num_blocks=4, tied=False),
                               offload=tuple((layer, "moments") for layer in range(6)))
    engine = tinypipe.Engine(make_model("llama"), cfg, plan=plan)
    engine.step(make_batch(4, 12))
    if {how!r} == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_every_directory_cleaned_at_exit_or_swept_after_a_kill(tmp_path: Path, how: str,
                                                               capfd: pytest.CaptureFixture) -> None:
    dirs = _dirs(tmp_path, 2)
    script = _CHILD.format(tests=str(ROOT / "tests"), dirs=[str(d) for d in dirs], how=how)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    if how == "exit":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert _empty(dirs)
        return
    assert proc.returncode == -signal.SIGKILL
    left = [_scratch(d) for d in dirs]
    assert all(len(x) == 1 for x in left), "nobody could clean up: the next run does, in each directory"
    capfd.readouterr()
    engine = _engine(dirs)
    lines = [x for x in capfd.readouterr().err.splitlines() if "killed run" in x]
    assert len(lines) == 2 and all(re.match(r"tinypipe: removed SSD scratch left by a killed run: .*pid", x)
                                   for x in lines), lines
    assert sorted(x.path for x in engine.store.offload.swept) == sorted(x[0] for x in left)
    assert not any(x[0].exists() for x in left)
    engine.close()
    assert _empty(dirs)


def test_finetune_with_two_offload_directories_equals_dram(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path,  # noqa: F811
        data_file: Path) -> None:  # noqa: F811
    dirs = _dirs(tmp_path, 2)
    dram = tmp_path / "dram"
    dram_plan, ssd_plan = _plan_file(tmp_path, False), _plan_file(tmp_path, True)
    code, _, err = run_cli(capsys, *_args(tiny_model_dir, data_file, dram, "--plan", dram_plan))
    assert code == 0, err
    striped = tmp_path / "striped"
    code, out, err = run_cli(capsys, *_args(tiny_model_dir, data_file, striped, "--plan", ssd_plan,
                                            "--offload-dir", f"{dirs[0]},{dirs[1]}"))
    assert code == 0, err
    assert "on SSD" in out + err and _empty(dirs)
    a, b = read_metrics(dram / "metrics.jsonl"), read_metrics(striped / "metrics.jsonl")
    assert all(r["ssd_read_bytes"] > 0 and r["ssd_write_bytes"] > 0 for r in b)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    wa = transformers.AutoModelForCausalLM.from_pretrained(dram, dtype=torch.float32).state_dict()
    wb = transformers.AutoModelForCausalLM.from_pretrained(striped, dtype=torch.float32).state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    code, _, err = run_cli(capsys, *_args(tiny_model_dir, data_file, tmp_path / "x", "--plan", ssd_plan,
                                          "--offload-dir", f"{dirs[0]},{dirs[0]}"))
    assert code == 2
    assert_one_line_error(err, "twice")

