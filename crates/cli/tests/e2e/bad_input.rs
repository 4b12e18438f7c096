//! Hostile and mistaken input at every door: malformed frames to chunk servers, broken
//! NBD clients at the gateway, out-of-range I/O, and bad admin commands. Each must be
//! refused without hurting the cluster or anyone else's data.

use crate::cluster::{nbdsh, ok, output, volume, Cluster};
use crate::io_helpers::{alive, floe_output, qemu_io, text, wait_for_file};
use crate::nbd_raw::{
    Raw, CMD_READ, CMD_WRITE, EINVAL, GREETING_BYTES, IHAVEOPT, OPT_GO, OPT_LIST, REP_ACK,
    REP_ERR_UNSUP, REP_SERVER,
};
use std::process::Command;
use std::time::Duration;

// Floe frames, spelled out here rather than taken from floe-protocol.
const MAGIC: u32 = 0x464c_4f45;
const HEADER: usize = 24;
/// The wire protocol version this suite speaks (floe_protocol::PROTOCOL_VERSION).
const PROTOCOL: u32 = 10;
const KIND_HELLO: u16 = 1;
const KIND_READ: u16 = 3;
/// A request to the master, and a chunk server's control request about a replica.
const KIND_MASTER: u16 = 5;
const KIND_REPLICA: u16 = 6;
const STATUS_OK: u16 = 0;
const STATUS_BAD_REQUEST: u16 = 1;
const STATUS_VERSION_MISMATCH: u16 = 6;

/// CRC-32C (Castagnoli), bitwise: the frame checksum, without a crate for it.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= byte as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A frame header with an explicit declared length and crc, so either can lie.
fn header(magic: u32, kind: u16, request_id: u64, length: u32, crc: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER);
    out.extend_from_slice(&magic.to_le_bytes());
    out.extend_from_slice(&kind.to_le_bytes());
    out.extend_from_slice(&STATUS_OK.to_le_bytes());
    out.extend_from_slice(&request_id.to_le_bytes());
    out.extend_from_slice(&length.to_le_bytes());
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn frame(kind: u16, request_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = header(
        MAGIC,
        kind,
        request_id,
        payload.len() as u32,
        crc32c(payload),
    );
    out.extend_from_slice(payload);
    out
}

fn hello(request_id: u64, version: u32) -> Vec<u8> {
    frame(KIND_HELLO, request_id, &version.to_le_bytes())
}

/// A well-formed Read of 4 KiB of some chunk: volume id, index, offset, length.
fn read_payload() -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&1u64.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    p.extend_from_slice(&4096u32.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes()); // min_version
    p.extend_from_slice(&u64::MAX.to_le_bytes()); // max_version
    p
}

struct Reply {
    status: u16,
    request_id: u64,
    payload: Vec<u8>,
}

/// Floe's frames on the shared raw connection.
impl Raw {
    fn frame(&mut self) -> Reply {
        let head = self.read_exact(HEADER);
        let u32_at = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().unwrap());
        assert_eq!(u32_at(0), MAGIC, "reply magic");
        let status = u16::from_le_bytes([head[6], head[7]]);
        let request_id = u64::from_le_bytes(head[8..16].try_into().unwrap());
        let payload = self.read_exact(u32_at(16) as usize);
        assert_eq!(crc32c(&payload), u32_at(20), "reply crc");
        Reply {
            status,
            request_id,
            payload,
        }
    }

    fn greet(&mut self) {
        self.send(&hello(1, PROTOCOL));
        let reply = self.frame();
        assert_eq!((reply.status, reply.request_id), (STATUS_OK, 1));
        assert_eq!(reply.payload, PROTOCOL.to_le_bytes(), "protocol version");
    }
}

