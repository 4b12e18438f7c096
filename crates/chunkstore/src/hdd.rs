//! Emulated hard disk (an emulation, for measuring hybrid mode on machines with only
//! ssds): every chunk-file access waits the service time a 7200 rpm disk would take.
//!
//! The model: one head, so accesses are served one after another (first come, first
//! served); a seek whose time grows with the square root of the distance from the
//! head's previous position (0.5 ms track-to-track, 8 ms full stroke); a rotational
//! latency uniform in [0, 8.33 ms) from a seeded generator, so runs are repeatable;
//! transfer at 150 MB/s. An access that starts where the previous one ended pays only
//! the transfer. Time is reserved, not slept under a lock: a caller reserves its slot
//! and then waits until the slot's end.

use crate::store::CHUNK_BYTES_MAX;
use floe_protocol::ChunkId;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Emulated device size: chunks are spread over it by a hash of their id.
pub const DEVICE_BYTES: u64 = 4 << 40;
const SEEK_TRACK_TO_TRACK: Duration = Duration::from_micros(500);
const SEEK_FULL_STROKE: Duration = Duration::from_millis(8);
/// One revolution at 7200 rpm.
const ROTATION: Duration = Duration::from_micros(8333);
const TRANSFER_BYTES_PER_SECOND: u64 = 150_000_000;

/// Where `offset` of `chunk` lies on the emulated device: the chunk's slot (a hash of
/// its id) times the chunk size, plus the offset.
pub fn device_position(chunk: ChunkId, offset: u64) -> u64 {
    let slots = DEVICE_BYTES / CHUNK_BYTES_MAX;
    let slot = splitmix64(chunk.volume_id ^ splitmix64(chunk.index)) % slots;
    slot * CHUNK_BYTES_MAX + offset
}

/// Where the hdd's own journal (the last overflow of hybrid mode) lies on the emulated
/// device: mid-disk, like a file system's journal.
const JOURNAL_POSITION: u64 = DEVICE_BYTES / 2;

/// Service time of an access of `length` bytes at `position` with the head at `head`
/// (where the previous access ended); `random` draws the rotational latency.
pub fn service_time(head: u64, position: u64, length: u64, random: u64) -> Duration {
    let transfer =
        Duration::from_nanos(length.saturating_mul(1_000_000_000) / TRANSFER_BYTES_PER_SECOND);
    if position == head {
        return transfer;
    }
    let fraction = (head.abs_diff(position) as f64 / DEVICE_BYTES as f64).min(1.0);
    let seek =
        SEEK_TRACK_TO_TRACK + (SEEK_FULL_STROKE - SEEK_TRACK_TO_TRACK).mul_f64(fraction.sqrt());
    let rotation = ROTATION.mul_f64((random >> 11) as f64 / (1u64 << 53) as f64);
    seek + rotation + transfer
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct Head {
    position: u64,
    /// When the last reserved access completes.
    busy_until: Instant,
    /// Rotational latency generator state.
    random: u64,
    /// When a foreground (not replay) access last completed.
    foreground_until: Instant,
}

/// One emulated disk, shared by everything that touches its chunk files.
pub struct Hdd {
    head: Mutex<Head>,
}

impl Default for Hdd {
    fn default() -> Self {
        let now = Instant::now();
        Hdd {
            head: Mutex::new(Head {
                position: 0,
                busy_until: now,
                random: 1,
                foreground_until: now,
            }),
        }
    }
}

impl Hdd {
    /// Reserves the head for an access; returns when it completes. The caller does the
    /// real I/O and then waits until that instant.
    pub fn reserve(&self, chunk: ChunkId, offset: u64, length: u64, foreground: bool) -> Instant {
        self.reserve_at(device_position(chunk, offset), length, foreground)
    }

    /// [`Hdd::reserve`] for an access to the hdd's own journal at byte `at`.
    pub fn reserve_journal(&self, at: u64, length: u64, foreground: bool) -> Instant {
        self.reserve_at(JOURNAL_POSITION + at, length, foreground)
    }

    fn reserve_at(&self, position: u64, length: u64, foreground: bool) -> Instant {
        let mut head = self.head.lock().unwrap();
        head.random = splitmix64(head.random);
        let time = service_time(head.position, position, length, head.random);
        let start = head.busy_until.max(Instant::now());
        head.busy_until = start + time;
        head.position = position + length;
        if foreground {
            head.foreground_until = head.busy_until;
        }
        head.busy_until
    }

    /// True when no foreground access ran in the last `quiet`.
    pub fn idle(&self, quiet: Duration) -> bool {
        self.head.lock().unwrap().foreground_until + quiet <= Instant::now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_access_pays_only_transfer() {
        let t = service_time(1 << 30, 1 << 30, 150_000, 12345);
        assert_eq!(t, Duration::from_millis(1));
    }

    #[test]
    fn seek_grows_with_distance_and_is_bounded() {
        let no_rotation = 0;
        let near = service_time(0, 4096, 0, no_rotation);
        let far = service_time(0, DEVICE_BYTES / 2, 0, no_rotation);
        let full = service_time(0, DEVICE_BYTES, 0, no_rotation);
        assert!(near >= SEEK_TRACK_TO_TRACK && near < Duration::from_micros(600));
        assert!(far > near && far < full);
        assert_eq!(full, SEEK_FULL_STROKE);
    }

    #[test]
    fn rotation_is_below_one_revolution() {
        let most = service_time(0, 4096, 0, u64::MAX) - service_time(0, 4096, 0, 0);
        // Nanosecond rounding may reach a whole revolution; never more.
        assert!(most <= ROTATION && most > ROTATION.mul_f64(0.99));
    }

    #[test]
    fn positions_are_deterministic_and_inside_the_device() {
        let chunk = ChunkId {
            volume_id: 7,
            index: 3,
        };
        assert_eq!(device_position(chunk, 10), device_position(chunk, 10));
        assert_eq!(device_position(chunk, 10) + 5, device_position(chunk, 15));
        assert!(device_position(chunk, CHUNK_BYTES_MAX - 1) < DEVICE_BYTES);
    }

    #[test]
    fn accesses_are_served_one_after_another() {
        let hdd = Hdd::default();
        let chunk = ChunkId {
            volume_id: 1,
            index: 0,
        };
        let first = hdd.reserve(chunk, 0, 1 << 20, true);
        let second = hdd.reserve(chunk, 1 << 20, 1 << 20, false);
        // Sequential: the second adds exactly its transfer time after the first.
        assert_eq!(second - first, service_time(0, 0, 1 << 20, 0));
        assert!(!hdd.idle(Duration::from_secs(60)));
    }
}
