"""`deepspeed.utils.zero_to_fp32`, as `import trident as deepspeed` finds it (`trident.deepspeed.utils.zero_to_fp32`)."""

from trident.deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                  get_fp32_state_dict_from_zero_checkpoint,
                                                  load_state_dict_from_zero_checkpoint)

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
