"""Issue #34's cases through the real ``tinypipe`` command (one process each; the rank cases two
gloo ranks, under ``torchrun`` or started as it starts them): the exit status, the one line it
printed, and whether anything was lost. Builds a 2-layer Llama in a temporary directory; the
disk-full case mounts a small tmpfs where it may (root), else it is left out.
Run: ``python bench/reliability_table.py`` (about two minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import psutil  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from _data_helpers import CORPUS, make_tokenizer, write_jsonl  # noqa: E402
from _dist_worker import free_port  # noqa: E402

COMMON = ["--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr", "1e-3", "--devices", "cpu",
          "--no-progress", "--steps", "2"]


def tinypipe(*argv: object, limit_file: int | None = None, env: dict | None = None) -> tuple[int, str]:
    def limits() -> None:
        if limit_file is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file, limit_file))
    proc = subprocess.run([sys.executable, "-m", "tinypipe.cli", *map(str, argv)], capture_output=True,
                          text=True, cwd=ROOT, preexec_fn=limits, env=dict(os.environ, HF_HUB_OFFLINE="1",
                                                                          **(env or {})))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tinypipe")]
    shown = " / ".join(lines) if lines else "(none)"
    if "Traceback" in proc.stderr:
        shown = "TRACEBACK " + shown
    return proc.returncode, shown


def rank_env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))


def torchrun(logs: Path, *argv: object) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 -m tinypipe.cli ARGV``, each rank's output in its file under ``logs``."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--log-dir",
                             str(logs), "-r", "3", "-m", "tinypipe.cli", *map(str, argv)], cwd=ROOT,
                            env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rank_line(logs: Path, rank: int) -> str:
    """What rank ``rank`` printed (its ``tinypipe`` lines; TRACEBACK first when there was one)."""
    err = next(logs.rglob(f"attempt_0/{rank}/stderr.log")).read_text()
    lines = [line for line in err.splitlines() if line.startswith("tinypipe")]
    return ("TRACEBACK " if "Traceback" in err else "") + (" / ".join(lines) or "(none)")


def rank_status(report: str, rank: int) -> int | None:
    """Rank ``rank``'s exit status in torchrun's failure summary."""
    found = re.search(rf"rank\s*:\s*{rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*:\s*(-?\d+)", report)
    return int(found.group(1)) if found else None


def intact(ckpt: Path) -> str:
    """Whether ``ckpt`` is a complete checkpoint whose files match their sha256, and what else is there."""
    from tinypipe.runtime.checksums import sha256_file

    if (ckpt / "manifest.json").is_file():
        record = json.loads((ckpt / "manifest.json").read_text())
        sums = record["sha256"]
    else:
        record = json.loads((ckpt / "state.json").read_text())
        sums = {layer["file"]: layer["sha256"] for layer in record["layers"]}
    ok = all(sha256_file(ckpt / name) == digest for name, digest in sums.items())
    return (f"checkpoint step {record['extra']['step']}, checksums match: {ok}, checkpoint.tmp left: "
            f"{ckpt.with_name('checkpoint.tmp').exists()}")


def wait_until(check: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.1)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".tinypipe.lock"}


def step_of(out: Path) -> int | None:
    state = out / "checkpoint" / "state.json"
    return json.loads(state.read_text())["extra"]["step"] if state.is_file() else None


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="tinypipe-table-"))
    os.environ["TMPDIR"] = str(root / "tmp")
    (root / "tmp").mkdir()
    tok = make_tokenizer()
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = root / "model"
    transformers.LlamaForCausalLM(cfg).save_pretrained(model)
    tok.save_pretrained(model)
    data = write_jsonl(root / "train.jsonl", [{"text": CORPUS[i % len(CORPUS)]} for i in range(40)])
    rows: list[tuple[str, int, str, str]] = []

    def case(name: str, run: Callable[[], tuple[int, str, str]]) -> None:
        code, line, kept = run()
        rows.append((name, code, line, kept))

    def base(out: Path, *extra: object, m: Path = model) -> list[object]:
        return ["finetune", "--model", m, "--data", data, "--output", out, *COMMON, *extra]

    done = root / "done"
    assert tinypipe(*base(done, "--checkpoint-every", "1"))[0] == 0

    def fresh_over_checkpoint() -> tuple[int, str, str]:
        before = snapshot(done)
        code, line = tinypipe(*base(done, "--checkpoint-every", "1"))
        return code, line, f"yes (checkpoint still step {step_of(done)}, files identical: {snapshot(done) == before})"
    case("fresh run into an output holding a checkpoint", fresh_over_checkpoint)

    def foreign() -> tuple[int, str, str]:
        out = root / "foreign"
        (out / "checkpoint").mkdir(parents=True)
        (out / "checkpoint" / "trainer_state.json").write_text("{}")
        before = snapshot(out)
        code, line = tinypipe(*base(out, "--checkpoint-every", "1", "--overwrite"))
        return code, line, f"yes (foreign files identical: {snapshot(out) == before})"
    case("foreign OUTPUT/checkpoint, even with --overwrite", foreign)

    def same_as_model() -> tuple[int, str, str]:
        copy = root / "model_copy"
        shutil.copytree(model, copy)
        before = snapshot(copy)
        code, line = tinypipe(*base(copy, m=copy))
        return code, line, f"yes (model files identical: {snapshot(copy) == before})"
    case("--output equal to --model", same_as_model)

    def seq_len() -> tuple[int, str, str]:
        code, line = tinypipe(*base(done, "--checkpoint-every", "1", "--resume", "--seq-len", "32"))
        return code, line, f"yes (checkpoint step {step_of(done)})"
    case("--resume with another --seq-len", seq_len)

    def replaced_base() -> tuple[int, str, str]:
        base_dir, out = root / "base", root / "lora"
        shutil.copytree(model, base_dir)
        assert tinypipe(*base(out, "--checkpoint-every", "1", "--lora", m=base_dir))[0] == 0
        torch.manual_seed(1)
        transformers.LlamaForCausalLM(cfg).save_pretrained(base_dir)
        code, line = tinypipe(*base(out, "--checkpoint-every", "1", "--lora", "--resume", m=base_dir))
        return code, line, f"yes (checkpoint step {step_of(out)})"
    case("LoRA --resume over a base replaced at the same path", replaced_base)

    disk = root / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    if mounted:
        def disk_full() -> tuple[int, str, str]:
            out = disk / "run"
            code, line = tinypipe(*base(out, "--checkpoint-every", "1"))
            rescued = list((root / "tmp").glob("tinypipe-rescued-*"))
            return code, line, (f"checkpoint step {step_of(out)}, checkpoint.tmp left: "
                                f"{(out / 'checkpoint.tmp').exists()}, rescued model dirs: {len(rescued)}")
        try:
            case("disk full (700 KiB tmpfs) while checkpointing", disk_full)
        finally:
            subprocess.run(["umount", str(disk)], check=False)

    def file_limit() -> tuple[int, str, str]:
        out = root / "ulimit"
        code, line = tinypipe(*base(out, "--checkpoint-every", "1"), limit_file=100_000)
        return code, line, f"no partial checkpoint.tmp left: {not (out / 'checkpoint.tmp').exists()}"
    case("ulimit -f 100 KB", file_limit)

    def flipped() -> tuple[int, str, str]:
        out = root / "flipped"
        shutil.copytree(done, out)
        victim = out / "checkpoint" / "layer-0001.safetensors"
        raw = bytearray(victim.read_bytes())
        for k in range(40):
            raw[-1 - 7 * k] ^= 0x5A
        victim.write_bytes(bytes(raw))
        code, line = tinypipe(*base(out, "--checkpoint-every", "1", "--resume"))
        return code, line, "yes (nothing trained on the damaged file)"
    case("40 flipped bytes in a checkpoint layer file", flipped)

    def two_runs() -> tuple[int, str, str]:
        out = root / "busy"
        out.mkdir()
        holder = subprocess.Popen([sys.executable, "-c", "import fcntl,os,sys,time;fd=os.open(sys.argv[1],"
                                   "os.O_RDWR|os.O_CREAT);fcntl.flock(fd,fcntl.LOCK_EX);"
                                   "os.pwrite(fd,str(os.getpid()).encode(),0);print(1,flush=True);time.sleep(60)",
                                   str(out / ".tinypipe.lock")], stdout=subprocess.PIPE)
        assert holder.stdout is not None and holder.stdout.readline()
        try:
            code, line = tinypipe(*base(out))
        finally:
            holder.kill()
            holder.wait()
        return code, line, f"yes (metrics.jsonl written: {(out / 'metrics.jsonl').exists()})"
    case("a second run into a busy output", two_runs)

    case("unknown flag", lambda: (*tinypipe("finetune", "--bogus"), "-"))
    case("--lr -1e-3", lambda: (*tinypipe(*base(root / "neg", "--lr", "-1e-3")), "-"))
    case("--lr 1e6", lambda: (*tinypipe(*base(root / "lr6", "--lr", "1e6", "--steps", "4")), "no model saved"))
    case("--checkpoint-every 0", lambda: (*tinypipe(*base(root / "ce0", "--checkpoint-every", "0")), "-"))

    def outside_path() -> tuple[int, str, str]:
        out = root / "outside"
        shutil.copytree(done, out)
        state_path = out / "checkpoint" / "state.json"
        state = json.loads(state_path.read_text())
        state["layers"][0]["file"] = "../../done/checkpoint/layer-0000.safetensors"
        state_path.write_text(json.dumps(state))
        code, line = tinypipe(*base(out, "--checkpoint-every", "1", "--resume"))
        return code, line, "yes (nothing read outside)"
    case("state.json naming ../ file", outside_path)

    case("demo into an output holding a model and a checkpoint",
         lambda: (*tinypipe("demo", "--device", "cpu", "--output", done, "--no-progress"), "yes (untouched)"))

    def killed_rank() -> tuple[int, str, str]:
        out, logs = root / "killed", root / "killed_logs"
        run = torchrun(logs, *base(out, "--checkpoint-every", "2", "--steps", "100000"))
        metrics = out / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5)
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(run.pid).children(recursive=True)
                 if "RANK" in p.environ()}
        t0 = time.monotonic()
        ranks[1].kill()
        psutil.wait_procs([ranks[0]], timeout=60)
        took = time.monotonic() - t0
        report, _ = run.communicate(timeout=60)
        return (rank_status(report, 0) or -1, rank_line(logs, 0),
                f"rank 0 gone {took:.2f} s after the kill; {intact(out / 'checkpoint')}")
    case("torchrun: rank 1 killed (SIGKILL) mid-run", killed_rank)

    def sigterm_mid_checkpoint() -> tuple[int, str, str]:
        out, ready, port = root / "term", root / "term_ready", free_port()
        argv = [*base(out, "--checkpoint-every", "1", "--steps", "100000")]
        procs, logs = [], [root / "term0.log", root / "term1.log"]
        for r in range(2):  # as torchrun starts them; rank 0 pauses in its 3rd checkpoint's 2nd file
            env = dict(rank_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if r == 0:
                env["TINYPIPE_TEST_PAUSE"] = f"layer:10:{ready}"
            with open(logs[r], "w") as f:
                procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "_rank_cli.py"),
                                               *map(str, argv)], env=env, cwd=ROOT, stdout=f,
                                              stderr=subprocess.STDOUT))
        wait_until(ready.exists)
        half = (out / "checkpoint.tmp").is_dir()
        t0 = time.monotonic()
        os.kill(procs[0].pid, signal.SIGTERM)
        code = procs[0].wait(timeout=60)
        took = time.monotonic() - t0
        procs[1].wait(timeout=60)
        text = logs[0].read_text()
        line = ("TRACEBACK " if "Traceback" in text else "") + " / ".join(
            x for x in text.splitlines() if x.startswith("tinypipe"))
        return code, line, (f"rank 0 gone {took:.2f} s after SIGTERM (checkpoint.tmp half-written then: {half}), "
                            f"rank 1 status {procs[1].returncode}; {intact(out / 'checkpoint')}")
    case("SIGTERM to rank 0 of 2 while it writes a checkpoint", sigterm_mid_checkpoint)

    def flipped_shard() -> tuple[int, str, str]:
        out = root / "sharded"
        saved = torchrun(root / "sharded_logs", *base(out, "--checkpoint-every", "1", "--optimizer-sharding",
                                                      "shard"))
        saved.communicate(timeout=300)
        victim = out / "checkpoint" / "rank-00001-of-00002" / "layer-0001.safetensors"
        raw = bytearray(victim.read_bytes())
        raw[-9] ^= 0x5A
        victim.write_bytes(bytes(raw))
        logs = root / "sharded_resume_logs"
        report, _ = torchrun(logs, *base(out, "--checkpoint-every", "1", "--optimizer-sharding", "shard",
                                         "--resume")).communicate(timeout=300)
        same = rank_line(logs, 0) == rank_line(logs, 1)
        return (rank_status(report, 0) or -1, rank_line(logs, 0),
                f"yes (nothing trained on the damaged shard; rank 1 printed the same line: {same})")
    case("a flipped byte in one rank's shard of a sharded checkpoint (torchrun --resume)", flipped_shard)

    print("| case | rc | the line printed | nothing lost? |")
    print("|---|---|---|---|")
    for name, code, line, kept in rows:
        print(f"| {name} | {code} | `{line.replace(str(root), '$T')}` | {kept} |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"({time.time() - t0:.0f} s)")
