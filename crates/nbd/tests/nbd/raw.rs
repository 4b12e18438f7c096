//! Hand-made byte streams: exact handshake and reply encodings, and hostile clients
//! that must only ever hurt their own connection. Constants are spelled out here
//! (from proto.md) rather than taken from the server.

use crate::common::*;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x3_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_MAGIC: u32 = 0x668e_33ef;

const C_FIXED_NEWSTYLE: u32 = 1;
const C_NO_ZEROES: u32 = 2;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_LIST_META_CONTEXT: u32 = 9;
const OPT_SET_META_CONTEXT: u32 = 10;

const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_META_CONTEXT: u32 = 4;
const REP_ERR_UNSUP: u32 = 0x8000_0001;
const REP_ERR_INVALID: u32 = 0x8000_0003;
const REP_ERR_UNKNOWN: u32 = 0x8000_0006;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_BLOCK_STATUS: u16 = 7;
const FLAG_DF: u16 = 4;

const TYPE_OFFSET_DATA: u16 = 1;
const TYPE_BLOCK_STATUS: u16 = 5;
const TYPE_ERROR: u16 = 0x8001;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;

/// Transmission flags every export must carry: HAS_FLAGS, SEND_FLUSH, SEND_FUA,
/// SEND_TRIM, SEND_WRITE_ZEROES, CAN_MULTI_CONN, SEND_CACHE, SEND_FAST_ZERO.
const BASE_FLAGS: u16 = 1 | 1 << 2 | 1 << 3 | 1 << 5 | 1 << 6 | 1 << 8 | 1 << 10 | 1 << 11;
const SEND_DF: u16 = 1 << 7;

struct Raw(TcpStream);

impl Raw {
    fn connect(port: u16) -> Raw {
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw(stream)
    }

    /// Reads the server greeting and answers with `client_flags`.
    fn greeted(port: u16, client_flags: u32) -> Raw {
        let mut raw = Raw::connect(port);
        let greeting = raw.read(18);
        assert_eq!(u64_at(&greeting, 0), NBDMAGIC);
        assert_eq!(u64_at(&greeting, 8), IHAVEOPT);
        assert_eq!(u16_at(&greeting, 16), 3, "FIXED_NEWSTYLE | NO_ZEROES");
        raw.send(&client_flags.to_be_bytes());
        raw
    }

    fn send(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).unwrap();
    }

    fn read(&mut self, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n];
        self.0.read_exact(&mut buf).unwrap();
        buf
    }

    fn option(&mut self, option: u32, data: &[u8]) {
        let mut msg = IHAVEOPT.to_be_bytes().to_vec();
        msg.extend(option.to_be_bytes());
        msg.extend((data.len() as u32).to_be_bytes());
        msg.extend(data);
        self.send(&msg);
    }

    /// One option reply: (reply type, data), checking magic and option echo.
    fn reply_to(&mut self, option: u32) -> (u32, Vec<u8>) {
        let head = self.read(20);
        assert_eq!(u64_at(&head, 0), REPLY_MAGIC);
        assert_eq!(u32_at(&head, 8), option);
        let data = self.read(u32_at(&head, 16) as usize);
        (u32_at(&head, 12), data)
    }

    /// All replies to one option, up to and including the final one.
    fn replies_to(&mut self, option: u32) -> Vec<(u32, Vec<u8>)> {
        let mut replies = Vec::new();
        loop {
            let (kind, data) = self.reply_to(option);
            let last = kind == REP_ACK || kind & 0x8000_0000 != 0;
            replies.push((kind, data));
            if last {
                return replies;
            }
        }
    }

    fn request(
        &mut self,
        flags: u16,
        kind: u16,
        handle: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) {
        self.send(&request(flags, kind, handle, offset, length));
        self.send(payload);
    }

    /// A simple reply: (error, handle).
    fn simple_reply(&mut self) -> (u32, u64) {
        let head = self.read(16);
        assert_eq!(u32_at(&head, 0), SIMPLE_MAGIC);
        (u32_at(&head, 4), u64_at(&head, 8))
    }

    /// A structured reply chunk: (flags, type, handle, payload).
    fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let head = self.read(20);
        assert_eq!(u32_at(&head, 0), STRUCTURED_MAGIC);
        let payload = self.read(u32_at(&head, 16) as usize);
        (
            u16_at(&head, 4),
            u16_at(&head, 6),
            u64_at(&head, 8),
            payload,
        )
    }

    /// Expects a final NBD_REPLY_TYPE_ERROR chunk; returns its message.
    fn structured_error(&mut self, handle: u64, error: u32) -> String {
        let (flags, kind, got, payload) = self.chunk();
        assert_eq!((flags, kind, got), (1, TYPE_ERROR, handle));
        assert_eq!(u32_at(&payload, 0), error);
        let len = u16_at(&payload, 4) as usize;
        assert_eq!(payload.len(), 6 + len);
        String::from_utf8(payload[6..].to_vec()).unwrap()
    }

    /// Whether the server closed the connection (instead of waiting for more).
    fn closed(&mut self) -> bool {
        let mut buf = [0; 1024];
        loop {
            match self.0.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return false
                }
                Err(e) => panic!("unexpected read error {e}"),
            }
        }
    }

    /// Fixed newstyle handshake into transmission on `export`, via NBD_OPT_GO.
    fn attach(port: u16, export: &str, structured: bool) -> Raw {
        let mut raw = Raw::greeted(port, C_FIXED_NEWSTYLE | C_NO_ZEROES);
        if structured {
            raw.option(OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(raw.reply_to(OPT_STRUCTURED_REPLY).0, REP_ACK);
            raw.option(
                OPT_SET_META_CONTEXT,
                &meta_request(export, &["base:allocation"]),
            );
            assert_eq!(raw.replies_to(OPT_SET_META_CONTEXT).len(), 2);
        }
        raw.option(OPT_GO, &info_request(export, &[]));
        let replies = raw.replies_to(OPT_GO);
        assert_eq!(
            replies.last().unwrap().0,
            REP_ACK,
            "GO {export:?} failed: {replies:?}"
        );
        raw
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

fn request(flags: u16, kind: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut msg = REQUEST_MAGIC.to_be_bytes().to_vec();
    msg.extend(flags.to_be_bytes());
    msg.extend(kind.to_be_bytes());
    msg.extend(handle.to_be_bytes());
    msg.extend(offset.to_be_bytes());
    msg.extend(length.to_be_bytes());
    msg
}

fn string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u32).to_be_bytes().to_vec();
    out.extend(s.as_bytes());
    out
}

