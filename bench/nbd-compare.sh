#!/usr/bin/env bash
# One fio comparison, same run: Floe's demo volume (3 replicas) vs nbdkit's file
# plugin on a local file (the NBD path with no replication). Prints a table with
# ratios and the CPU seconds Floe's processes used; each job runs REPEATS times, back to
# back on both systems, and the medians are reported. Writes bench/results/nbd-compare.json.
#   bench/nbd-compare.sh [SECONDS_PER_JOB [REPEATS]]   (defaults 30, 3)
set -euo pipefail
cd "$(dirname "$0")/.."
runtime=${1:-30}
repeats=${2:-3}
work=$(mktemp -d /tmp/floe-bench.XXXXXX)
port=17700; nbd_port=17800; kit_port=17900
mkdir -p bench/results
cargo build --release -q -p floe-cli
floe=./target/release/floe

cleanup() {
  [ -n "${demo_pid:-}" ] && kill "$demo_pid" 2>/dev/null && wait "$demo_pid" 2>/dev/null
  [ -n "${kit_pid:-}" ] && kill "$kit_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

$floe demo --dir "$work/floe" --port $port --nbd-port $nbd_port --size 4G >"$work/demo.out" 2>&1 &
demo_pid=$!
until [ -f "$work/floe/demo.json" ]; do sleep 0.2; kill -0 $demo_pid || { cat "$work/demo.out"; exit 1; }; done
truncate -s 4G "$work/nbdkit.img"
nbdkit -f -p $kit_port file "$work/nbdkit.img" & kit_pid=$!
sleep 1

floe_pids=$(python3 -c "import json;d=json.load(open('$work/floe/demo.json'));print(' '.join(map(str,[d['master_pid'],d['gateway_pid']]+d['chunkserver_pids'])))")
cpu_ticks() { local t=0; for p in $floe_pids; do t=$((t + $(awk '{print $14+$15}' /proc/$p/stat))); done; echo $t; }

# fio JOB_RW URI -> IOPS (terse v3: field 8 read IOPS, 49 write IOPS)
fio_iops() {
  local rw=$1 uri=$2 field=8
  [ "$rw" = randwrite ] && field=49
  fio --name=b --ioengine=nbd --uri="$uri" --rw="$rw" --bs=4k --iodepth=16 --size=1G \
      --time_based --runtime="$runtime" --output-format=terse | awk -F';' -v f=$field 'NF > f {print $f}'
}

# Pre-fill so reads hit allocated chunks on both.
for uri in "nbd://127.0.0.1:$nbd_port/demo" "nbd://127.0.0.1:$kit_port/"; do
  fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=4 --size=1G >/dev/null
done

# One line per run: job floe_iops nbdkit_iops floe_cpu_seconds
runs=$work/runs
for i in $(seq "$repeats"); do
  for rw in randwrite randread; do
    kit=$(fio_iops $rw "nbd://127.0.0.1:$kit_port/")
    before=$(cpu_ticks)
    floe=$(fio_iops $rw "nbd://127.0.0.1:$nbd_port/demo")
    after=$(cpu_ticks)
    cpu=$(python3 -c "print(($after-$before)/$(getconf CLK_TCK))")
    echo "$rw $floe $kit $cpu" | tee -a "$runs" >&2
  done
done

python3 - "$runtime" "$runs" <<'PY'
import json, statistics, sys
runtime = int(sys.argv[1])
runs = {}
for line in open(sys.argv[2]):
    job, *values = line.split()
    runs.setdefault(job, []).append([float(v) for v in values])
rows = []
for name, samples in runs.items():
    floe, kit, cpu = (statistics.median(column) for column in zip(*samples))
    rows.append({"job": f"4k {name} iodepth 16", "floe_iops": round(floe), "nbdkit_file_iops": round(kit),
                 "ratio_floe_over_nbdkit": round(floe / kit, 3), "floe_cpu_seconds": cpu,
                 "floe_ios_per_cpu_second": round(floe * runtime / cpu) if cpu else None,
                 "runs": samples})
print(f"medians of {len(samples)} runs of {runtime} s each")
print(f"{'job':<24} {'floe IOPS':>10} {'nbdkit IOPS':>12} {'ratio':>6} {'floe CPU s':>11} {'IOs/CPU-s':>10}")
for r in rows:
    print(f"{r['job']:<24} {r['floe_iops']:>10} {r['nbdkit_file_iops']:>12} {r['ratio_floe_over_nbdkit']:>6} {r['floe_cpu_seconds']:>11.1f} {r['floe_ios_per_cpu_second']:>10}")
json.dump({"runtime_seconds": runtime, "fio": "4k, iodepth 16, ioengine=nbd", "results": rows}, open("bench/results/nbd-compare.json", "w"), indent=2)
PY
