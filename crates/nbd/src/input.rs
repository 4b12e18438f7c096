//! Buffered socket input shared by the handshake and the request loop: few read
//! syscalls for small messages, and write payloads split off the buffer without a copy.

use bytes::{Buf, BytesMut};
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt};

/// How much to ask the socket for at once, so a burst of pipelined requests is one read.
const READ_AHEAD: usize = 64 * 1024;

pub(crate) struct Input<R> {
    socket: R,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> Input<R> {
    pub(crate) fn new(socket: R) -> Self {
        Self {
            socket,
            buf: BytesMut::new(),
        }
    }

    /// The next `n` bytes, or `None` if the peer closed the connection cleanly at a
    /// message boundary. A close inside the message is `UnexpectedEof`.
    pub(crate) async fn message(&mut self, n: usize) -> io::Result<Option<BytesMut>> {
        if self.buf.is_empty() && !self.fill_at_least(1).await? {
            return Ok(None);
        }
        self.take(n).await.map(Some)
    }

    /// Exactly `n` bytes. Reading a large write payload straight into its own
    /// allocation lets the caller freeze it and hand it to the device as is.
    pub(crate) async fn take(&mut self, n: usize) -> io::Result<BytesMut> {
        if !self.fill_at_least(n).await? {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(self.buf.split_to(n))
    }

    /// Discards `n` bytes without ever holding more than `READ_AHEAD` of them.
    pub(crate) async fn skip(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            let step = n.min(READ_AHEAD as u64) as usize;
            if !self.fill_at_least(step).await? {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.buf.advance(step);
            n -= step as u64;
        }
        Ok(())
    }

    /// Input over `socket` that first yields `buffered` (read by a previous process).
    pub(crate) fn with_buffered(socket: R, buffered: &[u8]) -> Self {
        Self {
            socket,
            buf: BytesMut::from(buffered),
        }
    }

    /// The socket and what is buffered from it.
    pub(crate) fn into_parts(self) -> (R, BytesMut) {
        (self.socket, self.buf)
    }

    /// The same input over `socket` made into another type, keeping what is buffered.
    pub(crate) fn map<S>(self, socket: impl FnOnce(R) -> S) -> Input<S> {
        Input {
            socket: socket(self.socket),
            buf: self.buf,
        }
    }

    /// The socket, for TLS to take over: nothing may be buffered (a client sends
    /// nothing after STARTTLS until it has the server's answer).
    pub(crate) fn into_inner(self) -> io::Result<R> {
        if !self.buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the client sent data after STARTTLS before its answer",
            ));
        }
        Ok(self.socket)
    }

    /// Reads until `n` bytes are buffered; `false` if the peer closed first.
    async fn fill_at_least(&mut self, n: usize) -> io::Result<bool> {
        if self.buf.len() < n {
            self.buf.reserve((n - self.buf.len()).max(READ_AHEAD));
        }
        while self.buf.len() < n {
            if self.socket.read_buf(&mut self.buf).await? == 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
