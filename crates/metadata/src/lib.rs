//! The master's metadata store: one trait, two back ends.
//!
//! - [`embedded`]: a single redb file, the zero-setup default for one machine.
//! - [`etcd`]: etcd v3 (Debian's `etcd-server`), the production back end.
//! - [`memory`]: in memory, shared by clones: the deterministic simulator's.
//!
//! Keys are UTF-8 strings with `/`-separated prefixes, values opaque bytes. A batch of
//! operations applies atomically, so the master never leaves half an update behind.
//!
//! Several masters may share an etcd store: they elect one leader ([`Election`]), and
//! the store applies only the leader's batches (each is conditional on its election
//! key), so a deposed master can change nothing.

use async_trait::async_trait;

pub mod embedded;
pub mod etcd;
pub mod memory;

#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("metadata store: {0}")]
    Backend(String),
    #[error("metadata store address {0:?} not understood: use embedded:PATH or etcd://HOST:PORT[,HOST:PORT]/PREFIX")]
    BadAddress(String),
    #[error("this master no longer leads: another was elected (its etcd lease ran out)")]
    Deposed,
}

/// One change in an atomic batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put { key: String, value: Vec<u8> },
    Delete { key: String },
    DeletePrefix { prefix: String },
}

#[async_trait]
pub trait MetaStore: Send + Sync + 'static {
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetaError>;
    /// All pairs whose key starts with `prefix`, in key order.
    async fn scan_prefix(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, MetaError>;
    /// Applies every op or none, with the effect of applying them in order (the last op
    /// touching a key wins).
    async fn apply(&self, ops: Vec<Op>) -> Result<(), MetaError>;
    /// The election of masters sharing this store; `None` where one master owns it.
    fn election(&self) -> Option<std::sync::Arc<dyn Election>> {
        None
    }
}

/// Masters sharing a store elect one leader; the others stand by.
#[async_trait]
pub trait Election: Send + Sync + 'static {
    /// Waits until the master at `address` leads; from then on the store applies its
    /// batches only while it still does. The receiver hears why when it stops leading.
    async fn campaign(
        &self,
        address: &str,
    ) -> Result<tokio::sync::oneshot::Receiver<String>, MetaError>;
    /// The leader's address, when one leads.
    async fn leader(&self) -> Option<String>;
}

/// Opens a store from an address: `embedded:PATH` or `etcd://HOST:PORT[,HOST:PORT]/PREFIX`.
pub async fn open(address: &str) -> Result<Box<dyn MetaStore>, MetaError> {
    if let Some(path) = address.strip_prefix("embedded:") {
        return Ok(Box::new(embedded::EmbeddedStore::open(path.as_ref())?));
    }
    if let Some(rest) = address.strip_prefix("etcd://") {
        let (hosts, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let endpoints: Vec<String> = hosts.split(',').map(|h| format!("http://{h}")).collect();
        return Ok(Box::new(
            etcd::EtcdStore::connect(&endpoints, prefix).await?,
        ));
    }
    Err(MetaError::BadAddress(address.to_string()))
}
