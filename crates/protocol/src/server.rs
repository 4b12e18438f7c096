//! The serving side: accept loop, handshake, and per-connection request dispatch.
//!
//! Each request runs as its own task so replies may return out of order; replies are
//! batched into few socket writes by the same writer as the client side. A malformed
//! frame is logged and answered with an error; a frame whose boundaries are lost
//! (bad magic, absurd length) closes that connection only.

use crate::connection::{write_loop, IN_FLIGHT_MAX, READ_BUFFER_BYTES};
use crate::frame::{Frame, FrameError, Status};
use crate::message::{Request, Response, KIND_HELLO};
use crate::tls::{self, Halves, Identity, Role};
use crate::PROTOCOL_VERSION;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tokio::io::BufReader;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

pub trait Handler: Send + Sync + 'static {
    /// Serves one request (never `Hello`, which the server answers itself).
    fn handle(self: Arc<Self>, request: Request) -> impl Future<Output = Response> + Send;

    /// Whether a peer of `role` may ask `request` (asked only with TLS, where peers
    /// have roles); `Err` says why not.
    fn permits(&self, role: Role, request: &Request) -> Result<(), String>;
}

/// What serves one connection's requests after its `Hello`: a [`Handler`] serves every
/// connection alike; a session of a connection's own (the gateway's transactions)
/// holds what the connection began, and ends with it.
pub trait Session: Send + Sync + 'static {
    type Request: Send + 'static;
    fn decode(frame: Frame) -> Result<Self::Request, FrameError>;
    /// Whether `peer` may ask `request` (asked only with TLS, where peers have
    /// certificates).
    fn permits(&self, peer: &Identity, request: &Self::Request) -> Result<(), String>;
    /// Serves one request: the reply's frame, of `kind` and `request_id`.
    fn serve(
        self: Arc<Self>,
        request: Self::Request,
        kind: u16,
        request_id: u64,
    ) -> impl Future<Output = Frame> + Send;
}

impl<H: Handler> Session for H {
    type Request = Request;
    fn decode(frame: Frame) -> Result<Request, FrameError> {
        Request::decode(frame)
    }
    fn permits(&self, peer: &Identity, request: &Request) -> Result<(), String> {
        Handler::permits(self, peer.role, request)
    }
    async fn serve(self: Arc<Self>, request: Request, kind: u16, request_id: u64) -> Frame {
        self.handle(request).await.encode(kind, request_id)
    }
}

/// Accepts connections until the listener fails.
pub async fn serve<H: Handler>(listener: TcpListener, handler: Arc<H>) -> std::io::Result<()> {
    serve_sessions(listener, move || handler.clone()).await
}

/// Accepts connections until the listener fails, each served by a session `open`
/// makes for it (TLS and roles as [`serve`]'s).
pub async fn serve_sessions<S: Session>(
    listener: TcpListener,
    open: impl Fn() -> Arc<S>,
) -> std::io::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await?;
        stream.set_nodelay(true).ok();
        let handler = open();
        tokio::spawn(async move {
            let (halves, identity) = match tls::accept(stream).await {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(%peer, "refused a connection: {e}");
                    return;
                }
            };
            let peer = Peer {
                address: peer,
                identity,
            };
            if let Err(e) = serve_connection(halves, &peer, handler).await {
                tracing::warn!(%peer, "connection closed: {e}");
            }
        });
    }
}

/// The other end of a served connection.
struct Peer {
    address: SocketAddr,
    /// From its certificate, with TLS.
    identity: Option<Identity>,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.identity {
            Some(identity) => write!(f, "{} ({identity})", self.address),
            None => write!(f, "{}", self.address),
        }
    }
}

async fn serve_connection<S: Session>(
    halves: Halves,
    peer: &Peer,
    handler: Arc<S>,
) -> Result<(), FrameError> {
    let integrity = halves.integrity;
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, halves.read);
    let (replies, replies_rx) = mpsc::channel::<Frame>(IN_FLIGHT_MAX);
    tokio::spawn(write_loop(
        halves.write,
        integrity,
        replies_rx,
        Arc::new(AtomicBool::new(false)),
    ));
    let in_flight = Arc::new(Semaphore::new(IN_FLIGHT_MAX));
    let mut greeted = false;
    loop {
        let frame = match Frame::read(&mut reader, integrity).await {
            Ok(frame) => frame,
            Err(FrameError::Closed) => return Ok(()),
            Err(FrameError::BadCrc { request_id, .. }) => {
                let error = Response::error(Status::BadRequest, "payload crc mismatch");
                tracing::warn!(request_id, "rejected a frame with a bad crc");
                let _ = replies.send(error.encode(0, request_id)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        let (kind, request_id) = (frame.kind, frame.request_id);
        if kind == KIND_HELLO {
            let reply = match Request::decode(frame) {
                Ok(Request::Hello { version }) if version == PROTOCOL_VERSION => {
                    greeted = true;
                    Response::Hello {
                        version: PROTOCOL_VERSION,
                    }
                }
                Ok(Request::Hello { version }) => Response::error(
                    Status::VersionMismatch,
                    format!("protocol version {version} not supported; this server speaks {PROTOCOL_VERSION}: upgrade the older side"),
                ),
                _ => Response::error(Status::BadRequest, "malformed hello"),
            };
            let _ = replies.send(reply.encode(kind, request_id)).await;
            continue;
        }
        if !greeted {
            let error = Response::error(Status::BadRequest, "expected Hello first");
            let _ = replies.send(error.encode(kind, request_id)).await;
            return Err(FrameError::Malformed("handshake"));
        }
        let request = match S::decode(frame) {
            Ok(request) => request,
            Err(e) => {
                tracing::warn!(request_id, "rejected a malformed request: {e}");
                let error = Response::error(Status::BadRequest, e.to_string());
                let _ = replies.send(error.encode(kind, request_id)).await;
                continue;
            }
        };
        if let Some(identity) = &peer.identity {
            if let Err(why) = handler.permits(identity, &request) {
                tracing::warn!(%peer, "refused a request: {why}");
                let error = Response::error(Status::Forbidden, why);
                let _ = replies.send(error.encode(kind, request_id)).await;
                continue;
            }
        }
        let permit = in_flight
            .clone()
            .acquire_owned()
            .await
            .expect("semaphore never closed");
        let handler = handler.clone();
        let replies = replies.clone();
        tokio::spawn(async move {
            let reply = handler.serve(request, kind, request_id).await;
            let _ = replies.send(reply).await;
            drop(permit);
        });
    }
}
