//! The one async block-device trait every Floe client layer implements (DESIGN.md
//! section 3), and the NBD server serves.
//!
//! - [`device`]: the trait, its error type and range check.
//! - [`memory`]: a RAM device, the reference model in tests of upper layers.
pub mod device;
pub mod memory;

pub use device::{check_range, BlockDevice, Extent, IoError};
pub use memory::MemoryDevice;
