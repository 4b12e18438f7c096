//! The seam between the processes and the network: every call a process makes to
//! another goes through a [`Transport`]. Real processes use TCP
//! ([`crate::connection::TcpTransport`]); the deterministic simulator (`crates/sim`)
//! delivers the same requests to in-process handlers through a network it controls.

use crate::connection::{CallError, TcpTransport};
use crate::message::{Request, Response};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub type CallFuture<'a> = Pin<Box<dyn Future<Output = Result<Response, CallError>> + Send + 'a>>;

pub trait Transport: Send + Sync + 'static {
    /// Sends one request to the process at `address` and waits for its reply.
    fn call<'a>(&'a self, address: &'a str, request: Request) -> CallFuture<'a>;
    /// Forgets any connection to `address`: the next call starts afresh.
    fn forget(&self, address: &str);
}

/// A process's calls to its peers, over its transport (TCP unless given another).
/// Cheap to clone: clones share connections.
#[derive(Clone)]
pub struct ConnectionPool {
    transport: Arc<dyn Transport>,
}

impl Default for ConnectionPool {
    fn default() -> ConnectionPool {
        ConnectionPool::over(Arc::new(TcpTransport::default()))
    }
}

impl ConnectionPool {
    pub fn over(transport: Arc<dyn Transport>) -> ConnectionPool {
        ConnectionPool { transport }
    }

    pub async fn call(&self, address: &str, request: Request) -> Result<Response, CallError> {
        self.transport.call(address, request).await
    }

    /// A call that fails as `Closed` when no answer comes within `limit`. The
    /// connection is then forgotten: a peer cut off by the network never answers on
    /// it, and TCP may take many minutes to declare it dead, so the next call starts
    /// afresh.
    pub async fn call_within(
        &self,
        address: &str,
        request: Request,
        limit: Duration,
    ) -> Result<Response, CallError> {
        match tokio::time::timeout(limit, self.call(address, request)).await {
            Ok(reply) => reply,
            Err(_) => {
                self.transport.forget(address);
                Err(CallError::Closed(format!(
                    "{address} (no answer within {limit:?})"
                )))
            }
        }
    }
}
