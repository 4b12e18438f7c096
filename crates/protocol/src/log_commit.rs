//! Where a log-commit volume (Blizzard, NSDI'14 section 2.5.3) keeps its log: the
//! layout the master allocates chunks over and the gateway's `client::log_commit`
//! layer writes. The volume exports `size_bytes`; its chunks hold more:
//!
//! ```text
//! [checkpoint region 0][checkpoint region 1][slot 0][slot 1] ... [slot P-1]
//! ```
//! - A virtual block is 4 KiB (what VM file systems write). A slot is 8 KiB: a 4 KiB
//!   header page (block, log position, epoch, CRC) and the 4 KiB data page, written
//!   in one request. Writes cost twice their bytes; a write not 4 KiB-aligned first
//!   reads the rest of its first and last blocks.
//! - P = V + max(V / 8, 1024) slots for V virtual blocks: 12.5% spare, which bounds
//!   how many writes land between two checkpoints.
//! - A checkpoint region holds a header and V u32 map entries, rounded up to 4 KiB.
//!
//! A 1 GiB volume: V = 262,144, P = 294,912, checkpoints 1 MiB each, 2.25 GiB of
//! chunks. The gateway keeps the map in memory (4 bytes per 4 KiB block), so
//! log-commit volumes are capped at [`SIZE_BYTES_MAX`].

/// The virtual block: the unit of the log.
pub const BLOCK_BYTES: u64 = 4096;
/// A header page and a data page.
pub const SLOT_BYTES: u64 = 2 * BLOCK_BYTES;
/// The largest log-commit volume: a 64 MiB map in the gateway's memory, written whole
/// at each checkpoint.
pub const SIZE_BYTES_MAX: u64 = 64 << 30;
/// A checkpoint's fixed fields before its map.
pub const CHECKPOINT_HEADER_BYTES: u64 = 64;
/// Spare slots at least, so that small volumes still write many blocks between
/// checkpoints.
const SPARE_SLOTS_MIN: u64 = 1024;

/// The log's geometry for a volume of a given size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Virtual blocks (V).
    pub blocks: u64,
    /// Physical slots (P).
    pub slots: u64,
    /// Bytes of one checkpoint region.
    pub checkpoint_bytes: u64,
}

impl Layout {
    /// The layout of a volume of `size_bytes` (a multiple of [`BLOCK_BYTES`]).
    pub fn of(size_bytes: u64) -> Layout {
        let blocks = size_bytes.div_ceil(BLOCK_BYTES);
        let slots = blocks + (blocks / 8).max(SPARE_SLOTS_MIN);
        // The map and a trailing crc32c.
        let checkpoint_bytes =
            (CHECKPOINT_HEADER_BYTES + 4 * blocks + 4).next_multiple_of(BLOCK_BYTES);
        Layout {
            blocks,
            slots,
            checkpoint_bytes,
        }
    }

    /// Where checkpoint region 0 or 1 starts.
    pub fn checkpoint_offset(&self, region: u64) -> u64 {
        assert!(region < 2, "two checkpoint regions");
        region * self.checkpoint_bytes
    }

    /// Where slot `slot` starts.
    pub fn slot_offset(&self, slot: u64) -> u64 {
        assert!(slot < self.slots, "slot {slot} of {}", self.slots);
        2 * self.checkpoint_bytes + slot * SLOT_BYTES
    }

    /// The bytes of chunks the volume needs.
    pub fn backing_bytes(&self) -> u64 {
        2 * self.checkpoint_bytes + self.slots * SLOT_BYTES
    }
}

/// Why a size cannot be a log-commit volume's, if it cannot.
pub fn check_size(size_bytes: u64) -> Result<(), String> {
    if !size_bytes.is_multiple_of(BLOCK_BYTES) {
        return Err(format!(
            "a log-commit volume's size must be a multiple of its 4 KiB block; {size_bytes} bytes is not"
        ));
    }
    if size_bytes > SIZE_BYTES_MAX {
        return Err(format!(
            "a log-commit volume is at most {} GiB (its block map is kept in the gateway's memory); {size_bytes} bytes asked",
            SIZE_BYTES_MAX >> 30
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gibibyte_volume_has_an_eighth_spare_and_one_mebibyte_checkpoints() {
        let layout = Layout::of(1 << 30);
        assert_eq!(layout.blocks, 262_144);
        assert_eq!(layout.slots, 294_912);
        assert_eq!(layout.checkpoint_bytes, (1 << 20) + 4096);
        assert_eq!(layout.slot_offset(0), 2 * layout.checkpoint_bytes);
        assert_eq!(
            layout.backing_bytes(),
            2 * ((1 << 20) + 4096) + 294_912 * 8192
        );
    }

    #[test]
    fn small_volumes_keep_a_thousand_spare_slots() {
        let layout = Layout::of(1 << 20);
        assert_eq!((layout.blocks, layout.slots), (256, 1280));
        assert_eq!(layout.checkpoint_bytes, 4096);
    }

    #[test]
    fn sizes_past_the_cap_or_off_the_block_are_refused() {
        assert!(check_size(SIZE_BYTES_MAX).is_ok());
        assert!(check_size(SIZE_BYTES_MAX + 4096)
            .unwrap_err()
            .contains("at most 64 GiB"));
        assert!(check_size(4096 + 512).unwrap_err().contains("multiple"));
    }
}
