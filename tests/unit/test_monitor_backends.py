"""The monitors that write to other tools, read back with each tool's own reader: a wandb offline
run (`wandb leet inspect --json`, wandb's reader of its .wandb log), an MLflow file store
(`MlflowClient.get_metric_history`), a Comet offline archive (its messages, through comet_ml's
`MetricMessage`); a missing library is an error naming the pip package. No network: wandb and
Comet run offline, Comet's cloud-metadata probe and both tools' error reporting are switched off."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest

from trident.config import load_config
from trident.monitor import MonitorLibraryMissing, Monitors

EVENTS = [[("Train/Samples/train_loss", 2.0 - 0.25 * s, 8 * s), ("Train/Samples/lr", 1e-3 * s, 8 * s)]
          for s in range(1, 5)]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    monkeypatch.setenv("COMET_AUTO_LOG_ENV_DETAILS", "false")
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # set here so that the test's environment is restored
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "COMET_API_KEY", "MLFLOW_TRACKING_URI",
                 "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path
    if "wandb" in sys.modules and sys.modules["wandb"] is not None:
        sys.modules["wandb"].teardown()  # wandb reads WANDB_DIR once per process: the next test sets another


def wandb_records(log) -> list[dict]:
    """The records of a .wandb run log as {"type": ..., <type>: {...}}, read by wandb itself:
    `wandb leet inspect --json` where this wandb has it, else the Python DataStore of older versions."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore  # the reader before wandb-core's

    store, records = datastore.DataStore(), []
    store.open_for_scan(str(log))
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            records.append({"type": kind, kind: {"item": item}})
        elif kind == "run":
            records.append({"type": kind, kind: {"project": record.run.project, "run_group": record.run.run_group}})
    return records


def wandb_history(wandb_dir, project: str = "trident-test", group: str | None = "g1") -> list[dict]:
    """The history rows of the one offline run under `wandb_dir`."""
    (log,) = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    records = wandb_records(log)
    runs = [r["run"] for r in records if r["type"] == "run"]
    assert runs and runs[0]["project"] == project and runs[0].get("run_group") == group
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def test_wandb_offline_run_holds_the_scalars(offline):
    import wandb  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    mons = Monitors(wandb={"enabled": True, "project": "trident-test", "group": "g1"}, run_config={"seed": 7})
    for events in EVENTS:
        mons.write_events(events)
    mons.close()
    rows = wandb_history(offline)
    assert [r["_step"] for r in rows] == [8, 16, 24, 32]
    assert [r["Train/Samples/train_loss"] for r in rows] == [1.75, 1.5, 1.25, 1.0]
    assert [r["Train/Samples/lr"] for r in rows] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])


def test_wandb_goes_offline_without_credentials(offline, monkeypatch):
    """No WANDB_MODE and no key anywhere: offline, not a login prompt or a hang."""
    import wandb  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("NETRC", str(offline / "no-netrc"))
    mons = Monitors(wandb={"enabled": True, "project": "trident-test", "group": "g1"})
    mons.write_events(EVENTS[0])
    mons.close()
    assert [r["Train/Samples/train_loss"] for r in wandb_history(offline)] == [1.75]


def test_mlflow_file_store_holds_the_scalars(offline, monkeypatch):
    import mlflow  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    from mlflow import MlflowClient

    monkeypatch.chdir(offline)  # the default store is ./mlruns
    mons = Monitors(mlflow={"enabled": True, "experiment_name": "exp1", "run_name": "r1"})
    for events in EVENTS:
        mons.write_events(events)
    (writer,) = mons.writers
    run_id = writer.run_id
    mons.close()
    uri = (offline / "mlruns").as_uri()
    assert writer.tracking_uri == uri
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "exp1"
    loss = client.get_metric_history(run_id, "Train/Samples/train_loss")
    assert [(m.step, m.value) for m in loss] == [(8, 1.75), (16, 1.5), (24, 1.25), (32, 1.0)]
    assert [m.step for m in client.get_metric_history(run_id, "Train/Samples/lr")] == [8, 16, 24, 32]


