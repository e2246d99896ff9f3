//! Checkpoint intervals (CheckpointPolicy `interval`). A workload is told its interval and its
//! marker (`GPUSLICE_CHECKPOINT_INTERVAL`, `GPUSLICE_CHECKPOINT_DONE`) and writes the marker
//! after each checkpoint; the agent reads when it last did (the marker's time) on every pass.
//! A workload whose last checkpoint (or, before its first, the moment the agent saw it take the
//! slice) is older than its interval by half again is overdue: said once per missed checkpoint
//! (an Event on its pods, a log line for `gpuslice run`), so its owner learns before a drain
//! loses that work.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

/// A held slice as the watch sees it: who holds it and how often its policy wants a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Watched {
    pub slice: String,
    /// Who holds it (a claim's `namespace/name`, or a process id): another holder starts afresh.
    pub holder: String,
    /// The CheckpointPolicy and its interval.
    pub policy: String,
    pub interval: Duration,
    /// When its workload last wrote the marker.
    pub last_checkpoint: Option<DateTime<Utc>>,
}

/// A workload past its interval by half again.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Overdue {
    pub slice: String,
    pub holder: String,
    pub policy: String,
    pub interval: Duration,
    /// Its last checkpoint, or when the agent saw it take the slice (`checkpointed` says which).
    pub since: DateTime<Utc>,
    pub checkpointed: bool,
}

impl Overdue {
    /// What its owner is told.
    pub fn text(&self, now: DateTime<Utc>) -> String {
        let minutes = (now - self.since).num_seconds().max(0) / 60;
        let what = if self.checkpointed {
            "no checkpoint-done marker since its last checkpoint"
        } else {
            "no checkpoint-done marker since it took the slice"
        };
        format!(
            "slice {}: {what} {minutes} min ago; CheckpointPolicy {} asks for one every {}s (write $GPUSLICE_CHECKPOINT_DONE after each): a drain now would lose that work",
            self.slice,
            self.policy,
            self.interval.as_secs()
        )
    }
}

/// A slice's holder as the watch last saw it.
#[derive(Debug)]
struct Seen {
    holder: String,
    /// When the agent first saw this holder on the slice.
    first: DateTime<Utc>,
    /// The `since` of the last overdue said, so each missed checkpoint is said once.
    told: Option<DateTime<Utc>>,
}

/// Per slice: its holder as last seen.
#[derive(Debug, Default)]
pub struct IntervalWatch {
    seen: BTreeMap<String, Seen>,
}

impl IntervalWatch {
    /// The workloads newly overdue at `now`; slices no longer watched are forgotten.
    pub fn check(&mut self, watched: &[Watched], now: DateTime<Utc>) -> Vec<Overdue> {
        self.seen
            .retain(|slice, _| watched.iter().any(|w| &w.slice == slice));
        let mut overdue = Vec::new();
        for w in watched {
            let fresh = || Seen {
                holder: w.holder.clone(),
                first: now,
                told: None,
            };
            let seen = self.seen.entry(w.slice.clone()).or_insert_with(fresh);
            if seen.holder != w.holder {
                *seen = fresh();
            }
            // A marker older than the holder is another holder's.
            let checkpoint = w.last_checkpoint.filter(|t| *t >= seen.first);
            let since = checkpoint.unwrap_or(seen.first);
            let allowed = w.interval + w.interval / 2;
            let late = TimeDelta::from_std(allowed).is_ok_and(|allowed| now - since > allowed);
            if late && seen.told != Some(since) {
                seen.told = Some(since);
                overdue.push(Overdue {
                    slice: w.slice.clone(),
                    holder: w.holder.clone(),
                    policy: w.policy.clone(),
                    interval: w.interval,
                    since,
                    checkpointed: checkpoint.is_some(),
                });
            }
        }
        overdue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).unwrap()
    }

    fn notebook(last_checkpoint: Option<i64>) -> Watched {
        Watched {
            slice: "gpu0-s1".into(),
            holder: "ml/notebook".into(),
            policy: "standard".into(),
            interval: Duration::from_secs(300),
            last_checkpoint: last_checkpoint.map(at),
        }
    }

    #[test]
    fn a_workload_is_told_once_per_missed_checkpoint() {
        let mut watch = IntervalWatch::default();
        // Seen at 0, never checkpointed: overdue after 1.5 × 300 s, said once.
        assert!(watch.check(&[notebook(None)], at(0)).is_empty());
        assert!(watch.check(&[notebook(None)], at(450)).is_empty());
        let late = watch.check(&[notebook(None)], at(451));
        assert_eq!(late.len(), 1);
        assert!(!late[0].checkpointed && late[0].since == at(0));
        assert!(
            late[0]
                .text(at(451))
                .contains("since it took the slice 7 min ago")
        );
        assert!(
            watch.check(&[notebook(None)], at(900)).is_empty(),
            "said once"
        );
        // It checkpoints at 1000: on time until 1450, then told again.
        assert!(watch.check(&[notebook(Some(1000))], at(1400)).is_empty());
        let late = watch.check(&[notebook(Some(1000))], at(1500));
        assert_eq!(late.len(), 1);
        assert!(late[0].checkpointed && late[0].since == at(1000));
    }

    #[test]
    fn a_new_holder_starts_afresh_and_a_marker_older_than_it_is_not_its_own() {
        let mut watch = IntervalWatch::default();
        watch.check(&[notebook(None)], at(0));
        let mut next = notebook(Some(100));
        next.holder = "ml/other".into();
        // Taken at 200 by another workload; the marker from 100 is the first one's.
        assert!(watch.check(&[next.clone()], at(200)).is_empty());
        assert!(watch.check(&[next.clone()], at(600)).is_empty());
        let late = watch.check(&[next], at(700));
        assert_eq!(late.len(), 1);
        assert!(!late[0].checkpointed && late[0].since == at(200));
    }
}
