# Writer and stale reader for the stale-read test (stale_reads.rs):
#   python3 stale_client.py WRITE_URI READ_URI SECONDS STALENESS_S
#
# The writer writes a counter c = 1, 2, ... into block c % BLOCKS (the counter and
# the block in every 16 bytes of it) through the writable gateway and notes when each
# write was acknowledged. The reader reads the blocks in turn through the read-only
# gateway with --staleness and notes when each read started. Clocks are
# CLOCK_MONOTONIC, shared by the two threads.
#
# Checks, per read: the block is whole (one counter throughout) and is the block
# asked for; its counter is never below an earlier read's of that block (monotonic
# reads); and never below the last counter acknowledged for the block STALENESS_S
# before the read started (the staleness bound). Prints a JSON summary.

import json
import struct
import sys
import threading
import time

import nbd

BLOCK = 4096
BLOCKS = 64
# Spread over the volume: a block in every 16 MiB, so every chunk has some.
SPACING = 16 << 20

write_uri, read_uri = sys.argv[1], sys.argv[2]
seconds, staleness = float(sys.argv[3]), float(sys.argv[4])
acked = []  # (counter, ack time)
reads = []  # (block, counter, start time, end time)
errors = []
stop = time.monotonic() + seconds


def content(counter, block):
    return struct.pack("<QQ", counter, block) * (BLOCK // 16)


def writer():
    h = nbd.NBD()
    h.connect_uri(write_uri)
    counter = 0
    while time.monotonic() < stop:
        counter += 1
        block = counter % BLOCKS
        try:
            h.pwrite(content(counter, block), block * SPACING)
        except nbd.Error as e:
            errors.append(f"write {counter}: {e}")
            return
        acked.append((counter, time.monotonic()))


def reader():
    h = nbd.NBD()
    h.connect_uri(read_uri)
    block = 0
    while time.monotonic() < stop:
        block = (block + 1) % BLOCKS
        started = time.monotonic()
        try:
            data = h.pread(BLOCK, block * SPACING)
        except nbd.Error as e:
            errors.append(f"read of block {block}: {e}")
            return
        ended = time.monotonic()
        counter, which = struct.unpack_from("<QQ", data)
        if data != (content(counter, which) if counter else bytes(BLOCK)):
            errors.append(f"block {block}: torn ({data[:32].hex()}...)")
        elif counter and which != block:
            errors.append(f"block {block}: holds block {which}")
        reads.append((block, counter, started, ended))


threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
for t in threads:
    t.start()
for t in threads:
    t.join()

# The counters of each block, in acknowledgement order (they only grow).
by_block = {}
for counter, at in acked:
    by_block.setdefault(counter % BLOCKS, []).append((at, counter))
last_read = {}
stale = 0
worst_lag = 0.0
for block, counter, started, ended in reads:
    if counter < last_read.get(block, 0):
        errors.append(
            f"block {block}: read {counter} after {last_read[block]} (not monotonic)"
        )
    last_read[block] = max(counter, last_read.get(block, 0))
    history = by_block.get(block, [])
    bound = max((c for at, c in history if at < started - staleness), default=0)
    if counter < bound:
        errors.append(
            f"block {block}: read {counter} at {started:.3f}, but {bound} was "
            f"acknowledged more than {staleness} s before"
        )
    newest = max((c for at, c in history if at < started), default=0)
    if counter < newest:
        stale += 1
        # How long ago the first write the read missed was acknowledged.
        missed = min(at for at, c in history if c > counter and at < started)
        worst_lag = max(worst_lag, started - missed)
print(
    json.dumps(
        {
            "writes": len(acked),
            "reads": len(reads),
            "stale_reads": stale,
            "worst_lag_s": round(worst_lag, 3),
            "errors": errors[:20],
            "error_count": len(errors),
        }
    )
)