/// Every kind of broken frame, on one chunk server.
fn attack_chunkserver(port: u16) {
    // Garbage: not a frame at all.
    let mut raw = Raw::connect(port);
    raw.send(b"GET / HTTP/1.1\r\nHost: floe\r\n\r\n");
    raw.assert_closed("garbage");

    // A well-formed header with a bad magic.
    let mut raw = Raw::connect(port);
    let payload = 1u32.to_le_bytes();
    raw.send(&header(0xdead_beef, KIND_HELLO, 1, 4, crc32c(&payload)));
    raw.send(&payload);
    raw.assert_closed("bad magic");

    // Anything but Hello first is refused and the connection closed.
    let mut raw = Raw::connect(port);
    raw.send(&frame(KIND_READ, 5, &read_payload()));
    let reply = raw.frame();
    assert_eq!((reply.status, reply.request_id), (STATUS_BAD_REQUEST, 5));
    raw.assert_closed("no hello");

    // Another protocol version is refused with a reason.
    let mut raw = Raw::connect(port);
    raw.send(&hello(2, 99));
    let reply = raw.frame();
    assert_eq!(
        (reply.status, reply.request_id),
        (STATUS_VERSION_MISMATCH, 2)
    );
    assert!(String::from_utf8_lossy(&reply.payload).contains("version"));

    // Truncated: a header promising 36 bytes, 10 sent, then the client leaves.
    let mut raw = Raw::connect(port);
    raw.greet();
    let payload = read_payload();
    raw.send(&header(
        MAGIC,
        KIND_READ,
        2,
        payload.len() as u32,
        crc32c(&payload),
    ));
    raw.send(&payload[..10]);
    raw.shutdown_write();
    raw.assert_closed("truncated frame");
    // Truncated inside the header too.
    let mut raw = Raw::connect(port);
    raw.send(&hello(1, PROTOCOL)[..11]);
    drop(raw);

    // A wrong crc: answered with an error, and the connection stays usable.
    let mut raw = Raw::connect(port);
    raw.greet();
    let payload = read_payload();
    raw.send(&header(
        MAGIC,
        KIND_READ,
        3,
        payload.len() as u32,
        crc32c(&payload) ^ 1,
    ));
    raw.send(&payload);
    let reply = raw.frame();
    assert_eq!((reply.status, reply.request_id), (STATUS_BAD_REQUEST, 3));
    assert!(String::from_utf8_lossy(&reply.payload).contains("crc"));
    // A payload too short for a Read, unknown kinds: errors, not disconnects.
    raw.send(&frame(KIND_READ, 4, &[1, 2, 3]));
    assert_eq!(raw.frame().status, STATUS_BAD_REQUEST);
    raw.send(&frame(999, 5, b"?"));
    let reply = raw.frame();
    assert_eq!((reply.status, reply.request_id), (STATUS_BAD_REQUEST, 5));
    raw.send(&hello(6, PROTOCOL));
    let reply = raw.frame();
    assert_eq!((reply.status, reply.request_id), (STATUS_OK, 6));

    // A huge declared length: refused before allocating, connection closed.
    raw.send(&header(MAGIC, KIND_READ, 7, u32::MAX, 0));
    raw.send(&[0u8; 64]);
    raw.assert_closed("huge length");
}

#[test]
fn chunkservers_survive_malformed_frames() {
    assert_eq!(crc32c(b"123456789"), 0xe306_9283, "crc32c check value");
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri();
    qemu_io(uri, &["write -P 0x61 0 2M", "write -P 0x62 200M 1M"]);

    let servers = cluster.info.chunkserver_pids.len();
    assert_eq!(servers, 6);
    for i in 0..servers {
        attack_chunkserver(cluster.port + 1 + i as u16);
    }

    for (i, &pid) in cluster.info.chunkserver_pids.iter().enumerate() {
        assert!(alive(pid), "chunkserver-{i} (pid {pid}) died");
        let log = dir.path().join("logs").join(format!("chunkserver-{i}.log"));
        let expected = [
            "bad frame magic",
            "bad crc",
            "malformed request",
            "exceeds the limit",
        ];
        let contents = wait_for_file(&log, Duration::from_secs(5), |text| {
            expected.iter().all(|e| text.contains(e))
        });
        for e in expected {
            assert!(
                contents.contains(e),
                "chunkserver-{i}.log does not mention {e:?}:\n{contents}"
            );
        }
    }
    // Data written before is intact and new I/O works (all replicas were attacked).
    qemu_io(uri, &["read -P 0x61 0 2M", "read -P 0x62 200M 1M"]);
    qemu_io(
        uri,
        &[
            "write -P 0x63 300M 1M",
            "read -P 0x63 300M 1M",
            "read -P 0x61 1M 1M",
        ],
    );
}

