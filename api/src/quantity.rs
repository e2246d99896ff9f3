//! Kubernetes quantities (`20Gi`, `500Mi`, `1.5G`) as byte counts.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube_quantity::ParsedQuantity;

/// Why a quantity cannot be used as a size in bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("{0:?} is not a Kubernetes quantity (write e.g. 20Gi, 512Mi or 40G)")]
    Malformed(String),
    #[error("{0:?} must be a whole, non-negative number of bytes")]
    NotBytes(String),
}

/// The number of bytes a quantity stands for.
pub fn bytes_of(q: &Quantity) -> Result<u64, QuantityError> {
    let parsed: ParsedQuantity = q
        .try_into()
        .map_err(|_| QuantityError::Malformed(q.0.clone()))?;
    let value = parsed
        .to_bytes_f64()
        .ok_or_else(|| QuantityError::NotBytes(q.0.clone()))?;
    if !(0.0..=u64::MAX as f64).contains(&value) || value.fract() != 0.0 {
        return Err(QuantityError::NotBytes(q.0.clone()));
    }
    Ok(value as u64)
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

    fn q(s: &str) -> Quantity {
        Quantity(s.to_string())
    }

    #[test]
    fn binary_and_decimal_suffixes() {
        assert_eq!(bytes_of(&q("20Gi")), Ok(20 << 30));
        assert_eq!(bytes_of(&q("512Mi")), Ok(512 << 20));
        assert_eq!(bytes_of(&q("40G")), Ok(40_000_000_000));
        assert_eq!(bytes_of(&q("1024")), Ok(1024));
    }

    #[test]
    fn rejects_garbage_and_fractions_of_a_byte() {
        assert!(matches!(
            bytes_of(&q("twenty")),
            Err(QuantityError::Malformed(_))
        ));
        assert!(bytes_of(&q("1m")).is_err());
    }

    #[test]
    fn formats_in_the_largest_exact_unit() {
        assert_eq!(format_bytes(20 << 30), "20Gi");
        assert_eq!(format_bytes(1536 << 20), "1536Mi");
        assert_eq!(format_bytes(1000), "1000");
    }
}
