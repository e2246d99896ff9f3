//! What the API server would say about an object, computed locally from the same generated
//! schema: structure (types, required fields, unknown fields, ranges, patterns, enums, list keys)
//! and the CEL rules (`x-kubernetes-validations`, evaluated by kube's client-side CEL).
//!
//! This is what makes `gpuslice validate` reject everything the server rejects.

use std::collections::{BTreeMap, HashSet};
use std::sync::{LazyLock, Mutex};

use kube::core::cel::{ErrorKind, Validator};
use serde_json::Value;

use crate::Kind;
use crate::crd::schema;

/// One problem with one field, as the API server would report it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Dotted path with list indices, for example `spec.windows[0].start`.
    pub path: String,
    /// Why the value is rejected, phrased so the user knows what to change.
    pub message: String,
}

impl FieldError {
    fn new(path: &str, message: impl Into<String>) -> Self {
        FieldError {
            path: path.to_string(),
            message: message.into(),
        }
    }
}

/// Checks an object (as JSON) of one of our kinds against its CRD schema and CEL rules.
pub fn check(kind: Kind, object: &Value) -> Vec<FieldError> {
    let schema = schema(kind);
    let mut errors = Vec::new();
    check_metadata(object, &mut errors);
    let mut walker = Walker {
        errors: &mut errors,
    };
    // `apiVersion`, `kind` and `metadata` are checked by the API machinery, not the CRD schema.
    if let (Some(props), Some(obj)) = (schema.get("properties"), object.as_object()) {
        for (key, value) in obj {
            if matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                continue;
            }
            match props.get(key) {
                Some(sub) => walker.walk(sub, value, key),
                None => walker.unknown(key),
            }
        }
        for req in required(&schema) {
            if obj.get(req).is_none_or(Value::is_null) {
                walker
                    .errors
                    .push(FieldError::new(req, "required field is missing"));
            }
        }
    }
    let structural_errors = !errors.is_empty();
    if let Err(cel) = validator().validate(&schema, object, None) {
        for e in cel.iter() {
            // A rule that cannot evaluate because a field has the wrong type repeats a
            // structural error already reported; the server reports only the latter too.
            if structural_errors && e.kind != ErrorKind::ValidationFailure {
                continue;
            }
            let message = match e.kind {
                ErrorKind::ValidationFailure => e.message.clone(),
                _ => format!("rule `{}` could not be evaluated: {}", e.rule, e.message),
            };
            errors.push(FieldError::new(&e.field_path, message));
        }
    }
    errors
}

fn validator() -> std::sync::MutexGuard<'static, Validator> {
    static VALIDATOR: LazyLock<Mutex<Validator>> = LazyLock::new(|| Mutex::new(Validator::new()));
    VALIDATOR
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

const DNS_SUBDOMAIN: &str = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";

fn check_metadata(object: &Value, errors: &mut Vec<FieldError>) {
    match object.pointer("/metadata/name") {
        None | Some(Value::Null) => errors.push(FieldError::new(
            "metadata.name",
            "required field is missing",
        )),
        Some(Value::String(name)) => {
            if name.len() > 253 || !regex(DNS_SUBDOMAIN).is_some_and(|re| re.is_match(name)) {
                errors.push(FieldError::new(
                    "metadata.name",
                    format!("{name:?} is not a valid name: use lowercase letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253 characters"),
                ));
            }
        }
        Some(_) => errors.push(FieldError::new("metadata.name", "must be a string")),
    }
}

fn required(schema: &Value) -> impl Iterator<Item = &str> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
}

/// Compiled patterns, cached: the schema has few of them and validate sees many objects.
fn regex(pattern: &str) -> Option<regex::Regex> {
    static CACHE: LazyLock<Mutex<BTreeMap<String, Option<regex::Regex>>>> =
        LazyLock::new(Default::default);
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    cache
        .entry(pattern.to_string())
        .or_insert_with(|| regex::Regex::new(pattern).ok())
        .clone()
}

struct Walker<'a> {
    errors: &'a mut Vec<FieldError>,
}

