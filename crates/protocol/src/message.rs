//! Requests and responses, and their encoding into [`Frame`]s.
//!
//! Data-path messages (write, read, zero) are packed by hand, little-endian, with the
//! data last so it is never copied behind the fields. Control-plane messages are rare
//! and carry JSON, which keeps them easy to evolve and to debug; those to the master
//! ([`MasterRequest`]) and those to chunk servers ([`ReplicaRequest`]) are separate
//! types with separate frame kinds, so a request cannot be sent to the wrong role.

use crate::frame::{Frame, FrameError, Status};
use crate::types::*;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

pub(crate) const KIND_HELLO: u16 = 1;
const KIND_WRITE: u16 = 2;
const KIND_READ: u16 = 3;
const KIND_ZERO: u16 = 4;
const KIND_MASTER: u16 = 5;
const KIND_REPLICA: u16 = 6;
/// A gateway's transaction service (`crate::transaction`): its own requests, never
/// sent to a master or a chunk server.
pub(crate) const KIND_TRANSACTION: u16 = 7;
const KIND_READ_AS_OF: u16 = 8;
const KIND_READ_RETAINED: u16 = 9;
/// Bits of a write's flags byte.
const WRITE_CATCH_UP: u8 = 1;
const WRITE_UNSYNCED: u8 = 2;
const WRITE_RETAIN: u8 = 4;
/// Bits of a zero's flags byte.
const ZERO_PUNCH: u8 = 1;
const ZERO_RETAIN: u8 = 2;

/// Bounds the backup list a primary will forward to.
pub const FORWARD_MAX: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Hello {
        version: u32,
    },
    /// Writes `data` at `offset` of a chunk replica, and, at a primary, forwards the
    /// same write to the backups in `forward`; the reply means durable on all of them.
    Write {
        chunk: ChunkId,
        stamp: Stamp,
        offset: u64,
        /// The writer's snapshot epoch (`crate::snapshot`); 0 from a writer that is not
        /// a volume's (repair, heal). Along a chunk's history epochs never go back.
        epoch: u32,
        /// Sent again to a replica that refused it for space while others took it:
        /// it may use the room kept for catching up, so the replicas stay equal.
        catch_up: bool,
        /// Acknowledged once the replica logged it, before its sync (write-back): a
        /// power cut of the replica may still take it until a
        /// [`ReplicaRequest::Sync`] covering it returned.
        unsynced: bool,
        /// Each replica keeps the blocks it overwrites first in `epoch` as they were
        /// (for the snapshots before it), in the same change.
        retain: bool,
        forward: Vec<String>,
        data: Bytes,
    },
    /// Reads from this server's replica only, if it holds at least `min_version` and
    /// has taken no change past `max_version` (`u64::MAX`: any; a snapshot's reader
    /// reads the live chunk only as of a version whose overwrites it has seen).
    Read {
        chunk: ChunkId,
        offset: u64,
        length: u32,
        min_version: u64,
        max_version: u64,
    },
    /// Reads a range of this server's replica as snapshot `epoch` has it: each block
    /// from the lowest epoch from `epoch` on that retained it, else from the chunk.
    /// The replica must hold at least `min_version`, a version the reader learned
    /// after the snapshot was taken, and no change past it of an epoch below
    /// `epoch` (an unacknowledged tail the snapshot may or may not come to hold:
    /// `Ahead`, learn the version again).
    ReadAsOf {
        chunk: ChunkId,
        epoch: u32,
        offset: u64,
        length: u32,
        min_version: u64,
    },
    /// The 4 KiB block at `offset` as this replica retained it for snapshot epoch
    /// `epoch` (a repair's copy); `NotFound` when it holds none (freed since).
    ReadRetained {
        chunk: ChunkId,
        epoch: u32,
        offset: u64,
    },
    /// Zeroes a range; `punch` frees the space. Forwarded like a write.
    Zero {
        chunk: ChunkId,
        stamp: Stamp,
        offset: u64,
        length: u64,
        /// As a write's.
        epoch: u32,
        punch: bool,
        /// As a write's.
        retain: bool,
        forward: Vec<String>,
    },
    /// A request to the master.
    Master(MasterRequest),
    /// A control request to a chunk server about one of its replicas.
    Replica(ReplicaRequest),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Hello { version: u32 },
    Done,
    Data(Bytes),
    Master(MasterResponse),
    Replica(ReplicaResponse),
    Error { status: Status, message: String },
}

impl Response {
    pub fn error(status: Status, message: impl Into<String>) -> Response {
        Response::Error {
            status,
            message: message.into(),
        }
    }
}

