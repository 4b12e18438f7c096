//! The client side of a connection: pipelined calls matched to replies by request id.
//!
//! One writer task batches queued frames into few socket writes (group send); one
//! reader task routes replies to their callers. No lock is held across I/O.

use crate::frame::{Frame, FrameError, Integrity, Status};
use crate::message::{Request, Response};
use crate::transport::{CallFuture, Transport};
use crate::PROTOCOL_VERSION;
use bytes::BytesMut;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// Requests in flight per connection; a full queue makes callers wait (back-pressure).
pub const IN_FLIGHT_MAX: usize = 256;
/// Frames or bytes gathered into one socket write.
const BATCH_FRAMES_MAX: usize = 64;
const WRITE_BUFFER_BYTES: usize = 256 << 10;
pub(crate) const READ_BUFFER_BYTES: usize = 256 << 10;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    #[error("cannot connect to {address}: {reason}")]
    Connect { address: String, reason: String },
    #[error("connection to {0} lost")]
    Closed(String),
    #[error("{message}")]
    Remote { status: Status, message: String },
    #[error("bad reply from {address}: {reason}")]
    BadReply { address: String, reason: String },
}

type Pending = Arc<Mutex<BTreeMap<u64, oneshot::Sender<Frame>>>>;

pub struct Connection {
    address: String,
    outgoing: mpsc::Sender<Frame>,
    pending: Pending,
    next_request_id: AtomicU64,
    closed: Arc<AtomicBool>,
}

impl Connection {
    /// Connects and performs the version handshake, with TLS if this process runs
    /// with it.
    pub async fn connect(address: &str) -> Result<Arc<Connection>, CallError> {
        Connection::connect_with(address, crate::tls::installed()).await
    }