#[test]
fn gateway_survives_hostile_nbd_clients_and_out_of_range_io() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri();
    let port: u16 = uri
        .trim_start_matches("nbd://127.0.0.1:")
        .split('/')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected URI {uri}"));
    const TARGET: u64 = 5 << 20;
    qemu_io(uri, &["write -P 0x77 5M 1M"]);

    // Truncated handshakes: gone at once, mid client flags, mid option header.
    drop(Raw::connect(port));
    let mut raw = Raw::connect(port);
    raw.read_exact(GREETING_BYTES);
    raw.send(&[0, 0]);
    drop(raw);
    let mut raw = Raw::nbd_greeted(port);
    raw.send(&IHAVEOPT.to_be_bytes()[..7]);
    drop(raw);

    // Unknown client flags are a protocol violation: disconnect.
    let mut raw = Raw::connect(port);
    raw.read_exact(GREETING_BYTES);
    raw.send(&0xffu32.to_be_bytes());
    raw.assert_closed("unknown client flags");

    // An unknown option is refused and haggling goes on; a bad option magic or an
    // absurd option length ends it.
    let mut raw = Raw::nbd_greeted(port);
    raw.option(0x7777, b"junk!");
    let (option, kind, _) = raw.option_reply();
    assert_eq!((option, kind), (0x7777, REP_ERR_UNSUP));
    raw.option(OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (_, kind, data) = raw.option_reply();
        if kind == REP_ACK {
            break;
        }
        assert_eq!(kind, REP_SERVER);
        names.push(String::from_utf8_lossy(&data[4..]).into_owned());
    }
    assert!(names.contains(&"demo".to_string()), "{names:?}");
    raw.send(&[0x5a; 16]);
    raw.assert_closed("bad option magic");
    let mut raw = Raw::nbd_greeted(port);
    let mut huge = IHAVEOPT.to_be_bytes().to_vec();
    huge.extend_from_slice(&OPT_GO.to_be_bytes());
    huge.extend_from_slice(&(64u32 << 20).to_be_bytes());
    raw.send(&huge);
    raw.assert_closed("huge option");

    // In transmission: a read past the end is an error reply, the connection lives on;
    // a request with a bad magic ends it.
    let mut raw = Raw::nbd_greeted(port);
    raw.go("demo");
    raw.request(CMD_READ, 11, 1 << 30, 4096);
    assert_eq!(raw.simple_reply(), (EINVAL, 11));
    raw.request(CMD_READ, 12, TARGET, 4096);
    assert_eq!(raw.simple_reply(), (0, 12));
    assert!(raw.read_exact(4096).iter().all(|&b| b == 0x77));
    raw.send(&[0xee; 28]);
    raw.assert_closed("bad request magic");

    // A 1 MiB WRITE cut off after 300 KiB: nothing of it may land.
    let mut raw = Raw::nbd_greeted(port);
    raw.go("demo");
    raw.request(CMD_WRITE, 13, TARGET, 1 << 20);
    raw.send(&vec![0xee; 300 << 10]);
    drop(raw);

    assert!(alive(cluster.info.gateway_pid), "gateway died");
    qemu_io(uri, &["read -P 0x77 5M 1M"]);
    qemu_io(
        uri,
        &[
            "write -P 0x78 7M 64k",
            "read -P 0x78 7M 64k",
            "read -P 0x77 5M 1M",
        ],
    );

    // Writes past the end fail and leave the last block as it was.
    qemu_io(uri, &["write -P 0x42 1073737728 4k"]);
    let past = output(Command::new("qemu-io").args(["-f", "raw", "-c", "write 1G 4k", uri]));
    assert!(
        !past.status.success(),
        "qemu-io wrote past the end:\n{}",
        text(&past)
    );
    // libnbd checks bounds itself unless strict mode is off; off, the server must refuse.
    let script = "
import nbd
h.set_strict_mode(0)
end = h.get_size()
for offset in (end, end - 2048, end + (1 << 40)):
    try:
        h.pwrite(b'x' * 4096, offset)
        print('WROTE', offset)
    except nbd.Error as e:
        print('REFUSED', offset, e)
