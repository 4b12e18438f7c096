//! Closing one export's connections while the server goes on (the gateway moves the
//! export's volume to another gateway): each connection stops reading at its next
//! request boundary, answers every request it read, and disconnects. Requests the
//! client sent after that were never read, so never run: a client that reconnects
//! (QEMU's `reconnect-delay`) sends them again.

use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;

/// The exports being closed, shared by the server and whoever closes them.
#[derive(Clone, Default)]
pub struct Closing(Arc<watch::Sender<BTreeMap<String, usize>>>);

/// Keeps its export closing (connections that attach meanwhile are closed too)
/// until dropped.
pub struct Closed {
    closing: Closing,
    export: String,
}

impl Closing {
    /// Closes `export`'s connections, and those attaching, until the guard drops.
    pub fn begin(&self, export: &str) -> Closed {
        self.0
            .send_modify(|closing| *closing.entry(export.to_string()).or_default() += 1);
        Closed {
            closing: self.clone(),
            export: export.to_string(),
        }
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<BTreeMap<String, usize>> {
        self.0.subscribe()
    }
}

impl Drop for Closed {
    fn drop(&mut self) {
        self.closing.0.send_modify(|closing| {
            let count = closing.get_mut(&self.export).expect("closing counted");
            *count -= 1;
            if *count == 0 {
                closing.remove(&self.export);
            }
        });
    }
}
