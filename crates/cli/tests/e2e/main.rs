//! End-to-end tests: real Floe processes on loopback, driven by NBD clients we did not
//! write (qemu-img, qemu-io, nbdinfo, nbdcopy, nbdsh, fio, nbdfuse + ext4).

mod cluster;
mod clients;
