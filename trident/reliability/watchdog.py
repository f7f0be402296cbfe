"""The watchdog: one thread per rank that turns a stuck or failed job into one report.

Every `poll_s` seconds it

1. reads the job's alarm counter from the store: if another rank raised the alarm, this rank
   publishes its flight-recorder snapshot (and where its main thread is now) and stops;
2. checks this rank's own waiting calls: one that has waited past `distributed.timeout_s`
   raises the alarm (a timeout error from the backend itself does the same, from the main
   thread, via `on_call_failure`);
3. in strict mode, publishes this rank's running hashes and compares those of its peers.

Raising the alarm elects one reporter (the first rank to count itself in). The reporter waits
a short grace period for every rank's snapshot, prints the one message, marks the report done;
every rank then exits with ABORT_EXIT_CODE, so the launcher ends (or restarts) the job. Rank 0
leaves last: the store may live in its process, and the others still need it to finish.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from trident.comm import recorder as flight
from trident.reliability.channel import Channel
from trident.reliability.failures import ABORT_EXIT_CODE, flush_and_exit, write_error_file
from trident.reliability.report import divergence_report, failure_line, hang_report

_log = logging.getLogger("trident.reliability")
_DIAG_DIR = os.path.dirname(os.path.abspath(__file__))
# A backend error this close to the timeout is the backend's own timeout firing first.
_TIMEOUT_SLACK = 0.95


def poll_interval(timeout_s: float) -> float:
    """A tenth of the timeout, within [0.2, 2] seconds."""
    return min(max(timeout_s / 10.0, 0.2), 2.0)


def _internal(filename: str) -> bool:
    return filename in flight._SKIP_FILES or filename.startswith(_DIAG_DIR)


def main_thread_site() -> str | None:
    """'file:line in function' of the main thread's innermost frame outside trident's comm and
    diagnostics code: where this rank is now."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{flight.short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class Watchdog:
    """Watches `recorder` and talks to the other ranks through `channel` (see module doc)."""

    def __init__(self, recorder: flight.FlightRecorder, channel: Channel | None, world_size: int,
                 poll_s: float) -> None:
        self.recorder, self.channel, self.world_size = recorder, channel, world_size
        self.poll_s = poll_s
        self.grace_s = max(2.0, 3 * poll_s)
        self._stop = threading.Event()
        self._alarm = threading.Lock()
        self._thread: threading.Thread | None = None
        self._unverified: list[tuple] = []
        self._verified: dict[str, int] = {}
        self.comm_error: BaseException | None = None
        recorder.on_failure = self.on_call_failure

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trident-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # the watchdog must outlive its own bugs: log and keep watching
                _log.exception("trident watchdog: poll failed")

    def poll(self) -> None:
        """One round of the three checks in the module docstring."""
        if self.channel is not None and self.channel.counter("alarm") > 0:
            self.respond()
        rec = self.recorder.overdue(time.monotonic())
        if rec is not None:
            self.raise_alarm(self._hang_info(rec))
        if self.recorder.strict_every and self.channel is not None:
            self._check_strict()

    # -- entry points ----------------------------------------------------------------------

    def on_call_failure(self, rec: flight.Record, err: BaseException) -> None:
        """A recorded call raised (main thread). A peer's alarm or a timeout ends the job here;
        any other error is left to propagate, marked as a consequence for the failure hook."""
        if self.channel is not None and self.channel.counter("alarm") > 0:
            self.respond()
        waited = time.monotonic() - (rec.t_wait or rec.t_issue)
        text = str(err).lower()
        if waited >= _TIMEOUT_SLACK * self.recorder.timeout_s or "timed out" in text or "timeout" in text:
            self.raise_alarm(self._hang_info(rec))
        if isinstance(err, RuntimeError):  # the backend's errors; a ValueError is the caller's own
            self.comm_error = err

    def announce_failure(self, summary: str) -> None:
        """This rank is ending with an uncaught exception: let the others stop now."""
        if self.channel is None or not self._alarm.acquire(blocking=False):
            return
        if self.channel.counter("reporters", 1) == 1:
            self.channel.put("alarm/info", {"kind": "failure", "rank": self.recorder.rank, "error": summary})
            self.channel.counter("alarm", 1)
            if self.recorder.rank == 0:
                self._await_acks(self.world_size - 1)

    def raise_alarm(self, info: dict) -> None:
        """This rank found the problem: elect a reporter, publish, report or wait; exit."""
        if not self._alarm.acquire(blocking=False):
            self._park()
        first = self.channel is None or self.channel.counter("reporters", 1) <= 1
        if not first:
            self._respond_locked()
        if self.channel is not None:
            self.channel.put("alarm/info", info)
            self.channel.counter("alarm", 1)
        self._publish_state()
        live = self._report(info)
        self._leave(live)

    def respond(self) -> None:
        """Another rank raised the alarm: stop as it says."""
        if not self._alarm.acquire(blocking=False):
            self._park()
        self._respond_locked()

    # -- internals -------------------------------------------------------------------------

    def _park(self) -> None:
        """Another thread of this process is already ending it."""
        while True:
            time.sleep(3600)

    def _respond_locked(self) -> None:
        deadline = time.monotonic() + self.grace_s
        info = None
        while info is None and time.monotonic() < deadline:
            info = self.channel.get("alarm/info")
            if info is None:
                time.sleep(0.05)
        rank = self.recorder.rank
        if info is not None and info.get("kind") == "failure":
            # one write, newline included: ranks share the launcher's stderr, and print's separate
            # write of "\n" let another rank's line land in between (seen in CI)
            sys.stderr.write(failure_line(rank, info) + "\n")
            sys.stderr.flush()
            write_error_file("peer", f"stopped because rank {info['rank']} failed", rank, {"cause_rank": info["rank"]})
            self._leave(self.world_size - (info["rank"] != 0))
        self._publish_state()
        done = self.channel.collect({0: "report/done"}, time.monotonic() + self.grace_s + 5.0)
        write_error_file("aborted", "stopped by trident's hang detector (see the report)", rank)
        self._leave(int(done.get(0, {}).get("live", 1)))

    def _leave(self, live: int) -> None:
        """Exit; rank 0 first waits (briefly) until the other `live` - 1 ranks are done with the store."""
        if self.channel is not None:
            if self.recorder.rank == 0:
                self._await_acks(live - 1)
            else:
                self.channel.counter("acks", 1)
        flush_and_exit(ABORT_EXIT_CODE)

    def _await_acks(self, expected: int) -> None:
        deadline = time.monotonic() + self.grace_s
        while self.channel.counter("acks") < expected and time.monotonic() < deadline:
            time.sleep(0.02)

    def _hang_info(self, rec: flight.Record) -> dict:
        return {"kind": "hang", "rank": self.recorder.rank, "record": rec.describe(time.monotonic()),
                "timeout_s": self.recorder.timeout_s}

    def _snapshot(self) -> dict:
        snap = self.recorder.snapshot()
        snap["now_at"] = main_thread_site()
        return snap

    def _publish_state(self) -> None:
        if self.channel is not None:
            self.channel.put(f"state/{self.recorder.rank}", self._snapshot())

    def _report(self, info: dict) -> int:
        """Gather the snapshots, print the message; returns how many ranks answered."""
        world = list(range(self.world_size))
        states = {}
        if self.channel is not None:
            keys = {r: f"state/{r}" for r in world if r != self.recorder.rank}
            states = self.channel.collect(keys, time.monotonic() + self.grace_s)
        states[self.recorder.rank] = self._snapshot()
        if info["kind"] == "divergence":
            text, summary = divergence_report(info, states)
        else:
            text, summary = hang_report(info, states, world)
        print(text, file=sys.stderr, flush=True)
        write_error_file(summary["kind"], summary["headline"], self.recorder.rank, summary)
        if self.channel is not None:
            self.channel.put("report/done", {"live": len(states)})
        return len(states)

    def _check_strict(self) -> None:
        """Publish new running hashes; compare those whose every peer has published."""
        rank, channel = self.recorder.rank, self.channel
        while self.recorder.checkpoints:
            key, ranks, seq, value = self.recorder.checkpoints.popleft()
            if len(ranks) > 1:
                channel.put(f"strict/{key}/{seq}/{rank}", value)
                self._unverified.append((key, ranks, seq))
        pending = []
        for key, ranks, seq in self._unverified:
            names = {r: f"strict/{key}/{seq}/{r}" for r in ranks}
            if not channel.has(list(names.values())):
                pending.append((key, ranks, seq))
                continue
            hashes = {r: channel.get(name) for r, name in names.items()}
            if len(set(hashes.values())) > 1:
                self.raise_alarm({"kind": "divergence", "rank": rank, "stream": key, "hashes": hashes,
                                  "seq_from": self._verified.get(key, 0), "seq_to": seq})
            self._verified[key] = seq
            if channel.counter(f"strict/{key}/{seq}/n", 1) == len(ranks):  # the last reader cleans up
                for name in [*names.values(), f"strict/{key}/{seq}/n"]:
                    channel.delete(name)
        self._unverified = pending
