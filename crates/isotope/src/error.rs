//! Why a transaction call failed. A conflict is no error: [`crate::Outcome::Conflict`].

use floe_blockdev::IoError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxError {
    /// A block number past the volume's data blocks.
    OutOfRange { block: u64, blocks: u64 },
    /// A write of other than one whole block.
    NotABlock { length: usize },
    /// The transaction would write more blocks than one log record holds.
    TooLarge { blocks_max: usize },
    /// `mark_accessed` with a range that is empty or leaves the block.
    MarkOutsideBlock { offset: usize, length: usize },
    /// `mark_accessed` of a block this transaction neither read nor wrote.
    NotAccessed { block: u64 },
    /// `take_over` of a handle that names no released transaction.
    UnknownHandle(u64),
    /// The bound on open transactions is reached.
    TooManyOpen { open_max: usize },
    /// The transaction stayed open while more blocks were committed than the conflict
    /// window keeps for it: aborted (its commit answers `Conflict`).
    Preempted { blocks_max: usize },
    /// A read failed below; the transaction can go on or abort.
    Io(IoError),
    /// The volume stopped taking commits (a log append or apply failed, e.g. because
    /// the lease moved); the failing commit's outcome is known after a reopen.
    Stopped(String),
    /// The gateway running the transaction refused a call (its reason, which ended
    /// the transaction), or could not be reached (a commit's outcome is then unknown
    /// until the volume is read again).
    Remote(String),
}

impl std::fmt::Display for TxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TxError::OutOfRange { block, blocks } => {
                write!(f, "block {block} is past the volume's {blocks} data blocks")
            }
            TxError::NotABlock { length } => {
                write!(
                    f,
                    "a write of {length} bytes: transactions write whole 4096-byte blocks"
                )
            }
            TxError::TooLarge { blocks_max } => write!(
                f,
                "transaction too large: it writes more than {blocks_max} blocks ({} KiB), \
                 the most one commit record holds",
                blocks_max * 4
            ),
            TxError::MarkOutsideBlock { offset, length } => write!(
                f,
                "mark_accessed({offset}, {length}) is outside the block: ranges are \
                 non-empty and within its 4096 bytes"
            ),
            TxError::NotAccessed { block } => {
                write!(
                    f,
                    "mark_accessed of block {block}, which this transaction did not read or write"
                )
            }
            TxError::UnknownHandle(handle) => {
                write!(f, "no released transaction has handle {handle}")
            }
            TxError::TooManyOpen { open_max } => {
                write!(
                    f,
                    "{open_max} transactions are open: commit or abort some first"
                )
            }
            TxError::Preempted { blocks_max } => write!(
                f,
                "the transaction was aborted: it stayed open while more than {blocks_max} \
                 blocks were committed after it; begin again"
            ),
            TxError::Io(e) => write!(f, "{e}"),
            TxError::Stopped(why) => write!(f, "the volume takes no more commits: {why}"),
            TxError::Remote(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for TxError {}
