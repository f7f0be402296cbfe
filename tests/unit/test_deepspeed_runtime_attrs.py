"""After a bare `import deepspeed` (the switch), DeepSpeed's runtime submodules are reachable as attributes,
as DeepSpeed's eager imports make them (DeepSpeedExamples calls `deepspeed.runtime.utils.set_random_seed`)."""
import subprocess
import sys

import pytest

SCRIPT = """
import trident
trident.install_as_deepspeed()
import deepspeed, torch
deepspeed.runtime.utils.set_random_seed(3)
a = torch.rand(2)
deepspeed.runtime.utils.set_random_seed(3)
assert torch.equal(a, torch.rand(2))
assert deepspeed.runtime.lr_schedules.WarmupLR is not None
try:
    deepspeed.runtime.no_such_thing
except AttributeError as e:
    assert "no_such_thing" in str(e)
else:
    raise SystemExit("no AttributeError")
print("ok")
"""


def test_runtime_submodules_are_attributes():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_unknown_runtime_attribute_is_attribute_error():
    import trident.deepspeed.runtime as runtime
    with pytest.raises(AttributeError, match="nope"):
        runtime.nope
