//! The accept loop: one task per client, each isolated from the others, and a
//! graceful stop that lets attached clients finish their in-flight requests.

use crate::handshake::{Negotiated, Session};
use crate::input::Input;
use crate::security::{Security, Transport};
use crate::{handshake, psk, transmission, Client, Exports};
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument;

/// Serves NBD clients on `listener` until `shutdown` completes, then stops accepting,
/// tells attached clients to stop reading requests, and returns once every client's
/// in-flight requests are answered and its connection closed.
///
/// A failing client (malformed input, disconnect mid-request) is logged and dropped;
/// it never affects other clients or the accept loop.
pub async fn serve(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    security: Security,
    shutdown: impl Future,
) {
    let (stop, stopped) = watch::channel(false);
    let mut clients = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(finished) = clients.join_next() => {
                if let Err(e) = finished {
                    tracing::error!("NBD client task failed: {e}");
                }
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let span = tracing::info_span!("nbd", %peer);
                    let transport = security.transport(Some(peer));
                    let client =
                        serve_client(stream, exports.clone(), transport, stopped.clone());
                    clients.spawn(client.instrument(span));
                }
                Err(e) => {
                    // Usually out of file descriptors: back off rather than spin.
                    tracing::warn!("NBD accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    let _ = stop.send(true);
    while let Some(finished) = clients.join_next().await {
        if let Err(e) = finished {
            tracing::error!("NBD client task failed: {e}");
        }
    }
}

async fn serve_client(
    stream: TcpStream,
    exports: Arc<dyn Exports>,
    transport: Transport,
    mut stop: watch::Receiver<bool>,
) {
    // Replies are already batched; Nagle would only delay them.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!("cannot set TCP_NODELAY: {e}");
    }
    let negotiated = tokio::select! {
        negotiated = handshake(stream, exports.as_ref(), transport) => negotiated,
        _ = stop.wait_for(|stop| *stop) => return,
    };
    let (input, write, session, tls) = match negotiated {
        Ok(Some(attached)) => attached,
        Ok(None) => return tracing::debug!("client left during the handshake"),
        Err(e) => return tracing::warn!("NBD handshake failed: {e}"),
    };
    tracing::info!(export = %session.name, structured = session.structured, tls, "client attached");
    match transmission::serve(input, write, session, stop).await {
        Ok(()) => tracing::debug!("client detached"),
        Err(e) => tracing::warn!("NBD connection dropped: {e}"),
    }
}

type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// A connection after STARTTLS, whichever TLS stack serves it.
trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<S: AsyncRead + AsyncWrite + Send + Unpin> Stream for S {}

/// Greeting and option haggling, over TLS from STARTTLS on: the socket's halves, the
/// session, and whether it is TLS; `None` if the client left.
async fn handshake(
    stream: TcpStream,
    exports: &dyn Exports,
    mut transport: Transport,
) -> io::Result<Option<(Input<Reader>, Writer, Session, bool)>> {
    let (read, mut write) = stream.into_split();
    let mut input = Input::new(read);
    let Some(mut state) = handshake::greet(&mut input, &mut write).await? else {
        return Ok(None);
    };
    let plain = Client::default();
    let negotiated = handshake::negotiate(
        &mut input, &mut write, exports, &mut state, &transport, &plain,
    );
    match negotiated.await? {
        Negotiated::Left => return Ok(None),
        Negotiated::Session(session) => {
            let input = input.map(|read| Box::new(read) as Reader);
            return Ok(Some((input, Box::new(write), session, false)));
        }
        Negotiated::StartTls => {}
    }
    let mut read = input.into_inner()?;
    // The ClientHello decides between X.509 (rustls) and a pre-shared key (OpenSSL);
    // the handshake then reads it again.
    let hello = psk::read_first_record(&mut read).await?;
    let stream = tokio::io::join(std::io::Cursor::new(hello.clone()).chain(read), write);
    let (stream, client): (Box<dyn Stream>, Client) = match &transport.psk {
        Some(keys) if keys.offered(&hello) => {
            let (stream, identity) = keys.accept(stream).await?;
            let client = Client {
                psk_identity: Some(identity),
                tls: true,
                ..Client::default()
            };
            (Box::new(stream), client)
        }
        _ => {
            let Some(config) = transport.tls.clone() else {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "the client offered no pre-shared key this server knows, and it has no certificate",
                ));
            };
            let stream = tokio_rustls::TlsAcceptor::from(config)
                .accept(stream)
                .await?;
            let client = Client {
                certificate: stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| c.to_vec()),
                tls: true,
                ..Client::default()
            };
            (Box::new(stream), client)
        }
    };
    let (read, mut write) = tokio::io::split(stream);
    let mut input = Input::new(read);
    state.forget();
    transport.secured = true;
    let negotiated = handshake::negotiate(
        &mut input, &mut write, exports, &mut state, &transport, &client,
    );
    match negotiated.await? {
        Negotiated::Session(session) => {
            let input = input.map(|read| Box::new(read) as Reader);
            Ok(Some((input, Box::new(write), session, true)))
        }
        Negotiated::Left => Ok(None),
        Negotiated::StartTls => unreachable!("STARTTLS over TLS is refused"),
    }
}