/// What a chunk server tells the master about itself (`MasterRequest::Register`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Stable across restarts: a server that registers again keeps its id.
    pub uuid: String,
    pub address: String,
    pub host: String,
    pub class: DeviceClass,
    #[serde(default)]
    pub emulated: bool,
    pub capacity_bytes: u64,
}

/// The requests the master serves, from chunk servers, writers and the CLI.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum MasterRequest {
    Register(Registration),
    Heartbeat {
        id: ServerId,
        used_bytes: u64,
        /// Hybrid-mode journal fill; a quota of 0 means no journal.
        #[serde(default)]
        journal_used_bytes: u64,
        #[serde(default)]
        journal_quota_bytes: u64,
        /// Blocks found failing their checksums since the last heartbeat: the
        /// master heals them from good replicas.
        #[serde(default)]
        corrupt_blocks: Vec<(ChunkId, u64)>,
        #[serde(default)]
        fs: Option<FsUsage>,
    },
    CreateVolume(VolumeSpec),
    ListVolumes,
    GetVolumeMap {
        name: String,
    },
    ResizeVolume {
        name: String,
        size_bytes: u64,
    },
    DeleteVolume {
        name: String,
    },
    /// Changes a volume's write mode; it takes effect when the volume is next opened.
    SetWriteMode {
        name: String,
        mode: WriteMode,
    },
    /// Changes a volume's rate limits; `None` keeps a limit as it is, 0 clears it.
    SetQos {
        name: String,
        iops: Option<u64>,
        bytes_per_second: Option<u64>,
    },
    /// Allocates a chunk on first write; idempotent. The writer proposes the
    /// placement it computed from its cluster map; the master records its own (from
    /// the same map when the epochs agree) and the writer refreshes its map if they
    /// differ.
    AllocateChunk {
        volume_id: u64,
        index: u64,
        #[serde(default)]
        proposal: Option<Proposal>,
        /// The writer's snapshot epoch (never past the volume's). The chunk is
        /// `born` in the volume's newest epoch.
        #[serde(default)]
        epoch: u32,
        /// The writer's lease generation: a deposed writer allocates nothing (its
        /// request may arrive after the next writer read the volume's chunks).
        #[serde(default)]
        generation: u32,
    },
    /// The cluster map and the servers not yet in it.
    GetClusterMap,
    /// Adds registered servers that are not in the map yet (all, or those on `hosts`)
    /// as a new layer (mapx) or into the hierarchy (crush).
    ExpandCluster {
        #[serde(default)]
        hosts: Vec<String>,
    },
    /// Points placement group `pg` at `layer` (mapx): its chunks move there.
    RemapPg {
        pg: u32,
        layer: u8,
    },
    /// Moves every placement group off `layer` (mapx), in proportion to the other
    /// layers' weights.
    ShrinkLayer {
        layer: u8,
    },
    /// Makes layers `a` and `b` one (mapx): their placement groups spread over both.
    MergeLayers {
        a: u8,
        b: u8,
    },
    Status,
    /// Takes the single-writer lease of a volume (refused with `Busy` while another
    /// holder's lease is alive).
    AcquireLease {
        name: String,
        holder: String,
        /// Names this attempt: the same attempt again (a resent request) gets the
        /// same grant while it is alive, not a new generation fencing the first.
        #[serde(default)]
        attempt: u64,
    },
    RenewLease {
        name: String,
        generation: u32,
    },
    ReleaseLease {
        name: String,
        generation: u32,
    },
    /// A writer committed without `server` (it failed, lagged or timed out): the
    /// master marks that replica stale and repairs it. Only the holder of the
    /// volume's lease `generation` may: a deposed writer's view is out of date.
    ReportLaggard {
        volume_id: u64,
        index: u64,
        server: ServerId,
        #[serde(default)]
        generation: u32,
    },
    /// An operator declares a chunk server permanently failed.
    MarkLost {
        id: ServerId,
    },
    /// Compares every chunk's replicas and repairs differences.
    Scrub {
        name: String,
    },
    /// Takes snapshot `snapshot` of volume `name`: answered once the writer holding
    /// the volume's lease stamps its writes with the new epoch (or at once if none).
    CreateSnapshot {
        name: String,
        snapshot: String,
    },
    DeleteSnapshot {
        name: String,
        snapshot: String,
    },
    /// A new volume `clone`, writable at once, that reads snapshot `snapshot` of
    /// volume `name` where it has not been written.
    CloneVolume {
        name: String,
        snapshot: String,
        clone: String,
    },
    /// Answered with the volume's [`crate::SnapshotEpochs`] once they differ from
    /// `known`, or after `wait_ms` (the writer of lease `generation` long-polls, so
    /// a new snapshot reaches it at once).
    WatchSnapshotEpochs {
        name: String,
        generation: u32,
        known: crate::SnapshotEpochs,
        wait_ms: u64,
    },
    /// The holder of lease `generation` stamps writes with `epoch` from now on, and
    /// every write of an older epoch has ended.
    ConfirmSnapshotEpoch {
        name: String,
        generation: u32,
        epoch: u32,
    },
    /// Clone `name` no longer reads through to its parent: the holder of its lease
    /// `generation` copied every block it still read from there.
    FlattenVolume {
        name: String,
        generation: u32,
    },
    /// A gateway names itself (`name`, serving NBD at `address`, taking leases as
    /// `holder`) and long-polls for the session moves it takes part in: answered
    /// with [`MasterResponse::Moves`] once they differ from `known`, or after
    /// `wait_ms`. Its polls are how the master knows it is alive.
    GatewayPoll {
        name: String,
        address: String,
        holder: String,
        known: Vec<crate::SessionMove>,
        wait_ms: u64,
    },
    /// Moves volume `name`'s session to gateway `to` (`floe volume move-session`).
    MoveSession {
        name: String,
        to: String,
    },
    /// Who serves volume `name`, once it differs from `known`, or after `wait_ms`.
    WatchSession {
        name: String,
        known: Option<crate::SessionInfo>,
        wait_ms: u64,
    },
}

