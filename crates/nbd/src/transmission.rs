//! The transmission-phase request loop: reads requests, runs each as its own task so
//! many are in flight, and hands replies to the connection's writer task.
//!
//! Everything is bounded: at most `MAX_IN_FLIGHT` requests and `MAX_IN_FLIGHT_BYTES`
//! of READ/WRITE data per connection, counted from the request header until its reply
//! is written. When the budget is spent the loop stops reading the socket, which is
//! the back-pressure a slow device or a client that does not read replies gets.

use crate::closing::Closing;
use crate::command::{Command, Header};
use crate::handover::Stop;
use crate::handshake::Session;
use crate::input::Input;
use crate::proto::*;
use crate::reply::Reply;
use crate::writer::{self, Outgoing};
use bytes::Bytes;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

const MAX_IN_FLIGHT: usize = 128;
const MAX_IN_FLIGHT_BYTES: usize = 128 << 20;
/// A WRITE longer than MAX_BLOCK but at most this is read and discarded so the
/// connection survives an EINVAL; anything longer is not worth the bandwidth.
const MAX_DRAINED_WRITE: u32 = 4 * MAX_BLOCK;
/// How long a stopping server waits for a client's in-flight replies to go out, so a
/// client that stopped reading them cannot hold the shutdown up forever.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// A request's share of the connection's in-flight limits, released on drop.
pub(crate) struct Budget {
    _request: OwnedSemaphorePermit,
    _bytes: Option<OwnedSemaphorePermit>,
}

/// Serves requests until the client disconnects, sends NBD_CMD_DISC, violates the
/// protocol, or `stop` says so. In-flight requests are answered before the socket is
/// closed (within `SHUTDOWN_GRACE` once stopping). On [`Stop::Handover`] reading stops
/// at a request boundary and, every reply sent, the connection's pieces come back
/// open: `Some`. When `closing` names the export, reading stops at a request
/// boundary too, and the connection closes once every reply is sent.
pub(crate) async fn serve<R, W>(
    mut input: Input<R>,
    socket: W,
    session: Session,
    mut stop: watch::Receiver<Option<Stop>>,
    closing: Closing,
) -> io::Result<Option<(Input<R>, W, Arc<Session>)>>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (replies, replies_rx) = mpsc::channel(MAX_IN_FLIGHT);
    let mut writer = tokio::spawn(writer::run(socket, replies_rx).in_current_span());
    let session = Arc::new(session);
    // Shutting down may interrupt the loop anywhere, even mid-payload: the request
    // being read is dropped, the ones already running still get their replies.
    let read = tokio::select! {
        read = read_requests(&mut input, session.clone(), &replies, stop.clone(), closing) => read,
        _ = stop.wait_for(|stop| *stop == Some(Stop::Shutdown)) => Ok(Ended::Closed),
    };
    drop(replies);
    let grace_over = async {
        // A closed sender also means shutdown: the server is gone.
        let _ = stop.wait_for(Option::is_some).await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    let written = tokio::select! {
        written = &mut writer => written.map_err(io::Error::other)?,
        _ = grace_over => {
            writer.abort();
            Err(io::Error::new(io::ErrorKind::TimedOut, "replies still unsent at shutdown"))
        }
    };
    let mut socket = written?;
    match read? {
        Ended::Parked => Ok(Some((input, socket, session))),
        Ended::Closed => {
            socket.shutdown().await?;
            Ok(None)
        }
    }
}

/// Why the request loop ended.
enum Ended {
    /// The client left, or the server shuts down.
    Closed,
    /// At a request boundary, for a handover.
    Parked,
}

async fn read_requests<R: AsyncRead + Unpin>(
    input: &mut Input<R>,
    session: Arc<Session>,
    replies: &mpsc::Sender<Outgoing>,
    mut stop: watch::Receiver<Option<Stop>>,
    closing: Closing,
) -> io::Result<Ended> {
    // `closing` stays alive with its receiver: a dropped sender would end the wait.
    let mut closed = closing.subscribe();
    let requests = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let bytes = Arc::new(Semaphore::new(MAX_IN_FLIGHT_BYTES));
    loop {
        // Only here, between requests, may a handover stop the loop: a header read
        // in part stays buffered in `input` (reading is cancel-safe).
        let header = tokio::select! {
            // The writer failed (client gone): nobody would see more replies.
            _ = replies.closed() => return Ok(Ended::Closed),
            _ = stop.wait_for(|stop| *stop == Some(Stop::Handover)) => return Ok(Ended::Parked),
            Ok(_) = closed.wait_for(|closed| closed.contains_key(&session.name)) => {
                tracing::info!(export = %session.name, "the export is closing here (moved): disconnecting the client once its replies are sent");
                return Ok(Ended::Closed);
            }
            header = input.message(Header::LEN) => match header? {
                Some(header) => Header::parse(header)?,
                None => {
                    tracing::debug!("client closed the connection");
                    return Ok(Ended::Closed);
                }
            },
        };
        if header.kind == CMD_DISC {
            tracing::debug!("client disconnected");
            return Ok(Ended::Closed);
        }
        let request = requests
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        let data_len = match header.kind {
            CMD_READ | CMD_WRITE if header.length <= MAX_BLOCK => header.length,
            _ => 0,
        };
        let byte_permit = match data_len {
            0 => None,
            n => Some(
                bytes
                    .clone()
                    .acquire_many_owned(n)
                    .await
                    .expect("never closed"),
            ),
        };
        let budget = Budget {
            _request: request,
            _bytes: byte_permit,
        };

        let mut payload = Bytes::new();
        if header.kind == CMD_WRITE {
            if header.length > MAX_DRAINED_WRITE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("write of {} bytes", header.length),
                ));
            }
            if data_len == 0 {
                input.skip(header.length as u64).await?;
            } else {
                payload = input.take(data_len as usize).await?.freeze();
            }
        }

        let handle = header.handle;
        match Command::parse(&header, payload, &session) {
            Err(rejected) => {
                tracing::debug!(handle, kind = header.kind, "rejected: {}", rejected.message);
                let reply =
                    Reply::error(handle, session.structured, rejected.error, rejected.message);
                if replies.send(Outgoing { reply, budget }).await.is_err() {
                    return Ok(Ended::Closed);
                }
            }
            Ok(command) => {
                let session = session.clone();
                let replies = replies.clone();
                let run = async move {
                    let reply = command.apply(handle, &session).await;
                    // Fails only when the writer is gone, i.e. the client is.
                    let _ = replies.send(Outgoing { reply, budget }).await;
                };
                tokio::spawn(run.in_current_span());
            }
        }
    }
}
