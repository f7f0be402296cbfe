"""Parameter-efficient fine-tuning: LoRA adapters that every parallel layout understands."""

from trident.peft.lora import LoRALinear, apply_lora, lora_state_dict, merge_lora
from trident.peft.export import save_adapters
from trident.peft.merge import merge_lora_state_dict

__all__ = ["LoRALinear", "apply_lora", "lora_state_dict", "merge_lora", "merge_lora_state_dict", "save_adapters"]