fn info_request(export: &str, infos: &[u16]) -> Vec<u8> {
    let mut data = string(export);
    data.extend((infos.len() as u16).to_be_bytes());
    for info in infos {
        data.extend(info.to_be_bytes());
    }
    data
}

fn meta_request(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = string(export);
    data.extend((queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend(string(query));
    }
    data
}

#[test]
fn option_haggling() {
    let server = Server::start();
    let mut raw = Raw::greeted(server.port, C_FIXED_NEWSTYLE | C_NO_ZEROES);

    raw.option(99, b"xyz");
    assert_eq!(raw.reply_to(99).0, REP_ERR_UNSUP);
    raw.option(OPT_LIST, b"x");
    assert_eq!(raw.reply_to(OPT_LIST).0, REP_ERR_INVALID);
    raw.option(OPT_LIST, &[]);
    let listed = raw.replies_to(OPT_LIST);
    let (ack, servers) = listed.split_last().unwrap();
    assert_eq!(ack.0, REP_ACK);
    let names: Vec<String> = servers
        .iter()
        .map(|(kind, data)| {
            assert_eq!(*kind, REP_SERVER);
            assert_eq!(u32_at(data, 0) as usize, data.len() - 4);
            String::from_utf8(data[4..].to_vec()).unwrap()
        })
        .collect();
    assert_eq!(names, ["", "disk", "full", "ro", "slow"]);

    raw.option(OPT_GO, &[0, 0, 0, 9, b'd']);
    assert_eq!(raw.reply_to(OPT_GO).0, REP_ERR_INVALID, "truncated GO");
    raw.option(OPT_INFO, &info_request("nope", &[]));
    let (kind, message) = raw.reply_to(OPT_INFO);
    assert_eq!(kind, REP_ERR_UNKNOWN);
    assert_eq!(message, br#"no volume named "nope" here"#);

    let select = meta_request("disk", &["x-other:thing", "base:allocation"]);
    raw.option(OPT_SET_META_CONTEXT, &select);
    assert_eq!(
        raw.reply_to(OPT_SET_META_CONTEXT).0,
        REP_ERR_INVALID,
        "needs structured replies"
    );
    raw.option(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(raw.reply_to(OPT_STRUCTURED_REPLY).0, REP_ACK);
    raw.option(OPT_LIST_META_CONTEXT, &meta_request("disk", &[]));
    let contexts = raw.replies_to(OPT_LIST_META_CONTEXT);
    assert_eq!(contexts.len(), 2);
    assert_eq!(contexts[0].0, REP_META_CONTEXT);
    assert_eq!(&contexts[0].1[4..], b"base:allocation");
    raw.option(OPT_LIST_META_CONTEXT, &meta_request("disk", &["x-other:"]));
    assert_eq!(
        raw.replies_to(OPT_LIST_META_CONTEXT).len(),
        1,
        "nothing matches: just ACK"
    );
    raw.option(OPT_SET_META_CONTEXT, &select);
    let selected = raw.replies_to(OPT_SET_META_CONTEXT);
    assert_eq!(selected.len(), 2);
    assert_eq!(&selected[0].1[4..], b"base:allocation");
    let context_id = u32_at(&selected[0].1, 0);

    raw.option(OPT_INFO, &info_request("disk", &[1]));
    let infos = raw.replies_to(OPT_INFO);
    assert!(infos[..infos.len() - 1]
        .iter()
        .all(|(kind, _)| *kind == REP_INFO));
    let export = infos
        .iter()
        .find(|(_, d)| u16_at(d, 0) == 0)
        .expect("NBD_INFO_EXPORT");
    assert_eq!(u64_at(&export.1, 2), DISK_SIZE);
    assert_eq!(u16_at(&export.1, 10), BASE_FLAGS | SEND_DF);
    let name = infos
        .iter()
        .find(|(_, d)| u16_at(d, 0) == 1)
        .expect("NBD_INFO_NAME");
    assert_eq!(&name.1[2..], b"disk");
    let sizes = infos
        .iter()
        .find(|(_, d)| u16_at(d, 0) == 3)
        .expect("NBD_INFO_BLOCK_SIZE");
    assert_eq!(
        (
            u32_at(&sizes.1, 2),
            u32_at(&sizes.1, 6),
            u32_at(&sizes.1, 10)
        ),
        (1, 4096, 32 << 20)
    );

    raw.option(OPT_GO, &info_request("disk", &[]));
    assert_eq!(raw.replies_to(OPT_GO).last().unwrap().0, REP_ACK);

    // Transmission with structured replies.
    raw.request(0, 42, 1, 0, 0, &[]);
    assert!(raw.structured_error(1, EINVAL).contains("unknown command"));
    raw.request(0, CMD_READ, 2, 0, 64 << 20, &[]);
    raw.structured_error(2, EINVAL);
    // Too long to serve but sane: the payload is drained and the connection lives on.
    raw.request(0, CMD_WRITE, 3, 0, 40 << 20, &vec![0xee; 40 << 20]);
    raw.structured_error(3, EINVAL);
    raw.request(0, CMD_FLUSH, 4, 1, 0, &[]);
    raw.structured_error(4, EINVAL);
    raw.request(0, CMD_WRITE, 5, 4096, 5, b"hello");
    assert_eq!(raw.simple_reply(), (0, 5));
    raw.request(FLAG_DF, CMD_READ, 6, 4096, 5, &[]);
    let (flags, kind, handle, payload) = raw.chunk();
    assert_eq!((flags, kind, handle), (1, TYPE_OFFSET_DATA, 6));
    assert_eq!(u64_at(&payload, 0), 4096);
    assert_eq!(&payload[8..], b"hello");
    raw.request(0, CMD_BLOCK_STATUS, 7, 0, DISK_SIZE as u32, &[]);
    let (flags, kind, handle, payload) = raw.chunk();
    assert_eq!((flags, kind, handle), (1, TYPE_BLOCK_STATUS, 7));
    assert_eq!(u32_at(&payload, 0), context_id);
    let descriptors: Vec<(u32, u32)> = payload[4..]
        .chunks(8)
        .map(|d| (u32_at(d, 0), u32_at(d, 4)))
        .collect();
    assert_eq!(
        descriptors,
        [(4096, 3), (4096, 0), (DISK_SIZE as u32 - 8192, 3)]
    );
    raw.request(0, CMD_WRITE, 8, DISK_SIZE - 2, 5, b"abcde");
    raw.structured_error(8, ENOSPC);
    assert!(
        server.disk_read(0, 4096).iter().all(|&b| b == 0),
        "rejected writes wrote nothing"
    );

    // Many requests in one burst, all answered.
    let mut burst = Vec::new();
    for handle in 100..300 {
        burst.extend(request(0, CMD_READ, handle, 4096, 5));
    }
    raw.send(&burst);
    let mut handles: Vec<u64> = (0..200).map(|_| raw.chunk().2).collect();
    handles.sort();
    assert_eq!(handles, (100..300).collect::<Vec<_>>());

    raw.request(0, CMD_DISC, 9, 0, 0, &[]);
    assert!(raw.closed(), "DISC closes the connection without a reply");
}

#[test]
fn export_name_and_simple_replies() {
    let server = Server::start();
    server.disk_write(0, b"floe");
    // Without NO_ZEROES the reply to EXPORT_NAME carries 124 zero bytes.
    let mut raw = Raw::greeted(server.port, C_FIXED_NEWSTYLE);
    raw.option(OPT_EXPORT_NAME, b"disk");
    let reply = raw.read(8 + 2 + 124);
    assert_eq!(u64_at(&reply, 0), DISK_SIZE);
    assert_eq!(
        u16_at(&reply, 8),
        BASE_FLAGS,
        "no DF without structured replies"
    );
    assert!(reply[10..].iter().all(|&b| b == 0));

    raw.request(0, CMD_READ, 1, 0, 4, &[]);
    assert_eq!(raw.simple_reply(), (0, 1));
    assert_eq!(raw.read(4), b"floe");
    // An error carries no data; the next reply follows right after.
    raw.request(0, CMD_READ, 2, DISK_SIZE, 1, &[]);
    assert_eq!(raw.simple_reply(), (EINVAL, 2));
    raw.request(FLAG_DF, CMD_READ, 3, 0, 4, &[]);
    assert_eq!(
        raw.simple_reply(),
        (EINVAL, 3),
        "DF is not valid without structured replies"
    );
    raw.request(0, CMD_BLOCK_STATUS, 4, 0, 4096, &[]);
    assert_eq!(
        raw.simple_reply(),
        (EINVAL, 4),
        "no metadata context negotiated"
    );
    raw.request(0, CMD_READ, 5, 1, 3, &[]);
    assert_eq!(raw.simple_reply(), (0, 5));
    assert_eq!(raw.read(3), b"loe");

    let mut aborted = Raw::greeted(server.port, C_FIXED_NEWSTYLE | C_NO_ZEROES);
    aborted.option(OPT_ABORT, &[]);
    assert_eq!(aborted.reply_to(OPT_ABORT).0, REP_ACK);
    assert!(aborted.closed());
}

#[test]
fn hostile_clients_only_hurt_themselves() {
    let server = Server::start();
    let port = server.port;
    // A well-behaved client stays attached through everything below.
    let mut good = Raw::attach(port, "disk", false);
    good.request(0, CMD_WRITE, 1, 0, 4, b"good");
    assert_eq!(good.simple_reply(), (0, 1));

    let mut unknown_flags = Raw::greeted(port, 0x80);
    assert!(unknown_flags.closed(), "unknown client flags");

    let mut truncated = Raw::connect(port);
    truncated.read(18);
    truncated.send(&[0, 0]);
    drop(truncated);

    let mut bad_magic = Raw::greeted(port, C_FIXED_NEWSTYLE);
    bad_magic.send(b"NOTMAGIC\0\0\0\x07\0\0\0\0");
    assert!(bad_magic.closed(), "bad option magic");

    // A gigabyte of option data is refused without waiting for (or buffering) it.
    let mut huge = Raw::greeted(port, C_FIXED_NEWSTYLE);
    let mut head = IHAVEOPT.to_be_bytes().to_vec();
    head.extend(OPT_GO.to_be_bytes());
    head.extend((1u32 << 30).to_be_bytes());
    huge.send(&head);
    assert!(huge.closed(), "huge option");

    let mut unknown_export = Raw::greeted(port, C_FIXED_NEWSTYLE | C_NO_ZEROES);
    unknown_export.option(OPT_EXPORT_NAME, b"nope");
    assert!(unknown_export.closed(), "EXPORT_NAME cannot fail politely");

    // Gone halfway through a write payload: nothing of it may land.
    let mut quitter = Raw::greeted(port, C_FIXED_NEWSTYLE | C_NO_ZEROES);
    quitter.option(OPT_EXPORT_NAME, b"disk");
    quitter.read(10);
    quitter.request(0, CMD_WRITE, 7, 0, 1 << 20, &[0xee; 1000]);
    drop(quitter);

    let mut garbage = Raw::attach(port, "disk", true);
    garbage.send(&[0xff; 28]);
    assert!(garbage.closed(), "a request with a bad magic");

    let mut absurd = Raw::attach(port, "disk", false);
    absurd.request(0, CMD_WRITE, 1, 0, u32::MAX, &[]);
    assert!(absurd.closed(), "a 4 GiB write is not drained");

    let mut half_header = Raw::attach(port, "disk", false);
    half_header.send(&request(0, CMD_READ, 1, 0, 4096)[..13]);
    drop(half_header);

    // Idle and pipelining clients that vanish with replies pending.
    let mut vanisher = Raw::attach(port, "disk", true);
    let mut burst = Vec::new();
    for handle in 0..128 {
        burst.extend(request(0, CMD_READ, handle, 0, 1 << 20));
    }
    vanisher.send(&burst);
    drop(vanisher);

    good.request(0, CMD_READ, 2, 0, 1000, &[]);
    assert_eq!(good.simple_reply(), (0, 2));
    let mut expected = b"good".to_vec();
    expected.resize(1000, 0);
    assert_eq!(good.read(1000), expected);

    // New clients are still accepted and served.
    let out = succeed(tool("qemu-io").args([
        "-f",
        "raw",
        &server.uri("disk"),
        "-c",
        "read -P 0 4096 1M",
        "-c",
        "write -P 0x42 1M 1M",
    ]));
    assert!(!out.contains("failed"), "{out}");
    assert_eq!(server.disk_read(1 << 20, 1 << 20), vec![0x42; 1 << 20]);
}

#[test]
fn shutdown_answers_in_flight_requests_then_closes() {
    let mut server = Server::start();
    let port = server.port;
    // Neither a client idle in the handshake nor one stalled mid-payload holds it up.
    let _idle = Raw::connect(port);
    let mut stalled = Raw::attach(port, "disk", false);
    stalled.request(0, CMD_WRITE, 1, 0, 1 << 20, &[0xee; 1000]);
    let mut busy = Raw::attach(port, "slow", false);
    busy.request(0, CMD_READ, 1, 0, 4096, &[]);
    std::thread::sleep(Duration::from_millis(50));

    assert!(
        server.stop(Duration::from_secs(10)),
        "serve returns once clients are done"
    );
    assert_eq!(
        busy.simple_reply(),
        (0, 1),
        "the in-flight read is answered"
    );
    assert_eq!(busy.read(4096), vec![0; 4096]);
    assert!(busy.closed());
    assert!(stalled.closed());
    let refused = TcpStream::connect(("127.0.0.1", port));
    assert!(refused.is_err(), "the listener is closed");
}

#[test]
fn a_handover_keeps_attached_clients_and_the_listener() {
    let mut server = Server::start();
    let port = server.port;
    let disk = server.disk.clone();
    // A structured client (its base:allocation context goes along) with a request
    // in flight on a slow export, and a plain one with half a request sent.
    let mut busy = Raw::attach(port, "slow", false);
    busy.request(0, CMD_READ, 1, 0, 4096, &[]);
    let mut plain = Raw::attach(port, "disk", false);
    plain.request(0, CMD_WRITE, 2, 8192, 4096, &[0xab; 4096]);
    assert_eq!(plain.simple_reply(), (0, 2));
    let mut structured = Raw::attach(port, "disk", true);
    let read = request(0, CMD_READ, 3, 8192, 4096);
    plain.send(&read[..10]);
    std::thread::sleep(Duration::from_millis(50));

    let handover = server.hand_over();
    assert_eq!(handover.connections.len(), 3, "{:?}", handover.connections);
    // The in-flight read was answered before the old server let go.
    assert_eq!(busy.simple_reply(), (0, 1));
    assert_eq!(busy.read(4096), vec![0; 4096]);
    drop(server);

    let mut server = Server::resume(handover, disk);
    assert_eq!(server.port, port);
    // The half-sent request completes against the new server.
    plain.send(&read[10..]);
    assert_eq!(plain.simple_reply(), (0, 3));
    assert_eq!(plain.read(4096), vec![0xab; 4096]);
    busy.request(0, CMD_READ, 4, 4096, 4096, &[]);
    assert_eq!(busy.simple_reply(), (0, 4));
    assert_eq!(busy.read(4096), vec![0; 4096]);
    // Structured replies and the selected context survived.
    structured.request(0, CMD_BLOCK_STATUS, 5, 0, 1 << 20, &[]);
    let (flags, kind, handle, payload) = structured.chunk();
    assert_eq!((flags, kind, handle), (1, TYPE_BLOCK_STATUS, 5));
    assert_eq!(u32_at(&payload, 0), 1, "base:allocation's id");
    // New clients reach the same listener.
    let mut fresh = Raw::attach(port, "disk", false);
    fresh.request(0, CMD_READ, 6, 8192, 4096, &[]);
    assert_eq!(fresh.simple_reply(), (0, 6));
    assert_eq!(fresh.read(4096), vec![0xab; 4096]);
    assert!(server.stop(Duration::from_secs(10)));
}
