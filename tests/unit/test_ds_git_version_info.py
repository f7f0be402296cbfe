"""`from deepspeed.git_version_info import ...` under the switch, as DeepSpeed's harness does."""

import subprocess
import sys


def test_git_version_info_under_switch():
    code = ("import trident; trident.install_as_deepspeed()\n"
            "from deepspeed.git_version_info import version, installed_ops, compatible_ops, torch_info\n"
            "assert version.startswith('0.19') and installed_ops == {} and compatible_ops == {}\n"
            "assert 'version' in torch_info\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_op_builder_answers_as_build_without_ops():
    code = ("import trident; trident.install_as_deepspeed()\n"
            "from deepspeed.ops.op_builder import FusedAdamBuilder, CPUAdamBuilder\n"
            "from trident.deepspeed.engine.surface import NotInTrident\n"
            "assert FusedAdamBuilder().is_compatible() is False\n"
            "try:\n    CPUAdamBuilder().load()\nexcept NotInTrident as e:\n    assert 'CPUAdamBuilder' in str(e)\n"
            "else:\n    raise SystemExit('load() did not raise')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_internal_module_without_counterpart_is_named_error():
    code = ("import trident; trident.install_as_deepspeed()\n"
            "from trident.deepspeed.errors import NotInTridentModule\n"
            "try:\n    import deepspeed.inference.v2.kernels\nexcept NotInTridentModule as e:\n"
            "    assert 'deepspeed.inference' in str(e) and 'Coming from DeepSpeed' in str(e)\n"
            "else:\n    raise SystemExit('imported')\n")
    subprocess.run([sys.executable, "-c", code], check=True)