assert h.pread(4096, end - 4096) == b'\\x42' * 4096, 'last block changed'
print('TAIL OK')
";
    let out = output(nbdsh().args(["-u", uri, "-c", script]));
    let all = text(&out);
    assert!(out.status.success(), "nbdsh failed:\n{all}");
    assert!(!all.contains("WROTE"), "{all}");
    assert_eq!(all.matches("REFUSED").count(), 3, "{all}");
    assert!(
        all.contains("command failed") && all.contains("TAIL OK"),
        "{all}"
    );
    qemu_io(uri, &["read -P 0x42 1073737728 4k", "read -P 0x77 5M 1M"]);
}

impl Raw {
    /// Sends a control request of `kind` and returns the reply's status and text.
    fn control(&mut self, kind: u16, request_id: u64, json: &str) -> (u16, String) {
        self.send(&frame(kind, request_id, json.as_bytes()));
        let reply = self.frame();
        assert_eq!(reply.request_id, request_id);
        (
            reply.status,
            String::from_utf8_lossy(&reply.payload).into_owned(),
        )
    }
}

/// A replica request sent to the master and a master request sent to a chunk server
/// are refused with a reason, and so is either one's body under the other's frame
/// kind; the connection, the servers and the cluster live on.
#[test]
fn control_requests_to_the_wrong_role_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let status = r#"{"op":"status"}"#;
    let checksum = r#"{"op":"checksum","chunk":{"volume_id":1,"index":0},"length":4096}"#;

    let mut master = Raw::connect(cluster.port);
    master.greet();
    let (code, text) = master.control(KIND_REPLICA, 2, checksum);
    assert_eq!(code, STATUS_BAD_REQUEST, "{text}");
    assert!(text.contains("this is the master; replica requests go to chunk servers"));
    let (code, text) = master.control(KIND_MASTER, 3, checksum);
    assert_eq!(code, STATUS_BAD_REQUEST, "{text}");
    assert!(text.contains("malformed request"), "{text}");
    let (code, text) = master.control(KIND_MASTER, 4, status);
    assert_eq!(code, STATUS_OK, "{text}");

    let mut chunkserver = Raw::connect(cluster.port + 1);
    chunkserver.greet();
    let (code, text) = chunkserver.control(KIND_MASTER, 2, status);
    assert_eq!(code, STATUS_BAD_REQUEST, "{text}");
    assert!(text.contains("this is a chunk server; send cluster requests to the master"));
    let (code, text) = chunkserver.control(KIND_REPLICA, 3, status);
    assert_eq!(code, STATUS_BAD_REQUEST, "{text}");
    assert!(text.contains("malformed request"), "{text}");
    let (code, text) = chunkserver.control(KIND_REPLICA, 4, checksum);
    assert_eq!(code, STATUS_OK, "{text}");

    assert!(alive(cluster.info.master_pid), "master died");
    for &pid in &cluster.info.chunkserver_pids {
        assert!(alive(pid), "chunkserver (pid {pid}) died");
    }
    let list = cluster.floe_json(&["volume", "list"]);
    assert!(volume(&list, "demo").is_some(), "{list}");
    let uri = cluster.uri();
    qemu_io(uri, &["write -P 0x5a 0 64k", "read -P 0x5a 0 64k"]);
}

/// Exactly one non-empty line on stderr, mentioning `keyword`.
fn assert_refused(out: &std::process::Output, keyword: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "accepted; expected a refusal about {keyword}:\n{}",
        text(out)
    );
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "not one line:\n{stderr}"
    );
    assert!(
        stderr.contains(keyword) && !stderr.contains("panicked"),
        "stderr does not mention {keyword:?}:\n{stderr}"
    );
}

