#!/usr/bin/python3
"""Renders a bench/run results JSON as results.md and PNG charts in the same folder.

    bench/report.py bench/results/results.json   (bench/run calls it after a run)
"""

import json
import math
import statistics
import sys
from pathlib import Path

COLORS = {"device": "#888888", "nbdkit": "#4c72b0", "floe": "#dd8452", "floe-hybrid": "#c44e52",
          "floe-hdd": "#8172b3", "ceph": "#55a868", "floe-unchecked": "#937860"}
# The ratios the suite answers with: Floe (its ssd volume) against each alternative,
# then Floe's other volume modes against ssd mode (issue 4's goal: hybrid >= 0.9 x ssd
# on 4 KiB writes). (numerator, denominator, column header; None: from the labels).
EMULATED = "hdd emulated"
RATIOS = [("floe", "nbdkit", None), ("floe", "ceph", None), ("floe", "device", None),
          ("floe-hybrid", "floe", f"hybrid/ssd ({EMULATED})"), ("floe-hdd", "floe", f"hdd/ssd ({EMULATED})"),
          ("floe", "floe-unchecked", "checked/unchecked reads"), ("floe", "floe-no-metrics", "metrics on/off"),
          ("floe", "floe-plain", "TLS on/off")]
MODE_RATIOS = {"floe-hybrid", "floe-hdd"}
HYBRID_GOAL = 0.9


def present_ratios(data):
    """[(a, b, header)] of the RATIOS whose two systems ran."""
    keys = [s["key"] for s in data["systems"]]
    labels = {s["key"]: s["label"] for s in data["systems"]}
    return [(a, b, header or f"{labels[a]}/{labels[b]}") for a, b, header in RATIOS if a in keys and b in keys]


def divide(x, y):
    return x / y if x is not None and y else None


def ratios(data):
    """Every ratio of the medians, machine-readable: {"a/b": {"label", "jobs": {job key:
    {"throughput", "ios_per_cpu_s", "p50_us", "p99_us"}}}}. Throughput and I/Os per
    CPU-second: above 1, a is faster or cheaper; latencies: above 1, a is slower."""
    out = {}
    for a, b, header in present_ratios(data):
        per_job = {}
        for job in data["jobs"]:
            x, y = (data["results"][k][job["key"]]["median"] for k in (a, b))
            per_job[job["key"]] = {
                "throughput": divide(figure(job, x), figure(job, y)),
                "ios_per_cpu_s": divide(x["ios_per_cpu_s"], y["ios_per_cpu_s"]),
                "p50_us": divide(x["p50_us"], y["p50_us"]),
                "p99_us": divide(x["p99_us"], y["p99_us"]),
            }
        out[f"{a}/{b}"] = {"label": header, "hdd_emulated": a in MODE_RATIOS, "jobs": per_job}
    return out


def ratio_text(value):
    return "-" if value is None else f"{value:.2f}"


def number(value):
    if value is None:
        return "-"
    return f"{value:,.1f}" if abs(value) < 10 else f"{value:,.0f}"


