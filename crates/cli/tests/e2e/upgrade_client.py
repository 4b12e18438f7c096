# One NBD connection (libnbd) writing and reading back 64 KiB blocks for SECONDS (or
# until the file STOP, if given, exists), while the test upgrades processes under
# it. Every write is acknowledged before the next; prints one JSON line: operations,
# errors, the longest pause, reconnects, and the last byte written to each block (the
# ledger the test checks afterwards).
#
# With several URIs (comma-separated: gateways a session moves between), a lost
# connection is made again, as QEMU's reconnect-delay does: to each URI in turn
# until one serves the export (for up to RECONNECT_FOR seconds), and the request that
# failed with it is sent again. With one URI any failure is an error.
import json, os, sys, time
import nbd

uris, seconds = sys.argv[1].split(","), float(sys.argv[2])
stop = sys.argv[3] if len(sys.argv) > 3 else None
BLOCK, BLOCKS = 65536, 256
RECONNECT_FOR = 30.0


def connect():
    """A handle connected to the first URI that serves the export; the refusals
    seen on the way (a gateway the session left names where it went)."""
    refusals, give_up = [], time.time() + RECONNECT_FOR
    while True:
        for uri in uris:
            h = nbd.NBD()
            try:
                h.connect_uri(uri)
                return h, refusals
            except nbd.Error as e:
                refusals.append(f"{uri}: {e}")
        if len(uris) == 1 or time.time() > give_up:
            raise RuntimeError(f"cannot reconnect: {refusals[-4:]}")
        time.sleep(0.05)


h, _ = connect()
ledger, errors, longest, n, reconnects, refusals = {}, [], 0.0, 0, 0, []
start = time.time()
while time.time() - start < seconds and not (stop and os.path.exists(stop)):
    block, value = n % BLOCKS, n % 251 + 1
    data = bytes([value]) * BLOCK
    began = time.time()
    while True:
        try:
            h.pwrite(data, block * BLOCK)
            ledger[block] = value
            if h.pread(BLOCK, block * BLOCK) != data:
                errors.append(f"block {block} read back other bytes")
            break
        except nbd.Error as e:
            # The server closed the connection (the session moved): connect again
            # and send the request again. A failed request on a live connection is
            # an error.
            if len(uris) == 1 or not (h.aio_is_dead() or h.aio_is_closed()):
                errors.append(str(e))
                break
            h, seen = connect()
            reconnects += 1
            refusals += seen
    longest = max(longest, time.time() - began)
    n += 1
h.shutdown()
print(json.dumps({"operations": n, "errors": errors, "longest_pause": longest,
                  "reconnects": reconnects, "refusals": refusals[-20:],
                  "ledger": ledger}))
