//! Layers that acknowledge writes before the replicas have them (flush-epoch,
//! log-commit) go on after they are dropped (the last NBD connection closed) until
//! every acknowledged write is durable. This counts them, by volume, so that a gateway
//! stopping, or a new open of the same volume, waits for them.

use std::collections::BTreeMap;
use std::sync::Mutex;
use tokio::sync::Notify;

/// Layers of this process still retiring changes, by volume, and a wake-up for
/// [`drained`].
static LIVE: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());
static RETIRED: Notify = Notify::const_new();

/// Waits until every such layer of the process has retired its changes (a gateway
/// stopping waits for this, so no acknowledged write is dropped).
pub async fn drained() {
    drained_where(|live| live.is_empty()).await
}

/// Waits until no layer of `volume` is left retiring changes. Opening a volume for
/// writing waits for this: its new lease would fence a dropped layer still sending
/// the acknowledged writes of the volume's last connection.
pub async fn drained_volume(volume: &str) {
    drained_where(|live| !live.contains_key(volume)).await
}

async fn drained_where(done: impl Fn(&BTreeMap<String, usize>) -> bool) {
    loop {
        let retired = RETIRED.notified();
        if done(&LIVE.lock().unwrap()) {
            return;
        }
        retired.await;
    }
}

/// Counts a layer's background task among the live ones while it runs (or until its
/// runtime drops it).
pub(crate) struct Live(String);

impl Live {
    pub(crate) fn new(volume: &str) -> Live {
        *LIVE.lock().unwrap().entry(volume.to_string()).or_default() += 1;
        Live(volume.to_string())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let mut live = LIVE.lock().unwrap();
        let count = live.get_mut(&self.0).expect("counted when made");
        *count -= 1;
        if *count == 0 {
            live.remove(&self.0);
        }
        drop(live);
        RETIRED.notify_waiters();
    }
}
