#!/usr/bin/python3
"""Incremental backup with libnbd: copies into FILE only the extents of an NBD export
whose meta context CONTEXT has state 1, and prints the bytes copied.

    nbdcopy nbd://HOST/vm1@monday full.raw                     # once: a full copy
    scripts/copy-changed.py nbd://HOST/vm1@tuesday floe:changed-since:monday full.raw

full.raw then equals vm1@tuesday (the export a later snapshot, or the volume itself).
"""
import os
import sys

import nbd

CHUNK = 32 << 20
DEPTH = 64


def changed_extents(h, context):
    """(offset, length) of every extent whose state has bit 0 set."""
    size = h.get_size()
    changed, offset = [], 0
    while offset < size:
        seen = [offset]

        def extents(name, start, entries, err):
            if name == context:
                at = start
                for i in range(0, len(entries), 2):
                    length, flags = entries[i], entries[i + 1]
                    if flags & 1:
                        changed.append((at, length))
                    at += length
                seen[0] = at
            return 0

        h.block_status(min(size - offset, 1 << 30), offset, extents)
        if seen[0] <= offset:
            sys.exit(f"{context}: the server described nothing at {offset}")
        offset = seen[0]
    return changed


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    uri, context, path = sys.argv[1:]
    h = nbd.NBD()
    h.add_meta_context(context)
    h.connect_uri(uri)
    if not h.can_meta_context(context):
        sys.exit(f"{uri} does not offer the meta context {context}")
    # Up to DEPTH reads in flight: changed extents are often small and scattered.
    pieces = [(at, min(CHUNK, offset + length - at))
              for offset, length in changed_extents(h, context)
              for at in range(offset, offset + length, CHUNK)]
    copied = 0
    in_flight = {}  # cookie -> (offset, buffer kept alive until completion)
    fd = os.open(path, os.O_WRONLY)
    try:
        while pieces or in_flight:
            while pieces and len(in_flight) < DEPTH:
                at, n = pieces.pop()
                buf = nbd.Buffer(n)
                in_flight[h.aio_pread(buf, at)] = (at, buf)
            h.poll(-1)
            for cookie in list(in_flight):
                if h.aio_command_completed(cookie):  # raises on a failed read
                    at, buf = in_flight.pop(cookie)
                    data = buf.to_bytearray()
                    os.pwrite(fd, data, at)
                    copied += len(data)
    finally:
        os.close(fd)
    print(copied)


if __name__ == "__main__":
    main()
