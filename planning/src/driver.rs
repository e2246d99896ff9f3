//! The driver pre-check: whether a node's NVIDIA driver is new enough for software slices. The
//! shim needs what it hooks (`cuGetProcAddress_v2`, CUDA 12.0, whose Linux driver is 525.60.13);
//! a pool may ask for more. Old drivers break isolation, so a node below either offers no
//! software slices — MIG instances are isolated by the hardware and stay offered.

use std::cmp::Ordering;
use std::fmt;

use gpuslice_api::{DriverMinimum, DriverVersions};

/// The oldest driver the shim works with: CUDA 12.0's minimum Linux driver.
pub const SHIM_MIN_DRIVER: &str = "525.60.13";
/// The oldest CUDA driver API the shim works with (it hooks `cuGetProcAddress_v2`, new in 12.0).
pub const SHIM_MIN_CUDA: &str = "12.0";

/// A dotted version compared number by number, missing parts as 0 (`550` = `550.0.0`).
#[derive(Clone, Debug)]
pub struct Version(Vec<u32>);

impl Version {
    /// Reads the leading `N[.N…]` of `text` (NVML may add a suffix such as `-open`); `None` when
    /// it does not start with a number.
    pub fn parse(text: &str) -> Option<Version> {
        let end = text
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(text.len());
        let parts: Option<Vec<u32>> = text[..end]
            .split('.')
            .filter(|p| !p.is_empty())
            .map(|p| p.parse().ok())
            .collect();
        parts.filter(|p| !p.is_empty()).map(Version)
    }

    fn part(&self, i: usize) -> u32 {
        self.0.get(i).copied().unwrap_or(0)
    }
}

impl Ord for Version {
    fn cmp(&self, other: &Self) -> Ordering {
        (0..self.0.len().max(other.0.len()))
            .map(|i| self.part(i).cmp(&other.part(i)))
            .find(|o| o.is_ne())
            .unwrap_or(Ordering::Equal)
    }
}

impl PartialEq for Version {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Version {}

impl PartialOrd for Version {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// NVML's CUDA driver version (`12040`) as `major.minor` (`12.4`).
pub fn cuda_version(nvml: i32) -> String {
    format!("{}.{}", nvml / 1000, (nvml % 1000) / 10)
}

/// What a node's driver falls short of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// What NVML reported (`None`: it reported nothing).
    pub found: Option<DriverVersions>,
    /// The driver and CUDA versions needed, the higher of the shim's and the pool's.
    pub driver: String,
    pub cuda: String,
    /// Whose minimum is not met: `the gpuslice shim`, `GpuPool p`.
    pub by: Vec<String>,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.found {
            Some(found) => write!(
                f,
                "driver {} (CUDA {}) is older than {} need{} (driver {} or newer, CUDA {} or newer)",
                found.version,
                found.cuda,
                self.by.join(" and "),
                if self.by.len() == 1 { "s" } else { "" },
                self.driver,
                self.cuda
            )?,
            None => write!(
                f,
                "NVML did not report the driver version, so it cannot be checked against what {} need{} (driver {} or newer, CUDA {} or newer)",
                self.by.join(" and "),
                if self.by.len() == 1 { "s" } else { "" },
                self.driver,
                self.cuda
            )?,
        }
        write!(
            f,
            ": install NVIDIA driver {} or newer on the node; until then its software slices are not offered (MIG instances and whole GPUs are)",
            self.driver
        )
    }
}

