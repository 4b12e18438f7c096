//! The accept loop: one task per client, each isolated from the others, and a
//! graceful stop that lets attached clients finish their in-flight requests, or parks
//! them for the next process (see `handover`).

use crate::handover::{Handover, Parked, Stop};
use crate::handshake::{Negotiated, Session};
use crate::input::Input;
use crate::security::{Security, Transport};
use crate::{handshake, psk, transmission, Client, Closing, Exports};
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument;

/// Serves NBD clients on `listener`, and on the `resumed` connections a previous
/// process parked, until `stop` completes. Then it stops accepting and tells attached
/// clients to stop reading requests; once every client's in-flight requests are
/// answered it returns: with [`Stop::Shutdown`] every connection is closed (`None`),
/// with [`Stop::Handover`] the plain ones are parked and returned with the listener.
///
/// A failing client (malformed input, disconnect mid-request) is logged and dropped;
/// it never affects other clients or the accept loop.
pub async fn serve(
    listener: TcpListener,
    exports: Arc<dyn Exports>,
    security: Security,
    resumed: Vec<Parked>,
    stop: impl Future<Output = Stop>,
) -> Option<Handover> {
    let (stopping, stopped) = watch::channel(None);
    let mut clients = JoinSet::new();
    for parked in resumed {
        let span = tracing::info_span!("nbd", export = parked.export().to_string());
        let client = resume_client(parked, exports.clone(), stopped.clone());
        clients.spawn(client.instrument(span));
    }
    tokio::pin!(stop);
    let how = loop {
        tokio::select! {
            how = &mut stop => break how,
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
    };
    let _ = stopping.send(Some(how));
    let mut connections = Vec::new();
    while let Some(finished) = clients.join_next().await {
        match finished {
            Ok(Some(parked)) => connections.push(parked),
            Ok(None) => {}
            Err(e) => tracing::error!("NBD client task failed: {e}"),
        }
    }
    if how == Stop::Shutdown {
        return None;
    }
    match listener.into_std() {
        Ok(listener) => Some(Handover {
            listener,
            connections,
        }),
        Err(e) => {
            tracing::error!("cannot hand the listening socket over: {e}");
            None
        }
    }
}

/// A connection after its handshake, plain or TLS.
enum Attached {
    Plain(Input<OwnedReadHalf>, OwnedWriteHalf, Session),
    Tls(Input<Reader>, Writer, Session),
}

async fn serve_client(
    stream: TcpStream,
    exports: Arc<dyn Exports>,
    transport: Transport,
    mut stop: watch::Receiver<Option<Stop>>,
) -> Option<Parked> {
    // Replies are already batched; Nagle would only delay them.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!("cannot set TCP_NODELAY: {e}");
    }
    let closing = exports.closing();
    let negotiated = tokio::select! {
        negotiated = handshake(stream, exports.as_ref(), transport) => negotiated,
        _ = stop.wait_for(Option::is_some) => return None,
    };
    let attached = match negotiated {
        Ok(Some(attached)) => attached,
        Ok(None) => {
            tracing::debug!("client left during the handshake");
            return None;
        }
        Err(e) => {
            tracing::warn!("NBD handshake failed: {e}");
            return None;
        }
    };
    match attached {
        Attached::Plain(input, write, session) => {
            tracing::info!(export = %session.name, structured = session.structured, tls = false, "client attached");
            let (input, write, session) = transmit(input, write, session, stop, closing).await?;
            park(input, write, &session)
        }
        Attached::Tls(input, write, session) => {
            tracing::info!(export = %session.name, structured = session.structured, tls = true, "client attached");
            let (_, mut write, _) = transmit(input, write, session, stop, closing).await?;
            tracing::info!("a TLS connection cannot be handed over: disconnecting the client");
            let _ = write.shutdown().await;
            None
        }
    }
}

/// The request loop of an attached connection; its pieces if it was parked.
async fn transmit<R, W>(
    input: Input<R>,
    write: W,
    session: Session,
    stop: watch::Receiver<Option<Stop>>,
    closing: Closing,
) -> Option<(Input<R>, W, Arc<Session>)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    match transmission::serve(input, write, session, stop, closing).await {
        Ok(None) => tracing::debug!("client detached"),
        Ok(Some(parked)) => return Some(parked),
        Err(e) => tracing::warn!("NBD connection dropped: {e}"),
    }
    None
}

fn park(input: Input<OwnedReadHalf>, write: OwnedWriteHalf, session: &Session) -> Option<Parked> {
    Parked::new(input, write, session)
        .map_err(|e| tracing::warn!("cannot park the connection: {e}"))
        .ok()
}

/// A connection a previous process parked, served on.
async fn resume_client(
    parked: Parked,
    exports: Arc<dyn Exports>,
    stop: watch::Receiver<Option<Stop>>,
) -> Option<Parked> {
    let (input, write, session) = match parked.resume(exports.as_ref()).await {
        Ok(resumed) => resumed,
        Err(e) => {
            tracing::error!("a handed-over client is lost: {e}");
            return None;
        }
    };
    tracing::info!(export = %session.name, "client handed over from the previous process");
    let closing = exports.closing();
    let (input, write, session) = transmit(input, write, session, stop, closing).await?;
    park(input, write, &session)
}

type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// A connection after STARTTLS, whichever TLS stack serves it.
trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<S: AsyncRead + AsyncWrite + Send + Unpin> Stream for S {}

/// Greeting and option haggling, over TLS from STARTTLS on; `None` if the client left.
async fn handshake(
    stream: TcpStream,
    exports: &dyn Exports,
    mut transport: Transport,
) -> io::Result<Option<Attached>> {
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
        Negotiated::Session(session) => return Ok(Some(Attached::Plain(input, write, session))),
        Negotiated::StartTls => {}
    }
    let (stream, client) = start_tls(input.into_inner()?, write, &transport).await?;
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
            Ok(Some(Attached::Tls(input, Box::new(write), session)))
        }
        Negotiated::Left => Ok(None),
        Negotiated::StartTls => unreachable!("STARTTLS over TLS is refused"),
    }
}

const TLS_READ_BUFFER_BYTES: usize = 256 << 10;

/// The server's side of the TLS handshake after STARTTLS, and who the client proved
/// to be. The ClientHello decides between a pre-shared key (OpenSSL) and X.509
/// (rustls); the chosen stack then reads it again.
async fn start_tls(
    mut read: OwnedReadHalf,
    write: OwnedWriteHalf,
    transport: &Transport,
) -> io::Result<(Box<dyn Stream>, Client)> {
    let hello = psk::read_first_record(&mut read).await?;
    // TLS stacks read the socket a record (rustls: 4 KiB) at a time: buffered, a
    // 1 MiB write costs a few recv calls instead of hundreds.
    let read = tokio::io::BufReader::with_capacity(TLS_READ_BUFFER_BYTES, read);
    let stream = tokio::io::join(std::io::Cursor::new(hello.clone()).chain(read), write);
    if let Some(keys) = transport.psk.as_ref().filter(|keys| keys.offered(&hello)) {
        let (stream, identity) = keys.accept(stream).await?;
        let client = Client {
            psk_identity: Some(identity),
            tls: true,
            ..Client::default()
        };
        return Ok((Box::new(stream), client));
    }
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
    Ok((Box::new(stream), client))
}
