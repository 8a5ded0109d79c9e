"""The planner's data-parallel replicas (#15): collective bytes, host memory per node for both
shardings, the exposed part of the collectives, the automatic sharding choice both ways, the refusal
of a global batch the replicas do not divide, and ``tinypipe plan --nodes --gpus``'s table.

Expected numbers are derived here from the shapes and the stated model (tinypipe/planner/replicas.py),
not read from the planner's output."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

import tinypipe
from model_zoo import make_model
from tinypipe.cli.plan import _links, main as plan_main
from tinypipe.errors import ConfigError
from tinypipe.planner.auto import resolve_plan
from tinypipe.planner.candidate import HOST_BASELINE_BYTES, evaluate
from tinypipe.planner.estimate import host_bytes
from tinypipe.planner.hardware import HARDWARE, INTERCONNECTS, interconnect_gbs
from tinypipe.planner.replica_search import plan_layout
from tinypipe.planner.replicas import (
    Cluster,
    Layout,
    allgather_bytes,
    collective_bytes,
    exposed_collective_s,
    host_per_node,
    layouts,
    replica_hardware,
    split_batch,
)
from tinypipe.planner.sharded_host import sharded_host
from tinypipe.planner.sizes import model_sizes
from tinypipe.schedule.plan import make_plan
from tinypipe.units import GIB, gib_text

H, I, V = 64, 128, 100  # a small Llama: hidden, intermediate, vocabulary


def _small_sizes():
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=4,
                                   num_key_value_heads=4, num_hidden_layers=2, vocab_size=V,
                                   tie_word_embeddings=False,
                                   max_position_embeddings=256)
    return model_sizes(cfg)


# per layer, from the shapes: embedding V x H; a block q/k/v/o (H x H each), gate/up/down (H x I each)
# and two RMSNorm weights; the head: the final norm and the V x H LM head
EMBED, BLOCK, HEAD = V * H, 4 * H * H + 3 * H * I + 2 * H, H + V * H
LAYERS = [EMBED, BLOCK, BLOCK, HEAD]


def _plan(device_optimizer: str = "off"):
    """Two packs of one block on one device (by default every layer stepped on the host)."""
    return make_plan(2, pack_size=1, micro_batch_size=1, backward_micro_batch_size=1, num_devices=1,
                     prefetch_window=1, stash="device", tied=False, device_optimizer=device_optimizer)


def test_small_model_sizes_are_the_shapes() -> None:
    assert list(_small_sizes().layer_train_numels) == LAYERS == [6400, 41088, 41088, 6464]


def test_collective_bytes_ring_all_reduce_and_reduce_scatter() -> None:
    sizes = _small_sizes()
    plan = _plan()  # every layer stepped on the host
    for R in (2, 3, 4, 8):
        rep = collective_bytes(sizes, plan, R, "replicate")
        sh = collective_bytes(sizes, plan, R, "shard")
        assert rep == pytest.approx([2 * (R - 1) / R * 4 * n for n in LAYERS], rel=1e-15)
        assert sh == pytest.approx([(R - 1) / R * 4 * n for n in LAYERS], rel=1e-15)
        assert allgather_bytes(sizes, plan, R) == pytest.approx((R - 1) / R * 4 * sum(LAYERS), rel=1e-15)
    assert sum(collective_bytes(sizes, plan, 4, "replicate")) == pytest.approx(6 * sum(LAYERS))
    # a layer stepped on its device keeps its whole AdamW state: all-reduced, never all-gathered
    dev = _plan("embed")
    sh = collective_bytes(sizes, dev, 4, "shard")
    assert sh[0] == pytest.approx(2 * 3 / 4 * 4 * EMBED) and sh[1] == pytest.approx(3 / 4 * 4 * BLOCK)
    assert allgather_bytes(sizes, dev, 4) == pytest.approx(3 / 4 * 4 * (2 * BLOCK + HEAD))


def test_host_per_node_for_both_shardings() -> None:
    sizes = _small_sizes()
    plan = _plan()
    for retain in (False, True):
        host = host_bytes(sizes, plan, batch=2, seq=8, precision="bf16", num_devices=1, retain_grads=retain)
        T = sum(LAYERS)
        assert host["master_weights"] == 4 * T and host["optimizer_state"] == 8 * T
        others = sum(v for k, v in host.items() if k not in ("master_weights", "optimizer_state",
                                                            "gradient_buffers"))
        # replicate: every replica process holds 4 + 8 B/param (+ 4 retained), its pools and the process
        for per_node in (1, 2, 4):
            assert host_per_node(host, per_node) == per_node * (
                12 * T + (4 * T if retain else 0) + others + HOST_BASELINE_BYTES)
        # shard over R = 3: each layer's 1/3 rounded up (6400 -> 2134, 41088 -> 13696, 6464 -> 2155)
        shard = sharded_host(host, sizes, plan, 3, retain)
        share = 2134 + 13696 + 13696 + 2155
        assert shard["master_weights"] == 4 * T  # the whole master copy stays in every replica
        assert shard["optimizer_state"] == 8 * share
        assert shard["gradient_buffers"] == (4 * share if retain else 0)
        # the embedding stepped on its device: its moments stay whole (8 B x 6400), the others are shared
        dev = sharded_host(host, sizes, _plan("embed"), 3, retain)
        assert dev["optimizer_state"] == 8 * (EMBED + 13696 + 13696 + 2155)
        assert host_per_node(shard, 2) == 2 * (4 * T + 8 * share + (4 * share if retain else 0) + others
                                               + HOST_BASELINE_BYTES)


def test_exposed_collectives_one_lane_in_gradient_order() -> None:
    """Two packs of one block, backward 1 s: the head's bytes at 0, pack 1's at 0.5 s, pack 0's and
    the embedding's at 1 s, on a 1 GB/s lane. Head 0.2 GB: 0 -> 0.2; pack 1 0.6 GB: 0.5 -> 1.1;
    pack 0 0.6 GB: 1.1 -> 1.7; embedding 0.1 GB: 1.7 -> 1.8: 1.5 s on the link, 0.8 s exposed."""
    sizes = _small_sizes()
    plan = _plan()
    total, exposed = exposed_collective_s(sizes, plan, 1.0, [0.1e9, 0.6e9, 0.6e9, 0.2e9], 1.0)
    assert total == pytest.approx(1.5) and exposed == pytest.approx(0.8)
    # a link fast enough to finish each pack's bytes within the next pack's backward: only the tail shows
    total, exposed = exposed_collective_s(sizes, plan, 1.0, [0.1e9, 0.4e9, 0.4e9, 0.2e9], 1.0)
    assert total == pytest.approx(1.1) and exposed == pytest.approx(0.4 + 0.1)


def test_interconnect_presets_and_links() -> None:
    assert interconnect_gbs("eth100") == pytest.approx(100 / 8 * 0.9)  # line rate 12.5 GB/s x 0.9
    assert interconnect_gbs("IB200") == pytest.approx(22.5) and interconnect_gbs("7.5") == 7.5
    assert set(INTERCONNECTS) >= {"pcie5", "nvlink", "eth25", "eth100", "ib200"}
    with pytest.raises(ConfigError, match="unknown interconnect"):
        interconnect_gbs("token-ring")
    with pytest.raises(ConfigError, match="positive"):
        interconnect_gbs("-3")
    hw = HARDWARE["h200-pcie5"]
    assert _links("nvlink,ib200", 2, hw) == (INTERCONNECTS["nvlink"], 22.5)
    assert _links("eth100", 2, hw) == (INTERCONNECTS["pcie5"], 11.25)  # within: the hardware's PCIe
    assert _links("12", 1, hw) == (12.0, INTERCONNECTS["eth25"])  # one node: a number is the node's link
    with pytest.raises(ConfigError, match="within a node"):
        _links("nvlink", 2, hw)
    with pytest.raises(ConfigError, match="within a node"):
        _links("pcie5,nvlink", 2, hw)
    assert Cluster(1, 4, 50.0, 1.0, GIB).ring_gbs(4) == 50.0
    assert Cluster(2, 4, 50.0, 1.0, GIB).ring_gbs(4) == 1.0
    # one replica per node: the ring crosses only the links between nodes, however fast or slow the node's
    two = Cluster(2, 4, 50.0, 360.0, GIB)
    assert two.ring_gbs(1) == 360.0 and two.ring_gbs(2) == 50.0


def test_layouts_and_the_indivisible_batch() -> None:
    cl = Cluster(2, 4, 50.0, 11.25, 256 * GIB)
    # on two nodes also one pipeline on one node: what the second node adds
    assert [(x.replicas, x.gpus_per_replica, x.per_node) for x in layouts(cl)] == [(8, 1, 4), (4, 2, 2),
                                                                                   (2, 4, 1), (1, 4, 1)]
    assert [x.nodes for x in layouts(cl)] == [2, 2, 2, 1] and len(layouts(cl, 2)) == 1
    assert [x.kind for x in layouts(Cluster(1, 2, 50.0, 1.0, GIB))] == ["data parallel", "pipeline"]
    with pytest.raises(ConfigError, match="does not divide the 4 GPUs of a node"):
        layouts(cl, 3)
    assert split_batch(16, 8) == 2
    with pytest.raises(ConfigError) as e:
        split_batch(12, 8)
    assert str(e.value) == ("global batch 12 does not split evenly over 8 replicas: use 1, 2, 3, 4, 6 or 12 "
                            "replicas, or a global batch that 8 divides (e.g. 16)")
    model = make_model("llama", layers=4)
    cfg = tinypipe.Config(devices=["cpu"], seq_len=16, global_batch=6, cpu_memory_bytes=16 * GIB)
    with pytest.raises(ConfigError, match="global batch 6 does not split evenly over 4 replicas: use 1, 2, 3 "
                                          "or 6"):
        resolve_plan(model, cfg, num_blocks=4, tied=False, replicas=4)


# ------------------------------------------------------------------ the automatic sharding choice

SEVEN_B = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096  # llama-2-7b


def test_only_sharding_fits_the_host() -> None:
    """One node, two replicas of one GPU: replicated, each process holds >= 12 B/param = 75.3 GiB, so
    >= 150.6 GiB for the node; sharded 4 + 8/2 = 8 B/param (50.2 GiB each) plus pools and the
    process: a 130 GiB node fits only sharding."""
    assert model_sizes(transformers.LlamaConfig(**_llama7b())).train_total == SEVEN_B
    budget = 130 * GIB
    assert 2 * 12 * SEVEN_B > budget
    cl = Cluster(1, 2, INTERCONNECTS["pcie5"], 1.0, budget)
    lp = plan_layout("llama-2-7b", "h200-pcie5", cl, Layout(2, 1, 2), seq=2048, global_batch=16)
    assert lp.fits and lp.choice is not None and lp.choice.sharding == "shard"
    assert lp.reason.startswith("shard: replicated state needs") and "have 130.0 GiB" in lp.reason
    rep, sh = lp.options["replicate"], lp.options["shard"]
    assert not rep.fits and rep.host_per_node >= 2 * 12 * SEVEN_B
    # the floor -- masters and both moments in each of the node's two processes -- already exceeds it
    assert rep.why_not == (f"replicated: needs at least {gib_text(2 * (12 * SEVEN_B + HOST_BASELINE_BYTES))} "
                           "host per node (2 x (4 + 8) B/param + the process), have 130.0 GiB")
    plan = sh.plan
    on_device = set().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
    assert sh.host["optimizer_state"] == 8 * sum(n if i in on_device else -(-n // 2)
                                                 for i, n in enumerate(sh.result.sizes.layer_train_numels))
    assert sh.host_per_node == 2 * (sum(sh.host.values()) + HOST_BASELINE_BYTES) <= budget
    # shard: each rank steps half the parameters with the node's CPU shared by two: the full machine rate
    assert sh.result.hardware.cpu_adamw_gparams_s == HARDWARE["h200-pcie5"].cpu_adamw_gparams_s
    assert lp.plan().replicas == 2 and lp.plan().optimizer_sharding == "shard"


def test_sharded_budget_counts_device_stepped_state_whole() -> None:
    """A 115 GiB node, two one-GPU replicas sharding the moments: each rank's budget is 57.5 GiB and
    a layer stepped on the GPU (resident packs, embedding, head) keeps its whole moments on the host
    too. Adding to the budget the 8 (1 - 1/2) B/param sharding would save if every layer were
    host-stepped (25.1 GiB) admitted plans with 2 resident packs that needed 118.4 GiB per node,
    and then no sharded plan fit; counted per layer, a plan that fits is found."""
    budget = 115 * GIB
    cl = Cluster(1, 2, INTERCONNECTS["pcie5"], 1.0, budget)
    lp = plan_layout("llama-2-7b", "h200-pcie5", cl, Layout(2, 1, 2), seq=2048, global_batch=16)
    sh = lp.options["shard"]
    assert lp.fits and lp.choice is sh, sh.why_not
    assert sh.result is not None and sh.result.cpu_memory_bytes == budget // 2
    trains = sh.result.sizes.layer_train_numels
    for c in sh.result.pareto:  # every plan the search kept: its rank's real bytes within the budget
        plan = c.plan
        on_device = set().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
        whole = host_bytes(sh.result.sizes, plan, batch=8, seq=2048, precision="bf16", num_devices=1)
        moments = 8 * sum(n if i in on_device else -(-n // 2) for i, n in enumerate(trains))
        assert c.memory.host == {**whole, "optimizer_state": moments}
        assert c.host_need == sum(c.memory.host.values()) + HOST_BASELINE_BYTES <= budget // 2
    plan = sh.plan
    assert plan is not None and plan.resident_packs >= 1  # device-stepped layers are in play
    assert sh.host_per_node == 2 * (sum(sh.host.values()) + HOST_BASELINE_BYTES) <= budget


def _llama7b() -> dict:
    return dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                intermediate_size=11008, vocab_size=32000, tie_word_embeddings=False,
                max_position_embeddings=4096)


def test_replicate_wins_on_a_fast_link_with_room() -> None:
    """Two nodes of one GPU on a 360 GB/s link with 512 GiB each: replicated state fits, and the host
    AdamW hides behind a 16-sequence backward that recomputes every pack either way, so sharding
    only adds its all-gather: 1/2 x 4 B x the host-stepped parameters / 360 GB/s. (Kept activations
    shorten the backward until it no longer hides the whole model's AdamW: the next test.)"""
    cl = Cluster(2, 1, INTERCONNECTS["pcie5"], 360.0, 512 * GIB)
    lp = plan_layout("llama-2-7b", "h200-pcie5", cl, Layout(2, 1, 1), seq=2048, global_batch=32,
                     keep_activations=False)
    rep, sh = lp.options["replicate"], lp.options["shard"]
    assert lp.choice is rep and rep.fits and sh.fits and rep.step_s <= sh.step_s
    assert lp.reason.startswith("replicate: fits the host") and "not slower" in lp.reason
    plan = sh.plan
    stepped = set().union(*(plan.device_optimized(d) for d in range(plan.num_devices)))
    host_params = sum(n for i, n in enumerate(sh.result.sizes.layer_train_numels) if i not in stepped)
    assert sh.allgather_s == pytest.approx(0.5 * 4 * host_params / 360e9, rel=1e-12)
    assert rep.allgather_s == 0
    for o in (rep, sh):
        assert o.step_s == pytest.approx(o.replica_step_s + o.exposed_s + o.allgather_s, rel=1e-12)
        assert o.tokens_per_s == pytest.approx(32 * 2048 / o.step_s, rel=1e-12)
    assert rep.host_per_node >= 12 * SEVEN_B and rep.host_per_node <= 512 * GIB
    # a forced sharding is kept (and timed the same way)
    forced = plan_layout("llama-2-7b", "h200-pcie5", cl, Layout(2, 1, 1), seq=2048, global_batch=32,
                         sharding="shard", keep_activations=False)
    assert list(forced.options) == ["shard"] and forced.choice.sharding == "shard"


def test_kept_activations_expose_the_replicated_host_adamw() -> None:
    """The same cluster with kept activations searched, on a host whose AdamW runs 3.0 G params/s
    (a smaller CPU than the H200 box's 4.1): kept packs take the recompute out of the backward,
    and the whole model's host AdamW on one replica's CPU no longer hides behind it -- the sharded
    plan, stepping half the parameters, is faster by more than its all-gather, and sharding is
    chosen. (At 4.1 G params/s the replicated plan is as fast: 3.06 vs 3.08 s.)"""
    cl = Cluster(2, 1, INTERCONNECTS["pcie5"], 360.0, 512 * GIB)
    layout = Layout(2, 1, 1)
    hw = dataclasses.replace(HARDWARE["h200-pcie5"], cpu_adamw_gparams_s=3.0)
    lp = plan_layout("llama-2-7b", hw, cl, layout, seq=2048, global_batch=32)
    rep, sh = lp.options["replicate"], lp.options["shard"]
    assert rep.fits and sh.fits and lp.choice is sh and lp.reason.startswith("shard: faster")
    plan = sh.plan
    assert any(plan.kept(q) for q in range(plan.num_packs))
    kw = dict(seq=2048, global_batch=16)
    as_rep = evaluate(sh.result.sizes, replica_hardware(hw, layout, "replicate"), plan, **kw).time.step_s
    assert as_rep - sh.replica_step_s > sh.allgather_s > 0


def test_resolve_plan_with_replicas_fills_the_plan() -> None:
    model = make_model("llama", layers=4)
    cfg = tinypipe.Config(devices=["cpu"], seq_len=16, global_batch=8, gpu_memory_bytes=GIB,
                          cpu_memory_bytes=16 * GIB)
    one, _ = resolve_plan(model, cfg, num_blocks=4, tied=False)
    assert (one.replicas, one.optimizer_sharding) == (1, "replicate")
    shape = dict(num_blocks=4, tied=False)
    assert resolve_plan(model, cfg, **shape, replicas=1) == resolve_plan(model, cfg, **shape)
    for forced in ("replicate", "shard"):
        plan, result = resolve_plan(model, cfg.replace(optimizer_sharding=forced), num_blocks=4, tied=False,
                                    replicas=2, replicas_per_node=1)
        assert (plan.replicas, plan.optimizer_sharding) == (2, forced) and result is not None
        assert result.global_batch == 4  # each replica plans its half of the batch
    # a hand-set plan keeps its knobs and gets the replica fields
    plan, result = resolve_plan(model, cfg.replace(pack_size=2, micro_batch_size=2), num_blocks=4, tied=False,
                                replicas=4, replicas_per_node=2)
    assert result is None and plan.pack_size == 2 and plan.replicas == 4
    assert plan.optimizer_sharding in ("replicate", "shard")
    # without a workload host memory alone decides: a tiny model fits replicated
    plan, _ = resolve_plan(model, tinypipe.Config(devices=["cpu"], cpu_memory_bytes=16 * GIB), num_blocks=4,
                           tied=False, replicas=2)
    assert (plan.replicas, plan.optimizer_sharding) == (2, "replicate")
    given = dataclasses.replace(one, micro_batch_size=1, backward_micro_batch_size=1)
    plan, result = resolve_plan(model, cfg, num_blocks=4, tied=False, plan=given, replicas=2)
    assert result is None and plan.packs == given.packs and plan.replicas == 2
    with pytest.raises(ConfigError, match="do not spread evenly"):
        resolve_plan(model, cfg, num_blocks=4, tied=False, replicas=4, replicas_per_node=3)
    with pytest.raises(ConfigError, match="SSD tier"):
        resolve_plan(model, cfg.replace(offload_dir="/tmp"), num_blocks=4, tied=False, replicas=2)


# ------------------------------------------------------------------ tinypipe plan --nodes --gpus


def _plan_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = plan_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        if line.startswith((" * ", "   ")) and line[3:].split(" (")[0].strip()[:1].isdigit():
            name = line[3:].split(" (")[0].strip()
            rows[name] = line
    return rows


def test_plan_cli_compares_layouts_on_two_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _plan_cli(capsys, "--model", "llama-2-7b", "--nodes", "2", "--gpus", "4",
                               "--seq-len", "2048", "--global-batch", "16", "--hardware", "h200-pcie5",
                               "--cpu-memory", "256GiB",
                               "--interconnect", "pcie5,eth25")
    assert code == 0, err
    assert out.startswith("layouts of 2 nodes x 4 GPUs (h200-pcie5), host 256.0 GiB per node, 16 x 2048 "
                          "tokens/step in all\nlinks: within a node 50 GB/s, between nodes 2.81 GB/s\n")
    rows = _rows(out)
    assert list(rows) == ["8 x 1 GPU", "4 x 2 GPUs", "2 x 4 GPUs", "1 x 4 GPUs"]
    assert "1 x 4 GPUs (pipeline, 1 node)" in rows["1 x 4 GPUs"]
    best = [name for name, line in rows.items() if line.startswith(" *")]
    assert len(best) == 1
    tokens = {}
    ring = 25 / 8 * 0.9 * 1e9
    for name, line in rows.items():
        cells = line[3:].split(")")[1].split()
        tok, step, comm = float(cells[0].replace(",", "")), float(cells[1]), float(cells[2])
        sharding = cells[-1]
        R = int(name.split()[0])
        tokens[name] = tok
        assert tok == pytest.approx(16 * 2048 / step, rel=5e-3)  # tokens/s and s/step agree (rounding)
        if sharding == "shard":  # the all-gather alone: (R-1)/R x 4 B of at least the blocks' parameters
            blocks = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)
            assert comm >= (R - 1) / R * 4 * blocks / ring - 0.005
    assert tokens[best[0]] >= 0.99 * max(tokens.values())  # the fastest (ties within 1 %: the leanest)
    assert f"best: {best[0]} " in out and "\noptimizer state: " in out and "\nplan per replica: " in out
    replica_plan = " ".join(out.split("plan per replica: ")[1].split("\n\n")[0].split())  # wrapped
    R = int(best[0].split()[0])
    if R > 1:
        assert f"{R} replicas (optimizer state " in replica_plan
    else:  # 25 GbE: the second node's collectives cost more than its compute saves
        assert "replicas" not in replica_plan and "on 1 of the 2 nodes" in out
    assert rows["1 x 4 GPUs"][3:].split(")")[1].split()[2] == "0.00"  # one replica: no collectives


