//! The NBD server driven by real clients (qemu-io, qemu-img, nbdinfo, nbdcopy, nbdsh,
//! fio) and by hand-made hostile byte streams.
mod clients;
mod common;
mod raw;