def ms(us):
    return None if us is None else us / 1e3


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
    pairs = present_ratios(data)
    computed = ratios(data)
    emulated = [s for s in systems if s.get("hdd_emulated")]
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
        "one fio job, the systems measured one after the other"
        + (", in rounds: each repeat a round over all the systems, each started afresh"
           if meta.get("interleaved") else "")
        + ". Ratios divide the first system's figure by the second's: above 1, the first is faster (or cheaper).",
        "",
    ]
    if emulated:
        out += [
            f"**{EMULATED}**: the hdd chunk servers of {', '.join(s['label'] for s in emulated)} are not disks. "
            "`floe demo --emulate-hdd` makes every access to their chunk files wait the service time a modelled "
            "7200 rpm disk would take (one head, seek 0.5-8 ms by distance, rotation 0-8.33 ms, transfer "
            "150 MB/s); their journals are files on the same (virtual) disk as the ssd servers' data. "
            "Every Floe system runs this same cluster; only the volume's mode differs.",
            "",
        ]
    shares = {k: statistics.median(r["other_cpu_share"] for job in jobs for r in results[k][job["key"]]["runs"])
              for k in keys}
    out += [
        "CPU used outside the measured processes during the runs (other work on the machine, and kernel threads "
        "doing the system's I/O), median share of the machine: "
        + ", ".join(f"{labels[k]} {share:.0%}" for k, share in shares.items())
        + ". Much more than a few percent means something else competed for the CPUs."
        + (f" Before the runs, other processes kept {meta['cpu_busy_before_start']:.0%} of the CPUs busy."
           if meta.get("cpu_busy_before_start") is not None else ""),
        "",
        "## Throughput",
        "",
    ]
    rows = []
    for job in jobs:
        row = [job_label(job, meta), job["unit"]] + [number(figure(job, med(k, job))) for k in keys]
        row += [ratio_text(computed[f"{a}/{b}"]["jobs"][job["key"]]["throughput"]) for a, b, _ in pairs]
        rows.append(row)
    out += [table(["job", "unit"] + [labels[k] for k in keys] + [h for _, _, h in pairs], rows,
                  text_columns=2), ""]
    out += ["Plain writes are not equally durable: the device's direct writes may sit in the disk's cache and "
            "nbdkit's in the page cache, while Floe and Ceph acknowledge a write once it is durable on 3 replicas. "
            "The fsync=1 job is the like-for-like durable write.", ""]

    out += ["## Latency at queue depth 1", "", "Completion latency in microseconds, p50 / p99.", ""]
    rows = [[job_label(job, meta)] + [f"{number(med(k, job)['p50_us'])} / {number(med(k, job)['p99_us'])}"
                                      for k in keys]
            for job in jobs if job["iodepth"] == 1 and job["unit"] == "IOPS"]
    out += [table(["job"] + [labels[k] for k in keys], rows), ""]

    out += ["## Longest I/O", "",
            "The longest completion of any I/O in a run, in milliseconds (median of the runs): a store that "
            "stops for a checkpoint or a sync shows it here, not in the percentiles.", ""]
    rows = [[job_label(job, meta)] + [number(ms(med(k, job).get("max_us"))) for k in keys] for job in jobs]
    out += [table(["job"] + [labels[k] for k in keys], rows), ""]

    counted = {s["key"]: s["cpu_counted"] for s in systems}
    out += ["## CPU efficiency", "",
            "I/Os completed per CPU-second (user + system, from /proc) used by the system's own processes:", ""]
    out += [f"- {labels[k]}: {counted[k]}" for k in keys]
    out += [""]
    rows = []
    for job in jobs:
        row = [job_label(job, meta)] + [number(med(k, job)["ios_per_cpu_s"]) for k in keys]
        row += [ratio_text(computed[f"{a}/{b}"]["jobs"][job["key"]]["ios_per_cpu_s"]) for a, b, _ in pairs]
        rows.append(row)
    out += [table(["job"] + [labels[k] for k in keys] + [h for _, _, h in pairs], rows), ""]

    out += volume_modes(data, computed)
    out += sustained(data)

    out += ["## Systems", ""]
    for s in systems:
        line = f"- {s['label']}: {s['description']}"
        if s.get("placement"):
            line += (f". Replicas by device class after the pre-fill (checked): primaries {s['placement']['primary']}, "
                     f"backups {s['placement']['backups']}; hdd journal quota {', '.join(s['journal_quota']) or '-'}; "
                     f"replay drained the pre-fill within {max(waited(s['replay_wait_s'])):.0f} s before the runs")
        out.append(line)
    out += [""]
    long_runs = any(own_runs(j, meta) for j in jobs)
    out += ["Charts: `throughput.png`, `latency.png`, `cpu-efficiency.png`"
            + (", `sustained.png`" if long_runs else "") + "; every run's figures and the ratios: `results.json`.", ""]
    return "\n".join(out)


