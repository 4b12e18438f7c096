//! Handing attached clients to another server process (an upgrade) without the
//! clients noticing: each connection stops reading requests at a request boundary,
//! sends every reply it owes, and is parked: its socket, what haggling agreed, and
//! the bytes of requests already read but not served. The next process serves parked
//! connections on from there. Only plain connections can be parked: a TLS session's
//! state lives in this process's TLS library, so TLS clients are disconnected (they
//! reconnect, as QEMU does with `reconnect-delay`).

use crate::handshake::{Context, Session};
use crate::input::Input;
use crate::{Client, Exports, Refusal};
use serde::{Deserialize, Serialize};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// How a server stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Clients are answered what is in flight and disconnected.
    Shutdown,
    /// Clients are parked for the next process ([`crate::serve`] returns them).
    Handover,
}

/// How long a resumed connection keeps trying to open its export: the previous
/// process's lease may take a moment to be released at the master.
const REOPEN_FOR: Duration = Duration::from_secs(30);

/// An attached connection stopped between requests with every reply sent.
#[derive(Debug, Serialize, Deserialize)]
pub struct Parked {
    /// The socket, a descriptor of this process that nothing else owns; the next
    /// process inherits it under the same number.
    fd: RawFd,
    export: String,
    structured: bool,
    base_allocation: bool,
    contexts: Vec<(u32, Vec<(u64, u64)>)>,
    /// Requests (or the start of one) read from the socket and not yet served.
    buffered: Vec<u8>,
}

/// What a server hands the next process: its listening socket and its parked clients.
#[derive(Debug)]
pub struct Handover {
    /// Out of this runtime's reactor, for whichever runtime serves next.
    pub listener: std::net::TcpListener,
    pub connections: Vec<Parked>,
}

impl Parked {
    /// Parks a plain connection. Its halves are forgotten, not dropped: dropping the
    /// write half would shut the socket down under the client. They keep the
    /// original descriptor (close-on-exec); the parked one is a duplicate.
    pub(crate) fn new(
        input: Input<OwnedReadHalf>,
        write: OwnedWriteHalf,
        session: &Session,
    ) -> io::Result<Parked> {
        let (read, buffered) = input.into_parts();
        let stream = read
            .reunite(write)
            .map_err(|e| io::Error::other(e.to_string()))?;
        // into_std leaves the reactor; dropping the std stream then only closes this
        // process's descriptor, which the duplicate outlives.
        let stream = stream.into_std()?;
        let fd: OwnedFd = stream.try_clone()?.into();
        Ok(Parked {
            fd: std::os::fd::IntoRawFd::into_raw_fd(fd),
            export: session.name.clone(),
            structured: session.structured,
            base_allocation: session.base_allocation,
            contexts: session
                .contexts
                .iter()
                .map(|(id, ranges)| (*id, ranges.as_ref().clone()))
                .collect(),
            buffered: buffered.to_vec(),
        })
    }

    /// The socket's descriptor, which must survive into the next process.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    pub fn export(&self) -> &str {
        &self.export
    }

    /// Serves on: reopens the export (retrying while the previous process's lease is
    /// released) and rebuilds the session and the socket.
    pub(crate) async fn resume(
        self,
        exports: &dyn Exports,
    ) -> Result<(Input<OwnedReadHalf>, OwnedWriteHalf, Session), String> {
        // SAFETY: the descriptor was duplicated for this parked connection alone
        // (`Parked::new`) and inherited under this number; only this takes it.
        let fd = unsafe { OwnedFd::from_raw_fd(self.fd) };
        let stream = std::net::TcpStream::from(fd);
        stream.set_nonblocking(true).map_err(|e| e.to_string())?;
        let stream = tokio::net::TcpStream::from_std(stream).map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        let device = reopen(exports, &self.export).await?;
        let (read, write) = stream.into_split();
        let contexts: Vec<Context> = self
            .contexts
            .into_iter()
            .map(|(id, ranges)| (id, Arc::new(ranges)))
            .collect();
        let session = Session {
            name: self.export,
            device,
            structured: self.structured,
            base_allocation: self.base_allocation,
            contexts,
        };
        Ok((Input::with_buffered(read, &self.buffered), write, session))
    }
}

async fn reopen(
    exports: &dyn Exports,
    export: &str,
) -> Result<Arc<dyn floe_blockdev::BlockDevice>, String> {
    let give_up = Instant::now() + REOPEN_FOR;
    loop {
        // Only plain clients are parked: they presented no credentials.
        match exports.open(export, &Client::default()).await {
            Ok(device) => return Ok(device),
            Err(Refusal::Unknown(e)) if Instant::now() < give_up => {
                tracing::info!(export, "reopening a handed-over export: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(format!("cannot reopen {export}: {e}")),
        }
    }
}
