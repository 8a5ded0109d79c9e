"""Which resident gradient accumulators -- and frozen resident weights -- exist only while they are
in use.

The embedding's and the head's fp32 gradient accumulators are, by default, buffers of the device
pool: alive the whole step and every step. For a Llama-3.1-8B shape they are 2 GiB each (a
128,256 x 4,096 fp32 matrix), 3.9 GiB of a 24 GiB GPU. At long sequences that is what stands
between the step and the cap: 8B full fine-tuning at 2 x 128K tokens needs 26.3 GiB with them and
22.4 without. Yet each is written in one phase only -- the head's by the head tasks, which run back
to back before any block's backward; the embedding's by the embedding's backward, the step's last
compute -- and read once, by its download right after. So at long sequences each is allocated when
its phase starts and freed once its download has left the device, and the first block backward
waits for the head's download (a ~0.1 s copy against a block backward of seconds there) so that
the two never share the GPU.

Short sequences keep the pool's buffers: there the accumulators are a small share of the peak,
and the head's download is better overlapped with the first backward than waited for.

A layer stays in the pool when something else holds its gradient beyond its download: AdamW
stepped on the device (``Plan.device_optimizer``), an assisted update (the round trip reads it),
a micro-batch-wise turn (head tasks interleave with block backwards),
or, for the embedding, a tied head (the head's weight gradient lands in the embedding's buffer
long before the embedding's backward).

The same holds for the embedding's and the head's *weights* when they are frozen (LoRA, QLoRA):
uploaded every step into resident buffers (1 GiB each in bf16 for the 8B shape), yet read only by
the embedding's forward (a frozen embedding's backward has nothing to differentiate) and by the
head tasks. At long sequences each is allocated by its upload and freed once the last task that
reads it has finished, so neither is on the GPU during the block backwards, where the step peaks.
Not under a tied head (one buffer serves both) or a micro-batch-wise turn (head tasks interleave
with block backwards).
"""

from __future__ import annotations

from tinypipe.schedule.plan import Plan


def transient_grad_layers(plan: Plan, tied: bool, long_sequences: bool) -> frozenset[int]:
    """Layers (0: the embedding, ``num_blocks + 1``: the head) whose gradient accumulator is
    allocated for its phase and freed after its download (see the module documentation).
    Replicas change nothing: the download waits for the reduction that reads the buffer."""
    if not long_sequences or plan.turn_packs or plan.assisted:
        return frozenset()
    head = plan.num_blocks + 1
    out = set()
    if head not in plan.device_optimized(plan.head_device):
        out.add(head)
    if not tied and 0 not in plan.device_optimized(plan.embed_device):
        out.add(0)
    return frozenset(out)


def transient_weight_layers(plan: Plan, tied: bool, frozen: frozenset[int],
                            long_sequences: bool) -> frozenset[int]:
    """Layers (0: the embedding, ``num_blocks + 1``: the head) among ``frozen`` (no trainable
    element) whose resident weight buffer is allocated by the step's upload and freed after its
    last reader (see the module documentation)."""
    if not long_sequences or tied or plan.turn_packs:
        return frozenset()
    return frozenset({0, plan.num_blocks + 1} & set(frozen))