def test_plan_cli_one_node_pipeline_and_refused_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _plan_cli(capsys, "--model", "llama-3.2-1b", "--nodes", "1", "--gpus", "2",
                               "--seq-len", "1024", "--global-batch", "3", "--hardware", "rtx4090-pcie4",
                               "--cpu-memory", "64GiB")
    assert code == 0, err
    rows = _rows(out)
    assert "refused: global batch 3 does not split evenly over 2 replicas" in rows["2 x 1 GPU"]
    pipe = rows["1 x 2 GPUs"]
    assert pipe.startswith(" * ") and pipe.split()[-1] == "replicate"
    assert "optimizer state: replicate (one replica, nothing to shard)" in out
    # the only layout asked for is refused: one line, exit 2
    code, out, err = _plan_cli(capsys, "--model", "llama-3.2-1b", "--nodes", "1", "--gpus", "8",
                               "--gpus-per-replica", "1", "--seq-len", "1024", "--global-batch", "12",
                               "--cpu-memory", "64GiB")
    assert code == 2 and out == ""
    assert err == ("tinypipe plan: error: global batch 12 does not split evenly over 8 replicas: use 1, 2, "
                   "3, 4, 6 or 12 replicas, or a global batch that 8 divides (e.g. 16)\n")


def test_plan_cli_without_nodes_is_one_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan_cli(capsys, "--model", "llama-3.2-1b", "--gpus", "2", "--seq-len", "1024",
                             "--global-batch", "4", "--cpu-memory", "64GiB")
    assert code == 0 and out.startswith("model: llama-3.2-1b") and "layouts of" not in out