/// The control requests a chunk server serves about its replicas, from the master,
/// writers and repairing peers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ReplicaRequest {
    /// The replica's view and durable version. A writer taking over a volume sends
    /// its lease `generation`: the server fences older writers of the volume before
    /// it answers, so none of their changes can land after the version it reports
    /// (0: the master asking, no fence).
    ChunkInfo {
        chunk: ChunkId,
        #[serde(default)]
        generation: u32,
    },
    /// Moves the replica to `view` (it then refuses changes stamped with an older
    /// one) and reports its state once its queued changes are durable.
    SetView { chunk: ChunkId, view: u64 },
    /// The ranges changed after `since`, from the journal lite; `NotFound` when it
    /// does not reach back that far.
    LogSince { chunk: ChunkId, since: u64 },
    /// The blocks the replica retained for snapshots with a tag (the retaining
    /// change's version) above `since`: what a repair from `since` copies. Changes in
    /// flight are made durable first.
    RetainedSince { chunk: ChunkId, since: u64 },
    /// The ranges holding data (everything else is a hole).
    Extents { chunk: ChunkId },
    /// GetCost: what reading the block holding `offset` costs this replica now (a
    /// stale reader's replica choice).
    ReadCost { chunk: ChunkId, offset: u64 },
    /// A fingerprint of each 4 KiB block, so that a repair whose source's journal
    /// lite does not reach back copies only the blocks that differ.
    BlockSums { chunk: ChunkId },
    /// Answers once every change the replica acknowledged is durable, if it holds
    /// `version` (`Behind` if not: it lost unsynced changes to a power cut).
    Sync { chunk: ChunkId, version: u64 },
    /// Brings this replica up to date from the replica at `source`, copying at most
    /// `bytes_per_second` (see [`RepairKind`]).
    Repair {
        chunk: ChunkId,
        source: String,
        kind: RepairKind,
        bytes_per_second: u64,
    },
    /// crc32c of the replica's first `length` bytes, with its version and the blocks
    /// that fail their own checksums; and a digest of the blocks it retained that the
    /// snapshots of `readers` may read (every one, without), with those that fail.
    Checksum {
        chunk: ChunkId,
        length: u64,
        #[serde(default)]
        readers: Option<crate::SnapshotReaders>,
    },
    /// Rewrites blocks of this replica that fail their checksums, each from the first
    /// of its sources whose copy checks, while the replica and they stay at `version`.
    Heal {
        chunk: ChunkId,
        version: u64,
        /// (offset of a 4 KiB block, addresses of replicas holding it good)
        blocks: Vec<(u64, Vec<String>)>,
    },
    /// The replica moved elsewhere in `view`: free its data, unless it has joined a
    /// later view since.
    DropChunk { chunk: ChunkId, view: u64 },
}

