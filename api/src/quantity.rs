//! Kubernetes quantities (`20Gi`, `500Mi`, `1.5G`) as byte counts.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_quantity::ParsedQuantity;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A size written as a Kubernetes quantity string (`20Gi`, `500Mi`), in spec fields that carry
/// CEL rules: a bounded string keeps the rules' estimated cost within the API server's budget.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Size(pub String);

impl Size {
    pub fn new(text: &str) -> Size {
        Size(text.to_string())
    }

    /// The number of bytes.
    pub fn bytes(&self) -> Result<u64, QuantityError> {
        bytes_of(&self.0)
    }
}

impl JsonSchema for Size {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Size".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"type": "string", "maxLength": 32})
    }
}

/// Why a quantity cannot be used as a size in bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("{0:?} is not a Kubernetes quantity (write e.g. 20Gi, 512Mi or 40G)")]
    Malformed(String),
    #[error("{0:?} must be a whole, non-negative number of bytes")]
    NotBytes(String),
    #[error("{0:?} must be a non-negative CPU quantity in whole millicores (write e.g. 4 or 500m)")]
    NotCpu(String),
}

/// `value` as a whole number, where it is one up to the binary floating point's round-off
/// (`700m` × 1000 is 700.0000000000001 in f64); none when negative, too large or fractional.
fn whole(value: f64) -> Option<u64> {
    let rounded = value.round();
    let exact = (value - rounded).abs() <= 1e-9 * rounded.max(1.0);
    ((0.0..=u64::MAX as f64).contains(&rounded) && exact).then_some(rounded as u64)
}

/// The millicores a CPU quantity (`4`, `500m`, `1.5`) stands for.
pub fn millicores_of(text: &str) -> Result<u64, QuantityError> {
    let parsed: ParsedQuantity = Quantity(text.to_string())
        .try_into()
        .map_err(|_| QuantityError::Malformed(text.to_string()))?;
    let value = parsed
        .to_bytes_f64()
        .map(|cores| cores * 1000.0)
        .ok_or_else(|| QuantityError::NotCpu(text.to_string()))?;
    whole(value).ok_or_else(|| QuantityError::NotCpu(text.to_string()))
}

/// The number of bytes a quantity (`20Gi`, `1.5G`, `1024`) stands for.
pub fn bytes_of(text: &str) -> Result<u64, QuantityError> {
    let parsed: ParsedQuantity = Quantity(text.to_string())
        .try_into()
        .map_err(|_| QuantityError::Malformed(text.to_string()))?;
    let value = parsed
        .to_bytes_f64()
        .ok_or_else(|| QuantityError::NotBytes(text.to_string()))?;
    whole(value).ok_or_else(|| QuantityError::NotBytes(text.to_string()))
}

/// A byte count in the largest binary unit that divides it (`20Gi`, `1536Mi`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 5] = [
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ];
    for (suffix, size) in UNITS {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{}{suffix}", bytes / size);
        }
    }
    if bytes >= 1 << 30 {
        return format!("{:.2}Gi", bytes as f64 / (1u64 << 30) as f64);
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> &str {
        s
    }

    #[test]
    fn binary_and_decimal_suffixes() {
        assert_eq!(bytes_of(q("20Gi")), Ok(20 << 30));
        assert_eq!(bytes_of(q("512Mi")), Ok(512 << 20));
        assert_eq!(bytes_of(q("40G")), Ok(40_000_000_000));
        assert_eq!(bytes_of(q("1024")), Ok(1024));
    }

    #[test]
    fn rejects_garbage_and_fractions_of_a_byte() {
        assert!(matches!(
            bytes_of(q("twenty")),
            Err(QuantityError::Malformed(_))
        ));
        assert!(bytes_of(q("1m")).is_err());
    }

    #[test]
    fn millicores_that_binary_floating_point_cannot_hold_exactly_still_read() {
        // 700m, 940m (GKE's allocatable on one vCPU) and 31580m are not exact in f64 after
        // scaling; every whole millicore count must read back as itself.
        for m in [9, 13, 700, 940, 1900, 31580, 199_999] {
            assert_eq!(millicores_of(&format!("{m}m")), Ok(m), "{m}m");
        }
        assert_eq!(millicores_of("1.5"), Ok(1500));
        assert!(millicores_of("0.5m").is_err());
        assert!(millicores_of("-1").is_err());
    }

    #[test]
    fn formats_in_the_largest_exact_unit() {
        assert_eq!(format_bytes(20 << 30), "20Gi");
        assert_eq!(format_bytes(1536 << 20), "1536Mi");
        assert_eq!(format_bytes(1000), "1000");
    }
}
