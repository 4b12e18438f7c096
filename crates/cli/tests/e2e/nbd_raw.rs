//! A raw client: one TCP connection to a Floe port with the bytes spelled out, for what
//! no real client sends (broken handshakes, lying frames) and for telling when a
//! server is up. NBD from the protocol's proto.md, in network byte order; bad_input.rs
//! adds Floe's own frames on the same connection.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const OPT_LIST: u32 = 3;
pub const OPT_GO: u32 = 7;
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const EINVAL: u32 = 22;
/// The server's greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const GREETING_BYTES: usize = 18;

/// One raw connection; reads time out so a server that hangs fails the test.
pub struct Raw(TcpStream);

impl Raw {
    pub fn connect(port: u16) -> Raw {
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw(stream)
    }

    /// Sends, ignoring errors: the server may already have hung up, which is the point.
    pub fn send(&mut self, bytes: &[u8]) {
        let _ = self.0.write_all(bytes);
    }

    pub fn read_exact(&mut self, n: usize) -> Vec<u8> {
        let mut buf = vec![0u8; n];
        self.0
            .read_exact(&mut buf)
            .unwrap_or_else(|e| panic!("reading {n} bytes: {e}"));
        buf
    }

    /// Tells the server nothing more will come.
    pub fn shutdown_write(&mut self) {
        self.0.shutdown(Shutdown::Write).unwrap();
    }

    /// The server hung up: EOF (or a reset) before the timeout, after any replies.
    pub fn assert_closed(&mut self, what: &str) {
        let mut sink = Vec::new();
        match self.0.read_to_end(&mut sink) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Err(e) => panic!("{what}: server kept the connection open ({e})"),
        }
    }

    /// Reads the greeting and answers FIXED_NEWSTYLE | NO_ZEROES.
    pub fn nbd_greeted(port: u16) -> Raw {
        let mut raw = Raw::connect(port);
        let greeting = raw.read_exact(GREETING_BYTES);
        assert_eq!(
            u64::from_be_bytes(greeting[..8].try_into().unwrap()),
            NBDMAGIC
        );
        assert_eq!(
            u64::from_be_bytes(greeting[8..16].try_into().unwrap()),
            IHAVEOPT
        );
        raw.send(&3u32.to_be_bytes());
        raw
    }

    pub fn option(&mut self, option: u32, data: &[u8]) {
        let mut out = IHAVEOPT.to_be_bytes().to_vec();
        out.extend_from_slice(&option.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
        self.send(&out);
    }

    /// One option reply: (option, reply type, data).
    pub fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        let head = self.read_exact(20);
        let be32 = |i: usize| u32::from_be_bytes(head[i..i + 4].try_into().unwrap());
        assert_eq!(
            u64::from_be_bytes(head[..8].try_into().unwrap()),
            OPTION_REPLY_MAGIC
        );
        let data = self.read_exact(be32(16) as usize);
        (be32(8), be32(12), data)
    }

    /// NBD_OPT_GO for `name`, up to the final ACK.
    pub fn go(&mut self, name: &str) {
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        self.option(OPT_GO, &data);
        loop {
            let (option, kind, data) = self.option_reply();
            assert_eq!(option, OPT_GO);
            assert!(
                kind & 0x8000_0000 == 0,
                "GO refused: {}",
                String::from_utf8_lossy(&data)
            );
            if kind == REP_ACK {
                return;
            }
        }
    }

    pub fn request(&mut self, kind: u16, handle: u64, offset: u64, length: u32) {
        let mut out = REQUEST_MAGIC.to_be_bytes().to_vec();
        out.extend_from_slice(&0u16.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&handle.to_be_bytes());
        out.extend_from_slice(&offset.to_be_bytes());
        out.extend_from_slice(&length.to_be_bytes());
        self.send(&out);
    }

    /// A simple reply: (error, handle).
    pub fn simple_reply(&mut self) -> (u32, u64) {
        let head = self.read_exact(16);
        assert_eq!(
            u32::from_be_bytes(head[..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        (
            u32::from_be_bytes(head[4..8].try_into().unwrap()),
            u64::from_be_bytes(head[8..16].try_into().unwrap()),
        )
    }
}

/// Waits until an NBD server on `port` greets a client: a gateway just started
/// listens a moment later, and later still on a busy machine, so a fixed sleep is
/// either slow or wrong.
pub fn wait_for_nbd_server(port: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) {
            stream.set_read_timeout(Some(timeout)).unwrap();
            let mut greeting = [0u8; GREETING_BYTES];
            if stream.read_exact(&mut greeting).is_ok() && greeting[..8] == NBDMAGIC.to_be_bytes() {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no NBD server greets on port {port} after {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
