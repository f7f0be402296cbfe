"""`from deepspeed.git_version_info import ...` under the switch, as DeepSpeed's harness does."""

import subprocess
import sys


def test_git_version_info_under_switch():
    code = ("import trident; trident.install_as_deepspeed()\n"
            "from deepspeed.git_version_info import version, installed_ops, compatible_ops, torch_info\n"
            "assert version.startswith('0.19') and installed_ops == {} and compatible_ops == {}\n"
            "assert 'version' in torch_info\n")
    subprocess.run([sys.executable, "-c", code], check=True)
