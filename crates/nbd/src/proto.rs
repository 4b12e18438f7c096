//! Wire constants from NetworkBlockDevice/nbd doc/proto.md, and the limits this server
//! advertises or enforces. Only what the server uses is listed.

// Magic numbers.
pub(crate) const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub(crate) const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub(crate) const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub(crate) const REQUEST_MAGIC: u32 = 0x2560_9513;
pub(crate) const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub(crate) const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub(crate) const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub(crate) const FLAG_NO_ZEROES: u16 = 1 << 1;
pub(crate) const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub(crate) const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Transmission flags.
pub(crate) const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub(crate) const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub(crate) const FLAG_SEND_FUA: u16 = 1 << 3;
pub(crate) const FLAG_SEND_TRIM: u16 = 1 << 5;
pub(crate) const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub(crate) const FLAG_SEND_DF: u16 = 1 << 7;
pub(crate) const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub(crate) const FLAG_SEND_CACHE: u16 = 1 << 10;
pub(crate) const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Options.
pub(crate) const OPT_EXPORT_NAME: u32 = 1;
pub(crate) const OPT_ABORT: u32 = 2;
pub(crate) const OPT_LIST: u32 = 3;
pub(crate) const OPT_STARTTLS: u32 = 5;
pub(crate) const OPT_INFO: u32 = 6;
pub(crate) const OPT_GO: u32 = 7;
pub(crate) const OPT_STRUCTURED_REPLY: u32 = 8;
pub(crate) const OPT_LIST_META_CONTEXT: u32 = 9;
pub(crate) const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub(crate) const REP_ACK: u32 = 1;
pub(crate) const REP_SERVER: u32 = 2;
pub(crate) const REP_INFO: u32 = 3;
pub(crate) const REP_META_CONTEXT: u32 = 4;
pub(crate) const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub(crate) const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub(crate) const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub(crate) const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub(crate) const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

// NBD_REP_INFO types.
pub(crate) const INFO_EXPORT: u16 = 0;
pub(crate) const INFO_NAME: u16 = 1;
pub(crate) const INFO_BLOCK_SIZE: u16 = 3;

// Commands.
pub(crate) const CMD_READ: u16 = 0;
pub(crate) const CMD_WRITE: u16 = 1;
pub(crate) const CMD_DISC: u16 = 2;
pub(crate) const CMD_FLUSH: u16 = 3;
pub(crate) const CMD_TRIM: u16 = 4;
pub(crate) const CMD_CACHE: u16 = 5;
pub(crate) const CMD_WRITE_ZEROES: u16 = 6;
pub(crate) const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub(crate) const CMD_FLAG_FUA: u16 = 1 << 0;
pub(crate) const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub(crate) const CMD_FLAG_DF: u16 = 1 << 2;
pub(crate) const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub(crate) const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured replies.
pub(crate) const REPLY_FLAG_DONE: u16 = 1 << 0;
pub(crate) const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub(crate) const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub(crate) const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

// base:allocation status flags.
pub(crate) const STATE_HOLE: u32 = 1 << 0;
pub(crate) const STATE_ZERO: u32 = 1 << 1;

// Error values (fixed by the protocol, not the host's errno).
pub(crate) const EPERM: u32 = 1;
pub(crate) const EIO: u32 = 5;
pub(crate) const EINVAL: u32 = 22;
pub(crate) const ENOSPC: u32 = 28;

/// The one metadata context served, and the id it gets in NBD_REP_META_CONTEXT and
/// block status replies (any value works; 0 is what LIST_META_CONTEXT must use).
pub(crate) const BASE_ALLOCATION: &str = "base:allocation";
pub(crate) const BASE_ALLOCATION_ID: u32 = 1;

/// Block size constraints sent with NBD_INFO_BLOCK_SIZE. The maximum is also the
/// largest READ/WRITE accepted, which bounds the memory one request can pin.
pub(crate) const MIN_BLOCK: u32 = 1;
pub(crate) const PREFERRED_BLOCK: u32 = 4096;
pub(crate) const MAX_BLOCK: u32 = 32 << 20;

/// The protocol's limit on any string (export names, messages).
pub(crate) const MAX_STRING: usize = 4096;
