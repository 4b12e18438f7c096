//! The one task that owns a connection's write half: it takes replies as requests
//! finish and sends every reply that is ready with a single vectored write.

use crate::reply::{Reply, Segments};
use crate::transmission::Budget;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Stop collecting more replies into one write past this many bytes, so the first
/// reply of a batch is not held back by a long tail.
const MAX_BATCH_BYTES: usize = 1 << 20;

/// A reply and the in-flight budget its request holds until the reply is on the wire.
pub(crate) struct Outgoing {
    pub(crate) reply: Reply,
    pub(crate) budget: Budget,
}

/// Writes replies until every sender is gone, then gives the socket back (to be shut
/// down, or handed over).
pub(crate) async fn run<W: AsyncWrite + Unpin>(
    mut socket: W,
    mut replies: mpsc::Receiver<Outgoing>,
) -> std::io::Result<W> {
    let mut out = Segments::default();
    let mut budgets = Vec::new();
    while let Some(first) = replies.recv().await {
        first.reply.encode(&mut out);
        budgets.push(first.budget);
        while out.len() < MAX_BATCH_BYTES {
            let Ok(next) = replies.try_recv() else { break };
            next.reply.encode(&mut out);
            budgets.push(next.budget);
        }
        out.seal();
        socket.write_all_buf(&mut out).await?;
        // Only now is the memory of these requests free for new ones.
        budgets.clear();
    }
    Ok(socket)
}