/// How a repair copies. A copy counts only once the source held still at one version
/// with nothing in flight to the end of it: data read while changes land may hold a
/// change newer than the version the source reported, which a chunk's history may
/// yet leave out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RepairKind {
    /// While writes go on, before a view change freezes the chunk: only a whole copy
    /// is made (an incremental one is small and waits for the freeze), and it
    /// replaces the replica only if the source held still at its end.
    Prefetch,
    /// Incremental when the source's journal lite reaches back to this replica's
    /// version, else a whole copy.
    CatchUp,
    /// A whole copy.
    Whole,
}

impl ReplicaRequest {
    /// The chunk the request is about.
    pub fn chunk(&self) -> ChunkId {
        match self {
            ReplicaRequest::ChunkInfo { chunk, .. }
            | ReplicaRequest::SetView { chunk, .. }
            | ReplicaRequest::LogSince { chunk, .. }
            | ReplicaRequest::RetainedSince { chunk, .. }
            | ReplicaRequest::Extents { chunk }
            | ReplicaRequest::BlockSums { chunk }
            | ReplicaRequest::ReadCost { chunk, .. }
            | ReplicaRequest::Sync { chunk, .. }
            | ReplicaRequest::Repair { chunk, .. }
            | ReplicaRequest::Checksum { chunk, .. }
            | ReplicaRequest::Heal { chunk, .. }
            | ReplicaRequest::DropChunk { chunk, .. } => *chunk,
        }
    }
}

/// One block a replica retained for snapshots (see [`ReplicaRequest::RetainedSince`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetainedInfo {
    pub epoch: u32,
    /// The block's offset in the chunk.
    pub offset: u64,
    /// The version of the change that retained it.
    pub tag: u64,
    /// It was all zeroes (nothing to read).
    pub zeroes: bool,
}

/// A writer's placement of a new chunk, from the cluster map at `epoch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    pub epoch: u64,
    pub layer: u8,
    pub replicas: Vec<ServerId>,
}

/// The master's replies to [`MasterRequest`]s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum MasterResponse {
    Registered {
        id: ServerId,
    },
    HeartbeatAck {
        /// Volumes deleted: the server drops their chunks.
        deleted_volumes: Vec<u64>,
        /// (volume id, current lease generation): older writers are fenced off.
        #[serde(default)]
        leases: Vec<(u64, u32)>,
        /// Every volume that ever had a snapshot: servers free the blocks they
        /// retained that no snapshot reads.
        #[serde(default)]
        snapshots: Vec<crate::SnapshotReaders>,
    },
    Volume(Volume),
    Volumes {
        volumes: Vec<Volume>,
    },
    VolumeMap(Box<VolumeMap>),
    Chunk {
        placement: ChunkPlacement,
        servers: Vec<ServerInfo>,
    },
    Status(Box<ClusterStatus>),
    Done,
    Lease {
        generation: u32,
        term_ms: u64,
        #[serde(default)]
        limits: VolumeLimits,
        #[serde(default)]
        snapshots: crate::SnapshotEpochs,
    },
    Scrub(ScrubReport),
    Snapshot(crate::Snapshot),
    SnapshotEpochs(crate::SnapshotEpochs),
    ClusterMap(Box<ClusterMapInfo>),
    Moves {
        moves: Vec<crate::SessionMove>,
    },
    Session(crate::SessionInfo),
}

/// A chunk server's replies to [`ReplicaRequest`]s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ReplicaResponse {
    Done,
    ChunkInfo {
        view: u64,
        version: u64,
    },
    /// Changed (or, for `Extents`, allocated) ranges as (offset, length), and the
    /// version they bring the chunk to.
    Ranges {
        version: u64,
        ranges: Vec<(u64, u64)>,
        /// Changes after `version` are in flight (handed to the store, not durable).
        #[serde(default)]
        pending: bool,
    },
    /// Per 4 KiB block from the chunk's start to the end of its last extent: 0 for a
    /// hole, else a 64-bit hash of its bytes (never 0); the version they show.
    BlockSums {
        version: u64,
        sums: Vec<u64>,
        /// Changes after `version` are in flight (handed to the store, not durable).
        #[serde(default)]
        pending: bool,
    },
    /// `None` from a store that cannot tell (the files engine).
    ReadCost {
        cost: Option<crate::ReadCost>,
    },
    /// Retained blocks, and the version the replica holds with them.
    Retained {
        version: u64,
        blocks: Vec<RetainedInfo>,
    },
    Repaired {
        version: u64,
        /// Only the ranges the source's journal lite names were copied.
        incremental: bool,
        /// Only the blocks whose fingerprints differ were copied (not incremental).
        #[serde(default)]
        compared: bool,
        bytes: u64,
    },
    Checksum {
        version: u64,
        crc: u32,
        /// Offsets of the blocks that fail their own checksums (read as zeroes for
        /// `crc`).
        #[serde(default)]
        bad: Vec<u64>,
        /// crc32c over the retained blocks asked for: (epoch, offset, and the data's
        /// crc32c, 0 for zeroes, all ones for a block that fails), in order.
        #[serde(default)]
        retained: u32,
        /// (epoch, offset) of the retained blocks that fail their checksums.
        #[serde(default)]
        bad_retained: Vec<(u32, u64)>,
    },
    /// Blocks rewritten by a heal.
    Healed {
        blocks: u64,
    },
}