    /// [`Connection::connect`] as the holder of `tls` (plain TCP if `None`).
    pub async fn connect_with(
        address: &str,
        tls: Option<&crate::tls::Tls>,
    ) -> Result<Arc<Connection>, CallError> {
        let connect_error = |reason: String| CallError::Connect {
            address: address.to_string(),
            reason,
        };
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
            .await
            .map_err(|_| connect_error("timed out".into()))?
            .map_err(|e| connect_error(e.to_string()))?;
        stream.set_nodelay(true).ok();
        let halves = crate::tls::connect(stream, tls)
            .await
            .map_err(|e| connect_error(format!("TLS handshake failed: {e}")))?;
        let integrity = halves.integrity;
        // Buffered so a burst of small replies costs one recv, not two per frame.
        let mut read_half = BufReader::with_capacity(READ_BUFFER_BYTES, halves.read);
        let (outgoing, outgoing_rx) = mpsc::channel(IN_FLIGHT_MAX);
        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        // Why the connection dropped: a TLS server refusing this process's certificate
        // says so only in the alert that ends the first read.
        let dropped: Arc<OnceLock<String>> = Arc::default();
        tokio::spawn(write_loop(
            halves.write,
            integrity,
            outgoing_rx,
            closed.clone(),
        ));
        let reader_pending = pending.clone();
        let reader_closed = closed.clone();
        let peer = address.to_string();
        let reader_dropped = dropped.clone();
        tokio::spawn(async move {
            let reason = loop {
                match Frame::read(&mut read_half, integrity).await {
                    Ok(frame) => {
                        let waiter = reader_pending.lock().unwrap().remove(&frame.request_id);
                        if let Some(waiter) = waiter {
                            let _ = waiter.send(frame);
                        }
                    }
                    Err(e) => break e,
                }
            };
            if !matches!(reason, FrameError::Closed) {
                tracing::warn!(%peer, "connection dropped: {reason}");
                let _ = reader_dropped.set(reason.to_string());
            }
            // Order matters: callers check `closed` after registering, so setting it
            // before draining leaves no caller waiting forever.
            reader_closed.store(true, Ordering::SeqCst);
            reader_pending.lock().unwrap().clear();
        });
        let connection = Arc::new(Connection {
            address: address.to_string(),
            outgoing,
            pending,
            next_request_id: AtomicU64::new(1),
            closed,
        });
        match connection
            .call(Request::Hello {
                version: PROTOCOL_VERSION,
            })
            .await
        {
            Ok(Response::Hello { version }) if version == PROTOCOL_VERSION => Ok(connection),
            Ok(other) => Err(connect_error(format!(
                "unexpected handshake reply {other:?}"
            ))),
            Err(CallError::Remote { message, .. }) => Err(connect_error(message)),
            Err(e) => Err(connect_error(match (dropped.get(), tls) {
                (Some(reason), _) => reason.clone(),
                // A TLS server closes a connection that does not start with TLS.
                (None, None) => format!("{e} (if the cluster runs TLS, give --ca and --cert)"),
                (None, Some(_)) => e.to_string(),
            })),
        }
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Sends one request and waits for its reply. An error reply becomes
    /// `CallError::Remote`.
    pub async fn call(&self, request: Request) -> Result<Response, CallError> {
        let kind = request.kind();
        let frame = self.call_frame(|id| request.encode(id)).await?;
        if frame.kind != kind {
            return Err(CallError::BadReply {
                address: self.address.clone(),
                reason: format!("reply kind {} to a request of kind {kind}", frame.kind),
            });
        }
        match Response::decode(frame) {
            Ok(Response::Error { status, message }) => Err(CallError::Remote { status, message }),
            Ok(response) => Ok(response),
            Err(e) => Err(CallError::BadReply {
                address: self.address.clone(),
                reason: e.to_string(),
            }),
        }
    }

    /// Sends the frame `encode` makes with a fresh request id and waits for the
    /// reply's frame: for messages other than [`Request`]'s (`crate::transaction`).
    pub async fn call_frame(&self, encode: impl FnOnce(u64) -> Frame) -> Result<Frame, CallError> {
        let request_id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(request_id, tx);
        if self.is_closed() {
            self.pending.lock().unwrap().remove(&request_id);
            return Err(CallError::Closed(self.address.clone()));
        }
        if self.outgoing.send(encode(request_id)).await.is_err() {
            self.pending.lock().unwrap().remove(&request_id);
            return Err(CallError::Closed(self.address.clone()));
        }
        rx.await
            .map_err(|_| CallError::Closed(self.address.clone()))
    }
}

/// Drains queued frames into one buffered write per batch, so many small requests
/// cost one syscall.
pub(crate) async fn write_loop<W: tokio::io::AsyncWrite + Unpin>(
    writer: W,
    integrity: Integrity,
    mut frames: mpsc::Receiver<Frame>,
    closed: Arc<AtomicBool>,
) {
    let mut writer = BufWriter::with_capacity(WRITE_BUFFER_BYTES, writer);
    let mut head = BytesMut::with_capacity(4096);
    while let Some(first) = frames.recv().await {
        let mut next = Some(first);
        let mut batched = 0;
        let mut result = Ok(());
        while let Some(frame) = next.take() {
            head.clear();
            frame.encode_head(&mut head, integrity);
            result = writer.write_all(&head).await;
            if result.is_ok() && !frame.data.is_empty() {
                result = writer.write_all(&frame.data).await;
            }
            batched += 1;
            if result.is_err() || batched == BATCH_FRAMES_MAX {
                break;
            }
            next = frames.try_recv().ok();
        }
        if result.is_ok() {
            result = writer.flush().await;
        }
        if let Err(e) = result {
            tracing::debug!("write failed: {e}");
            closed.store(true, Ordering::SeqCst);
            return;
        }
    }
}

/// Connections to many peers over TCP, opened on first use and reopened after a
/// failure: the transport of real processes.
#[derive(Default)]
pub struct TcpTransport {
    connections: Mutex<BTreeMap<String, Arc<Connection>>>,
}

impl TcpTransport {
    async fn get(&self, address: &str) -> Result<Arc<Connection>, CallError> {
        if let Some(c) = self.connections.lock().unwrap().get(address) {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let fresh = Connection::connect(address).await?;
        let mut connections = self.connections.lock().unwrap();
        let entry = connections
            .entry(address.to_string())
            .or_insert_with(|| fresh.clone());
        if entry.is_closed() {
            *entry = fresh;
        }
        Ok(entry.clone())
    }
}

impl Transport for TcpTransport {
    /// One call, with one reconnect if the pooled connection had died meanwhile.
    fn call<'a>(&'a self, address: &'a str, request: Request) -> CallFuture<'a> {
        Box::pin(async move {
            let connection = self.get(address).await?;
            match connection.call(request.clone()).await {
                Err(CallError::Closed(_)) => self.get(address).await?.call(request).await,
                other => other,
            }
        })
    }

    fn forget(&self, address: &str) {
        self.connections.lock().unwrap().remove(address);
    }
}
