//! Times of day, days of the week and daily windows, as written in pool specs.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A day of the week, written as its three-letter English abbreviation.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub enum Weekday {
    Mon,
    Tue,
    Wed,
    Thu,
    Fri,
    Sat,
    Sun,
}

impl Weekday {
    pub const ALL: [Weekday; 7] = [
        Weekday::Mon,
        Weekday::Tue,
        Weekday::Wed,
        Weekday::Thu,
        Weekday::Fri,
        Weekday::Sat,
        Weekday::Sun,
    ];

    /// Days since Monday (Mon = 0 … Sun = 6).
    pub fn index(self) -> u32 {
        self as u32
    }
}

/// The regular expression a time of day must match (`HH:MM`, 24-hour clock).
pub const CLOCK_TIME_PATTERN: &str = "^([01][0-9]|2[0-3]):[0-5][0-9]$";

/// The regular expression a duration must match: Go's `time.ParseDuration` format, not negative.
pub const DURATION_PATTERN: &str = "^(0|(([0-9]+(\\.[0-9]*)?|\\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+)$";

/// A time of day on the 24-hour clock, `HH:MM` (for example `"20:00"`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClockTime(pub String);

impl JsonSchema for ClockTime {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ClockTime".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "maxLength": 5,
            "pattern": CLOCK_TIME_PATTERN,
        })
    }
}

impl ClockTime {
    /// Minutes after midnight, or `None` when the text is not `HH:MM`.
    pub fn minutes(&self) -> Option<u32> {
        let (h, m) = self.0.split_once(':')?;
        if h.len() != 2 || m.len() != 2 {
            return None;
        }
        let h: u32 = h.parse().ok()?;
        let m: u32 = m.parse().ok()?;
        (h < 24 && m < 60).then_some(h * 60 + m)
    }
}

impl From<&str> for ClockTime {
    fn from(s: &str) -> Self {
        ClockTime(s.to_string())
    }
}

/// A daily window of time in one time zone, such as a maintenance window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, kube::KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.start != self.end").message("start and end must differ (a window of zero length never opens)"))]
pub struct DailyWindow {
    /// When the window opens, `HH:MM` in `timeZone`.
    pub start: ClockTime,
    /// When the window closes, `HH:MM` in `timeZone`; earlier than `start` means it closes the next day.
    pub end: ClockTime,
    /// IANA time zone name, for example `UTC` or `Europe/Berlin`.
    #[serde(default = "utc")]
    #[schemars(length(min = 1, max = 64))]
    pub time_zone: String,
}

pub(crate) fn utc() -> String {
    "UTC".to_string()
}

/// A Kubernetes time for a chrono one (`None` out of range).
pub fn time_of(
    at: chrono::DateTime<chrono::Utc>,
) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time> {
    k8s_openapi::jiff::Timestamp::new(at.timestamp(), at.timestamp_subsec_nanos() as i32)
        .ok()
        .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time)
}

/// A chrono time for a Kubernetes one.
pub fn chrono_of(
    t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::from_timestamp(t.0.as_second(), t.0.subsec_nanosecond().max(0) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_time_minutes() {
        assert_eq!(ClockTime::from("00:00").minutes(), Some(0));
        assert_eq!(ClockTime::from("20:30").minutes(), Some(20 * 60 + 30));
        assert_eq!(ClockTime::from("24:00").minutes(), None);
        assert_eq!(ClockTime::from("8:00").minutes(), None);
        assert_eq!(ClockTime::from("08:60").minutes(), None);
    }
}