/// The cluster map as `floe cluster map` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMapInfo {
    pub map: ClusterMap,
    /// Registered servers not in the map: `floe cluster expand` adds them.
    pub pending: Vec<ServerInfo>,
    /// Per layer (mapx) or for the whole map (crush): the placement groups placed
    /// there now.
    pub layers: Vec<LayerInfo>,
}

/// One layer of the cluster map as `floe cluster map` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerInfo {
    pub id: u8,
    pub devices: Vec<ServerId>,
    /// Placement groups created with the layer (MAPX eq. 2), and placed in it now.
    pub pgs_created: u32,
    pub pgs_placed: u32,
    pub removed: bool,
    /// Layers merged into one share this.
    pub timestamp: u64,
}

fn put_chunk(out: &mut BytesMut, chunk: ChunkId) {
    out.put_u64_le(chunk.volume_id);
    out.put_u64_le(chunk.index);
}

fn put_stamp(out: &mut BytesMut, stamp: &Stamp) {
    out.put_u64_le(stamp.view);
    out.put_u64_le(stamp.prev);
    out.put_u64_le(stamp.version);
}

fn put_forward(out: &mut BytesMut, forward: &[String]) {
    out.put_u8(forward.len() as u8);
    for address in forward {
        out.put_u16_le(address.len() as u16);
        out.put_slice(address.as_bytes());
    }
}

/// A bounds-checked reader over a payload: malformed input becomes an error, never a
/// panic, because peers are not trusted.
pub(crate) struct Fields {
    pub(crate) buf: Bytes,
    pub(crate) what: &'static str,
}

impl Fields {
    pub(crate) fn need(&self, n: usize) -> Result<(), FrameError> {
        if self.buf.remaining() < n {
            Err(FrameError::Malformed(self.what))
        } else {
            Ok(())
        }
    }
    pub(crate) fn u8(&mut self) -> Result<u8, FrameError> {
        self.need(1)?;
        Ok(self.buf.get_u8())
    }
    pub(crate) fn u32(&mut self) -> Result<u32, FrameError> {
        self.need(4)?;
        Ok(self.buf.get_u32_le())
    }
    pub(crate) fn u64(&mut self) -> Result<u64, FrameError> {
        self.need(8)?;
        Ok(self.buf.get_u64_le())
    }
    fn chunk(&mut self) -> Result<ChunkId, FrameError> {
        let chunk = ChunkId {
            volume_id: self.u64()?,
            index: self.u64()?,
        };
        if chunk.index >= CHUNK_INDEX_LIMIT {
            return Err(FrameError::Malformed(self.what));
        }
        Ok(chunk)
    }
    fn stamp(&mut self) -> Result<Stamp, FrameError> {
        Ok(Stamp {
            view: self.u64()?,
            prev: self.u64()?,
            version: self.u64()?,
        })
    }
    fn forward(&mut self) -> Result<Vec<String>, FrameError> {
        let count = self.u8()? as usize;
        if count > FORWARD_MAX {
            return Err(FrameError::Malformed(self.what));
        }
        let mut out = Vec::with_capacity(count);
        for _ in 0..count {
            self.need(2)?;
            let len = self.buf.get_u16_le() as usize;
            self.need(len)?;
            let raw = self.buf.split_to(len);
            out.push(
                String::from_utf8(raw.to_vec()).map_err(|_| FrameError::Malformed(self.what))?,
            );
        }
        Ok(out)
    }
    /// The rest of the payload, as JSON.
    fn json<T: serde::de::DeserializeOwned>(&mut self) -> Result<T, FrameError> {
        let value =
            serde_json::from_slice(&self.buf).map_err(|_| FrameError::Malformed(self.what))?;
        self.buf.clear();
        Ok(value)
    }
    pub(crate) fn end(&self) -> Result<(), FrameError> {
        if self.buf.has_remaining() {
            Err(FrameError::Malformed(self.what))
        } else {
            Ok(())
        }
    }
}

