# One NBD connection (libnbd) writing and reading back 64 KiB blocks for SECONDS (or
# until the file STOP, if given, exists), while the test upgrades processes under
# it. Every write is acknowledged before the next; prints one JSON line: operations,
# errors, the longest pause, and the last byte written to each block (the ledger the
# test checks afterwards).
import json, os, sys, time
import nbd

uri, seconds = sys.argv[1], float(sys.argv[2])
stop = sys.argv[3] if len(sys.argv) > 3 else None
BLOCK, BLOCKS = 65536, 256
h = nbd.NBD()
h.connect_uri(uri)
ledger, errors, longest, n = {}, [], 0.0, 0
start = time.time()
while time.time() - start < seconds and not (stop and os.path.exists(stop)):
    block, value = n % BLOCKS, n % 251 + 1
    data = bytes([value]) * BLOCK
    began = time.time()
    try:
        h.pwrite(data, block * BLOCK)
        ledger[block] = value
        if h.pread(BLOCK, block * BLOCK) != data:
            errors.append(f"block {block} read back other bytes")
    except Exception as e:
        errors.append(str(e))
    longest = max(longest, time.time() - began)
    n += 1
h.shutdown()
print(json.dumps({"operations": n, "errors": errors, "longest_pause": longest,
                  "ledger": ledger}))
