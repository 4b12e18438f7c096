//! The one place that builds fio command lines (fio's nbd engine against a gateway)
//! and reads what fio reports: its text summary, its JSON and its per-second IOPS log.
//! Tests say what a job does; the spelling of fio's options lives here.

use crate::cluster::output;
use crate::io_helpers::text;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, SystemTime};

/// How a job checks its data: every block it writes carries a crc32c of its contents.
#[derive(Clone, Copy, Debug)]
pub enum Verify {
    /// Write, then read back and check every block in the same run.
    WriteAndRead,
    /// Write only. `save_state`: a run cut short (time-based) records in the working
    /// directory how far it got, so that `Read { load_state: true }` checks just that.
    Write { save_state: bool },
    /// Read back and check what an earlier run of the same job wrote.
    Read { load_state: bool },
}

/// One fio job on fio's nbd engine, run in `work`: fio leaves its verify state and
/// logs there, named after the job.
#[derive(Clone, Debug)]
pub struct FioJob {
    name: String,
    work: PathBuf,
    args: Vec<String>,
    /// The network namespace fio runs in (a test's host), if not the test's own.
    namespace: Option<String>,
}

impl FioJob {
    pub fn new(name: &str, uri: &str, work: &Path) -> FioJob {
        FioJob {
            name: name.to_string(),
            work: work.to_path_buf(),
            args: vec![
                format!("--name={name}"),
                "--ioengine=nbd".into(),
                format!("--uri={uri}"),
            ],
            namespace: None,
        }
    }

    /// Runs fio in network namespace `ns`.
    pub fn in_namespace(mut self, ns: &str) -> FioJob {
        self.namespace = Some(ns.to_string());
        self
    }

    /// 4 KiB random writes, 16 in flight, over the first 256 MiB: the demo volume's
    /// chunks 0-3. `seed` makes a later pass revisit exactly the blocks written.
    pub fn random_4k(uri: &str, work: &Path, seed: u64) -> FioJob {
        FioJob::new("random", uri, work)
            .rw("randwrite")
            .bs("4k")
            .size("256M")
            .iodepth(16)
            .seed(seed)
    }

    /// 1 MiB sequential writes, 4 in flight, of `size` from 256 MiB on: the chunks
    /// after [`FioJob::random_4k`]'s.
    pub fn fill(uri: &str, work: &Path, size: &str) -> FioJob {
        FioJob::new("fill", uri, work)
            .rw("write")
            .bs("1M")
            .offset("256M")
            .size(size)
            .iodepth(4)
    }

    fn arg(mut self, arg: String) -> FioJob {
        self.args.push(arg);
        self
    }

    /// fio's `rw`: write, randwrite, read, randread...
    pub fn rw(self, rw: &str) -> FioJob {
        self.arg(format!("--rw={rw}"))
    }

    pub fn bs(self, bs: &str) -> FioJob {
        self.arg(format!("--bs={bs}"))
    }

    pub fn iodepth(self, depth: u32) -> FioJob {
        self.arg(format!("--iodepth={depth}"))
    }

    /// Where the job's region starts.
    pub fn offset(self, offset: &str) -> FioJob {
        self.arg(format!("--offset={offset}"))
    }

    /// The region the job writes in.
    pub fn size(self, size: &str) -> FioJob {
        self.arg(format!("--size={size}"))
    }

    /// At most this many bytes a second (fio's `rate`, e.g. 16m).
    pub fn rate(self, rate: &str) -> FioJob {
        self.arg(format!("--rate={rate}"))
    }

    /// Bounds the run by bytes rather than by the region's size.
    pub fn io_size(self, io_size: &str) -> FioJob {
        self.arg(format!("--io_size={io_size}"))
    }

    /// A fixed seed makes a later pass revisit exactly the blocks a random run wrote.
    pub fn seed(self, seed: u64) -> FioJob {
        self.arg(format!("--randseed={seed}"))
    }

    /// An NBD FLUSH after every `writes` writes.
    pub fn fsync(self, writes: u32) -> FioJob {
        self.arg(format!("--fsync={writes}"))
    }

    /// Runs for `seconds` whatever the size (fio goes round the region again).
    pub fn runtime(self, seconds: u64) -> FioJob {
        self.arg("--time_based".into())
            .arg(format!("--runtime={seconds}"))
    }

    pub fn verify(self, verify: Verify) -> FioJob {
        let job = self.arg("--verify=crc32c".into());
        match verify {
            Verify::WriteAndRead => job.arg("--do_verify=1".into()),
            Verify::Write { save_state } => job
                .arg("--do_verify=0".into())
                .arg(format!("--verify_state_save={}", u8::from(save_state))),
            Verify::Read { load_state } => {
                let job = job.arg("--verify_only".into());
                if load_state {
                    job.arg("--verify_state_load=1".into())
                } else {
                    job
                }
            }
        }
    }