impl Request {
    pub fn encode(&self, request_id: u64) -> Frame {
        let mut f = BytesMut::new();
        let mut data = Bytes::new();
        let kind = match self {
            Request::Hello { version } => {
                f.put_u32_le(*version);
                KIND_HELLO
            }
            Request::Write {
                chunk,
                stamp,
                offset,
                epoch,
                catch_up,
                unsynced,
                retain,
                forward,
                data: d,
            } => {
                put_chunk(&mut f, *chunk);
                put_stamp(&mut f, stamp);
                f.put_u64_le(*offset);
                f.put_u32_le(*epoch);
                f.put_u8(
                    (u8::from(*catch_up) * WRITE_CATCH_UP)
                        | (u8::from(*unsynced) * WRITE_UNSYNCED)
                        | (u8::from(*retain) * WRITE_RETAIN),
                );
                put_forward(&mut f, forward);
                data = d.clone();
                KIND_WRITE
            }
            Request::Read {
                chunk,
                offset,
                length,
                min_version,
                max_version,
            } => {
                put_chunk(&mut f, *chunk);
                f.put_u64_le(*offset);
                f.put_u32_le(*length);
                f.put_u64_le(*min_version);
                f.put_u64_le(*max_version);
                KIND_READ
            }
            Request::ReadAsOf {
                chunk,
                epoch,
                offset,
                length,
                min_version,
            } => {
                put_chunk(&mut f, *chunk);
                f.put_u32_le(*epoch);
                f.put_u64_le(*offset);
                f.put_u32_le(*length);
                f.put_u64_le(*min_version);
                KIND_READ_AS_OF
            }
            Request::ReadRetained {
                chunk,
                epoch,
                offset,
            } => {
                put_chunk(&mut f, *chunk);
                f.put_u32_le(*epoch);
                f.put_u64_le(*offset);
                KIND_READ_RETAINED
            }
            Request::Zero {
                chunk,
                stamp,
                offset,
                length,
                epoch,
                punch,
                retain,
                forward,
            } => {
                put_chunk(&mut f, *chunk);
                put_stamp(&mut f, stamp);
                f.put_u64_le(*offset);
                f.put_u64_le(*length);
                f.put_u32_le(*epoch);
                f.put_u8((u8::from(*punch) * ZERO_PUNCH) | (u8::from(*retain) * ZERO_RETAIN));
                put_forward(&mut f, forward);
                KIND_ZERO
            }
            Request::Master(m) => {
                f.extend_from_slice(&serde_json::to_vec(m).expect("master requests serialize"));
                KIND_MASTER
            }
            Request::Replica(r) => {
                f.extend_from_slice(&serde_json::to_vec(r).expect("replica requests serialize"));
                KIND_REPLICA
            }
        };
        Frame {
            kind,
            status: Status::Ok as u16,
            request_id,
            fields: f.freeze(),
            data,
        }
    }

    pub fn decode(frame: Frame) -> Result<Request, FrameError> {
        let what = "request";
        let mut r = Fields {
            buf: frame.fields,
            what,
        };
        let request = match frame.kind {
            KIND_HELLO => Request::Hello { version: r.u32()? },
            KIND_WRITE => {
                let chunk = r.chunk()?;
                let stamp = r.stamp()?;
                let offset = r.u64()?;
                let epoch = r.u32()?;
                let flags = r.u8()?;
                if flags & !(WRITE_CATCH_UP | WRITE_UNSYNCED | WRITE_RETAIN) != 0 {
                    return Err(FrameError::Malformed(r.what));
                }
                let forward = r.forward()?;
                let data = std::mem::take(&mut r.buf);
                Request::Write {
                    chunk,
                    stamp,
                    offset,
                    epoch,
                    catch_up: flags & WRITE_CATCH_UP != 0,
                    unsynced: flags & WRITE_UNSYNCED != 0,
                    retain: flags & WRITE_RETAIN != 0,
                    forward,
                    data,
                }
            }
            KIND_READ => Request::Read {
                chunk: r.chunk()?,
                offset: r.u64()?,
                length: r.u32()?,
                min_version: r.u64()?,
                max_version: r.u64()?,
            },
            KIND_READ_AS_OF => Request::ReadAsOf {
                chunk: r.chunk()?,
                epoch: r.u32()?,
                offset: r.u64()?,
                length: r.u32()?,
                min_version: r.u64()?,
            },
            KIND_READ_RETAINED => Request::ReadRetained {
                chunk: r.chunk()?,
                epoch: r.u32()?,
                offset: r.u64()?,
            },
            KIND_ZERO => {
                let (chunk, stamp, offset, length, epoch) =
                    (r.chunk()?, r.stamp()?, r.u64()?, r.u64()?, r.u32()?);
                let flags = r.u8()?;
                if flags & !(ZERO_PUNCH | ZERO_RETAIN) != 0 {
                    return Err(FrameError::Malformed(r.what));
                }
                Request::Zero {
                    chunk,
                    stamp,
                    offset,
                    length,
                    epoch,
                    punch: flags & ZERO_PUNCH != 0,
                    retain: flags & ZERO_RETAIN != 0,
                    forward: r.forward()?,
                }
            }
            KIND_MASTER => Request::Master(r.json()?),
            KIND_REPLICA => {
                let request: ReplicaRequest = r.json()?;
                if request.chunk().index >= CHUNK_INDEX_LIMIT {
                    return Err(FrameError::Malformed(r.what));
                }
                Request::Replica(request)
            }
            other => return Err(FrameError::UnknownKind(other)),
        };
        r.end()?;
        Ok(request)
    }

