//! Deterministic simulation of a Floe cluster (TigerBeetle's VOPR, FoundationDB's
//! simulator): the real master, chunk servers and gateway client stack run in one
//! process on one thread, on tokio's paused clock, with simulated disks
//! ([`floe_chunkstore::SimDisk`]), and talk through a simulated network that delays,
//! reorders, drops and duplicates messages and partitions any set of processes.
//! Processes crash (kill -9), hosts lose power (unsynced writes partly lost, sectors
//! torn) and both restart, two gateways race for one
//! volume's lease, chunk servers die for good and are marked lost, the map expands.
//! A workload writes and reads with a ledger; the checkers then prove nothing
//! acknowledged was lost, no two writers overlapped, versions name one change each,
//! and, once healed, replicas agree and sit where the map places them.
//!
//! - [`network`]: the simulated network and the [`floe_protocol::Transport`] processes
//!   call through.
//! - [`observe`]: checks on the messages themselves (lease grants, acknowledged
//!   versions).
//! - [`cluster`]: starting, killing and restarting the processes.
//! - [`ledger`], [`workload`]: what was written and acknowledged, and by whom.
//! - [`scenario`]: one seed's run: faults chosen by the seed, then healing.
//! - [`check`]: the checkers at the end.
//!
//! Everything random comes from the seed, so a seed replays exactly:
//! `FLOE_SIM_SEED=S cargo test -p floe-sim` (see `tests/seeds.rs`).

pub mod check;
pub mod cluster;
pub mod ledger;
pub mod network;
pub mod observe;
pub mod scenario;
pub mod stale_reader;
pub mod workload;

pub use floe_protocol::WriteMode;
pub use scenario::{write_mode_of, Report};

/// A seed that broke a rule, with what it did.
pub struct Failure {
    pub seed: u64,
    pub write_mode: WriteMode,
    pub violations: Vec<String>,
    pub report: Report,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = if self.write_mode == write_mode_of(self.seed) {
            String::new()
        } else {
            format!("FLOE_SIM_WRITE_MODE={} ", self.write_mode)
        };
        writeln!(
            f,
            "seed {} failed (replay: {mode}FLOE_SIM_SEED={} cargo test -p floe-sim --test seeds -- --nocapture):",
            self.seed, self.seed
        )?;
        for v in &self.violations {
            writeln!(f, "  violation: {v}")?;
        }
        writeln!(f, "  what happened:")?;
        for e in &self.report.events {
            writeln!(f, "    {e}")?;
        }
        Ok(())
    }
}

thread_local! {
    /// Panics on this thread (a seed runs on one thread): a failed assertion in any
    /// task of any simulated process.
    static PANICS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Records every panic on the thread it happened on, for [`run`] to report; tokio
/// would otherwise only end the panicking task.
fn watch_panics() {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |panic| {
            PANICS.with(|p| p.borrow_mut().push(panic.to_string()));
            report(panic);
        }));
    });
}

/// Runs one seed on a fresh single-threaded runtime with a paused clock, its volume
/// in the write mode the seed picks ([`write_mode_of`]).
pub fn run(seed: u64) -> Result<Report, Box<Failure>> {
    run_in(seed, write_mode_of(seed))
}

/// Runs one seed with its volume in `write_mode`.
pub fn run_in(seed: u64, write_mode: WriteMode) -> Result<Report, Box<Failure>> {
    watch_panics();
    PANICS.with(|p| p.borrow_mut().clear());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a tokio runtime");
    let result = runtime.block_on(scenario::run(seed, write_mode));
    // Zombie tasks of killed processes die with the runtime.
    drop(runtime);
    let panics = PANICS.with(|p| p.take());
    let result = match result {
        Ok(report) if !panics.is_empty() => Err((Vec::new(), report)),
        other => other,
    };
    let result = result.map_err(|(mut violations, report)| {
        violations.extend(panics.into_iter().map(|p| format!("a task panicked: {p}")));
        (violations, report)
    });
    result.map_err(|(violations, report)| {
        Box::new(Failure {
            seed,
            write_mode,
            violations,
            report,
        })
    })
}
