"""The churn soak of benchmarks/soak.py for a minute on the tiny model: 64 users, a third of the requests
cancelled at random moments, mixed n, stop strings, logprobs, long prompts, streams and whole answers. At the end
nothing runs, every block is free, RSS and open descriptors are flat, and the canary (under load and after) answers
exactly what it answers alone. `python benchmarks/soak.py --minutes 30` runs the long one."""

from __future__ import annotations

from pathlib import Path

from benchmarks import soak


def test_churn_soak_leaves_the_server_as_it_found_it(tiny_model: Path, server_logs: Path) -> None:
    summary = soak.run(tiny_model, minutes=1.0, users=64, threads=1, log_dir=server_logs, canary_every=8.0,
                       sample_every=1.0)
    print(summary.report())
    assert summary.ok, summary.report()
    assert summary.num_completed >= 100 and summary.num_canaries >= 4
    # Every kind of cancellation happened, and the engine saw them as aborts.
    assert all(summary.cancelled[moment] >= 20 for moment in ("before first token", "mid-stream", "whole answer"))
    assert summary.finished.get("abort", 0) >= 60 and summary.finished.get("error", 0) == 0
    assert len(summary.samples) >= 30  # RSS and descriptors were watched all along
