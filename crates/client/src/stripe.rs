//! Striping: one formula for Blizzard's nested striping, URSA's striping groups and
//! RBD's striping v2. The volume is cut into stripe units of `unit` bytes dealt
//! round-robin over `count` chunks; when those chunks are full (`chunk` bytes each),
//! the next `count` chunks start (an object set).

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use floe_blockdev::{check_range, BlockDevice, Extent, IoError};
use floe_protocol::VolumeSpec;

/// Pieces a single extents call walks before answering with what it has.
const EXTENT_PIECES_MAX: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub unit: u64,
    pub count: u64,
    pub chunk: u64,
}

/// A contiguous part of a request that lands in one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub chunk: u64,
    pub chunk_offset: u64,
    pub length: u64,
    /// Offset of the piece from the start of the request.
    pub request_offset: u64,
}

impl Layout {
    pub fn of(spec: &VolumeSpec) -> Layout {
        Layout {
            unit: spec.stripe_unit_bytes,
            count: spec.stripe_count as u64,
            chunk: spec.chunk_bytes,
        }
    }

    /// Chunk index and offset in it of volume byte `offset`, and the bytes left in its
    /// stripe unit.
    pub fn locate(&self, offset: u64) -> (u64, u64, u64) {
        let unit_index = offset / self.unit;
        let within = offset % self.unit;
        let stripe = unit_index / self.count;
        let chunk_in_set = unit_index % self.count;
        let units_per_chunk = self.chunk / self.unit;
        let set = stripe / units_per_chunk;
        let stripe_in_chunk = stripe % units_per_chunk;
        (
            set * self.count + chunk_in_set,
            stripe_in_chunk * self.unit + within,
            self.unit - within,
        )
    }

    /// Splits `[offset, offset + length)` into per-chunk pieces, in volume order.
    pub fn pieces(&self, offset: u64, length: u64) -> impl Iterator<Item = Piece> + '_ {
        let mut done = 0;
        std::iter::from_fn(move || {
            if done >= length {
                return None;
            }
            let (chunk, chunk_offset, left) = self.locate(offset + done);
            let piece = Piece {
                chunk,
                chunk_offset,
                length: left.min(length - done),
                request_offset: done,
            };
            done += piece.length;
            Some(piece)
        })
    }
}

/// A contiguous range of one chunk that a request touches, gathered from its pieces:
/// a request spanning several stripes costs one chunk request per chunk, not one per
/// stripe unit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub chunk: u64,
    pub chunk_offset: u64,
    pub length: u64,
    /// (offset in the request, length) of each piece, in chunk order.
    pub parts: Vec<(u64, u64)>,
}

impl Layout {
    /// The pieces of `[offset, offset + length)` merged into runs, in volume order of
    /// their first piece.
    pub fn runs(&self, offset: u64, length: u64) -> Vec<Run> {
        let mut runs: Vec<Run> = Vec::new();
        for piece in self.pieces(offset, length) {
            // The run a piece continues is among the last `count` (one per chunk).
            match runs
                .iter_mut()
                .rev()
                .take(self.count as usize)
                .find(|r| r.chunk == piece.chunk && r.chunk_offset + r.length == piece.chunk_offset)
            {
                Some(run) => {
                    run.length += piece.length;
                    run.parts.push((piece.request_offset, piece.length));
                }
                None => runs.push(Run {
                    chunk: piece.chunk,
                    chunk_offset: piece.chunk_offset,
                    length: piece.length,
                    parts: vec![(piece.request_offset, piece.length)],
                }),
            }
        }
        runs
    }
}

/// Chunk-addressed I/O: what the striping layer needs from the layer below.
#[async_trait]
pub trait ChunkIo: Send + Sync + 'static {
    async fn read(&self, chunk: u64, offset: u64, length: u32) -> Result<Bytes, IoError>;
    /// `fua` as in [`BlockDevice::write`].
    async fn write(&self, chunk: u64, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError>;
    async fn zero(&self, chunk: u64, offset: u64, length: u64, punch: bool) -> Result<(), IoError>;
    /// Makes every write that completed before this call durable.
    async fn flush(&self) -> Result<(), IoError>;
    fn is_allocated(&self, chunk: u64) -> bool;
}

/// A volume as a block device over its chunks.
pub struct Striped<C> {
    layout: Layout,
    size: u64,
    chunks: C,
}