    /// A write IOPS log, one line a second (read it with [`iops_log`]), stamped with
    /// the wall clock so that it lines up with the moments a test acts, whenever fio
    /// got going.
    pub fn iops_log(self) -> FioJob {
        let name = self.name.clone();
        self.arg(format!("--write_iops_log={name}"))
            .arg("--log_avg_msec=1000".into())
            .arg("--log_unix_epoch=1".into())
    }

    /// The report as JSON on stdout (read it with [`json_report`]).
    pub fn json(self) -> FioJob {
        self.arg("--output-format=json".into())
    }

    pub fn iops_log_path(&self) -> PathBuf {
        self.work.join(format!("{}_iops.1.log", self.name))
    }

    pub fn command(&self) -> Command {
        let mut command = match &self.namespace {
            Some(ns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", ns, "fio"]);
                command
            }
            None => Command::new("fio"),
        };
        command.current_dir(&self.work).args(&self.args);
        command
    }

    /// Runs the job to its end.
    pub fn run(&self) -> Output {
        output(&mut self.command())
    }

    /// Starts the job in the background, its output kept for `wait_with_output`.
    pub fn spawn(&self) -> Child {
        self.command()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("fio starts")
    }
}

/// Exit status 0, every job reporting `err= 0`, and no verify complaint.
pub fn assert_clean(out: &Output, what: &str) {
    let all = text(out);
    let errors: Vec<&str> = all
        .lines()
        .filter(|l| l.contains("err=") && !l.contains("err= 0"))
        .collect();
    assert!(
        out.status.success() && errors.is_empty() && !all.contains("verify:"),
        "fio {what} failed ({}):\n{all}",
        out.status
    );
    assert!(all.contains("err= 0"), "fio {what}: no job summary:\n{all}");
}

/// Writes [`FioJob::fill`]'s blocks, checksummed for [`assert_random_and_fill_verify`].
pub fn write_fill(fill: &FioJob) {
    let written = fill
        .clone()
        .verify(Verify::Write { save_state: true })
        .run();
    assert_clean(&written, "fill");
}

/// Reads back and checks every block that a time-based run of `random` (by the state it
/// saved) and [`write_fill`] wrote.
pub fn assert_random_and_fill_verify(random: &FioJob, fill: &FioJob) {
    assert_clean(
        &random
            .clone()
            .verify(Verify::Read { load_state: true })
            .run(),
        "verify of the random writes",
    );
    assert_clean(
        &fill
            .clone()
            .verify(Verify::Read { load_state: false })
            .run(),
        "verify of the fill",
    );
}

/// The JSON report of a run that ended without an error.
pub fn json_report(out: &Output, what: &str) -> serde_json::Value {
    report_of(out, what, out.status.success())
}

/// Ends a spawned time-based run now rather than at its runtime; its JSON report.
pub fn interrupt(fio: Child, what: &str) -> serde_json::Value {
    // On SIGINT fio stops its jobs, then reports and writes its logs as at a normal
    // end, and exits with this status.
    const INTERRUPTED: i32 = 128;
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(fio.id() as i32, libc::SIGINT) }, 0);
    let out = fio.wait_with_output().expect("fio runs");
    report_of(&out, what, out.status.code() == Some(INTERRUPTED))
}

fn report_of(out: &Output, what: &str, ended: bool) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The nbd engine (and an interrupted fio) print a line before the JSON.
    let json = stdout.find('{').and_then(|start| {
        serde_json::Deserializer::from_str(&stdout[start..])
            .into_iter::<serde_json::Value>()
            .next()?
            .ok()
    });
    match json {
        Some(json) if ended && json["jobs"][0]["error"] == 0 => json,
        _ => panic!(
            "fio {what} failed ({}): {stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// One second of an IOPS log: write I/Os completed per second in the second ending at
/// `end`.
#[derive(Clone, Copy, Debug)]
pub struct IopsSample {
    pub end: SystemTime,
    pub iops: f64,
}

/// The lines of a log written by [`FioJob::iops_log`] ("msec since the epoch, iops, ...").
pub fn iops_log(path: &Path) -> Vec<IopsSample> {
    let log = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    log.lines()
        .map(|line| {
            let fields: Vec<u64> = line
                .split(',')
                .take(2)
                .map(|f| f.trim().parse().expect("a number"))
                .collect();
            IopsSample {
                end: SystemTime::UNIX_EPOCH + Duration::from_millis(fields[0]),
                iops: fields[1] as f64,
            }
        })
        .collect()
}
