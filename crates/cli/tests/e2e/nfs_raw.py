"""Raw NFSv3 requests that the real clients never send (they check sizes first): a
WRITE past the end of an image file, a REMOVE. Prints one JSON object of the
statuses the server answered; the e2e test asserts on them.

usage: nfs_raw.py HOST PORT EXPORT FILE
"""
import json
import socket
import struct
import sys

MOUNT, NFS = 100005, 100003


def opaque(data):
    return struct.pack(">I", len(data)) + data + b"\0" * (-len(data) % 4)


class Rpc:
    def __init__(self, host, port):
        self.sock = socket.create_connection((host, port), timeout=30)
        self.xid = 0x4E465300

    def call(self, prog, proc, args):
        self.xid += 1
        null_auth = struct.pack(">II", 0, 0)
        header = struct.pack(">IIIIII", self.xid, 0, 2, prog, 3, proc)
        message = header + null_auth + null_auth + args
        self.sock.sendall(struct.pack(">I", 0x80000000 | len(message)) + message)
        reply = b""
        last = False
        while not last:
            (mark,) = struct.unpack(">I", self.recv(4))
            last = bool(mark & 0x80000000)
            reply += self.recv(mark & 0x7FFFFFFF)
        xid, kind, reply_stat = struct.unpack(">III", reply[:12])
        assert (xid, kind, reply_stat) == (self.xid, 1, 0), (xid, kind, reply_stat)
        _, verf_length = struct.unpack(">II", reply[12:20])
        at = 20 + verf_length + (-verf_length % 4)
        (accept_stat,) = struct.unpack(">I", reply[at : at + 4])
        assert accept_stat == 0, f"accept_stat {accept_stat}"
        return reply[at + 4 :]

    def recv(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise EOFError("the server closed the connection")
            data += chunk
        return data


def handle(body, at=4):
    (length,) = struct.unpack(">I", body[at : at + 4])
    return body[at + 4 : at + 4 + length]


def open_file(rpc, export, name):
    """Mounts `export` and looks `name` up: (the root's handle, the file's)."""
    mounted = rpc.call(MOUNT, 1, opaque(export.encode()))
    assert struct.unpack(">I", mounted[:4])[0] == 0, "mount refused"
    root = handle(mounted)
    found = rpc.call(NFS, 3, opaque(root) + opaque(name.encode()))
    assert struct.unpack(">I", found[:4])[0] == 0, f"no file {name}"
    return root, handle(found)


FILE_SYNC = 2


def write(rpc, file, offset, data, stable=FILE_SYNC):
    """WRITE's status; `stable`: 0 UNSTABLE, 1 DATA_SYNC, 2 FILE_SYNC."""
    args = opaque(file) + struct.pack(">QII", offset, len(data), stable) + opaque(data)
    return struct.unpack(">I", rpc.call(NFS, 7, args)[:4])[0]


def commit(rpc, file):
    """COMMIT of the whole file: its status."""
    return struct.unpack(">I", rpc.call(NFS, 21, opaque(file) + struct.pack(">QI", 0, 0))[:4])[0]


def main():
    host, port, export, name = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rpc = Rpc(host, port)
    root, file = open_file(rpc, export, name)

    def size():
        attributes = rpc.call(NFS, 1, opaque(file))
        status = struct.unpack(">I", attributes[:4])[0]
        assert status == 0, f"GETATTR: {status}"
        return struct.unpack(">Q", attributes[4 + 20 : 4 + 28])[0]

    bytes_before = size()
    result = {
        "size": bytes_before,
        "write_across_the_end": write(rpc, file, bytes_before - 4096, b"\xee" * 8192),
        "write_after_the_end": write(rpc, file, bytes_before, b"\xee" * 4096),
        "remove": struct.unpack(">I", rpc.call(NFS, 12, opaque(root) + opaque(name.encode()))[:4])[0],
        "write_inside": write(rpc, file, bytes_before - 4096, b"\xee" * 4096),
        "size_after": size(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