impl<C: ChunkIo> Striped<C> {
    pub fn new(layout: Layout, size: u64, chunks: C) -> Self {
        Striped {
            layout,
            size,
            chunks,
        }
    }

    /// Zeroes a range, one request per run: a whole-device discard becomes one request
    /// per chunk, not one per stripe unit.
    async fn zero(&self, offset: u64, length: u64, punch: bool) -> Result<(), IoError> {
        check_range(self.size, offset, length)?;
        let requests = self
            .layout
            .runs(offset, length)
            .into_iter()
            .map(|r| self.chunks.zero(r.chunk, r.chunk_offset, r.length, punch));
        futures::future::try_join_all(requests).await.map(drop)
    }
}

#[async_trait]
impl<C: ChunkIo> BlockDevice for Striped<C> {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read(&self, offset: u64, length: u32) -> Result<Bytes, IoError> {
        check_range(self.size, offset, length as u64)?;
        let runs = self.layout.runs(offset, length as u64);
        let reads = runs
            .iter()
            .map(|r| self.chunks.read(r.chunk, r.chunk_offset, r.length as u32));
        let mut datas = futures::future::try_join_all(reads).await?;
        if let [run] = &runs[..] {
            if run.parts.len() == 1 {
                return Ok(datas.pop().expect("one run"));
            }
        }
        // Scatter each run's pieces back to their places in the request.
        let mut out = BytesMut::zeroed(length as usize);
        for (run, data) in runs.iter().zip(datas) {
            let mut at = 0;
            for &(start, len) in &run.parts {
                let (start, len) = (start as usize, len as usize);
                out[start..start + len].copy_from_slice(&data[at..at + len]);
                at += len;
            }
        }
        Ok(out.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), IoError> {
        check_range(self.size, offset, data.len() as u64)?;
        let writes = self
            .layout
            .runs(offset, data.len() as u64)
            .into_iter()
            .map(|run| {
                // One piece is a zero-copy slice; several are gathered into one buffer.
                let part = match run.parts[..] {
                    [(start, len)] => data.slice(start as usize..(start + len) as usize),
                    _ => {
                        let mut gathered = BytesMut::with_capacity(run.length as usize);
                        for &(start, len) in &run.parts {
                            gathered
                                .extend_from_slice(&data[start as usize..(start + len) as usize]);
                        }
                        gathered.freeze()
                    }
                };
                self.chunks.write(run.chunk, run.chunk_offset, part, fua)
            });
        futures::future::try_join_all(writes).await.map(drop)
    }

    async fn flush(&self) -> Result<(), IoError> {
        self.chunks.flush().await
    }

    async fn trim(&self, offset: u64, length: u64) -> Result<(), IoError> {
        self.zero(offset, length, true).await
    }

    async fn write_zeroes(&self, offset: u64, length: u64, may_punch: bool) -> Result<(), IoError> {
        self.zero(offset, length, may_punch).await
    }