fn describe(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

impl Walker<'_> {
    fn push(&mut self, path: &str, message: impl Into<String>) {
        self.errors.push(FieldError::new(path, message));
    }

    fn unknown(&mut self, path: &str) {
        self.push(path, "unknown field (check its spelling and indentation)");
    }

    fn walk(&mut self, schema: &Value, value: &Value, path: &str) {
        // The server prunes null values of non-nullable fields and treats them as absent.
        if value.is_null() {
            return;
        }
        if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true)) {
            return;
        }
        if schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
            if !(value.is_string() || value.is_i64() || value.is_u64()) {
                self.push(
                    path,
                    format!("must be an integer or a string, not {}", describe(value)),
                );
            }
            return;
        }
        let Some(ty) = schema.get("type").and_then(Value::as_str) else {
            return;
        };
        match (ty, value) {
            ("object", Value::Object(map)) => self.walk_object(schema, map, path),
            ("array", Value::Array(items)) => self.walk_array(schema, items, path),
            ("string", Value::String(s)) => self.check_string(schema, s, path),
            ("integer", Value::Number(n)) if n.is_i64() || n.is_u64() => {
                self.check_number(schema, value, path)
            }
            ("number", Value::Number(_)) => self.check_number(schema, value, path),
            ("boolean", Value::Bool(_)) => {}
            _ => {
                let want = match ty {
                    "object" => "a mapping",
                    "array" => "a list",
                    "string" => "a string",
                    "integer" => "an integer",
                    "number" => "a number",
                    "boolean" => "true or false",
                    other => other,
                };
                self.push(path, format!("must be {want}, not {}", describe(value)));
            }
        }
        self.check_enum(schema, value, path);
    }

    fn walk_object(&mut self, schema: &Value, map: &serde_json::Map<String, Value>, path: &str) {
        let props = schema.get("properties").and_then(Value::as_object);
        let additional = schema.get("additionalProperties").filter(|a| a.is_object());
        for (key, value) in map {
            let here = join(path, key);
            match (props.and_then(|p| p.get(key)), additional) {
                (Some(sub), _) | (None, Some(sub)) => self.walk(sub, value, &here),
                (None, None) => self.unknown(&here),
            }
        }
        for req in required(schema) {
            if map.get(req).is_none_or(Value::is_null) {
                self.push(&join(path, req), "required field is missing");
            }
        }
    }

    fn walk_array(&mut self, schema: &Value, items: &[Value], path: &str) {
        if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
            && (items.len() as u64) < min
        {
            self.push(
                path,
                format!(
                    "must have at least {min} item{}",
                    if min == 1 { "" } else { "s" }
                ),
            );
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                self.walk(item_schema, item, &format!("{path}[{i}]"));
            }
        }
        match schema.get("x-kubernetes-list-type").and_then(Value::as_str) {
            Some("map") => {
                let keys: Vec<&str> = schema
                    .get("x-kubernetes-list-map-keys")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                let mut seen = HashSet::new();
                for (i, item) in items.iter().enumerate() {
                    let key: Vec<String> = keys
                        .iter()
                        .map(|k| item.get(*k).map(Value::to_string).unwrap_or_default())
                        .collect();
                    if !seen.insert(key.clone()) {
                        self.push(
                            &format!("{path}[{i}]"),
                            format!(
                                "duplicate entry with {} {}: each must be unique",
                                keys.join("/"),
                                key.join("/")
                            ),
                        );
                    }
                }
            }
            Some("set") => {
                let mut seen = HashSet::new();
                for (i, item) in items.iter().enumerate() {
                    if !seen.insert(item.to_string()) {
                        self.push(&format!("{path}[{i}]"), format!("duplicate value {item}"));
                    }
                }
            }
            _ => {}
        }
    }

    fn check_string(&mut self, schema: &Value, s: &str, path: &str) {
        let len = s.chars().count() as u64;
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && len < min
        {
            self.push(
                path,
                if min == 1 {
                    "must not be empty".to_string()
                } else {
                    format!("must be at least {min} characters long")
                },
            );
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && len > max
        {
            self.push(path, format!("must be at most {max} characters long"));
        }
        if let Some(pattern) = schema.get("pattern").and_then(Value::as_str)
            && regex(pattern).is_some_and(|re| !re.is_match(s))
        {
            let expected = match pattern {
                crate::time::CLOCK_TIME_PATTERN => {
                    "a time of day HH:MM on the 24-hour clock, such as \"20:00\"".to_string()
                }
                crate::time::DURATION_PATTERN => {
                    "a duration such as 50ms, 90s, 5m or 1h30m".to_string()
                }
                crate::pool::DRIVER_VERSION_PATTERN => {
                    "a driver version such as \"550.54.15\"".to_string()
                }
                crate::pool::CUDA_VERSION_PATTERN => "a CUDA version such as \"12.4\"".to_string(),
                other => format!("text matching {other}"),
            };
            self.push(path, format!("{s:?} is not {expected}"));
        }
    }

    fn check_number(&mut self, schema: &Value, value: &Value, path: &str) {
        let Some(v) = value.as_f64() else { return };
        let bound = |key: &str| schema.get(key).and_then(Value::as_f64);
        let show = |b: f64| {
            if b.fract() == 0.0 {
                format!("{b:.0}")
            } else {
                b.to_string()
            }
        };
        match (bound("minimum"), bound("maximum")) {
            (Some(min), Some(max)) if v < min || v > max => self.push(
                path,
                format!(
                    "{value} is out of range: must be between {} and {}",
                    show(min),
                    show(max)
                ),
            ),
            (Some(min), None) if v < min => self.push(
                path,
                format!("{value} is too small: must be at least {}", show(min)),
            ),
            (None, Some(max)) if v > max => self.push(
                path,
                format!("{value} is too large: must be at most {}", show(max)),
            ),
            _ => {}
        }
    }

    fn check_enum(&mut self, schema: &Value, value: &Value, path: &str) {
        let Some(allowed) = schema.get("enum").and_then(Value::as_array) else {
            return;
        };
        if !allowed.contains(value) {
            let names: Vec<String> = allowed
                .iter()
                .filter(|a| !a.is_null())
                .map(|a| a.as_str().map_or_else(|| a.to_string(), str::to_string))
                .collect();
            self.push(path, format!("{value} is not one of: {}", names.join(", ")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(spec: Value) -> Value {
        json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuPool", "metadata": {"name": "p"}, "spec": spec})
    }

    fn paths(errors: &[FieldError]) -> Vec<&str> {
        errors.iter().map(|e| e.path.as_str()).collect()
    }

    #[test]
    fn a_valid_pool_passes() {
        let obj = pool(json!({
            "nodeSelector": {"matchLabels": {"gpuslice.io/pool": "a"}},
            "layout": {"software": {"slices": 4, "memory": "20Gi", "compute": 25}},
            "windows": [{"name": "night", "timeZone": "Asia/Shanghai", "start": "20:00", "end": "08:00",
                         "layout": {"mig": {"profiles": {"3g.40gb": 2}}}}],
            "timeSlice": "50ms",
        }));
        assert_eq!(check(Kind::GpuPool, &obj), vec![]);
    }

    #[test]
    fn structural_errors_name_the_field() {
        let obj = pool(json!({
            "nodeSelector": {},
            "layout": {"software": {"slices": "four", "memory": "20Gi", "compute": 250}},
            "windows": [{"name": "n", "start": "25:00", "end": "08:00", "days": ["Funday"], "layout": {"exclusive": {}}}],
            "colour": "blue",
        }));
        let errors = check(Kind::GpuPool, &obj);
        let p = paths(&errors);
        for expected in [
            "spec.layout.software.slices",
            "spec.layout.software.compute",
            "spec.windows[0].start",
            "spec.windows[0].days[0]",
            "spec.colour",
        ] {
            assert!(p.contains(&expected), "{expected} missing from {errors:?}");
        }
    }

    #[test]
    fn cel_rules_are_enforced() {
        let obj = pool(json!({
            "nodeSelector": {},
            "layout": {"software": {"slices": 8, "memory": "10Gi", "compute": 25}, "exclusive": {}},
            "windows": [{"name": "n", "start": "08:00", "end": "08:00", "layout": {"exclusive": {}}}],
            "timeSlice": "5s",
        }));
        let errors = check(Kind::GpuPool, &obj);
        let messages: Vec<String> = errors
            .iter()
            .map(|e| format!("{}: {}", e.path, e.message))
            .collect();
        let has = |needle: &str| messages.iter().any(|m| m.contains(needle));
        assert!(
            has("exactly one of mig, software, mps or exclusive"),
            "{messages:?}"
        );
        assert!(has("slices × compute must be at most 100"), "{messages:?}");
        assert!(has("start and end must differ"), "{messages:?}");
        assert!(has("timeSlice must be between 1ms and 1s"), "{messages:?}");
    }

    #[test]
    fn guarantee_above_limit_is_rejected() {
        let obj = json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuSlicePolicy", "metadata": {"name": "x"},
            "spec": {"pool": "p", "memory": "18Gi", "compute": {"limit": 20, "guarantee": 30}}});
        let errors = check(Kind::GpuSlicePolicy, &obj);
        assert!(
            errors.iter().any(|e| e.path == "spec.compute"
                && e.message.contains("guarantee must not exceed limit")),
            "{errors:?}"
        );
    }

    #[test]
    fn non_positive_memory_is_rejected() {
        for memory in ["0", "-1Gi", "lots"] {
            let obj = json!({"apiVersion": "gpuslice.io/v1alpha1", "kind": "GpuSlicePolicy", "metadata": {"name": "x"},
                "spec": {"pool": "p", "memory": memory}});
            let errors = check(Kind::GpuSlicePolicy, &obj);
            assert!(
                errors.iter().any(|e| e.path == "spec.memory"),
                "{memory}: {errors:?}"
            );
        }
    }

    #[test]
    fn bad_names_are_rejected() {
        let obj = json!({"metadata": {"name": "Big_Name"}, "spec": {"interval": "5m", "gracePeriod": "2m"}});
        let errors = check(Kind::CheckpointPolicy, &obj);
        assert_eq!(paths(&errors), vec!["metadata.name"]);
    }
}