def waited(seconds):
    """replay_wait_s: one figure, or one per round (bench/run --interleave)."""
    return seconds if isinstance(seconds, list) else [seconds]


def own_runs(job, meta):
    """Whether a job ran other than the suite's runs (bench/run --long)."""
    return (job.get("runtime_s", meta["runtime_s"]), job.get("repeats", meta["repeats"])) \
        != (meta["runtime_s"], meta["repeats"])


def job_label(job, meta):
    """A job's label, with its number of runs when they differ from the suite's."""
    if not own_runs(job, meta):
        return job["label"]
    repeats = job.get("repeats", meta["repeats"])
    return f"{job['label']} ({repeats} run{'s' if repeats > 1 else ''})"


def journal_note(runs):
    fills = [r["journal_fill_pct"] for r in runs if r.get("journal_fill_pct") is not None]
    throttled = any(r.get("throttled") for r in runs)
    return (f"{max(fills)}%" if fills else "-") + (", throttled" if throttled else "")


def volume_modes(data, computed):
    """Issue 4's question: Floe's hybrid (and hdd) volume against its ssd volume, same
    cluster, hdd servers emulated."""
    results, jobs, meta = data["results"], data["jobs"], data["meta"]
    modes = [k for k in ("floe-hybrid", "floe-hdd") if f"{k}/floe" in computed]
    if not modes:
        return []
    labels = {s["key"]: s["label"] for s in data["systems"]}
    short = {"floe": "ssd", "floe-hybrid": "hybrid", "floe-hdd": "hdd"}
    out = ["## Volume modes: hybrid and hdd against ssd (hdd emulated)", "",
           f"The same Floe cluster with its volume in ssd, hybrid or hdd mode; {EMULATED}. Throughput ratios: "
           "above 1, the mode is faster than ssd; latency ratios: above 1, it is slower. Journals: the fullest "
           "hdd server journal right after any run of the job, as `floe status` shows it (% of its quota), and "
           "whether the master throttled the volume for journal pressure.", ""]
    header = ["job", "unit"] + [short[k] for k in ["floe", *modes]]
    header += [f"{short[k]}/ssd" for k in modes] + [f"{short[k]}/ssd p50, p99" for k in modes]
    header += [f"{short[k]} journals" for k in modes]
    rows = []
    for job in jobs:
        r = {k: computed[f"{k}/floe"]["jobs"][job["key"]] for k in modes}
        row = [job_label(job, meta), job["unit"]]
        row += [number(figure(job, results[k][job["key"]]["median"])) for k in ["floe", *modes]]
        row += [ratio_text(r[k]["throughput"]) for k in modes]
        row += [f"{ratio_text(r[k]['p50_us'])}, {ratio_text(r[k]['p99_us'])}" if job["iodepth"] == 1
                and job["unit"] == "IOPS" else "" for k in modes]
        row += [journal_note(results[k][job["key"]]["runs"]) for k in modes]
        rows.append(row)
    out += [table(header, rows, text_columns=2), ""]
    if "floe-hybrid" in modes:
        writes = [j for j in jobs if j["key"].startswith("randwrite") and "fsync" not in j["key"]]
        verdicts = []
        for job in writes:
            x = computed["floe-hybrid/floe"]["jobs"][job["key"]]["throughput"]
            verdicts.append(f"{job_label(job, meta)} {x:.2f} ({'met' if x >= HYBRID_GOAL else 'NOT met'})")
        out += [f"Issue 4's goal, {labels['floe-hybrid']} at least {HYBRID_GOAL} x Floe ssd on 4 KiB random "
                f"writes: " + "; ".join(verdicts) + ".", ""]
    return out


def windows(series, count):
    """`series` averaged over `count` consecutive windows."""
    size = max(1, math.ceil(len(series) / count))
    return [statistics.mean(series[i:i + size]) for i in range(0, len(series), size)]


