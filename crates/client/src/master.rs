//! Typed calls to the master, over one pooled connection.

use floe_protocol::connection::CallError;
use floe_protocol::{
    ClusterStatus, ConnectionPool, ControlRequest, ControlResponse, Request, Response, Volume,
    VolumeMap, VolumeSpec,
};
use std::time::Duration;

/// How long a call waits for the master's answer: a gateway cut off from it fails the
/// NBD request or connection with an error instead of waiting out TCP's retransmissions.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

pub struct MasterClient {
    address: String,
    pool: ConnectionPool,
}

impl MasterClient {
    pub fn new(address: &str) -> MasterClient {
        MasterClient::over(address, ConnectionPool::default())
    }

    /// Calls the master, and (through [`MasterClient::pool`]) chunk servers, over
    /// `pool`'s transport.
    pub fn over(address: &str, pool: ConnectionPool) -> MasterClient {
        MasterClient {
            address: address.to_string(),
            pool,
        }
    }

    /// This process's connections, shared with the volumes opened through it.
    pub fn pool(&self) -> &ConnectionPool {
        &self.pool
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// One call, failing as `Closed` without an answer within [`CALL_TIMEOUT`].
    pub async fn call(&self, request: ControlRequest) -> Result<ControlResponse, CallError> {
        self.call_within(request, CALL_TIMEOUT).await
    }

    /// One call, failing as `Closed` without an answer within `limit`.
    pub async fn call_within(
        &self,
        request: ControlRequest,
        limit: Duration,
    ) -> Result<ControlResponse, CallError> {
        match self
            .pool
            .call_within(&self.address, Request::Control(request), limit)
            .await?
        {
            Response::Control(reply) => Ok(reply),
            other => Err(CallError::BadReply {
                address: self.address.clone(),
                reason: format!("{other:?}"),
            }),
        }
    }

    pub async fn create_volume(&self, spec: VolumeSpec) -> Result<Volume, CallError> {
        self.expect_volume(ControlRequest::CreateVolume(spec)).await
    }

    pub async fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<Volume, CallError> {
        self.expect_volume(ControlRequest::ResizeVolume {
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
        self.expect_volume(ControlRequest::SetQos {
            name: name.into(),
            iops,
            bytes_per_second,
        })
        .await
    }

    pub async fn delete_volume(&self, name: &str) -> Result<(), CallError> {
        self.call(ControlRequest::DeleteVolume { name: name.into() })
            .await
            .map(drop)
    }

    pub async fn list_volumes(&self) -> Result<Vec<Volume>, CallError> {
        match self.call(ControlRequest::ListVolumes).await? {
            ControlResponse::Volumes { volumes } => Ok(volumes),
            other => Err(self.unexpected(other)),
        }
    }

    pub async fn volume_map(&self, name: &str) -> Result<VolumeMap, CallError> {
        match self
            .call(ControlRequest::GetVolumeMap { name: name.into() })
            .await?
        {
            ControlResponse::VolumeMap(map) => Ok(map),
            other => Err(self.unexpected(other)),
        }
    }

    pub async fn status(&self) -> Result<ClusterStatus, CallError> {
        match self.call(ControlRequest::Status).await? {
            ControlResponse::Status(status) => Ok(*status),
            other => Err(self.unexpected(other)),
        }
    }

    async fn expect_volume(&self, request: ControlRequest) -> Result<Volume, CallError> {
        match self.call(request).await? {
            ControlResponse::Volume(volume) => Ok(volume),
            other => Err(self.unexpected(other)),
        }
    }

    fn unexpected(&self, reply: ControlResponse) -> CallError {
        CallError::BadReply {
            address: self.address.clone(),
            reason: format!("unexpected reply {reply:?}"),
        }
    }
}