/// The list's row for `name`, if any.
#[test]
fn volume_admin_rejects_bad_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri();
    qemu_io(uri, &["write -P 0x99 0 1M"]);

    assert_refused(
        &floe_output(&cluster, &["volume", "create", "odd", "--size", "1000"]),
        "512",
    );
    assert_refused(
        &floe_output(
            &cluster,
            &[
                "volume",
                "create",
                "norep",
                "--size",
                "64M",
                "--replicas",
                "0",
            ],
        ),
        "replicas",
    );
    assert_refused(
        &floe_output(&cluster, &["volume", "create", "demo", "--size", "64M"]),
        "exists",
    );
    assert_refused(
        &floe_output(&cluster, &["volume", "resize", "demo", "--size", "512M"]),
        "shrink",
    );
    let list = cluster.floe_json(&["volume", "list"]);
    assert!(
        volume(&list, "odd").is_none() && volume(&list, "norep").is_none(),
        "{list}"
    );
    let demo = volume(&list, "demo").unwrap_or_else(|| panic!("{list}"));
    assert_eq!(
        demo["size_bytes"],
        1u64 << 30,
        "shrink changed demo: {demo}"
    );
    let size = ok(Command::new("nbdinfo").args(["--size", uri]));
    assert_eq!(size.trim(), (1u64 << 30).to_string());

    // A second volume: listed, exported at its own name, then deleted.
    cluster.floe(&["volume", "create", "v2", "--size", "64M"]);
    let list = cluster.floe_json(&["volume", "list"]);
    let v2 = volume(&list, "v2").unwrap_or_else(|| panic!("v2 not listed:\n{list}"));
    assert_eq!(v2["size_bytes"], 64u64 << 20, "{v2}");
    let v2_uri = uri.replace("/demo", "/v2");
    let size = ok(Command::new("nbdinfo").args(["--size", &v2_uri]));
    assert_eq!(size.trim(), (64u64 << 20).to_string());
    // Within the first stripe unit: the whole range is `small_volumes_writable_throughout`.
    qemu_io(&v2_uri, &["write -P 0x2 0 4k", "read -P 0x2 0 4k"]);
    cluster.floe(&["volume", "delete", "v2"]);
    let list = cluster.floe_json(&["volume", "list"]);
    assert!(volume(&list, "v2").is_none(), "v2 still listed:\n{list}");
    let gone = output(Command::new("nbdinfo").args(["--size", &v2_uri]));
    assert!(!gone.status.success(), "deleted v2 still exported");
    assert_refused(&floe_output(&cluster, &["volume", "delete", "v2"]), "v2");

    // None of it touched demo.
    qemu_io(uri, &["read -P 0x99 0 1M"]);
}

/// Every byte of a volume smaller than one object set (chunk size x stripe count,
/// 256 MiB by default) or with a partial last set must be writable.
#[test]
fn small_volumes_writable_throughout() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    for (name, size) in [("small", "64M"), ("partial", "300M")] {
        cluster.floe(&["volume", "create", name, "--size", size]);
        let uri = cluster.uri().replace("/demo", &format!("/{name}"));
        // The second stripe unit (chunk 1) and the last 64 KiB of the volume.
        let last = if name == "small" {
            "67043328"
        } else {
            "314507264"
        };
        qemu_io(
            &uri,
            &[
                "write -P 0x1 0 1M",
                &format!("write -P 0x2 {last} 64k"),
                "read -P 0x1 0 1M",
                &format!("read -P 0x2 {last} 64k"),
            ],
        );
    }
}

/// A Read longer than the frame payload limit gets a reply no Floe peer accepts
/// (FrameError::TooLarge) and lets one small request allocate up to 1 GiB: it must be
/// refused with BadRequest.
#[test]
fn chunkserver_refuses_reads_larger_than_a_frame() {
    const PAYLOAD_BYTES_MAX: u32 = 33 << 20;
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let mut raw = Raw::connect(cluster.port + 1);
    raw.greet();
    let mut payload = Vec::new();
    for field in [1u64, 0, 0] {
        payload.extend_from_slice(&field.to_le_bytes());
    }
    payload.extend_from_slice(&(64u32 << 20).to_le_bytes());
    payload.extend_from_slice(&0u64.to_le_bytes());
    payload.extend_from_slice(&u64::MAX.to_le_bytes());
    raw.send(&frame(KIND_READ, 2, &payload));
    let reply = raw.frame();
    assert!(
        reply.payload.len() <= PAYLOAD_BYTES_MAX as usize,
        "reply of {} bytes (status {}) exceeds the frame limit",
        reply.payload.len(),
        reply.status
    );
    assert_eq!((reply.status, reply.request_id), (STATUS_BAD_REQUEST, 2));
}
