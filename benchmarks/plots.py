"""PNG plots for ``docs/benchmarks.md`` (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from benchmarks import contention, failover, ledger_scale, overhead, resources
from benchmarks.common import DASH, Summary


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def overhead_plot(result: overhead.Result, path: Path) -> Path:
    names = [n for n in overhead.TIMED if n != "plain"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row, name in enumerate(names):
        publish = Summary.of([r.publish_extra(name) for r in result.rounds])
        total = Summary.of(result.values("total_extra", name))
        ax.barh(row, total.median * 1e6, color="#9ecae1" if name.startswith("floor") else "#3182bd")
        ax.barh(row, max(0.0, publish.median) * 1e6, color="#fdae6b")
        ax.errorbar(
            total.median * 1e6,
            row,
            xerr=[[(total.median - total.low) * 1e6], [(total.high - total.median) * 1e6]],
            color="black",
            capsize=3,
        )
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("extra time per task vs plain Task, µs (orange: at publish)")
    ax.set_title(f"Per-task overhead, real worker (median, min{DASH}max over rounds)")
    return _save(fig, path)


def failover_plot(series: list[failover.Series], path: Path) -> Path:
    shown = [s for s in series if s.trials]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.boxplot([[t.detected for t in s.trials] for s in shown], vert=False)
    ax.set_yticks(
        range(1, len(shown) + 1), [f"{s.system}\n{s.config}, {s.fault}" for s in shown], fontsize=7
    )
    ax.set_xlabel("fault → first send by another replica, s")
    ax.set_title("Beat failover")
    return _save(fig, path)


def ledger_plot(result: ledger_scale.Result, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    curves = {f"{kind}, {size:,} rows": v for (size, kind), v in result.latencies.items()}
    if result.during_prune:
        curves["during prune"] = result.during_prune
    for label, values in curves.items():
        ordered = sorted(values)
        ax.plot(
            [v * 1e3 for v in ordered], [i / len(ordered) for i in range(len(ordered))], label=label
        )
    ax.set_xscale("log")
    ax.set_xlabel("claim latency (acquire + release), ms")
    ax.set_ylabel("fraction of claims")
    ax.legend()
    ax.set_title("Ledger size and claim latency")
    return _save(fig, path)


def contention_plot(result: contention.Result, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.hist([d * 1e3 for d in result.decisions], bins=50)
    ax.set_xlabel("task_prerun → SKIPPED decision, ms")
    ax.set_ylabel("skips")
    ax.set_title("64 deliveries of one slot across 4 processes")
    return _save(fig, path)


def resources_plot(result: resources.Result, path: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    start = result.samples[0].at if result.samples else 0.0
    times = [s.at - start for s in result.samples]
    top.step(times, [s.worker_connections for s in result.samples], label="worker", lw=3)
    top.step(times, [s.beat_connections for s in result.samples], "--", label="beat replicas")
    top.set_ylim(0, max(result.peak_worker, result.peak_beat) + 1)
    top.set_ylabel("connections")
    top.legend()
    pids = sorted({pid for s in result.samples for pid in s.rss_kib})
    for pid in pids:
        bottom.plot(times, [s.rss_kib.get(pid, 0) / 1024 for s in result.samples], label=str(pid))
    bottom.set_ylim(
        0, max((max(s.rss_kib.values(), default=0) for s in result.samples), default=0) / 1024 * 1.2
    )
    bottom.set_ylabel("RSS, MiB")
    bottom.set_xlabel("s")
    top.set_title(f"Connections and worker memory over {result.tasks:,} locked tasks")
    return _save(fig, path)