def sustained(data):
    """Long runs (--long): IOPS second by second, in 10 windows, and journal fill."""
    long_jobs = [j for j in data["jobs"] if own_runs(j, data["meta"])]
    out = []
    for job in long_jobs:
        out += [f"## Sustained: {job['label']}", "",
                "IOPS averaged over 10 consecutive windows of the run; for Floe, the fullest hdd journal "
                "(% of its quota) every 5 s and whether the master throttled the volume then.", ""]
        for s in data["systems"]:
            r = data["results"][s["key"]][job["key"]]["runs"][0]
            series = r.get("iops_per_second")
            line = f"- {s['label']}: {number(r['iops'])} IOPS overall"
            if series:
                line += "; by window: " + ", ".join(number(x) for x in windows(series, 10))
            if r.get("journal_samples"):
                line += "; fullest journal: " + ", ".join(f"{t} s {fill}%" + (" throttled" if throttled else "")
                                                          for t, fill, throttled in r["journal_samples"])
            if s.get("hdd_emulated") and r.get("replay_mb_s_after") is not None:
                line += (f"; the 3 hdd servers wrote {r['hdd_servers_write_mb_s']:.1f} MB/s during the run "
                         f"(journal appends and replay), replay alone {r['replay_mb_s_after']:.1f} MB/s in the "
                         "10 s after it")
            out.append(line)
        out.append("")
        if any(s.get("hdd_emulated") for s in data["systems"]):
            out += ["Replay keeps up when the hdd servers write no more during a run than replay alone does "
                    "after it; otherwise the journals grow by the difference until they reach their quota, "
                    "then the master throttles the volume (from 80% full) down to what replay drains.", ""]
    return out


def charts(data, folder):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems, jobs, results = data["systems"], data["jobs"], data["results"]
    keys = [s["key"] for s in systems]
    # "Floe hybrid (hdd emulated)" on two lines under its bar.
    labels = [s["label"].replace(" (", "\n(") for s in systems]
    colors = [COLORS.get(k, "#999999") for k in keys]
    title = f"{data['meta']['mode']} run, {data['meta']['date'][:10]}"
    if any(s.get("hdd_emulated") for s in systems):
        title += f"; {EMULATED} for Floe hybrid and hdd"

    def grid(name, heading, value, unit_of):
        rows = math.ceil(len(jobs) / 4)
        fig, axes = plt.subplots(rows, 4, figsize=(16 + len(keys) - 4 if len(keys) > 4 else 16, 3.75 * rows + 0.5),
                                 squeeze=False)
        for ax, job in zip(axes.flat, jobs):
            values = [value(job, results[k][job["key"]]["median"]) or 0 for k in keys]
            bars = ax.bar(labels, values, color=colors)
            ax.bar_label(bars, labels=[number(x) for x in values], fontsize=8)
            ax.set_title(job_label(job, data["meta"]), fontsize=10)
            ax.set_ylabel(unit_of(job), fontsize=8)
            ax.tick_params(labelsize=7 if len(keys) > 4 else 8)
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
    if qd1:  # a run of --jobs without a queue-depth-1 IOPS job has no latency chart
        fig, axes = plt.subplots(1, len(qd1), figsize=(5 * len(qd1), 4.5), squeeze=False)
        width = 0.8 / len(keys)
        for ax, job in zip(axes.flat, qd1):
            for i, (k, label, color) in enumerate(zip(keys, [s["label"] for s in systems], colors)):
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

    long_jobs = [j for j in jobs if any(results[k][j["key"]]["runs"][0].get("iops_per_second") for k in keys)]
    for job in long_jobs:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for k, label, color in zip(keys, [s["label"] for s in systems], colors):
            series = results[k][job["key"]]["runs"][0].get("iops_per_second")
            if series:
                ax.plot(range(1, len(series) + 1), series, label=label, color=color)
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("IOPS (1 s averages)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.set_title(f"{job['label']}, IOPS second by second ({title})", fontsize=10)
        fig.tight_layout()
        fig.savefig(folder / "sustained.png", dpi=80)
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