def test_plan_cli_json_and_the_pipeline_row_is_the_single_plan(capsys: pytest.CaptureFixture[str],
                                                                tmp_path) -> None:
    """One node: the 1 x 2 GPUs row is exactly `tinypipe plan --gpus 2` (no collectives, the whole
    CPU); every row's step is its replica's plus the exposed collectives plus the all-gather."""
    import json

    from tinypipe.planner.search import plan_for
    from tinypipe.schedule.plan import Plan

    saved = tmp_path / "plan.json"
    code, out, err = _plan_cli(capsys, "--model", "llama-3.2-1b", "--nodes", "1", "--gpus", "2", "--seq-len",
                               "1024", "--global-batch", "8", "--cpu-memory", "64GiB", "--json",
                               "--save-plan", str(saved))
    assert code == 0, err
    d = json.loads(out)
    rows = {(r["replicas"], r["gpus_per_replica"]): r for r in d["layouts"]}
    assert set(rows) == {(2, 1), (1, 2)}
    single = plan_for("llama-3.2-1b", "rtx4090-pcie4", gpus=2, cpu_memory_bytes=64 * GIB, seq=1024,
                      global_batch=8).best
    pipe = rows[(1, 2)]
    assert pipe["step_s"] == single.time.step_s and pipe["exposed_s"] == pipe["allgather_s"] == 0
    assert pipe["host_per_node_bytes"] == single.host_need and pipe["sharding"] == "replicate"
    for r in rows.values():
        parts = r["replica_step_s"] + r["exposed_s"] + r["allgather_s"]
        assert r["step_s"] == pytest.approx(parts, rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(8 * 1024 / r["step_s"], rel=1e-12)
    best = rows[(d["best"]["replicas"], d["best"]["gpus_per_replica"])]
    # the fastest, or within 1 % of it with less host memory per node
    fastest = max(rows.values(), key=lambda r: r["tokens_per_s"])
    assert best is fastest or (best["tokens_per_s"] >= 0.99 * fastest["tokens_per_s"]
                               and best["host_per_node_bytes"] < fastest["host_per_node_bytes"])
    plan = Plan.load(saved)
    assert (plan.replicas, plan.optimizer_sharding) == (best["replicas"], best["sharding"])


def test_sharded_replicas_with_the_ssd_tier_are_refused_in_one_place(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The planner's refusal of the SSD tier under sharded replicas is the engine's
    (planner/ssd.py sharded_ssd_refusal), one line."""
    from tinypipe.planner.hardware import load_hardware
    from tinypipe.planner.search import plan_for
    from tinypipe.planner.ssd import sharded_ssd_refusal, ssd_spec

    ssd = ssd_spec(load_hardware("h200-pcie5"), directory=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        plan_for("llama-3.2-1b", "h200-pcie5", gpus=1, cpu_memory_bytes=64 << 30, seq=512, global_batch=4,
                 host_shards=2, ssd=ssd)
    assert str(err.value) == str(sharded_ssd_refusal()) and "\n" not in str(err.value)
