"""`deepspeed.checkpoint.utils`: transformers' Trainer imports `clone_tensors_for_torch_save` from here to
save a state dict whose tensors do not share storage with the live model."""
import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """A copy of `item` (a tensor, or lists / tuples / dicts of them, nested) with every tensor detached and
    copied onto `device` (a torch.device or its name); other values are returned as they are."""
    if torch.is_tensor(item):
        device = torch.device(device) if isinstance(device, str) else device
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
