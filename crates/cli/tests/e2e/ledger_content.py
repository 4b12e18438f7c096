"""Self-identifying 4 KiB block contents and ledgers for the crash tests: shared by
crash_client.py (NBD, inside nbdsh) and nfs_ledger.py (NFS). The content function is
mirrored by `Content` in crash.rs (the on-disk check).

A ledger has one line per event: "I <block>" before a write is issued, "A <block>"
once it is acknowledged (durable, as the protocol defines it). Each line is flushed
before anything else happens, so it survives a kill -9 of the writer.
"""
import random
import struct

BLOCK = 4096
MAGIC = 0x464C4352  # "FLCR"
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
POOL_WORDS = 2048
BODY = BLOCK - 16
# Pool word offsets a body can start at: BODY // 8 words must fit after it.
POOL_STARTS = 1536
ZERO = bytes(BLOCK)


def mix(x):
    """splitmix64's step and finaliser."""
    x = (x + GOLDEN) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


class Content:
    """Self-identifying block content: magic, round, block, then a pseudo-random body
    (a key-dependent slice of a seeded pool XORed with the key), cheap in Python."""

    def __init__(self, seed):
        self.seed = seed
        self.pool = b"".join(
            mix((seed + i * GOLDEN) & M64).to_bytes(8, "little") for i in range(POOL_WORDS)
        )

    def block(self, rnd, block):
        k = mix(self.seed ^ mix((rnd << 32) | block))
        off = (k % POOL_STARTS) * 8
        key = int.from_bytes(k.to_bytes(8, "little") * (BODY // 8), "little")
        body = int.from_bytes(self.pool[off : off + BODY], "little") ^ key
        return struct.pack("<IIQ", MAGIC, rnd, block) + body.to_bytes(BODY, "little")


def describe(data):
    if data == ZERO:
        return "zeroes"
    magic, rnd, block = struct.unpack_from("<IIQ", data)
    if magic == MAGIC:
        return f"header of round {rnd} block {block}"
    return f"foreign data {bytes(data[:16]).hex()}"


class Ledger:
    def __init__(self, path):
        self.file = open(path, "a")

    def note(self, kind, block):
        self.file.write(f"{kind} {block}\n")
        self.file.flush()  # in the kernel before anything else happens: survives kill -9

    def close(self):
        self.file.close()


def my_blocks(env, content):
    """This round's blocks: every round takes its own slice of one permutation of the
    region, so no block is written twice."""
    start = int(env["FLOE_CRASH_START"])
    count = int(env["FLOE_CRASH_COUNT"])
    blocks = list(range(int(env["FLOE_CRASH_REGION_BLOCKS"])))
    random.Random(content.seed).shuffle(blocks)
    return blocks[start : start + count]
