#!/usr/bin/python3
"""Renders a bench/run results JSON as results.md and PNG charts in the same folder.

    bench/report.py bench/results/results.json   (bench/run calls it after a run)
"""

import json
import statistics
import sys
from pathlib import Path

COLORS = {"device": "#888888", "nbdkit": "#4c72b0", "floe": "#dd8452", "ceph": "#55a868"}
# The ratios the suite answers with: Floe against each alternative.
RATIOS = [("floe", "nbdkit"), ("floe", "ceph"), ("floe", "device")]


def number(value):
    if value is None:
        return "-"
    return f"{value:,.1f}" if abs(value) < 10 else f"{value:,.0f}"


def figure(job, median):
    return median["mb_s"] if job["unit"] == "MB/s" else median["iops"]


def table(header, rows, text_columns=1):
    """A markdown table whose first `text_columns` columns are left-aligned, numbers right."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < text_columns else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(data):
    meta, systems, jobs, results = data["meta"], data["systems"], data["jobs"], data["results"]
    keys = [s["key"] for s in systems]
    labels = {s["key"]: s["label"] for s in systems}
    ratios = [(a, b) for a, b in RATIOS if a in keys and b in keys]
    m, v = meta["machine"], meta["versions"]

    def med(system, job):
        return results[system][job["key"]]["median"]

    out = [
        "# Floe benchmark results",
        "",
        f"{meta['mode'].capitalize()} run of `bench/run`, {meta['date']}, in {meta['wall_clock_s'] // 60} min "
        f"{meta['wall_clock_s'] % 60} s. Machine: {m['cpus']} x {m['cpu_model']}, {m['memory_gib']} GiB, "
        f"Linux {m['kernel']}. Floe {v['floe']}, {v['fio']}, {v['nbdkit']}, {v['ceph']}.",
        "",
        f"Each figure is the median of {meta['repeats']} fio runs of {meta['runtime_s']} s over a "
        f"{meta['working_set_bytes'] >> 20} MiB region written in full beforehand; 4 KiB blocks unless noted, "
        "one fio job, the systems measured one after the other. Ratios divide Floe's figure by the other's: "
        "above 1, Floe is faster (or cheaper).",
        "",
    ]
    shares = {k: statistics.median(r["other_cpu_share"] for job in jobs for r in results[k][job["key"]]["runs"])
              for k in keys}
    out += [
        "CPU used outside the measured processes during the runs (other work on the machine, and kernel threads "
        "doing the system's I/O), median share of the machine: "
        + ", ".join(f"{labels[k]} {share:.0%}" for k, share in shares.items())
        + ". Much more than a few percent means something else competed for the CPUs.",
        "",
        "## Throughput",
        "",
    ]
    rows = []
    for job in jobs:
        row = [job["label"], job["unit"]] + [number(figure(job, med(k, job))) for k in keys]
        for a, b in ratios:
            row.append(f"{figure(job, med(a, job)) / figure(job, med(b, job)):.2f}")
        rows.append(row)
    out += [table(["job", "unit"] + [labels[k] for k in keys] + [f"{labels[a]}/{labels[b]}" for a, b in ratios], rows,
                  text_columns=2), ""]
    out += ["Plain writes are not equally durable: the device's direct writes may sit in the disk's cache and "
            "nbdkit's in the page cache, while Floe and Ceph acknowledge a write once it is durable on 3 replicas. "
            "The fsync=1 job is the like-for-like durable write.", ""]

    out += ["## Latency at queue depth 1", "", "Completion latency in microseconds, p50 / p99.", ""]
    rows = [[job["label"]] + [f"{number(med(k, job)['p50_us'])} / {number(med(k, job)['p99_us'])}" for k in keys]
            for job in jobs if job["iodepth"] == 1 and job["unit"] == "IOPS"]
    out += [table(["job"] + [labels[k] for k in keys], rows), ""]

    counted = {s["key"]: s["cpu_counted"] for s in systems}
    out += ["## CPU efficiency", "",
            "I/Os completed per CPU-second (user + system, from /proc) used by the system's own processes:", ""]
    out += [f"- {labels[k]}: {counted[k]}" for k in keys]
    out += [""]
    rows = []
    for job in jobs:
        row = [job["label"]] + [number(med(k, job)["ios_per_cpu_s"]) for k in keys]
        for a, b in ratios:
            x, y = med(a, job)["ios_per_cpu_s"], med(b, job)["ios_per_cpu_s"]
            row.append(f"{x / y:.2f}" if x and y else "-")
        rows.append(row)
    out += [table(["job"] + [labels[k] for k in keys] + [f"{labels[a]}/{labels[b]}" for a, b in ratios], rows), ""]

    out += ["## Systems", ""] + [f"- {s['label']}: {s['description']}" for s in systems] + [""]
    out += ["Charts: `throughput.png`, `latency.png`, `cpu-efficiency.png`; every run's figures: `results.json`.", ""]
    return "\n".join(out)


def charts(data, folder):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems, jobs, results = data["systems"], data["jobs"], data["results"]
    keys = [s["key"] for s in systems]
    labels = [s["label"] for s in systems]
    colors = [COLORS.get(k, "#999999") for k in keys]
    title = f"{data['meta']['mode']} run, {data['meta']['date'][:10]}"

    def grid(name, heading, value, unit_of):
        fig, axes = plt.subplots(2, 4, figsize=(16, 7.5))
        for ax, job in zip(axes.flat, jobs):
            values = [value(job, results[k][job["key"]]["median"]) or 0 for k in keys]
            bars = ax.bar(labels, values, color=colors)
            ax.bar_label(bars, labels=[number(x) for x in values], fontsize=8)
            ax.set_title(job["label"], fontsize=10)
            ax.set_ylabel(unit_of(job), fontsize=8)
            ax.tick_params(labelsize=8)
            ax.margins(y=0.15)
        for ax in axes.flat[len(jobs):]:
            ax.axis("off")
        fig.suptitle(f"{heading} ({title})")
        fig.tight_layout()
        fig.savefig(folder / name, dpi=80)
        plt.close(fig)

    grid("throughput.png", "Throughput, higher is better", figure, lambda job: job["unit"])
    grid("cpu-efficiency.png", "I/Os per CPU-second of the storage system, higher is better",
         lambda job, m: m["ios_per_cpu_s"], lambda job: "I/Os per CPU-second")

    qd1 = [j for j in jobs if j["iodepth"] == 1 and j["unit"] == "IOPS"]
    fig, axes = plt.subplots(1, len(qd1), figsize=(5 * len(qd1), 4.5), squeeze=False)
    width = 0.8 / len(keys)
    for ax, job in zip(axes.flat, qd1):
        for i, (k, label, color) in enumerate(zip(keys, labels, colors)):
            m = results[k][job["key"]]["median"]
            bars = ax.bar([x + i * width for x in (0, 1)], [m["p50_us"], m["p99_us"]], width, label=label, color=color)
            ax.bar_label(bars, labels=[number(m["p50_us"]), number(m["p99_us"])], fontsize=7)
        ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in (0, 1)], ["p50", "p99"])
        ax.set_yscale("log")
        ax.set_ylabel("microseconds (log scale)")
        ax.set_title(job["label"], fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"Completion latency at queue depth 1, lower is better ({title})")
    fig.tight_layout()
    fig.savefig(folder / "latency.png", dpi=80)
    plt.close(fig)


def render(data, folder):
    folder = Path(folder)
    (folder / "results.md").write_text(markdown(data))
    charts(data, folder)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip())
    path = Path(sys.argv[1])
    render(json.loads(path.read_text()), path.parent)
