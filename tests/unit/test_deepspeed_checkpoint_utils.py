"""`from deepspeed.checkpoint.utils import clone_tensors_for_torch_save` (transformers' save_model) under the
switch: DeepSpeed's meaning, every tensor of a nested container copied, storage not shared."""
import collections
import subprocess
import sys

import torch

from trident.deepspeed.ds_checkpoint.utils import clone_tensors_for_torch_save


def test_clone_nested_containers_do_not_share_storage():
    a, b = torch.arange(4.0, requires_grad=True), torch.ones(2)
    item = collections.OrderedDict(x=a, y=[b, (b, 3)], z="name")
    out = clone_tensors_for_torch_save(item)
    assert type(out) is collections.OrderedDict and out["z"] == "name" and out["y"][1][1] == 3
    assert isinstance(out["y"][1], tuple)
    assert torch.equal(out["x"], a.detach()) and not out["x"].requires_grad
    assert out["x"].data_ptr() != a.data_ptr() and out["y"][0].data_ptr() != b.data_ptr()
    assert clone_tensors_for_torch_save(b, device="cpu").data_ptr() != b.data_ptr()


def test_import_path_under_the_switch():
    script = ("import trident; trident.install_as_deepspeed()\n"
              "from deepspeed.checkpoint.utils import clone_tensors_for_torch_save\n"
              "import torch; t = torch.ones(3); assert torch.equal(clone_tensors_for_torch_save({'a': t})['a'], t)\n"
              "print('ok')")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
