//! End-to-end tests: real Floe processes on loopback, driven by NBD clients we did not
//! write (qemu-img, qemu-io, nbdinfo, nbdcopy, nbdsh, fio, nbdfuse + ext4, and over
//! NFS qemu-img, qemu-io and libnfs's tools).

mod bad_input;
mod chained_log;
mod cli_ux;
mod clients;
mod cluster;
mod copy_tuning;
mod crash;
mod deploy;
mod etcd;
mod expand;
mod ext4;
mod failover;
mod fencing;
mod fio;
mod fio_job;
mod full_disk;
mod hosts;
mod hybrid;
mod integrity;
mod io_helpers;
mod mark_lost;
mod master_outage;
mod masters;
mod metrics;
mod move_session;
mod nbd_raw;
mod netcut;
mod nfs;
mod qos;
mod remote_transactions;
mod scrub;
mod servers;
mod snapshots;
mod stale_reads;
mod takeover;
mod tls;
mod transactions;
mod upgrade;
mod write_back;
mod write_modes;
mod write_modes_ext4;
