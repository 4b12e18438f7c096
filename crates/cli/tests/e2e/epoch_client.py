# The writer and reader of write_modes.rs, run inside nbdsh, which provides the
# connected libnbd handle `h`.
#
# write: epochs of writes to random blocks of a region, a FLUSH between epochs, now and
#   then a FUA write; each write is logged to the ledger ("w epoch seq block fua")
#   before it is sent and again ("a seq") once acknowledged, until the connection
#   fails (the gateway is killed) or SIGTERM.
# read: prints "block epoch seq" for every block of the region that holds a write.
import os
import random
import signal
import struct
import sys

import nbd

BLOCK = 4096
MAGIC = 0x46455043  # "FEPC"

mode = os.environ["FLOE_EPOCH_MODE"]
first = int(os.environ["FLOE_EPOCH_FIRST_BLOCK"])
count = int(os.environ["FLOE_EPOCH_BLOCKS"])


def content(epoch, seq, block):
    head = struct.pack("<IQQQ", MAGIC, epoch, seq, block)
    rng = random.Random(seq * 1_000_003 + block)
    return head + rng.randbytes(BLOCK - len(head))


if mode == "write":
    stop = False

    def on_term(*_):
        global stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    rng = random.Random(int(os.environ["FLOE_EPOCH_SEED"]))
    ledger = open(os.environ["FLOE_EPOCH_LEDGER"], "a", buffering=1)
    seq = 0
    epoch = 0
    try:
        while not stop:
            for _ in range(rng.randrange(1, 24)):
                block = first + rng.randrange(count)
                fua = rng.random() < 0.05
                seq += 1
                flags = nbd.CMD_FLAG_FUA if fua else 0
                # Logged before it is sent (a write the gateway took may land even if
                # its reply is lost with the gateway), and again once acknowledged.
                ledger.write(f"w {epoch} {seq} {block} {int(fua)}\n")
                h.pwrite(content(epoch, seq, block), block * BLOCK, flags)
                ledger.write(f"a {seq}\n")
            h.flush()
            epoch += 1
    except nbd.Error as e:
        print(f"writer stopped at epoch {epoch}: {e}", file=sys.stderr)
elif mode == "read":
    for block in range(first, first + count):
        data = h.pread(BLOCK, block * BLOCK)
        magic, epoch, seq, at = struct.unpack("<IQQQ", data[:28])
        if magic != MAGIC:
            if any(data):
                print(f"{block} garbage")
            continue
        if at != block or data != content(epoch, seq, block):
            print(f"{block} torn")
            continue
        print(f"{block} {epoch} {seq}")
