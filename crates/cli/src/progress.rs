//! Progress of a long operation on stderr: done of total, rate and ETA. On a terminal
//! a bar redrawn in place a few times a second; otherwise (a log, a pipe, a test) a
//! plain line every few seconds, with no escape codes.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Redraws on a terminal, and plain lines elsewhere, at most this often.
const REDRAW_EVERY: Duration = Duration::from_millis(200);
const LINE_EVERY: Duration = Duration::from_secs(2);
const BAR_WIDTH: usize = 30;
/// How often a command following work the master does asks it for its progress.
pub const POLL_EVERY: Duration = Duration::from_secs(1);

/// What is counted: bytes print as sizes, anything else as a number of it.
#[derive(Clone, Copy)]
pub enum Unit {
    Bytes,
    Chunks,
}

impl Unit {
    fn format(self, n: u64) -> String {
        match self {
            Unit::Bytes => crate::size::format(n),
            Unit::Chunks => format!("{n} chunks"),
        }
    }
}

pub struct Progress {
    what: String,
    unit: Unit,
    started: Instant,
    shown: Option<Instant>,
    terminal: bool,
    /// A bar is on the terminal's last line: cleared before anything else prints.
    drawn: bool,
}

impl Progress {
    pub fn new(what: String, unit: Unit) -> Progress {
        Progress {
            what,
            unit,
            started: Instant::now(),
            shown: None,
            terminal: std::io::stderr().is_terminal(),
            drawn: false,
        }
    }

    /// Shows `done` of `total`, with `extra` after them, if it is time to.
    pub fn update(&mut self, done: u64, total: u64, extra: &str) {
        let every = if self.terminal {
            REDRAW_EVERY
        } else {
            LINE_EVERY
        };
        if self.shown.is_some_and(|at| at.elapsed() < every) {
            return;
        }
        self.shown = Some(Instant::now());
        let seconds = self.started.elapsed().as_secs_f64();
        let rate = done as f64 / seconds.max(0.001);
        let eta = match total.saturating_sub(done) {
            0 => "done".to_string(),
            _ if done == 0 => "ETA ?".to_string(),
            left => format!("ETA {}", clock(left as f64 / rate)),
        };
        let text = format!(
            "{} of {}{extra} ({}/s, {eta})",
            self.unit.format(done),
            self.unit.format(total),
            self.unit.format(rate as u64),
        );
        let mut stderr = std::io::stderr().lock();
        if self.terminal {
            let filled = (done.min(total) as usize * BAR_WIDTH)
                .checked_div(total as usize)
                .unwrap_or(0);
            let bar = format!("{}{}", "#".repeat(filled), "-".repeat(BAR_WIDTH - filled));
            // \r and erase-to-end-of-line: the bar redraws in place.
            let _ = write!(stderr, "\r{} [{bar}] {text}\x1b[K", self.what);
            self.drawn = true;
        } else {
            let _ = writeln!(stderr, "{}: {text}", self.what);
        }
        let _ = stderr.flush();
    }

    /// Clears the bar, so the result prints on a line of its own.
    pub fn finish(&mut self) {
        if self.drawn {
            eprint!("\r\x1b[K");
            self.drawn = false;
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Seconds as `1h02m`, `3m05s` or `42s`.
fn clock(seconds: f64) -> String {
    let s = seconds.ceil().min(u64::MAX as f64) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn clock() {
        assert_eq!(super::clock(0.2), "1s");
        assert_eq!(super::clock(185.0), "3m05s");
        assert_eq!(super::clock(3720.0), "1h02m");
    }
}