    /// The frame kind, echoed by the reply.
    pub fn kind(&self) -> u16 {
        match self {
            Request::Hello { .. } => KIND_HELLO,
            Request::Write { .. } => KIND_WRITE,
            Request::Read { .. } => KIND_READ,
            Request::ReadAsOf { .. } => KIND_READ_AS_OF,
            Request::ReadRetained { .. } => KIND_READ_RETAINED,
            Request::Zero { .. } => KIND_ZERO,
            Request::Master(_) => KIND_MASTER,
            Request::Replica(_) => KIND_REPLICA,
        }
    }
}

impl Response {
    /// Encodes a reply to a request of `kind` (the reply echoes the kind).
    pub fn encode(&self, kind: u16, request_id: u64) -> Frame {
        let mut f = BytesMut::new();
        let mut data = Bytes::new();
        let mut status = Status::Ok;
        match self {
            Response::Hello { version } => f.put_u32_le(*version),
            Response::Done => {}
            Response::Data(d) => data = d.clone(),
            Response::Master(m) => {
                f.extend_from_slice(&serde_json::to_vec(m).expect("master responses serialize"))
            }
            Response::Replica(r) => {
                f.extend_from_slice(&serde_json::to_vec(r).expect("replica responses serialize"))
            }
            Response::Error { status: s, message } => {
                status = *s;
                f.extend_from_slice(message.as_bytes());
            }
        }
        Frame {
            kind,
            status: status as u16,
            request_id,
            fields: f.freeze(),
            data,
        }
    }

