//! YAML documents with the position of every field.
//!
//! serde_yaml gives the values; yaml-rust2's event parser, run over the same text, gives the line
//! and column where each field path starts, so findings point at the line a person edits.

use std::collections::BTreeMap;

use serde::Deserialize;
use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// A line and column, both 1-based.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

/// One YAML document of a file.
#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    /// Where the document starts.
    pub start: Position,
    pub value: serde_json::Value,
    /// Field path (`spec.windows[0].start`) → where it is written.
    pub positions: BTreeMap<String, Position>,
}

impl Document {
    /// Where a field is written, or its nearest written ancestor, or the document start.
    pub fn position_of(&self, path: &str) -> Position {
        let mut path = path;
        loop {
            if let Some(p) = self.positions.get(path) {
                return *p;
            }
            match path.rfind(['.', '[']) {
                Some(cut) => path = &path[..cut],
                None => return self.start,
            }
        }
    }
}

/// A YAML syntax error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntaxError {
    pub position: Position,
    pub message: String,
}

/// The documents of a file, up to the first syntax error if there is one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParsedFile {
    pub documents: Vec<Document>,
    pub syntax_error: Option<SyntaxError>,
}

/// Splits a YAML file into documents; empty documents are skipped.
pub fn parse(text: &str) -> ParsedFile {
    let mut recorder = Recorder::default();
    let scan = Parser::new_from_str(text).load(&mut recorder, true);
    let mut out = ParsedFile::default();
    let mut maps = recorder.documents.into_iter();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let (start, positions) = maps.next().unwrap_or_default();
        match serde_json::Value::deserialize(doc) {
            Ok(serde_json::Value::Null) => {}
            Ok(value) => out.documents.push(Document {
                start,
                value,
                positions,
            }),
            Err(e) => {
                let position = e.location().map_or(start, |l| Position {
                    line: l.line(),
                    column: l.column(),
                });
                out.syntax_error = Some(SyntaxError {
                    position,
                    message: clean(&e.to_string()),
                });
                break;
            }
        }
    }
    if out.syntax_error.is_none()
        && let Err(e) = scan
    {
        let m = e.marker();
        out.syntax_error = Some(SyntaxError {
            position: Position {
                line: m.line(),
                column: m.col() + 1,
            },
            message: e.info().to_string(),
        });
    }
    out
}

/// serde_yaml appends " at line X column Y"; the position is reported separately.
fn clean(message: &str) -> String {
    match message.find(" at line ") {
        Some(cut) => message[..cut].to_string(),
        None => message.to_string(),
    }
}

enum Frame {
    Mapping { path: String, key: Option<String> },
    Sequence { path: String, index: usize },
}

#[derive(Default)]
struct Recorder {
    stack: Vec<Frame>,
    current: BTreeMap<String, Position>,
    start: Position,
    documents: Vec<(Position, BTreeMap<String, Position>)>,
}

impl Default for Position {
    fn default() -> Self {
        Position { line: 1, column: 1 }
    }
}

fn position(mark: Marker) -> Position {
    Position {
        line: mark.line(),
        column: mark.col() + 1,
    }
}

impl Recorder {
    /// The path of the value that starts now, recording it; `None` when a mapping key is next.
    fn value_path(&mut self, mark: Marker) -> Option<String> {
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Mapping { path, key }) => {
                let key = key.take()?;
                Some(if path.is_empty() {
                    key
                } else {
                    format!("{path}.{key}")
                })
            }
            Some(Frame::Sequence { path, index }) => {
                let here = format!("{path}[{index}]");
                *index += 1;
                self.current.insert(here.clone(), position(mark));
                Some(here)
            }
        }
    }
}

impl MarkedEventReceiver for Recorder {
    fn on_event(&mut self, event: Event, mark: Marker) {
        match event {
            Event::DocumentStart => {
                self.start = position(mark);
                self.current.clear();
                self.stack.clear();
            }
            Event::DocumentEnd => {
                self.documents
                    .push((self.start, std::mem::take(&mut self.current)));
            }
            Event::Scalar(text, ..) => {
                if let Some(Frame::Mapping {
                    path,
                    key: key @ None,
                }) = self.stack.last_mut()
                {
                    let full = if path.is_empty() {
                        text.clone()
                    } else {
                        format!("{path}.{text}")
                    };
                    self.current.insert(full, position(mark));
                    *key = Some(text);
                } else {
                    self.value_path(mark);
                }
            }
            Event::Alias(_) => {
                self.value_path(mark);
            }
            Event::MappingStart(..) => {
                let path = self.value_path(mark).unwrap_or_default();
                self.stack.push(Frame::Mapping { path, key: None });
            }
            Event::SequenceStart(..) => {
                let path = self.value_path(mark).unwrap_or_default();
                self.stack.push(Frame::Sequence { path, index: 0 });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            Event::StreamStart | Event::StreamEnd | Event::Nothing => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_DOCS: &str = "\
# a comment
apiVersion: gpuslice.io/v1alpha1
kind: GpuPool
metadata:
  name: a
spec:
  windows:
  - name: night
    start: \"20:00\"
  - name: day
    start: \"08:00\"
---
kind: CheckpointPolicy
spec: {gracePeriod: 2m}
";

    #[test]
    fn positions_of_fields_and_list_items() {
        let parsed = parse(TWO_DOCS);
        assert_eq!(parsed.syntax_error, None);
        assert_eq!(parsed.documents.len(), 2);
        let first = &parsed.documents[0];
        assert_eq!(
            first.position_of("metadata.name"),
            Position { line: 5, column: 3 }
        );
        assert_eq!(first.position_of("spec.windows[1].start").line, 11);
        assert_eq!(first.position_of("spec.windows[0]").line, 8);
        // A missing field points at its nearest parent.
        assert_eq!(first.position_of("spec.windows[1].layout").line, 10);
        let second = &parsed.documents[1];
        assert_eq!(second.position_of("spec.gracePeriod").line, 14);
        assert_eq!(second.position_of("spec.missing").line, 14);
        assert_eq!(second.value["spec"]["gracePeriod"], "2m");
    }

    #[test]
    fn syntax_errors_have_line_and_column_and_keep_earlier_documents() {
        let parsed = parse("kind: A\n---\nkind: B\nspec:\n  a: [1, 2\n  b: 3\n");
        assert_eq!(parsed.documents.len(), 1);
        let err = parsed.syntax_error.expect("unterminated flow sequence");
        assert!(err.position.line >= 5, "{err:?}");
        assert!(!err.message.contains(" at line "), "{err:?}");
    }

    #[test]
    fn empty_documents_are_skipped() {
        let parsed = parse("---\n---\nkind: A\n---\n");
        assert_eq!(parsed.documents.len(), 1);
        assert_eq!(parsed.documents[0].position_of("kind").line, 3);
    }
}
