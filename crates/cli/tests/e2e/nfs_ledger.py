"""NFS writer for the NFS crash test (nfs.rs): ledger_content's 4 KiB blocks written to
one image file over raw NFSv3, in batches of eight that alternate between UNSTABLE
writes followed by a COMMIT (acknowledged at the COMMIT's reply) and FILE_SYNC writes
(acknowledged each at its reply). Every block goes to the ledger before it is sent and
again once acknowledged. Stops at the first error or when the server goes away (it is
killed), and prints a JSON summary.

usage: nfs_ledger.py HOST PORT EXPORT FILE
Settings: FLOE_CRASH_SEED, _ROUND, _START, _COUNT, _REGION_BLOCKS, _LEDGER, as
crash_client.py's write mode; ledger_content.py and nfs_raw.py on PYTHONPATH.
"""
import json
import os
import sys

from ledger_content import BLOCK, Content, Ledger, my_blocks
from nfs_raw import FILE_SYNC, Rpc, commit, open_file, write

UNSTABLE = 0
BATCH = 8


def main():
    host, port, export, name = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    env = os.environ
    content = Content(int(env["FLOE_CRASH_SEED"]))
    rnd = int(env["FLOE_CRASH_ROUND"])
    blocks = my_blocks(env, content)
    ledger = Ledger(env["FLOE_CRASH_LEDGER"])
    rpc = Rpc(host, port)
    _, file = open_file(rpc, export, name)
    issued = acked = 0
    error = None
    try:
        for at in range(0, len(blocks), BATCH):
            batch = blocks[at : at + BATCH]
            stable = FILE_SYNC if (at // BATCH) % 2 else UNSTABLE
            for block in batch:
                ledger.note("I", block)
                issued += 1
                status = write(rpc, file, block * BLOCK, content.block(rnd, block), stable)
                if status != 0:
                    raise RuntimeError(f"WRITE answered status {status}")
                if stable == FILE_SYNC:
                    ledger.note("A", block)
                    acked += 1
            if stable == UNSTABLE:
                status = commit(rpc, file)
                if status != 0:
                    raise RuntimeError(f"COMMIT answered status {status}")
                for block in batch:
                    ledger.note("A", block)
                    acked += 1
    except (EOFError, OSError, RuntimeError) as e:
        error = str(e) or type(e).__name__
    ledger.close()
    print(json.dumps({"issued": issued, "acked": acked, "error": error}))


main()
