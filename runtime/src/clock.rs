//! The one clock the agent and the operator read. Tests pin or shift it so that a window
//! boundary is crossed in seconds, not hours: `GPUSLICE_CLOCK_START=<RFC 3339 instant>` makes the
//! process start at that instant, and time runs on from there at the normal rate.

use chrono::{DateTime, TimeDelta, Utc};

/// The environment variable that shifts the clock.
pub const CLOCK_START_VAR: &str = "GPUSLICE_CLOCK_START";

/// Why the clock setting cannot be used.
#[derive(Debug, thiserror::Error)]
#[error(
    "{CLOCK_START_VAR}={value:?} is not an RFC 3339 instant (for example 2026-12-02T21:59:50Z)"
)]
pub struct ClockError {
    value: String,
}

/// Wall-clock time, shifted by a fixed offset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Clock {
    offset: TimeDelta,
}

impl Clock {
    /// The real time.
    pub fn system() -> Clock {
        Clock::default()
    }

    /// A clock that reads `start` now and runs on from there.
    pub fn starting_at(start: DateTime<Utc>) -> Clock {
        Clock {
            offset: start - Utc::now(),
        }
    }

    /// The system clock, or the one `GPUSLICE_CLOCK_START` asks for.
    pub fn from_env() -> Result<Clock, ClockError> {
        match std::env::var(CLOCK_START_VAR) {
            Ok(value) if !value.trim().is_empty() => DateTime::parse_from_rfc3339(value.trim())
                .map(|t| Clock::starting_at(t.with_timezone(&Utc)))
                .map_err(|_| ClockError { value }),
            _ => Ok(Clock::system()),
        }
    }

    pub fn now(&self) -> DateTime<Utc> {
        Utc::now() + self.offset
    }

    /// How long, in real time, until the clock reads `at` (zero when it already has).
    pub fn until(&self, at: DateTime<Utc>) -> std::time::Duration {
        (at - self.now()).to_std().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shifted_clock_starts_where_asked_and_runs_on() {
        let start: DateTime<Utc> = "2026-12-02T21:59:50Z".parse().unwrap();
        let clock = Clock::starting_at(start);
        let first = clock.now();
        assert!((first - start).num_seconds().abs() <= 1, "{first}");
        let boundary: DateTime<Utc> = "2026-12-02T22:00:00Z".parse().unwrap();
        let wait = clock.until(boundary);
        assert!(
            wait <= std::time::Duration::from_secs(10) && wait >= std::time::Duration::from_secs(8)
        );
        assert_eq!(clock.until(start), std::time::Duration::ZERO);
        assert!(clock.now() >= first);
    }
}