    /// Unallocated chunks are holes; an allocated chunk is data throughout.
    async fn extents(&self, offset: u64, length: u64) -> Result<Vec<Extent>, IoError> {
        check_range(self.size, offset, length)?;
        let mut out: Vec<Extent> = Vec::new();
        for piece in self.layout.pieces(offset, length).take(EXTENT_PIECES_MAX) {
            let hole = !self.chunks.is_allocated(piece.chunk);
            match out.last_mut() {
                Some(last) if last.hole == hole => last.length += piece.length,
                _ => out.push(Extent {
                    length: piece.length,
                    hole,
                }),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use floe_blockdev::MemoryDevice;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeSet;
    use std::sync::Mutex;

    const LAYOUT: Layout = Layout {
        unit: 4096,
        count: 3,
        chunk: 16384,
    };

    #[test]
    fn the_master_maps_chunk_bytes_back_to_the_volume() {
        let spec = VolumeSpec {
            name: "v".into(),
            size_bytes: 1 << 30,
            replicas: 3,
            chunk_bytes: 1 << 20,
            stripe_unit_bytes: 64 << 10,
            stripe_count: 4,
            mode: Default::default(),
            write_mode: Default::default(),
        };
        let layout = Layout::of(&spec);
        for offset in (0..64 << 20).step_by(4096 * 7 + 512) {
            let (chunk, within, _) = layout.locate(offset);
            assert_eq!(spec.volume_offset(chunk, within), offset);
        }
    }

    #[test]
    fn locate_is_a_bijection_onto_chunk_space() {
        let units = 3 * 2 * (LAYOUT.chunk / LAYOUT.unit); // two object sets
        let mut seen = BTreeSet::new();
        for u in 0..units {
            let (chunk, at, left) = LAYOUT.locate(u * LAYOUT.unit);
            assert_eq!(left, LAYOUT.unit);
            assert!(at < LAYOUT.chunk && at % LAYOUT.unit == 0);
            assert!(seen.insert((chunk, at)), "unit {u} collides");
        }
        assert_eq!(LAYOUT.locate(0), (0, 0, 4096));
        assert_eq!(LAYOUT.locate(4096 + 5), (1, 5, 4091));
        assert_eq!(LAYOUT.locate(3 * 4096), (0, 4096, 4096));
        assert_eq!(LAYOUT.locate(3 * 16384), (3, 0, 4096), "second object set");
    }

    #[test]
    fn runs_merge_the_pieces_of_one_chunk() {
        // Two whole stripes: one run per chunk, each of two units.
        let runs = LAYOUT.runs(0, 6 * 4096);
        assert_eq!(runs.len(), 3);
        assert_eq!(
            runs[1],
            Run {
                chunk: 1,
                chunk_offset: 0,
                length: 8192,
                parts: vec![(4096, 4096), (4 * 4096, 4096)],
            }
        );
        // Crossing into the next object set starts new chunks.
        let across = LAYOUT.runs(3 * 16384 - 4096, 8192);
        assert_eq!(across.len(), 2);
        assert_eq!((across[0].chunk, across[1].chunk), (2, 3));
    }

    /// Chunks as RAM devices, recording which were written.
    struct MemoryChunks {
        chunks: Vec<MemoryDevice>,
        allocated: Mutex<BTreeSet<u64>>,
    }

    #[async_trait]
    impl ChunkIo for MemoryChunks {
        async fn read(&self, chunk: u64, offset: u64, length: u32) -> Result<Bytes, IoError> {
            self.chunks[chunk as usize].read(offset, length).await
        }
        async fn write(
            &self,
            chunk: u64,
            offset: u64,
            data: Bytes,
            fua: bool,
        ) -> Result<(), IoError> {
            self.allocated.lock().unwrap().insert(chunk);
            self.chunks[chunk as usize].write(offset, data, fua).await
        }
        async fn flush(&self) -> Result<(), IoError> {
            Ok(())
        }
        async fn zero(
            &self,
            chunk: u64,
            offset: u64,
            length: u64,
            punch: bool,
        ) -> Result<(), IoError> {
            self.chunks[chunk as usize]
                .write_zeroes(offset, length, punch)
                .await
        }
        fn is_allocated(&self, chunk: u64) -> bool {
            self.allocated.lock().unwrap().contains(&chunk)
        }
    }

    /// Random reads, writes and zeroes on a striped device agree with one flat device.
    #[tokio::test]
    async fn striped_matches_a_flat_model() {
        let size = 6 * LAYOUT.chunk;
        let chunks = MemoryChunks {
            chunks: (0..6).map(|_| MemoryDevice::new(LAYOUT.chunk)).collect(),
            allocated: Mutex::default(),
        };
        let striped = Striped::new(LAYOUT, size, chunks);
        let model = MemoryDevice::new(size);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for round in 0..2000 {
            let offset = rng.gen_range(0..size);
            let length = rng.gen_range(1..=(size - offset).min(20000));
            match rng.gen_range(0..3) {
                0 => {
                    let data: Vec<u8> = (0..length).map(|_| rng.gen()).collect();
                    let data = Bytes::from(data);
                    striped.write(offset, data.clone(), false).await.unwrap();
                    model.write(offset, data, false).await.unwrap();
                }
                1 => {
                    striped.write_zeroes(offset, length, true).await.unwrap();
                    model.write_zeroes(offset, length, true).await.unwrap();
                }
                _ => {
                    let got = striped.read(offset, length as u32).await.unwrap();
                    let want = model.read(offset, length as u32).await.unwrap();
                    assert_eq!(got, want, "round {round}: read {offset}+{length}");
                }
            }
        }
        assert!(striped.read(size - 1, 2).await.is_err(), "past the end");
        let extents = striped.extents(0, size).await.unwrap();
        assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), size);
    }
}
