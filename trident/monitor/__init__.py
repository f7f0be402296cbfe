"""What a run reports: the rank-0 logger (`log`), the progress bar (`progress`), the monitors
with DeepSpeed's `write_events` interface (`writers`: CSV, TensorBoard and the fan-out; one module
each for Weights & Biases, Comet and MLflow, importing their library only when enabled), and
loss-curve PNGs (`plot`, imported on its own so that matplotlib loads only when a plot is drawn)."""

from trident.monitor.progress import ProgressBar
from trident.monitor.writers import CSVMonitor, MonitorLibraryMissing, MonitorMaster, Monitors, TensorBoardMonitor

__all__ = ["CSVMonitor", "MonitorLibraryMissing", "MonitorMaster", "Monitors", "ProgressBar", "TensorBoardMonitor"]