    pub fn decode(frame: Frame) -> Result<Response, FrameError> {
        let what = "response";
        if frame.status != Status::Ok as u16 {
            return Ok(Response::Error {
                status: Status::from_u16(frame.status),
                message: String::from_utf8_lossy(&frame.fields).into_owned(),
            });
        }
        let mut r = Fields {
            buf: frame.fields,
            what,
        };
        let response = match frame.kind {
            KIND_HELLO => Response::Hello { version: r.u32()? },
            KIND_WRITE | KIND_ZERO => Response::Done,
            KIND_READ | KIND_READ_AS_OF | KIND_READ_RETAINED => {
                Response::Data(std::mem::take(&mut r.buf))
            }
            KIND_MASTER => Response::Master(r.json()?),
            KIND_REPLICA => Response::Replica(r.json()?),
            other => return Err(FrameError::UnknownKind(other)),
        };
        r.end()?;
        Ok(response)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(request: Request) {
        let mut frame = request.encode(9);
        // A frame read from a socket has the whole payload in `fields`.
        let mut all = BytesMut::from(&frame.fields[..]);
        all.extend_from_slice(&frame.data);
        frame.fields = all.freeze();
        frame.data = Bytes::new();
        assert_eq!(Request::decode(frame).unwrap(), request);
    }

    #[test]
    fn requests_round_trip() {
        let chunk = ChunkId {
            volume_id: 3,
            index: 77,
        };
        roundtrip(Request::Hello { version: 1 });
        let stamp = Stamp {
            view: 2,
            prev: 1 << 32 | 7,
            version: 1 << 32 | 8,
        };
        roundtrip(Request::Write {
            chunk,
            stamp,
            offset: 4096,
            epoch: 3,
            catch_up: true,
            unsynced: false,
            retain: true,
            forward: vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
            data: Bytes::from(vec![5u8; 4096]),
        });
        roundtrip(Request::Write {
            chunk,
            stamp,
            offset: 0,
            epoch: 0,
            catch_up: false,
            unsynced: true,
            retain: false,
            forward: Vec::new(),
            data: Bytes::from(vec![6u8; 512]),
        });
        roundtrip(Request::Read {
            chunk,
            offset: 1,
            length: 2,
            min_version: 3,
            max_version: u64::MAX,
        });
        roundtrip(Request::ReadAsOf {
            chunk,
            epoch: 4,
            offset: 8192,
            length: 4096,
            min_version: 5,
        });
        roundtrip(Request::ReadRetained {
            chunk,
            epoch: 6,
            offset: 4096,
        });
        roundtrip(Request::Zero {
            chunk,
            stamp,
            offset: 0,
            length: 1 << 20,
            epoch: u32::MAX,
            punch: true,
            retain: true,
            forward: vec![],
        });
        roundtrip(Request::Zero {
            chunk,
            stamp,
            offset: 4096,
            length: 512,
            epoch: 1,
            punch: false,
            retain: false,
            forward: vec!["127.0.0.1:3".into()],
        });
        roundtrip(Request::Master(MasterRequest::GetVolumeMap {
            name: "demo".into(),
        }));
        roundtrip(Request::Replica(ReplicaRequest::ChunkInfo {
            chunk,
            generation: 4,
        }));
    }

    #[test]
    fn control_responses_round_trip_under_their_request_kind() {
        let replies = [
            (
                KIND_MASTER,
                Response::Master(MasterResponse::Registered { id: 3 }),
            ),
            (KIND_MASTER, Response::Master(MasterResponse::Done)),
            (
                KIND_REPLICA,
                Response::Replica(ReplicaResponse::Checksum {
                    version: 5,
                    crc: 6,
                    bad: vec![4096],
                    retained: 7,
                    bad_retained: vec![(3, 8192)],
                }),
            ),
            (KIND_REPLICA, Response::Replica(ReplicaResponse::Done)),
        ];
        for (kind, reply) in replies {
            assert_eq!(Response::decode(reply.encode(kind, 1)).unwrap(), reply);
        }
    }

    /// A replica request in a master frame, or the reverse, does not decode: the
    /// server answers it as malformed.
    #[test]
    fn control_requests_do_not_decode_under_the_other_role() {
        let chunk = ChunkId {
            volume_id: 1,
            index: 2,
        };
        let checksum = ReplicaRequest::Checksum {
            chunk,
            length: 4,
            readers: None,
        };
        let replica = Request::Replica(checksum).encode(1);
        let master = Request::Master(MasterRequest::Scrub { name: "v".into() }).encode(2);
        for (frame, kind) in [(replica, KIND_MASTER), (master, KIND_REPLICA)] {
            let misdirected = Frame { kind, ..frame };
            assert!(matches!(
                Request::decode(misdirected),
                Err(FrameError::Malformed("request"))
            ));
        }
    }

    #[test]
    fn chunk_indexes_a_chunk_server_keeps_for_itself_do_not_decode() {
        let read = |index| Request::Read {
            chunk: ChunkId {
                volume_id: 1,
                index,
            },
            offset: 0,
            length: 4096,
            min_version: 0,
            max_version: u64::MAX,
        };
        let extents = |index| {
            Request::Replica(ReplicaRequest::Extents {
                chunk: ChunkId {
                    volume_id: 1,
                    index,
                },
            })
        };
        let requests: [fn(u64) -> Request; 2] = [read, extents];
        for request in requests {
            roundtrip(request(CHUNK_INDEX_LIMIT - 1));
            assert!(matches!(
                Request::decode(request(CHUNK_INDEX_LIMIT).encode(1)),
                Err(FrameError::Malformed(_))
            ));
        }
    }

    #[test]
    fn truncated_fields_are_errors_not_panics() {
        let frame = Request::Read {
            chunk: ChunkId {
                volume_id: 1,
                index: 2,
            },
            offset: 3,
            length: 4,
            min_version: 5,
            max_version: 6,
        }
        .encode(1);
        for cut in 0..frame.fields.len() {
            let truncated = Frame {
                fields: frame.fields.slice(..cut),
                ..frame.clone()
            };
            assert!(Request::decode(truncated).is_err());
        }
        for kind in [KIND_MASTER, KIND_REPLICA] {
            let garbage = Frame {
                kind,
                fields: Bytes::from_static(b"{not json"),
                ..frame.clone()
            };
            assert!(Request::decode(garbage).is_err());
        }
    }
}
