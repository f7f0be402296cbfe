"""DeepSpeed's own tests/unit, once under real DeepSpeed (bench venv) and once under trident.

    python bench/deepspeed_unit_tests.py /tmp/ds-src [--files runtime/test_data.py ...] [--timeout 600]

Per file: collected (world size <= 2), passed under DeepSpeed, passed under trident of those.
DeepSpeed's results are cached by DeepSpeed commit in bench/results/deepspeed_unit_tests_ds.json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_PY = str(ROOT / ".venv-bench" / "bin" / "python")  # the Makefile's bench venv
TARGET = ["runtime/test_ds_config_dict.py", "runtime/test_ds_initialize.py", "runtime/test_lr_schedulers.py",
          "runtime/test_data.py", "runtime/zero/test_zero_context.py", "v1/zero/test_zero.py",
          "checkpoint/test_latest_checkpoint.py", "checkpoint/test_zero_optimizer.py",
          "runtime/pipe/test_pipe.py", "comm/test_dist.py"]
RESULTS = ROOT / "bench" / "results"


def run_file(python: str, src: Path, rel: str, switch: bool, timeout: int) -> dict[str, str]:
    """Test id -> outcome ("passed", "failed", "skipped", "error") for one file."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", TRIDENT_DS_SWITCH="1" if switch else "0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)]))
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "r.xml"
        cmd = [python, "-m", "pytest", "-q", "-p", "_ds_unit_plugin", f"--junitxml={xml}",
               f"tests/unit/{rel}"]
        try:
            subprocess.run(cmd, cwd=src, env=env, timeout=timeout, capture_output=True)
        except subprocess.TimeoutExpired:
            return {"<timeout>": "error"}
        if not xml.exists():
            return {"<no result>": "error"}
        out = {}
        for case in ET.parse(xml).iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            out[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(kind, kind)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--files", nargs="*", default=TARGET)
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", str(args.src), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    cache_path = RESULTS / "deepspeed_unit_tests_ds.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    ds = cache.setdefault(commit, {})
    rows, report = [], {}
    for rel in args.files:
        if rel not in ds:
            ds[rel] = run_file(BENCH_PY, args.src, rel, False, args.timeout)
            RESULTS.mkdir(parents=True, exist_ok=True)
            cache_path.write_text(json.dumps(cache, indent=1))
        tr = run_file(sys.executable, args.src, rel, True, args.timeout)
        ds_pass = [t for t, o in ds[rel].items() if o == "passed"]
        tr_pass = [t for t in ds_pass if tr.get(t) == "passed"]
        rows.append((rel, len(ds[rel]), len(ds_pass), len(tr_pass)))
        report[rel] = {"deepspeed": ds[rel], "trident": tr}
        print(f"{rel:45s} {len(ds[rel]):5d} {len(ds_pass):5d} {len(tr_pass):5d}", flush=True)
    lines = ["| file | collected | DeepSpeed pass | trident pass |", "|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "deepspeed_unit_tests.md").write_text(f"DeepSpeed commit {commit}\n\n" + "\n".join(lines) + "\n")
    (RESULTS / "deepspeed_unit_tests.json").write_text(json.dumps({"commit": commit, "files": report}, indent=1))


if __name__ == "__main__":
    main()