/// Checks `found` against the shim's minimum and the pool's (`pool`: its name and
/// `spec.driver`). A minimum that does not parse cannot be enforced and is left out (the CRD's
/// pattern keeps it from being stored).
pub fn check(
    found: Option<&DriverVersions>,
    pool: Option<(&str, &DriverMinimum)>,
) -> Result<(), Shortfall> {
    let shim = (
        "the gpuslice shim".to_string(),
        Some(SHIM_MIN_DRIVER),
        Some(SHIM_MIN_CUDA),
    );
    let wanted = pool.map(|(name, min)| {
        (
            format!("GpuPool {name}"),
            min.min_version.as_deref(),
            min.min_cuda_version.as_deref(),
        )
    });
    let found_driver = found.and_then(|f| Version::parse(&f.version));
    let found_cuda = found.and_then(|f| Version::parse(&f.cuda));
    let below = |have: &Option<Version>, need: Option<&str>| match need.and_then(Version::parse) {
        Some(need) => have.as_ref().is_none_or(|have| *have < need),
        None => false,
    };
    let mut by = Vec::new();
    let mut driver = Version::parse(SHIM_MIN_DRIVER).unwrap_or(Version(vec![0]));
    let mut cuda = Version::parse(SHIM_MIN_CUDA).unwrap_or(Version(vec![0]));
    let mut driver_text = SHIM_MIN_DRIVER.to_string();
    let mut cuda_text = SHIM_MIN_CUDA.to_string();
    for (who, min_driver, min_cuda) in std::iter::once(shim).chain(wanted) {
        if below(&found_driver, min_driver) || below(&found_cuda, min_cuda) {
            by.push(who);
        }
        if let Some((v, text)) = min_driver.and_then(|t| Some((Version::parse(t)?, t)))
            && v > driver
        {
            driver = v;
            driver_text = text.to_string();
        }
        if let Some((v, text)) = min_cuda.and_then(|t| Some((Version::parse(t)?, t)))
            && v > cuda
        {
            cuda = v;
            cuda_text = text.to_string();
        }
    }
    if by.is_empty() {
        return Ok(());
    }
    Err(Shortfall {
        found: found.cloned(),
        driver: driver_text,
        cuda: cuda_text,
        by,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn driver(version: &str, cuda: &str) -> DriverVersions {
        DriverVersions {
            version: version.into(),
            cuda: cuda.into(),
        }
    }

    fn minimum(version: Option<&str>, cuda: Option<&str>) -> DriverMinimum {
        DriverMinimum {
            min_version: version.map(Into::into),
            min_cuda_version: cuda.map(Into::into),
        }
    }

    #[test]
    fn versions_compare_number_by_number_with_missing_parts_as_zero() {
        let v = |t| Version::parse(t).unwrap();
        assert!(v("550.54.15") > v("550.54.9"));
        assert!(v("550") == v("550.0.0"));
        assert!(v("535.104.05") < v("550"));
        assert_eq!(v("575.57.08-open"), v("575.57.8"));
        assert_eq!(Version::parse("r550"), None);
        assert_eq!(cuda_version(12080), "12.8");
        assert_eq!(cuda_version(11040), "11.4");
    }

    #[test]
    fn a_current_driver_passes_the_shim_and_the_pool() {
        let found = driver("575.57.08", "12.8");
        assert_eq!(check(Some(&found), None), Ok(()));
        let pool = minimum(Some("550.54.15"), Some("12.4"));
        assert_eq!(check(Some(&found), Some(("train", &pool))), Ok(()));
    }

    #[test]
    fn an_old_driver_fails_the_shim_and_the_message_names_both_versions_and_the_fix() {
        let found = driver("470.82.01", "11.4");
        let short = check(Some(&found), None).unwrap_err();
        assert_eq!(short.by, vec!["the gpuslice shim"]);
        let text = short.to_string();
        assert!(text.contains("driver 470.82.01 (CUDA 11.4)"), "{text}");
        assert!(
            text.contains("driver 525.60.13 or newer, CUDA 12.0 or newer"),
            "{text}"
        );
        assert!(
            text.contains("install NVIDIA driver 525.60.13 or newer"),
            "{text}"
        );
    }

    #[test]
    fn a_pool_may_ask_more_than_the_shim_and_the_higher_minimum_is_named() {
        let found = driver("535.104.05", "12.2");
        let pool = minimum(Some("550"), None);
        let short = check(Some(&found), Some(("train", &pool))).unwrap_err();
        assert_eq!(short.by, vec!["GpuPool train"]);
        assert_eq!(short.driver, "550");
        assert_eq!(short.cuda, "12.0");
        let cuda_only = minimum(None, Some("12.4"));
        let short = check(Some(&found), Some(("infer", &cuda_only))).unwrap_err();
        assert_eq!(
            (short.driver.as_str(), short.cuda.as_str()),
            ("525.60.13", "12.4")
        );
        let old = driver("470.82.01", "11.4");
        let both = check(Some(&old), Some(("train", &pool))).unwrap_err();
        assert_eq!(both.by, vec!["the gpuslice shim", "GpuPool train"]);
        assert!(both.to_string().contains("need (driver 550 or newer"));
    }

    #[test]
    fn an_unreported_driver_fails_closed() {
        let short = check(None, None).unwrap_err();
        assert!(short.to_string().starts_with("NVML did not report"));
    }
}
