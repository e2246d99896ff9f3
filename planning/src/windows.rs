//! Time-of-day windows in IANA time zones: when each is open, which is active, when the next
//! change happens, and whether two windows overlap.
//!
//! Local times that do not exist (spring-forward gaps) move to the first minute after the gap;
//! local times that happen twice (fall-back) take the first, so a window neither vanishes nor
//! opens twice on a daylight-saving day.

use chrono::{
    DateTime, Datelike, Duration, LocalResult, NaiveDate, NaiveDateTime, NaiveTime, TimeZone, Utc,
};
use chrono_tz::Tz;
use gpuslice_api::{ClockTime, DailyWindow, TimeWindow, Weekday};

/// Why a window cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error("{0:?} is not an IANA time zone (write e.g. UTC, Europe/Berlin or Asia/Shanghai)")]
    UnknownTimeZone(String),
    #[error("{0:?} is not a time of day: write HH:MM on the 24-hour clock")]
    BadTime(String),
    #[error("start and end are both {0}: a window of zero length never opens")]
    Empty(String),
}

/// A weekly recurrence: opens at `start` on each of `days`, closes at the next `end`.
#[derive(Clone, Debug, PartialEq)]
pub struct Recurrence {
    pub tz: Tz,
    pub days: Vec<Weekday>,
    /// Minutes after local midnight.
    pub start: u32,
    /// Minutes after local midnight; at or before `start` means the next day.
    pub end: u32,
}

/// One opening of a window, in UTC, half-open `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Interval {
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
}

/// Looks up an IANA time zone.
pub fn time_zone(name: &str) -> Result<Tz, WindowError> {
    name.parse::<Tz>()
        .map_err(|_| WindowError::UnknownTimeZone(name.to_string()))
}

fn minutes(t: &ClockTime) -> Result<u32, WindowError> {
    t.minutes().ok_or_else(|| WindowError::BadTime(t.0.clone()))
}

impl Recurrence {
    pub fn new(
        tz: &str,
        days: &[Weekday],
        start: &ClockTime,
        end: &ClockTime,
    ) -> Result<Self, WindowError> {
        let (start_min, end_min) = (minutes(start)?, minutes(end)?);
        if start_min == end_min {
            return Err(WindowError::Empty(start.0.clone()));
        }
        Ok(Recurrence {
            tz: time_zone(tz)?,
            days: days.to_vec(),
            start: start_min,
            end: end_min,
        })
    }

    pub fn of_window(w: &TimeWindow) -> Result<Self, WindowError> {
        Self::new(&w.time_zone, &w.days, &w.start, &w.end)
    }

    pub fn of_daily(w: &DailyWindow) -> Result<Self, WindowError> {
        Self::new(&w.time_zone, &Weekday::ALL, &w.start, &w.end)
    }