def test_comet_offline_archive_holds_the_scalars(offline):
    import comet_ml  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    from comet_ml.messages import MetricMessage

    mons = Monitors(comet={"enabled": True, "project": "trident-test", "experiment_name": "e1",
                           "samples_log_interval": 16})
    for events in EVENTS:
        mons.write_events(events)
    mons.close()
    (archive,) = list((offline / "comet").glob("*.zip"))
    with zipfile.ZipFile(archive) as z:
        lines = z.read("messages.json").decode().splitlines()
        meta = json.loads(z.read("experiment.json"))
    assert meta["project_name"] == "trident-test"
    metrics = [MetricMessage.from_message_dict(m["payload"]).metric for m in map(json.loads, lines)
               if m["type"] == "metric_msg"]
    loss = [(m["step"], m["metricValue"]) for m in metrics if m["metricName"] == "Train/Samples/train_loss"]
    assert loss == [(8, 1.75), (24, 1.25)]  # DeepSpeed's thinning: again only after 16 more samples


def test_missing_library_names_the_pip_package(monkeypatch, tmp_path):
    for module, package, section in (("wandb", "wandb", "wandb"), ("mlflow", "mlflow-skinny", "mlflow"),
                                     ("comet_ml", "comet_ml", "comet")):
        monkeypatch.setitem(sys.modules, module, None)  # find_spec, and import, now fail as if not installed
        with pytest.raises(MonitorLibraryMissing, match=rf"{section}.enabled is true.*pip install {package}"):
            Monitors(**{section: {"enabled": True}}, enabled=False)  # every rank checks, not only the writer
    assert issubclass(MonitorLibraryMissing, ImportError)
    Monitors(wandb={"enabled": False})  # switched off: nothing asked for


def test_sections_come_from_a_deepspeed_config(offline, monkeypatch):
    """DeepSpeed's `wandb` and `comet` keys (and trident's `mlflow`) load; Monitors.from_config
    builds every enabled backend (here: CSV and MLflow)."""
    import mlflow  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    monkeypatch.chdir(offline)
    cfg = load_config({
        "train_micro_batch_size_per_gpu": 1,
        "wandb": {"enabled": False, "team": "t", "group": "g", "project": "p"},
        "comet": {"enabled": False, "samples_log_interval": 10, "project": "p", "workspace": "w", "api_key": "k",
                  "experiment_name": "e", "experiment_key": "x" * 32, "online": False, "mode": "get_or_create"},
        "mlflow": {"enabled": True, "tracking_uri": str(offline / "store"), "experiment_name": "e", "run_name": "r"},
        "csv_monitor": {"enabled": True, "output_path": str(offline), "job_name": "csv"}})
    assert cfg.wandb.team == "t" and cfg.comet.mode == "get_or_create" and cfg.mlflow.run_name == "r"
    mons = Monitors.from_config(cfg, enabled=True)
    assert [type(w).__name__ for w in mons.writers] == ["CSVMonitor", "MLflowMonitor"]
    mons.write_events(EVENTS[0])
    mons.close()
    mons.close()  # idempotent (also registered at exit)
    assert (offline / "csv" / "metrics.csv").read_text().splitlines()[1].startswith("8,1.75")
    assert list((offline / "store").glob("*/*/metrics/Train/Samples/train_loss"))


def test_the_recorded_run_config_leaves_api_keys_out(monkeypatch):
    """wandb and Comet record the resolved config with the run; Comet's api_key stays out of it."""
    import comet_ml  # noqa: F401  (the dev extra installs it: missing is a failure, not a skip)
    from trident.monitor import writers

    built = []

    def build(key, settings, run_config):
        built.append((key, run_config))
        return CSVStandIn()

    monkeypatch.setattr(writers, "_build", build)
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "seed": 5,
                       "comet": {"enabled": True, "api_key": "secret-key", "online": False}})
    Monitors.from_config(cfg, enabled=True).close()
    ((key, recorded),) = built
    assert key == "comet" and recorded["seed"] == 5 and recorded["comet"]["online"] is False
    assert "secret-key" not in json.dumps(recorded)


class CSVStandIn:
    """A writer that writes nothing (a monitor of one's own needs only these three methods)."""

    def write_events(self, events) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
