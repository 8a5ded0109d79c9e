"""LoRA fine-tuning through the engine.

    peft_model = tinypipe.lora.apply_lora(hf_model, tinypipe.lora.LoraSettings(rank=8, alpha=16))
    engine = tinypipe.Engine(peft_model, config)      # trains only the adapters
    engine.step(batch)
    engine.save_pretrained("adapter/")               # PEFT format: PeftModel.from_pretrained loads it
    tinypipe.lora.save_merged(engine, "merged/")     # full weights: AutoModelForCausalLM loads them

Any ``peft.PeftModel`` with one LoRA adapter works too (``peft.get_peft_model``). Base weights are
frozen: they stay in host memory at the compute precision (2 bytes/parameter in bf16), stream to
the devices with the adapters, and get no gradients and no optimizer state; the adapters get fp32
master weights and AdamW moments like any trained parameter.
"""

from tinypipe.lora.hooks import LoraTrainer, merged_tensors, save_adapter, save_merged, split_peft
from tinypipe.lora.settings import LoraSettings, apply_lora, block_linears, default_targets

__all__ = [
    "LoraSettings",
    "LoraTrainer",
    "apply_lora",
    "block_linears",
    "default_targets",
    "merged_tensors",
    "save_adapter",
    "save_merged",
    "split_peft",
]
