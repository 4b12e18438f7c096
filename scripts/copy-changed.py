#!/usr/bin/python3
"""Incremental backup with libnbd: copies into FILE only the extents of an NBD export
whose meta context CONTEXT has state 1, and prints the bytes copied.

    nbdcopy nbd://HOST/vm1@monday full.raw                     # once: a full copy
    scripts/copy-changed.py nbd://HOST/vm1@tuesday floe:changed-since:monday full.raw

full.raw then equals vm1@tuesday (the export a later snapshot, or the volume itself).
"""
import sys

import nbd

CHUNK = 32 << 20


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
    copied = 0
    with open(path, "r+b") as out:
        for offset, length in changed_extents(h, context):
            for at in range(offset, offset + length, CHUNK):
                n = min(CHUNK, offset + length - at)
                out.seek(at)
                out.write(h.pread(n, at))
                copied += n
    print(copied)


if __name__ == "__main__":
    main()
