"""`from deepspeed.git_version_info import ...` under the switch, as DeepSpeed's harness does."""

import subprocess
import sys

SWITCH = "import trident; trident.install_as_deepspeed()\n"


def run_under_switch(code: str) -> None:
    """`code` in a fresh interpreter whose `import deepspeed` is trident."""
    subprocess.run([sys.executable, "-c", SWITCH + code], check=True)


def test_git_version_info_under_switch():
    run_under_switch("from deepspeed.git_version_info import version, installed_ops, compatible_ops, torch_info\n"
                     "assert version.startswith('0.19') and installed_ops == {} and compatible_ops == {}\n"
                     "assert 'version' in torch_info\n")


def test_op_builder_answers_as_build_without_ops():
    run_under_switch("from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder\n"
                     "from trident.deepspeed.engine.surface import NotInTrident\n"
                     "assert FusedAdamBuilder().is_compatible() is False\n"
                     "try:\n    CPUAdamBuilder().load()\nexcept NotInTrident as e:\n    assert 'CPUAdamBuilder' in str(e)\n"
                     "else:\n    raise SystemExit('load() did not raise')\n")


def test_internal_module_without_counterpart_is_named_error():
    run_under_switch("from trident.deepspeed.errors import NotInTridentModule\n"
                     "try:\n    import deepspeed.inference.v2.kernels\nexcept NotInTridentModule as e:\n"
                     "    assert 'deepspeed.inference' in str(e) and 'Coming from DeepSpeed' in str(e)\n"
                     "else:\n    raise SystemExit('imported')\n")
