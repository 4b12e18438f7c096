//! The accept loop: one task per client, each isolated from the others, and a
//! graceful stop that lets attached clients finish their in-flight requests.

use crate::input::Input;
use crate::{handshake, transmission, Exports};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
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
pub async fn serve(listener: TcpListener, exports: Arc<dyn Exports>, shutdown: impl Future) {
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
                    let client = serve_client(stream, exports.clone(), stopped.clone());
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
    mut stop: watch::Receiver<bool>,
) {
    // Replies are already batched; Nagle would only delay them.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!("cannot set TCP_NODELAY: {e}");
    }
    let (read, mut write) = stream.into_split();
    let mut input = Input::new(read);
    let negotiated = tokio::select! {
        negotiated = handshake::negotiate(&mut input, &mut write, exports.as_ref()) => negotiated,
        _ = stop.wait_for(|stop| *stop) => return,
    };
    let session = match negotiated {
        Ok(Some(session)) => session,
        Ok(None) => return tracing::debug!("client left during the handshake"),
        Err(e) => return tracing::warn!("NBD handshake failed: {e}"),
    };
    tracing::info!(export = %session.name, structured = session.structured, "client attached");
    match transmission::serve(input, write, session, stop).await {
        Ok(()) => tracing::debug!("client detached"),
        Err(e) => tracing::warn!("NBD connection dropped: {e}"),
    }
}