    /// Openings that intersect `[from, to)`, in order.
    pub fn occurrences(&self, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<Interval> {
        let first = from.with_timezone(&self.tz).date_naive() - Duration::days(2);
        let last = to.with_timezone(&self.tz).date_naive() + Duration::days(1);
        let mut out = Vec::new();
        let mut day = first;
        while day <= last {
            if self
                .days
                .iter()
                .any(|d| d.index() == day.weekday().num_days_from_monday())
            {
                let end_day = if self.end <= self.start {
                    day + Duration::days(1)
                } else {
                    day
                };
                let interval = Interval {
                    start: self.instant(day, self.start),
                    end: self.instant(end_day, self.end),
                };
                if interval.end > from && interval.start < to && interval.start < interval.end {
                    out.push(interval);
                }
            }
            day += Duration::days(1);
        }
        out
    }

    /// The UTC instant of a local date and minute, resolving gaps and repeats.
    fn instant(&self, day: NaiveDate, minute: u32) -> DateTime<Utc> {
        let time =
            NaiveTime::from_hms_opt(minute / 60, minute % 60, 0).expect("minute of day < 1440");
        let mut local: NaiveDateTime = day.and_time(time);
        // Gaps are at most a few hours (usually one); step to the first local time that exists.
        for _ in 0..=24 * 60 {
            match self.tz.from_local_datetime(&local) {
                LocalResult::Single(t) => return t.with_timezone(&Utc),
                LocalResult::Ambiguous(first, _) => return first.with_timezone(&Utc),
                LocalResult::None => local += Duration::minutes(1),
            }
        }
        Utc.from_utc_datetime(&local)
    }
}

/// The first instant at which two recurrences are both open, searching `days` days from `from`.
pub fn first_overlap(
    a: &Recurrence,
    b: &Recurrence,
    from: DateTime<Utc>,
    days: i64,
) -> Option<DateTime<Utc>> {
    let to = from + Duration::days(days);
    let (xs, ys) = (a.occurrences(from, to), b.occurrences(from, to));
    let mut best: Option<DateTime<Utc>> = None;
    for x in &xs {
        for y in ys.iter().filter(|y| y.start < x.end && x.start < y.end) {
            let at = x.start.max(y.start);
            best = Some(best.map_or(at, |b| b.min(at)));
        }
    }
    best
}

/// Which of `windows` is open at `at` (the first, if several), and when that next changes.
pub fn active_at(
    windows: &[Recurrence],
    at: DateTime<Utc>,
) -> (Option<usize>, Option<DateTime<Utc>>) {
    let horizon = at + Duration::days(8);
    let mut active = None;
    let mut next: Option<DateTime<Utc>> = None;
    for (i, w) in windows.iter().enumerate() {
        for occ in w.occurrences(at, horizon) {
            if occ.start <= at && at < occ.end && active.is_none() {
                active = Some(i);
            }
            for edge in [occ.start, occ.end] {
                if edge > at {
                    next = Some(next.map_or(edge, |n| n.min(edge)));
                }
            }
        }
    }
    (active, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn every_day(tz: &str, start: &str, end: &str) -> Recurrence {
        Recurrence::new(tz, &Weekday::ALL, &start.into(), &end.into()).unwrap()
    }

    #[test]
    fn night_window_crosses_midnight_in_shanghai() {
        let night = every_day("Asia/Shanghai", "20:00", "08:00");
        // 13:00 UTC = 21:00 in Shanghai: open; 02:00 UTC = 10:00: closed.
        assert_eq!(
            active_at(std::slice::from_ref(&night), utc("2026-12-02T13:00:00Z")).0,
            Some(0)
        );
        let (active, next) = active_at(std::slice::from_ref(&night), utc("2026-12-02T02:00:00Z"));
        assert_eq!(active, None);
        assert_eq!(next, Some(utc("2026-12-02T12:00:00Z")));
    }

    #[test]
    fn spring_forward_start_in_the_gap_opens_once_at_the_end_of_the_gap() {
        // Europe/Berlin skips 02:00-03:00 on 2026-03-29.
        let w = every_day("Europe/Berlin", "02:30", "04:00");
        let occ = w.occurrences(utc("2026-03-28T12:00:00Z"), utc("2026-03-29T12:00:00Z"));
        assert_eq!(
            occ,
            vec![Interval {
                start: utc("2026-03-29T01:00:00Z"),
                end: utc("2026-03-29T02:00:00Z")
            }]
        );
    }

    #[test]
    fn fall_back_repeat_opens_once() {
        // America/New_York repeats 01:00-02:00 on 2026-11-01.
        let w = every_day("America/New_York", "01:30", "03:00");
        let occ = w.occurrences(utc("2026-11-01T00:00:00Z"), utc("2026-11-02T00:00:00Z"));
        assert_eq!(occ.len(), 1);
        assert_eq!(occ[0].start, utc("2026-11-01T05:30:00Z"));
        assert_eq!(occ[0].end, utc("2026-11-01T08:00:00Z"));
    }

    #[test]
    fn overlap_across_time_zones() {
        let a = every_day("UTC", "12:00", "14:00");
        let b = every_day("Asia/Shanghai", "21:00", "22:00"); // 13:00-14:00 UTC
        let c = every_day("Asia/Shanghai", "23:00", "01:00"); // 15:00-17:00 UTC
        let from = utc("2026-12-02T00:00:00Z");
        assert_eq!(
            first_overlap(&a, &b, from, 7),
            Some(utc("2026-12-02T13:00:00Z"))
        );
        assert_eq!(first_overlap(&a, &c, from, 7), None);
    }

    #[test]
    fn weekday_windows_only_open_on_their_days() {
        let w = Recurrence::new(
            "UTC",
            &[Weekday::Sat, Weekday::Sun],
            &"00:00".into(),
            &"23:59".into(),
        )
        .unwrap();
        // 2026-12-02 is a Wednesday.
        assert_eq!(
            active_at(std::slice::from_ref(&w), utc("2026-12-02T10:00:00Z")).0,
            None
        );
        assert_eq!(
            active_at(std::slice::from_ref(&w), utc("2026-12-05T10:00:00Z")).0,
            Some(0)
        );
    }

    /// Daylight-saving edge cases in two zones: each window opens exactly once on the day, at
    /// the instant given (UTC), and closes at the instant given.
    #[test]
    fn dst_edge_cases_in_berlin_and_new_york() {
        let table = [
            // zone, start, end, a UTC instant on the local day before, expected open, expected close
            (
                "Europe/Berlin",
                "02:30",
                "04:00",
                "2026-03-28T12:00:00Z",
                "2026-03-29T01:00:00Z",
                "2026-03-29T02:00:00Z",
            ), // spring gap: opens at 03:00 CEST
            (
                "Europe/Berlin",
                "02:00",
                "02:59",
                "2026-03-28T12:00:00Z",
                "2026-03-29T01:00:00Z",
                "2026-03-29T01:00:00Z",
            ), // entirely in the gap: vanishes to nothing, not twice
            (
                "Europe/Berlin",
                "02:30",
                "04:00",
                "2026-10-24T12:00:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-25T03:00:00Z",
            ), // fall repeat: first 02:30 (CEST)
            (
                "Europe/Berlin",
                "22:00",
                "06:00",
                "2026-10-24T12:00:00Z",
                "2026-10-24T20:00:00Z",
                "2026-10-25T05:00:00Z",
            ), // night crossing the change: 9 h
            (
                "America/New_York",
                "02:30",
                "05:00",
                "2026-03-07T12:00:00Z",
                "2026-03-08T07:00:00Z",
                "2026-03-08T09:00:00Z",
            ), // spring gap: opens at 03:00 EDT
            (
                "America/New_York",
                "20:00",
                "08:00",
                "2026-03-07T12:00:00Z",
                "2026-03-08T01:00:00Z",
                "2026-03-08T12:00:00Z",
            ), // night crossing the change: 11 h
            (
                "America/New_York",
                "01:30",
                "03:00",
                "2026-10-31T12:00:00Z",
                "2026-11-01T05:30:00Z",
                "2026-11-01T08:00:00Z",
            ), // fall repeat: first 01:30 (EDT)
        ];
        for (zone, start, end, from, open, close) in table {
            let w = every_day(zone, start, end);
            let from = utc(from);
            let occ: Vec<Interval> = w
                .occurrences(from, from + Duration::hours(24))
                .into_iter()
                .filter(|o| o.start >= from)
                .collect();
            let case = format!("{zone} {start}-{end} after {from}");
            if open == close {
                assert!(occ.is_empty(), "{case}: {occ:?}");
                continue;
            }
            assert_eq!(occ.len(), 1, "{case}: opens exactly once: {occ:?}");
            assert_eq!(
                (occ[0].start, occ[0].end),
                (utc(open), utc(close)),
                "{case}"
            );
        }
    }

    #[test]
    fn compaction_windows_are_daily() {
        let w = Recurrence::of_daily(&DailyWindow {
            start: "03:00".into(),
            end: "04:00".into(),
            time_zone: "UTC".into(),
        })
        .unwrap();
        let (active, next) = active_at(std::slice::from_ref(&w), utc("2026-12-05T03:30:00Z"));
        assert_eq!((active, next), (Some(0), Some(utc("2026-12-05T04:00:00Z"))));
    }

    #[test]
    fn bad_inputs_name_the_problem() {
        assert_eq!(
            time_zone("Mars/Olympus"),
            Err(WindowError::UnknownTimeZone("Mars/Olympus".into()))
        );
        assert!(matches!(
            Recurrence::new("UTC", &Weekday::ALL, &"08:00".into(), &"08:00".into()),
            Err(WindowError::Empty(_))
        ));
    }
}
