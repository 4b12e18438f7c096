# NBD client for the crash test (crash.rs), run inside nbdsh, which provides the
# connected libnbd handle `h`:
#   nbdsh -u URI -c 'exec(open("crash_client.py").read())'
# Settings come from FLOE_CRASH_* environment variables.
#
# write:  4 KiB writes, up to DEPTH in flight, each to a block never written before,
#         with content derived from (seed, round, block). Every block goes to the
#         ledger as "I <block>" before it is issued and as "A <block>" only once
#         libnbd reports the write succeeded. Stops issuing at the first error or
#         on SIGTERM, drains what is in flight, prints a JSON summary.
# verify: reads every block of the ledgers of rounds 0..ROUNDS-1; an acknowledged
#         block must hold exactly its content, an issued but unacknowledged one its
#         content or zeroes (never a mix). Prints a JSON summary.
#
# The contents and the ledger: ledger_content.py (on PYTHONPATH).

import json
import signal
import os

import nbd
from ledger_content import BLOCK, ZERO, Content, Ledger, describe, my_blocks

DEPTH = 16
VERIFY_DEPTH = 64


def write_mode(env, content):
    rnd = int(env["FLOE_CRASH_ROUND"])
    mine = my_blocks(env, content)
    ledger = Ledger(env["FLOE_CRASH_LEDGER"])
    note = ledger.note

    # SIGTERM: stop issuing, wait for what is in flight, exit.
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))

    in_flight = {}  # cookie -> (block, buffer kept alive until completion)
    issued = acked = 0
    error = None
    while True:
        while (
            error is None and not stopping and issued < len(mine) and len(in_flight) < DEPTH
        ):
            block = mine[issued]
            issued += 1
            buf = nbd.Buffer.from_bytearray(content.block(rnd, block))
            note("I", block)
            try:
                cookie = h.aio_pwrite(buf, block * BLOCK)  # noqa: F821 (nbdsh's handle)
            except nbd.Error as e:
                error = str(e)
                break
            in_flight[cookie] = (block, buf)
        if not in_flight:
            break
        try:
            h.poll(1000)  # noqa: F821
        except nbd.Error as e:
            error = error or str(e)
        for cookie in list(in_flight):
            try:
                done = h.aio_command_completed(cookie)  # noqa: F821
            except nbd.Error as e:
                # Failed (EIO after the gateway's retries, or connection lost): retired.
                error = error or str(e)
                del in_flight[cookie]
                continue
            if done:  # true only on success
                block, _ = in_flight.pop(cookie)
                note("A", block)
                acked += 1
        if h.aio_is_dead():  # noqa: F821
            error = error or "connection dead"
            break
    ledger.close()
    print(json.dumps({"issued": issued, "acked": acked, "error": error}))


def read_ledger(path):
    """(acknowledged, issued) block lists; a torn last line was never acted on."""
    acked, issued = [], []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            kind, block = line.split()
            (acked if kind == "A" else issued).append(int(block))
    return acked, issued


def verify_mode(env, content):
    work = env["FLOE_CRASH_DIR"]
    todo = []  # (round, block, acknowledged)
    for rnd in range(int(env["FLOE_CRASH_ROUNDS"])):
        acked, issued = read_ledger(os.path.join(work, f"ledger-{rnd}.txt"))
        done = set(acked)
        todo += [(rnd, b, True) for b in acked]
        todo += [(rnd, b, False) for b in issued if b not in done]
    result = {
        "acked": 0,
        "lost": 0,
        "unacked": 0,
        "unacked_present": 0,
        "unacked_present_blocks": [],
        "torn": 0,
        "bad": [],
    }

    def check(rnd, block, is_acked, data):
        want = content.block(rnd, block)
        if is_acked:
            result["acked"] += 1
            if data != want:
                result["lost"] += 1
                result["bad"].append(f"acked round {rnd} block {block}: {describe(data)}")
        else:
            result["unacked"] += 1
            if data == want:
                result["unacked_present"] += 1
                result["unacked_present_blocks"].append(block)
            elif data != ZERO:
                result["torn"] += 1
                result["bad"].append(f"unacked round {rnd} block {block}: {describe(data)}")

    in_flight = {}
    next_i = 0
    while next_i < len(todo) or in_flight:
        while next_i < len(todo) and len(in_flight) < VERIFY_DEPTH:
            rnd, block, is_acked = todo[next_i]
            next_i += 1
            buf = nbd.Buffer(BLOCK)
            cookie = h.aio_pread(buf, block * BLOCK)  # noqa: F821
            in_flight[cookie] = (rnd, block, is_acked, buf)
        h.poll(-1)  # noqa: F821
        for cookie in list(in_flight):
            if h.aio_command_completed(cookie):  # noqa: F821 (raises on a failed read)
                rnd, block, is_acked, buf = in_flight.pop(cookie)
                check(rnd, block, is_acked, bytes(buf.to_bytearray()))
    result["bad"] = result["bad"][:20]
    print(json.dumps(result))


def main():
    env = os.environ
    content = Content(int(env["FLOE_CRASH_SEED"]))
    mode = env["FLOE_CRASH_MODE"]
    if mode == "write":
        write_mode(env, content)
    elif mode == "verify":
        verify_mode(env, content)
    else:
        raise SystemExit(f"unknown FLOE_CRASH_MODE {mode}")


main()
