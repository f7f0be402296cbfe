"""`from deepspeed.x import y` follows `import trident as deepspeed`, and `install_as_deepspeed()` makes
`import deepspeed` trident (issue 32, item 4 and the zero-line switch). Each case runs in a fresh
interpreter: the switch is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_from_imports_follow_import_trident_as_deepspeed():
    proc = run("""
        import trident as deepspeed
        from deepspeed.pipe import PipelineModule
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.utils import set_random_seed
        from deepspeed.runtime.pipe.module import LayerSpec
        from deepspeed.utils import RepeatingLoader, log_dist, logger
        from deepspeed.ops.adam import FusedAdam
        import deepspeed.comm as dist
        import sys, trident
        assert PipelineModule is trident.PipelineModule and dist is trident.comm
        assert trident.__spec__.name == "trident" and sys.modules["deepspeed"] is trident
        assert sys.modules["deepspeed.runtime.utils"] is sys.modules["trident.deepspeed.runtime.utils"]
        print("ok", get_accelerator().device_name())
    """)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok", "cpu"], proc.stderr


def test_a_function_local_binding_counts_too():
    proc = run("""
        def main():
            import trident as deepspeed
            from deepspeed.runtime.lr_schedules import WarmupLR
            return WarmupLR
        print(main().__module__)
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "trident.optim.schedulers", proc.stderr


def test_without_the_binding_or_the_switch_deepspeed_is_not_trident():
    proc = run("""
        import trident
        try:
            from deepspeed.pipe import PipelineModule
        except ModuleNotFoundError as err:
            print("missing", err.name)
    """)
    assert proc.stdout.strip() == "missing deepspeed", proc.stderr


def test_install_as_deepspeed_and_modules_trident_lacks():
    proc = run("""
        import trident
        assert trident.install_as_deepspeed() is True
        import deepspeed
        assert deepspeed is trident and deepspeed.initialize is trident.initialize
        from deepspeed.runtime.zero.partition_parameters import Init
        from deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
        try:
            import deepspeed.autotuning
        except ModuleNotFoundError as err:
            print(err)
        try:
            deepspeed.init_inference(None)
        except AttributeError as err:
            print(type(err).__name__, err)
    """)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert "No module named 'deepspeed.autotuning'" in lines[0] and "no counterpart" in lines[0]
    assert lines[1].startswith("NotInTrident deepspeed.init_inference is not available in trident")
