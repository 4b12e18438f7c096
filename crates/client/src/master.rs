//! Typed calls to the master (the leader of several, see `floe_protocol::masters`),
//! over one pooled connection.

use floe_protocol::connection::CallError;
use floe_protocol::{
    ClusterStatus, ConnectionPool, MasterRequest, MasterResponse, Masters, Request, Response,
    Volume, VolumeMap, VolumeSpec, WriteMode,
};
use std::time::Duration;

/// How long a call waits for the master's answer: a gateway cut off from it fails the
/// NBD request or connection with an error instead of waiting out TCP's retransmissions.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub struct MasterClient {
    masters: Masters,
    pool: ConnectionPool,
}

impl MasterClient {
    /// The master at `address`, or the leader of several (`a,b,c`).
    pub fn new(address: &str) -> MasterClient {
        MasterClient::over(address, ConnectionPool::default())
    }

    /// Calls the master, and (through [`MasterClient::pool`]) chunk servers, over
    /// `pool`'s transport.
    pub fn over(address: &str, pool: ConnectionPool) -> MasterClient {
        MasterClient {
            masters: Masters::parse(address),
            pool,
        }
    }

    /// This process's connections, shared with the volumes opened through it.
    pub fn pool(&self) -> &ConnectionPool {
        &self.pool
    }

    /// The addresses as given (`a` or `a,b,c`).
    pub fn address(&self) -> String {
        self.masters.list()
    }

    /// The master that answered last as leader.
    pub fn leader(&self) -> String {
        self.masters.leader().to_string()
    }

    /// One call, failing as `Closed` without an answer within [`CALL_TIMEOUT`].
    pub async fn call(&self, request: MasterRequest) -> Result<MasterResponse, CallError> {
        self.call_within(request, CALL_TIMEOUT).await
    }

    /// One call, failing as `Closed` without an answer within `limit`.
    pub async fn call_within(
        &self,
        request: MasterRequest,
        limit: Duration,
    ) -> Result<MasterResponse, CallError> {
        match self
            .masters
            .call(&self.pool, Request::Master(request), limit)
            .await?
        {
            Response::Master(reply) => Ok(reply),
            other => Err(CallError::BadReply {
                address: self.masters.leader().to_string(),
                reason: format!("{other:?}"),
            }),
        }
    }

    pub async fn create_volume(&self, spec: VolumeSpec) -> Result<Volume, CallError> {
        self.expect_volume(MasterRequest::CreateVolume(spec)).await
    }

    pub async fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<Volume, CallError> {
        self.expect_volume(MasterRequest::ResizeVolume {
            name: name.into(),
            size_bytes,
        })
        .await
    }

    /// Changes a volume's rate limits; `None` keeps one, 0 clears it.
    pub async fn set_qos(
        &self,
        name: &str,
        iops: Option<u64>,
        bytes_per_second: Option<u64>,
    ) -> Result<Volume, CallError> {
        self.expect_volume(MasterRequest::SetQos {
            name: name.into(),
            iops,
            bytes_per_second,
        })
        .await
    }

    pub async fn set_write_mode(&self, name: &str, mode: WriteMode) -> Result<Volume, CallError> {
        self.expect_volume(MasterRequest::SetWriteMode {
            name: name.into(),
            mode,
        })
        .await
    }

    pub async fn delete_volume(&self, name: &str) -> Result<(), CallError> {
        self.call(MasterRequest::DeleteVolume { name: name.into() })
            .await
            .map(drop)
    }

    pub async fn list_volumes(&self) -> Result<Vec<Volume>, CallError> {
        match self.call(MasterRequest::ListVolumes).await? {
            MasterResponse::Volumes { volumes } => Ok(volumes),
            other => Err(self.unexpected(other)),
        }
    }

    pub async fn volume_map(&self, name: &str) -> Result<VolumeMap, CallError> {
        match self
            .call(MasterRequest::GetVolumeMap { name: name.into() })
            .await?
        {
            MasterResponse::VolumeMap(map) => Ok(*map),
            other => Err(self.unexpected(other)),
        }
    }

    pub async fn status(&self) -> Result<ClusterStatus, CallError> {
        match self.call(MasterRequest::Status).await? {
            MasterResponse::Status(status) => Ok(*status),
            other => Err(self.unexpected(other)),
        }
    }

    async fn expect_volume(&self, request: MasterRequest) -> Result<Volume, CallError> {
        match self.call(request).await? {
            MasterResponse::Volume(volume) => Ok(volume),
            other => Err(self.unexpected(other)),
        }
    }

    fn unexpected(&self, reply: MasterResponse) -> CallError {
        CallError::BadReply {
            address: self.masters.leader().to_string(),
            reason: format!("unexpected reply {reply:?}"),
        }
    }
}
